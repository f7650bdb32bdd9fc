"""The HTTP layer in-process with a scripted engine: response shapes (chat, streaming, tool calls,
reasoning), prompt rendering of requests, and error statuses. The live-model tests are in
test_openai_live.py."""

from __future__ import annotations

import json
import re

import pytest
from starlette.testclient import TestClient

from k3.chat.xtml import SegmentBuilder
from k3.serve.async_engine import Overloaded
from k3.serve.engine import RequestOutput
from k3.serve.server import ServerConfig, build_app

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def encode(tok, b: SegmentBuilder) -> list[int]:
    return [t for s in b.segments for t in tok.encode(s.text, allow_special=s.special)]


def scripted_reply(tok, reasoning="Let me think.", content="Hello there", city="Paris") -> list[int]:
    b = SegmentBuilder()
    b.text(reasoning)
    b.close_tag("think")
    b.open_tag("response")
    b.text(content)
    b.close_tag("response")
    if city is not None:
        b.open_tag("tools")
        b.open_tag("call", [("tool", "get_weather"), ("index", 1)])
        b.open_tag("argument", [("key", "city"), ("type", "string")])
        b.text(city)
        b.close_tag("argument")
        b.close_tag("call")
        b.close_tag("tools")
    b.close_tag("message")
    b.end_of_msg()
    return encode(tok, b)


class _Core:
    def __init__(self, vocab: int) -> None:
        self.vocab_limit, self.max_model_len = vocab, 2048

    def max_tokens_limit(self, prompt_len: int) -> int:
        return self.max_model_len - prompt_len

    def stats(self) -> dict:
        return {"running": 0, "waiting": 0, "finished": {}}


