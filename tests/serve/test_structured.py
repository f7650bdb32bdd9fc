"""The structured-output grammar (k3.serve.structured) accepts exactly what the renderer writes: an
assistant turn rendered by k3.chat with tool calls / JSON content is accepted token by token; a
missing required argument or a second call without parallel calls is not."""

from __future__ import annotations

import json

import pytest

from k3.chat import render_segments
from k3.serve.structured import GrammarCompiler, GrammarError, StructuredSpec
from tests.serve.test_structured_live import PERSON, TOOLS


def turn_ids(tok, message: dict, thinking: bool) -> list[int]:
    """Token ids of an assistant turn after its generation prompt, as the renderer writes it."""
    user = [{"role": "user", "content": "hi"}]
    prompt = render_segments(user, TOOLS, thinking=thinking, add_generation_prompt=True)
    full = render_segments(user + [message], TOOLS, thinking=thinking)
    enc = lambda segs: [t for s in segs for t in tok.encode(s.text, allow_special=s.special)]  # noqa: E731
    p, f = enc(prompt), enc(full)
    assert f[: len(p)] == p
    return f[len(p):]


def accepts(compiler, spec, ids, budget=10_000) -> bool:
    c = compiler.compile(spec, budget)()
    for t in ids:
        allowed = c.allowed(2048)
        if allowed is None or not allowed[t]:
            return False
        c.accept(t)
    return c.matcher.is_stopped() or c.matcher.is_accepting()


def call(name, args) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


@pytest.mark.parametrize("thinking", [False, True])
def test_grammar_accepts_rendered_tool_calls(tokenizer, thinking):
    gc = GrammarCompiler(tokenizer)
    two = {"role": "assistant", "content": "", "reasoning_content": "plan" if thinking else None,
           "tool_calls": [call("get_weather", {"city": "Paris", "unit": "celsius", "days": 3}),
                          call("search", {"query": "rain", "exact": True})]}
    spec = StructuredSpec(thinking=thinking, tools=TOOLS, tool_choice="required")
    assert accepts(gc, spec, turn_ids(tokenizer, two, thinking))
    single = StructuredSpec(thinking=thinking, tools=TOOLS, tool_choice="required", parallel=False)
    assert not accepts(gc, single, turn_ids(tokenizer, two, thinking))
    missing = dict(two, tool_calls=[call("get_weather", {"city": "Paris", "days": 3})])
    assert not accepts(gc, spec, turn_ids(tokenizer, missing, thinking))
    out_of_range = dict(two, tool_calls=[call("get_weather", {"city": "Paris", "unit": "celsius", "days": 9})])
    assert not accepts(gc, spec, turn_ids(tokenizer, out_of_range, thinking))


def test_grammar_accepts_rendered_json_and_closes_thinking_at_budget(tokenizer):
    gc = GrammarCompiler(tokenizer)
    fmt = {"type": "json_schema", "json_schema": {"schema": PERSON}}
    msg = {"role": "assistant", "reasoning_content": "ok", "content": '{"name": "Ann", "age": 3, "tags": ["a"]}'}
    assert accepts(gc, StructuredSpec(thinking=True, response_format=fmt), turn_ids(tokenizer, msg, True))
    bad = dict(msg, content='{"name": "Ann", "age": 3}')
    assert not accepts(gc, StructuredSpec(thinking=True, response_format=fmt), turn_ids(tokenizer, bad, True))
    c = gc.compile(StructuredSpec(thinking=True, response_format=fmt), 2)()
    for t in tokenizer.encode("ab cd ef")[:2]:
        c.accept(t)
    assert c.allowed(2048).nonzero().flatten().tolist() == [tokenizer.special_id("<|close|>")]
    with pytest.raises(GrammarError):
        gc.compile(StructuredSpec(thinking=False, response_format={"type": "json_schema", "json_schema": {
            "schema": {"type": "object", "properties": {"x": {"type": "nonsense"}}}}}), 10)


@pytest.mark.parametrize("thinking", [False, True])
def test_auto_with_strict_tools_allows_text_or_valid_calls(tokenizer, thinking):
    """tool_choice auto (every tool strict): free text, with or without calls after it, but every call
    has valid arguments; thinking is not cut short (nothing is forced)."""
    gc = GrammarCompiler(tokenizer)
    spec = StructuredSpec(thinking=thinking, tools=TOOLS, tool_choice="auto")
    assert spec.active and not spec.forced
    reasoning = "plan" if thinking else None
    text = {"role": "assistant", "content": "It is sunny.", "reasoning_content": reasoning}
    assert accepts(gc, spec, turn_ids(tokenizer, text, thinking), budget=1)
    both = dict(text, tool_calls=[call("search", {"query": "rain"})])
    assert accepts(gc, spec, turn_ids(tokenizer, both, thinking))
    bad = dict(text, tool_calls=[call("get_weather", {"city": "Paris", "unit": "kelvin", "days": 3})])
    assert not accepts(gc, spec, turn_ids(tokenizer, bad, thinking))
