"""LLM agents: EngineAgent on a random-weight k3-tiny, OpenAIAgent against a scripted HTTP server."""

from __future__ import annotations

import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from k3.chat import render
from k3.envs.base import run_episode
from k3.envs.llm_agent import (AgentConfig, EndpointError, EngineAgent, OpenAIAgent, message_from_ids,
                               message_from_completion, renderable)
from tests.envs.test_base import Counter
from tests.envs.tiny_lm import engine_config, tiny_model, tiny_tokenizer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
CALL_TEXT = ('<|close|>think<|sep|><|open|>response<|sep|>checking<|close|>response<|sep|><|open|>tools<|sep|>'
             '<|open|>call tool="get_weather" index="1"<|sep|><|open|>argument key="city" type="string"<|sep|>Paris'
             '<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>')


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def agent():
    a = EngineAgent(tiny_model(), tiny_tokenizer(), AgentConfig(max_new_tokens=12), engine_config=engine_config())
    yield a
    a.close()


def _well_formed(msg: dict) -> None:
    assert msg["role"] == "assistant" and isinstance(msg["content"], str) and isinstance(msg["reasoning_content"], str)
    for call in msg.get("tool_calls", []):
        assert call["type"] == "function" and isinstance(call["id"], str) and call["id"]
        assert isinstance(call["function"]["name"], str) and isinstance(call["function"]["arguments"], str)


def test_engine_agent_act_and_batch(agent):
    msg = agent.act([{"role": "user", "content": "weather in Paris?"}], TOOLS)
    _well_formed(msg)
    convs = [([{"role": "user", "content": f"hello {i}"}], TOOLS if i % 2 else []) for i in range(3)]
    out = agent.act_batch(convs)
    assert len(out) == 3
    for m in out:
        _well_formed(m)
    gens = agent.generate_batch(convs[:1])
    g = gens[0]
    assert g.prompt_ids == agent.prompt_ids(*convs[0]) and 1 <= len(g.token_ids) <= 12
    assert g.finish_reason in ("stop", "length")
    # greedy decoding: the same conversation gives the same turn whether batched or alone
    assert g.token_ids == agent.generate_batch(convs[:1])[0].token_ids


def test_logprobs_and_close():
    a = EngineAgent(tiny_model(), tiny_tokenizer(), AgentConfig(max_new_tokens=5, temperature=1.0, seed=3,
                                                                logprobs=True), engine_config=engine_config())
    g = a.generate_batch([([{"role": "user", "content": "hi"}], [])])[0]
    assert len(g.logprobs) == len(g.token_ids) and all(lp <= 0 for lp, _ in g.logprobs)
    assert g.token_ids == a.generate_batch([([{"role": "user", "content": "hi"}], [])])[0].token_ids  # seeded
    a.close()
    a.close()


def test_engine_agent_threads_share_the_engine(agent):
    convs = [[{"role": "user", "content": f"plan step {i}"}] for i in range(4)]
    with ThreadPoolExecutor(4) as pool:
        out = list(pool.map(lambda m: agent.act(m, TOOLS), convs))
    for m in out:
        _well_formed(m)


def test_engine_agent_in_the_tool_loop(agent):
    ep = run_episode(Counter(), agent, seed=0, max_turns=3)
    assert ep.agent_error is None and 1 <= ep.turns <= 3
    for m in ep.messages:
        if m["role"] == "assistant":
            _well_formed(m)


def test_too_long_and_unrenderable_conversations(agent):
    long = [{"role": "user", "content": "weather " * 5000}]
    with pytest.raises(ValueError, match="context"):
        agent.act(long, [])
    bad = [{"role": "tool", "content": "orphan result"}]
    out = agent.act_batch([(long, []), (bad, []), ([{"role": "user", "content": "hi"}], [])], return_exceptions=True)
    assert isinstance(out[0], ValueError) and isinstance(out[1], Exception)
    _well_formed(out[2])
    # a batch that fails part-way cancels what it submitted; the engine is left empty and usable
    with pytest.raises(ValueError):
        agent.act_batch([([{"role": "user", "content": "hi"}], []), (long, [])])
    _well_formed(agent.act([{"role": "user", "content": "hello"}], []))
    time.sleep(0.2)
    assert not agent.engine.requests