class _Stream:
    def __init__(self, owner, ids: list[int], prompt_len: int, max_tokens: int) -> None:
        self.owner, self.request_id, self.done = owner, f"req{len(owner.submitted)}", False
        ids = ids[:max_tokens]
        cut = [0, len(ids) // 3, 2 * len(ids) // 3, len(ids)]
        self._outs = [RequestOutput(self.request_id, ids[a:b], "", [(None, None)] * (b - a), k == 2,
                                    ("length" if len(ids) == max_tokens else "stop") if k == 2 else None,
                                    prompt_len, 7, b, 0.0) for k, (a, b) in enumerate(zip(cut, cut[1:]))]

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._outs:
            self.done = True
            raise StopAsyncIteration
        return self._outs.pop(0)

    def close(self) -> None:
        self.done = True


class FakeEngine:
    """Stands in for AsyncEngine: records submitted prompts and replays a scripted output."""

    def __init__(self, tok, script: list[int]) -> None:
        self.engine, self.script, self.submitted = _Core(tok.vocab_size), script, []
        self.overloaded, self.alive, self.aborted = False, True, 0

    def start(self) -> None: ...

    def shutdown(self) -> None: ...

    def submit(self, prompt, params, **kw):
        if self.overloaded:
            raise Overloaded("busy")
        self.submitted.append((list(prompt), params))
        return _Stream(self, self.script, len(prompt), params.max_tokens)

    def submit_n(self, prompt, params, n, **kw):
        return [self.submit(prompt, params, **kw) for _ in range(n)]


@pytest.fixture
def server(tokenizer):
    fake = FakeEngine(tokenizer, scripted_reply(tokenizer))
    app = build_app(fake, tokenizer, ServerConfig(model_names=("k3-test",), default_max_tokens=256))
    with TestClient(app) as client:
        yield client, fake


def chat(client, **body):
    body.setdefault("model", "k3-test")
    body.setdefault("messages", [{"role": "user", "content": "weather in Paris?"}])
    return client.post("/v1/chat/completions", json=body)


def sse(resp) -> list:
    events = [line[len("data: "):] for line in resp.text.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_chat_non_stream_reasoning_content_and_tool_calls(server):
    client, fake = server
    r = chat(client, tools=TOOLS)
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == "k3-test"
    choice = body["choices"][0]
    msg = choice["message"]
    assert msg["role"] == "assistant" and msg["content"] == "Hello there"
    assert msg["reasoning_content"] == msg["reasoning"] == "Let me think."
    (call,) = msg["tool_calls"]
    assert re.fullmatch(r"call_[0-9a-f]{24}", call["id"]) and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert choice["finish_reason"] == "tool_calls"
    u = body["usage"]
    assert u["prompt_tokens"] == len(fake.submitted[0][0]) and u["prompt_tokens_details"] == {"cached_tokens": 7}
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    assert fake.submitted[0][1].max_tokens == 256  # the server default


def test_chat_stream_chunk_protocol(server):
    client, _ = server
    r = chat(client, tools=TOOLS, stream=True, stream_options={"include_usage": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    ev = sse(r)
    assert ev[0]["choices"][0]["delta"]["role"] == "assistant"
    deltas = [e["choices"][0]["delta"] for e in ev if e["choices"]]
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    assert reasoning == "Let me think." and all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
    assert "".join(d.get("content", "") for d in deltas) == "Hello there"
    first_reason = next(i for i, d in enumerate(deltas) if d.get("reasoning_content"))
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    calls = [(i, d["tool_calls"][0]) for i, d in enumerate(deltas) if d.get("tool_calls")]
    assert first_reason < first_content < calls[0][0]
    head, args = calls[0][1], calls[1][1]
    assert head["index"] == 0 and head["id"].startswith("call_") and head["function"] == {"name": "get_weather",
                                                                                          "arguments": ""}
    assert args == {"index": 0, "function": {"arguments": '{"city": "Paris"}'}}
    finals = [e for e in ev if e["choices"] and e["choices"][0]["finish_reason"]]
    assert [f["choices"][0]["finish_reason"] for f in finals] == ["tool_calls"]
    assert ev[-1]["choices"] == [] and ev[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 7
    assert all(e["object"] == "chat.completion.chunk" and e["id"] == ev[0]["id"] for e in ev)
    no_usage = sse(chat(client, stream=True))
    assert all("usage" not in e for e in no_usage)


def test_history_is_rendered_with_preserved_thinking_and_tool_results(server, tokenizer):
    client, fake = server
    messages = [
        {"role": "system", "content": "be brief", "tools": TOOLS},  # dynamic tools on a system message
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "reasoning_content": "need the tool",
         "tool_calls": [{"id": "call_x1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_x1", "content": "rainy"},
        {"role": "assistant", "content": "It rains.", "reasoning": "summarise"},
        {"role": "user", "content": "thanks", "tools": None},
    ]
    r = chat(client, messages=messages, reasoning_effort="low", thinking={"type": "enabled", "keep": "all"},
             prompt_cache_key="abc", max_completion_tokens=5, parallel_tool_calls=True, user="u1")
    assert r.status_code == 200, r.text
    prompt, params = fake.submitted[-1]
    text = tokenizer.decode(prompt)
    for piece in ("need the tool", "summarise", "rainy", 'tool="get_weather" index="1"', "thinking_effort=low",
                  "## New Tools Available"):
        assert piece in text
    assert text.endswith('<|open|>message role="assistant"<|sep|><|open|>think<|sep|>')
    assert params.max_tokens == 5
    chat(client, thinking={"type": "disabled"})
    text = tokenizer.decode(fake.submitted[-1][0])
    assert text.endswith('<|open|>message role="assistant"<|sep|><|open|>response<|sep|>')
    assert "thinking_effort" not in text


@pytest.mark.parametrize("ending", ["cut_off", "end_of_msg"])
def test_named_tool_choice_forces_the_call(tokenizer, ending):
    b = SegmentBuilder()
    b.open_tag("argument", [("key", "city"), ("type", "string")])
    b.text("Rome")  # the argument is never closed
    if ending == "end_of_msg":  # what a random model did in CI: an end marker inside the forced call
        b.end_of_msg()
    fake = FakeEngine(tokenizer, encode(tokenizer, b))
    app = build_app(fake, tokenizer, ServerConfig(model_names=("k3-test",)))
    forced = {"type": "function", "function": {"name": "get_weather"}}
    with TestClient(app) as client:
        r = chat(client, tools=TOOLS, tool_choice=forced)
        ev = sse(chat(client, tools=TOOLS, tool_choice=forced, stream=True))
    assert r.status_code == 200, r.text
    text = tokenizer.decode(fake.submitted[0][0])
    assert text.endswith('<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>')
    choice = r.json()["choices"][0]
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    assert choice["finish_reason"] == "tool_calls"
    calls = [d["choices"][0]["delta"]["tool_calls"][0] for d in ev if d["choices"] and "tool_calls" in d["choices"][0]["delta"]]
    assert calls[0]["function"]["name"] == "get_weather" and calls[1]["function"]["arguments"] == '{"city": "Rome"}'
    assert [e["choices"][0]["finish_reason"] for e in ev if e["choices"] and e["choices"][0]["finish_reason"]] == [
        "tool_calls"]


def test_completions_shapes(server):
    client, fake = server
    r = client.post("/v1/completions", json={"model": "k3-test", "prompt": "hello <|open|>", "max_tokens": 4})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "text_completion" and body["choices"][0]["finish_reason"] == "length"
    prompt = fake.submitted[-1][0]
    assert client.app.state.k3.tok.special_id("<|open|>") in prompt  # raw prompts may carry markers
    r = client.post("/v1/completions", json={"model": "k3-test", "prompt": [1, 2, 3], "stream": True,
                                            "stream_options": {"include_usage": True}})
    ev = sse(r)
    assert ev[-1]["usage"]["prompt_tokens"] == 3 and ev[-2]["choices"][0]["finish_reason"] == "stop"


def test_models_health_metrics(server):
    client, _ = server
    m = client.get("/v1/models").json()
    assert m["object"] == "list" and [d["id"] for d in m["data"]] == ["k3-test"]
    assert client.get("/health").json() == {"status": "ok"}
    chat(client, model="nope")
    text = client.get("/metrics").text
    assert "# TYPE k3_running gauge" in text and "k3_http_status_404" in text


@pytest.mark.parametrize("body,status,param", [
    ({"model": "gpt-4"}, 404, "model"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ({"max_tokens": -1}, 400, "max_tokens"),
    ({"max_tokens": 10**9}, 400, "max_tokens"),
    ({"max_tokens": "5"}, 400, "max_tokens"),
    ({"temperature": "hot"}, 400, "temperature"),
    ({"reasoning_effort": "none"}, 400, "reasoning_effort"),
    ({"tool_choice": "required"}, 400, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": TOOLS}, 400, "tool_choice"),
    ({"n": 0}, 400, "n"),
    ({"logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ({"presence_penalty": 3}, 400, "presence_penalty"),
    ({"messages": [{"role": "tool", "content": "x", "tool_call_id": "a"}]}, 400, None),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages[0].content[0]"),
])
def test_errors_are_openai_shaped(server, body, status, param):
    client, _ = server
    r = chat(client, **body)
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param and err["message"]


def test_overload_bad_json_big_body_and_routes(server):
    client, fake = server
    fake.overloaded = True
    r = chat(client)
    assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded"
    fake.overloaded = False
    assert client.post("/v1/chat/completions", content=b'{"model": ').status_code == 400
    assert client.post("/v1/chat/completions", content=b"[" * 100_000 + b"]" * 100_000).status_code == 400
    client.app.state.k3.cfg.max_body_bytes = 1000
    assert client.post("/v1/completions", content=b" " * 2000).status_code == 413
    r = client.get("/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()
    assert client.get("/nope").json()["error"]["code"] == "not_found"


def test_clamp_max_tokens_option(tokenizer):
    fake = FakeEngine(tokenizer, scripted_reply(tokenizer))
    app = build_app(fake, tokenizer, ServerConfig(model_names=("k3-test",), clamp_max_tokens=True))
    with TestClient(app) as client:
        r = chat(client, max_completion_tokens=10**6)
        assert r.status_code == 200
        requested, used = r.headers["x-k3-max-tokens-clamped"].split("->")
        assert int(requested) == 10**6 and int(used) == fake.submitted[-1][1].max_tokens
        assert len(fake.submitted[-1][0]) + int(used) == 2048  # the whole context left
        assert "x-k3-max-tokens-clamped" not in chat(client, max_tokens=5).headers
