"""Structured outputs through the official `openai` client against a live `k3 serve` with random
weights: tool_choice required / named always yields schema-valid calls and json_schema output
validates (grammar-constrained decoding, k3.serve.structured)."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest

from tests.serve.schemas import PERSON

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "unit", "days"],
    "additionalProperties": False}
SEARCH = {"type": "object", "properties": {"query": {"type": "string", "minLength": 1, "maxLength": 16},
                                           "exact": {"type": "boolean"}}, "required": ["query"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER, "strict": True}},
         {"type": "function", "function": {"name": "search", "parameters": SEARCH}}]
# the live tests use short names: the test tokenizer spells tag text almost letter by letter
W = {"type": "object", "properties": {"c": {"type": "string", "maxLength": 6}, "d": {"type": "integer",
     "minimum": 1, "maximum": 7}}, "required": ["c", "d"], "additionalProperties": False}
S = {"type": "object", "properties": {"q": {"type": "string", "minLength": 1, "maxLength": 6}}, "required": ["q"]}
LIVE_TOOLS = [{"type": "function", "function": {"name": "w", "parameters": W, "strict": True}},
              {"type": "function", "function": {"name": "s", "parameters": S}}]
SCHEMAS = {"w": W, "s": S}
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_THINK = {"thinking": {"type": "disabled"}}


@pytest.fixture(scope="module")
def client(live_server):
    return openai.OpenAI(base_url=live_server.base_url + "/v1", api_key="unused", timeout=120, max_retries=0)


def valid_calls(calls) -> None:
    assert calls, "tool_choice required must yield at least one call"
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


@pytest.mark.parametrize("extra,temperature,max_tokens", [(NO_THINK, 0.0, 200), ({}, 1.0, 320)])
def test_tool_choice_required_yields_valid_calls(client, extra, temperature, max_tokens):
    # one call (the test tokenizer spells the tag text letter by letter: a call costs ~100-150 tokens;
    # with thinking, the think channel is closed at max_tokens - min(512, max_tokens // 2))
    r = client.chat.completions.create(model="k3-tiny", messages=MSGS, tools=LIVE_TOOLS, tool_choice="required",
                                       max_tokens=max_tokens, temperature=temperature, seed=7, extra_body=extra,
                                       parallel_tool_calls=False)
    assert r.choices[0].finish_reason == "tool_calls"
    valid_calls(r.choices[0].message.tool_calls)


def test_named_tool_choice_and_streaming(client):
    named = {"type": "function", "function": {"name": "w"}}
    r = client.chat.completions.create(model="k3-tiny", messages=MSGS, tools=LIVE_TOOLS, tool_choice=named,
                                       max_tokens=200, temperature=1.0, seed=1)
    calls = r.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["w"]
    valid_calls(calls)
    stream = client.chat.completions.create(model="k3-tiny", messages=MSGS, tools=LIVE_TOOLS, tool_choice="required",
                                            max_tokens=200, stream=True, parallel_tool_calls=False,
                                            extra_body=NO_THINK)
    name, args, finish = None, "", None
    for chunk in stream:
        ch = chunk.choices[0]
        for d in ch.delta.tool_calls or []:
            assert d.index == 0  # parallel_tool_calls=False: exactly one call
            name = d.function.name or name
            args += d.function.arguments or ""
        finish = ch.finish_reason or finish
    assert finish == "tool_calls"
    jsonschema.validate(json.loads(args), SCHEMAS[name])


def test_json_schema_output_validates(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for extra in (NO_THINK, {}):
        r = client.chat.completions.create(model="k3-tiny", messages=[{"role": "user", "content": "a person"}],
                                           response_format=fmt, max_tokens=200, temperature=1.0, seed=3,
                                           extra_body=extra)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


def test_bad_schema_is_a_400(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="k3-tiny", messages=MSGS, response_format=fmt, max_tokens=8)


def _streamed(stream) -> tuple[str, str | None, dict]:
    """(content, finish_reason, {index: [name, arguments]}) of a one-choice chat stream."""
    text, finish, calls = "", None, {}
    for chunk in stream:
        for ch in chunk.choices:
            text += ch.delta.content or ""
            for d in ch.delta.tool_calls or []:
                c = calls.setdefault(d.index, ["", ""])
                c[0] = d.function.name or c[0]
                c[1] += d.function.arguments or ""
            finish = ch.finish_reason or finish
    return text, finish, calls


def test_json_object_and_streamed_json_schema(client, tokenizer):
    """json_object, non-stream twice (the repeat hits the prefix cache and still validates) and
    streamed; json_schema streamed. A free object has unbounded keys and strings, which a random model
    never closes on its own: a logit_bias on `"` and `}` (added before the grammar mask) ends them."""
    bias = {str(tokenizer.encode('"')[0]): 5, str(tokenizer.encode("}")[0]): 3}
    kw = dict(model="k3-tiny", messages=[{"role": "user", "content": "an object"}], max_tokens=120,
              temperature=1.0, seed=3, logit_bias=bias, extra_body=NO_THINK, response_format={"type": "json_object"})
    first, again = (client.chat.completions.create(**kw) for _ in range(2))
    assert again.usage.prompt_tokens_details.cached_tokens >= again.usage.prompt_tokens - 1
    for r in (first, again):
        assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)
    assert again.choices[0].message.content == first.choices[0].message.content  # seeded: the same sample
    text, finish, _ = _streamed(client.chat.completions.create(**kw, stream=True))
    assert finish == "stop" and text == first.choices[0].message.content
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    kw.pop("logit_bias")
    text, finish, _ = _streamed(client.chat.completions.create(**{**kw, "response_format": fmt, "seed": 4},
                                                               stream=True))
    assert finish == "stop"
    jsonschema.validate(json.loads(text), PERSON)


def test_named_tool_choice_streamed(client):
    named = {"type": "function", "function": {"name": "s"}}
    _, finish, calls = _streamed(client.chat.completions.create(
        model="k3-tiny", messages=MSGS, tools=LIVE_TOOLS, tool_choice=named, max_tokens=120, temperature=1.0, seed=2,
        stream=True))
    assert finish == "tool_calls" and [c[0] for c in calls.values()] == ["s"]
    jsonschema.validate(json.loads(calls[0][1]), S)


class Pet(pydantic.BaseModel):
    kind: Literal["cat", "dog"]
    age: int = pydantic.Field(ge=0, le=30)


class Owner(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    pets: list[Pet] = pydantic.Field(max_length=2)


def test_sdk_parse_with_pydantic_models(client):
    """The SDKs' own structured-output helpers: a strict schema with `$defs` / `$ref` and titles."""
    r = client.chat.completions.parse(model="k3-tiny", messages=[{"role": "user", "content": "an owner"}],
                                      response_format=Owner, max_tokens=200, temperature=1.0, seed=1,
                                      extra_body=NO_THINK)
    assert isinstance(r.choices[0].message.parsed, Owner)
    r = client.responses.parse(model="k3-tiny", input="an owner", text_format=Owner, max_output_tokens=200,
                               reasoning={"effort": "none"})
    assert isinstance(r.output_parsed, Owner)


def test_auto_with_strict_tools(client, tokenizer):
    """tool_choice auto (absent) with every tool `strict`: the model may write text, and any call it
    makes has valid arguments. A random model rarely opens a tools block on its own: a logit_bias on
    the XTML <|open|> / <|close|> markers (where the grammar allows them) makes it call."""
    strict = [{"type": "function", "function": {**t["function"], "strict": True}} for t in LIVE_TOOLS]
    bias = {str(tokenizer.special_id("<|close|>")): 8, str(tokenizer.special_id("<|open|>")): 12}
    kw = dict(model="k3-tiny", messages=MSGS, tools=strict, max_tokens=200, temperature=1.0, seed=1, logit_bias=bias,
              parallel_tool_calls=False, extra_body=NO_THINK)
    r = client.chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "tool_calls"
    valid_calls(r.choices[0].message.tool_calls)
    _, finish, calls = _streamed(client.chat.completions.create(**{**kw, "seed": 2}, stream=True))
    assert finish == "tool_calls" and len(calls) == 1
    jsonschema.validate(json.loads(calls[0][1]), SCHEMAS[calls[0][0]])