def test_garbage_output_never_raises():
    tok = tiny_tokenizer()
    msg = message_from_ids(tok.encode(CALL_TEXT, allow_special=True), tok)
    assert msg["content"] == "checking" and msg["tool_calls"][0]["function"]["name"] == "get_weather"
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    specials = [tok.special_id(s) for s in ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>")]
    pieces = tok.encode('call tool="f" index="1"json type="object"argument key="k"[1]tools', allow_special=False)
    rng = random.Random(0)
    for n in range(200):
        ids = [rng.choice(specials + pieces + [rng.randrange(tok.vocab_size)]) for _ in range(rng.randrange(40))]
        msg = message_from_ids(ids, tok, thinking=bool(n % 2))
        _well_formed(msg)
        # the turn can always be rendered back into the next prompt
        convo = [{"role": "user", "content": "x"}, msg]
        convo += [{"role": "tool", "tool_call_id": c["id"], "content": "r"} for c in msg.get("tool_calls", [])]
        render(renderable(convo), tok, TOOLS, add_generation_prompt=True)


def test_renderable_fixes_only_unrenderable_calls():
    calls = [{"id": "a", "type": "function", "function": {"name": "f", "arguments": "[1]"}},
             {"id": "b", "type": "function", "function": {"name": "", "arguments": "{bad"}},
             {"id": "c", "type": "function", "function": {"name": "g", "arguments": '{"x": 1}'}}]
    out = renderable([{"role": "assistant", "content": "", "tool_calls": calls}])[0]["tool_calls"]
    assert out[0]["function"]["arguments"] == {"_raw": "[1]"} and out[1]["function"]["name"] == "_"
    assert out[2] is calls[2] and calls[0]["function"]["arguments"] == "[1]"


# ------------------------------------------------------------------------------------------ OpenAIAgent


class _Scripted(BaseHTTPRequestHandler):
    replies: list = []
    seen: list = []

    def do_POST(self):  # noqa: N802 - http.server's naming
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append((self.path, self.headers.get("Authorization"), body))
        status, reply = type(self).replies.pop(0)
        data = reply.encode() if isinstance(reply, str) else json.dumps(reply).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Scripted)
    _Scripted.replies, _Scripted.seen = [], []
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def _completion(message: dict) -> dict:
    return {"id": "x", "object": "chat.completion", "choices": [{"index": 0, "message": message,
                                                                "finish_reason": "stop"}]}


def test_openai_agent_round_trip(fake_server):
    call = {"id": "call_9", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    _Scripted.replies = [(200, _completion({"role": "assistant", "content": None, "reasoning": "think",
                                            "tool_calls": [call]})),
                         (200, _completion({"role": "assistant", "content": "sunny"}))]
    agent = OpenAIAgent(fake_server, "m", api_key="k", temperature=0.0, max_tokens=64,
                        extra_body={"thinking": {"type": "enabled"}})
    msgs = [{"role": "user", "content": "weather?"}]
    first = agent.act(msgs, TOOLS)
    assert first["content"] == "" and first["reasoning_content"] == "think"
    assert first["tool_calls"] == [{"id": "call_9", "type": "function",
                                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    msgs += [first, {"role": "tool", "tool_call_id": "call_9", "name": "get_weather", "content": "sunny", "x": 1}]
    assert agent.act(msgs, TOOLS) == {"role": "assistant", "content": "sunny", "reasoning_content": ""}
    path, auth, body = _Scripted.seen[1]
    assert path == "/v1/chat/completions" and auth == "Bearer k"
    assert body["model"] == "m" and body["tools"] == TOOLS and body["max_tokens"] == 64 and body["temperature"] == 0.0
    assert body["thinking"] == {"type": "enabled"} and body["messages"][1]["reasoning_content"] == "think"
    assert "x" not in body["messages"][2]  # only OpenAI message fields go on the wire
    agent.close()


def test_openai_agent_errors(fake_server):
    _Scripted.replies = [(400, {"error": {"message": "bad tools"}}), (200, "not json"), (200, {"choices": []})]
    agent = OpenAIAgent(fake_server, "m", retries=0)
    for pattern in ("HTTP 400: bad tools", "not JSON", "no choices"):
        with pytest.raises(EndpointError, match=pattern):
            agent.act([{"role": "user", "content": "hi"}], [])
    with pytest.raises(ValueError, match="http"):
        OpenAIAgent("localhost:8000", "m")
    _Scripted.replies = [(500, {"error": {"message": "boom"}})]
    ep = run_episode(Counter(), agent, seed=0)
    assert ep.agent_error.startswith("EndpointError") and ep.turns == 0


def test_openai_agent_retries(fake_server):
    ok = (200, _completion({"role": "assistant", "content": "fine"}))
    _Scripted.replies = [(503, {"error": {"message": "busy"}}), (429, {}), ok]
    agent = OpenAIAgent(fake_server, "m", retries=2, retry_wait_s=0.01)
    assert agent.act([{"role": "user", "content": "hi"}], [])["content"] == "fine" and len(_Scripted.seen) == 3
    _Scripted.replies = [(503, {"error": {"message": "busy"}})] * 2
    with pytest.raises(EndpointError, match="HTTP 503: busy"):
        OpenAIAgent(fake_server, "m", retries=1, retry_wait_s=0.01).act([{"role": "user", "content": "hi"}], [])
    dead = OpenAIAgent("http://127.0.0.1:9/v1", "m", retries=1, retry_wait_s=0.01)
    with pytest.raises(Exception, match="(?i)connect"):
        dead.act([{"role": "user", "content": "hi"}], [])


def test_message_from_completion_normalises():
    msg = message_from_completion(_completion({"content": [{"type": "text", "text": "a"}, {"text": "b"}],
                                               "tool_calls": [{"function": {"name": 3}}, "junk"]}))
    assert msg["content"] == "ab"
    assert msg["tool_calls"] == [{"id": "call_0", "type": "function", "function": {"name": "", "arguments": "{}"}}]
