"""Hostile traffic against a live `k3 serve`: hundreds of malformed requests must each get a 4xx
OpenAI-shaped JSON error (never a 5xx), clients that disconnect mid-request must have their requests
cancelled and their cache freed, and the server must stay healthy."""

from __future__ import annotations

import json
import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import httpx

MODEL = "k3-tiny"
MB = "x" * (1 << 20)
OK_MSG = [{"role": "user", "content": "hi"}]


def _chat(**fields) -> dict:
    body = {"model": MODEL, "messages": OK_MSG, "max_tokens": 2}
    body.update(fields)
    return body


def _raw_bodies() -> list[bytes]:
    rng = random.Random(0)
    bodies = [b"", b"{", b"}", b"null", b"[]", b"123", b'"text"', b"{'a': 1}", b'{"model": "k3-tiny",}',
              b"\xff\xfe\x00",
              b"[" * 50_000, b'{"a":' * 20_000, b'{"model": NaN}', b"1e999999", b"\x00" * 100, b"true",
              b'{"model": "k3-tiny", "messages": [{"role": "user", "content": "\\ud800"}]}',
              b'{"model": "k3-tiny", "messages": [{"role": "user", "content": "a"}], "max_tokens": 1e400}']
    bodies += [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200))) for _ in range(12)]
    return bodies


def _wrong_values() -> dict[str, list]:
    return {
        "model": [123, None, [], {}, True], "messages": ["x", 5, {}, [1], [None], [[]], None],
        "temperature": ["hot", -1, 5, [], True, float("inf")], "top_p": [0, 2, "x", -0.5], "top_k": [-5, 1.5, "3"],
        "max_tokens": [-1, 0, -10**20, 10**9, 10**30, 1.5, "5", True], "max_completion_tokens": [-5, 0, "x", 10**12],
        "stream": ["yes", 1, {}], "stream_options": [[], "x", {"include_usage": "yes"}], "stop": [5, [1, 2], [""] * 3,
                                                                                                ["a"] * 40, MB],
        "n": [0, 500, "2"], "seed": ["x", 1.5, [1]], "logprobs": ["x", 3], "top_logprobs": [100, -1, "x"],
        "presence_penalty": [3.0, "x"], "frequency_penalty": [-2.5], "logit_bias": [{"x": 5}, {"1": 500}, [1]],
        "tools": ["x", 5, [1], [{"type": "function"}], [{"type": "function", "function": {"name": 5}}],
                  [{"type": "function", "function": {"name": "f", "parameters": "x"}}]],
        "tool_choice": [5, "sometimes", {"type": "function"}, {"type": "function", "function": {"name": "nope"}},
                        "required"],
        "reasoning_effort": ["none", "extreme", 5, ""], "thinking": ["on", 5, {"type": "maybe"}, {"effort": "huge"}],
        "chat_template_kwargs": [[], {"thinking": "no"}], "response_format": ["json", {"type": "xml"}, 5,
                                                                             {"type": "json_schema"}],
        "stop_token_ids": [[-1], [10**9], "x"],
    }


def _typed_fields() -> list[dict]:
    return [_chat(**{k: v}) for k, vs in _wrong_values().items() for v in vs]


def _messages() -> list[dict]:
    roles = ["robot", "", None, 5, "function", "SYSTEM", ["user"]]
    out = [_chat(messages=[{"role": r, "content": "x"}]) for r in roles]
    bad_msgs = [
        [{"content": "no role"}], [{"role": "user", "content": 5}], [{"role": "user", "content": [5]}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}],
        [{"role": "user", "content": [{"type": "text", "text": 5}]}], [{"role": "user", "name": 5, "content": "x"}],
        [{"role": "tool", "content": "orphan result", "tool_call_id": "a"}],
        [{"role": "assistant", "tool_calls": "x"}], [{"role": "assistant", "tool_calls": [{"function": {}}]}],
        [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": [1]}}]}],
        [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1, 2]"}}]}],
        [{"role": "assistant", "reasoning_content": 5, "content": "x"}],
        [{"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "f"}}]},
         {"role": "tool", "tool_call_id": "c2", "content": "wrong id"}],
        [{"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "f"}}]},
         {"role": "tool", "tool_call_id": "c1", "content": "a"},
         {"role": "tool", "tool_call_id": "c1", "content": "b"}],
        [{"role": "system", "content": "x", "tools": "bad"}],
        [{"role": "user", "content": MB}], [{"role": "user", "content": "x", "name": MB}],
        [{"role": "assistant", "content": "x", "reasoning_content": MB}],
        [{"role": "assistant", "tool_calls": [{"id": MB, "function": {"name": "f"}}]},
         {"role": "tool", "tool_call_id": "other", "content": "x"}],
    ]
    out += [_chat(messages=m) for m in bad_msgs]
    out += [_chat(model=MB), _chat(tools=[{"type": "function", "function": {"name": "f", "description": MB}}]),
            _chat(max_tokens=4090), {"messages": OK_MSG}, {"model": MODEL}]
    return out


def _deep_tools() -> bytes:
    """Tool parameters nested 3000 deep (deeper than the JSON parser's recursion limit)."""
    head = json.dumps(_chat())[:-1].encode()
    return head + b', "tools": [{"type": "function", "function": {"name": "f", "parameters": ' + b'{"a": ' * 3000 \
        + b"{}" + b"}" * 3000 + b"}}]}"


def _completions() -> list[dict]:
    prompts = [None, 5, [], [-1], [10**9], [1.5], ["a", 5], {"a": 1}, "", [[1], []], MB, True, ["x"] * 100]
    out = [{"model": MODEL, "prompt": p, "max_tokens": 2} for p in prompts]
    shared = ("temperature", "top_p", "top_k", "max_tokens", "stream", "stream_options", "stop", "n", "seed",
              "presence_penalty", "logit_bias", "stop_token_ids", "model")
    out += [{"model": MODEL, "prompt": "x", "max_tokens": 2, k: v} for k, vs in _wrong_values().items() if k in shared
            for v in vs]
    out += [{"model": MODEL, "prompt": "x", **kv} for kv in (
        {"echo": True, "logprobs": 1}, {"suffix": "s"}, {"best_of": 3}, {"logprobs": 10}, {"logprobs": -1}, {"max_tokens": -3},
        {"max_tokens": 10**8}, {"n": 300}, {"temperature": 9}, {"model": "gpt-4"}, {"stop": {"a": 1}})]
    return out


def _requests() -> list[tuple[str, str, object]]:
    """(method, path, body): body is bytes (sent raw) or a JSON-able object."""
    reqs: list[tuple[str, str, object]] = [("POST", "/v1/chat/completions", b) for b in _raw_bodies()]
    reqs += [("POST", "/v1/completions", b) for b in _raw_bodies()[:10]]
    reqs += [("POST", "/v1/chat/completions", b) for b in _typed_fields() + _messages() + [_deep_tools()]]
    reqs += [("POST", "/v1/completions", b) for b in _completions()]
    reqs += [("GET", "/v1/chat/completions", None), ("PUT", "/v1/completions", b"{}"), ("DELETE", "/v1/models", None),
             ("GET", "/v1/unknown", None), ("POST", "/v1/chat/completions/extra", b"{}"), ("GET", "/v2/models", None)]
    return reqs


def _send(client: httpx.Client, method: str, path: str, body: object) -> tuple[int, object, str]:
    content = body if isinstance(body, bytes) or body is None else json.dumps(body, allow_nan=True).encode()
    r = client.request(method, path, content=content, headers={"content-type": "application/json"})
    try:
        payload = r.json()
    except ValueError:
        payload = None
    return r.status_code, payload, f"{method} {path} {str(body)[:120]!r}"


def _disconnect(base: str, body: dict, read_bytes: int) -> None:
    """Send a request on a raw socket, read a little (or nothing), then drop the connection."""
    u = urlsplit(base)
    data = json.dumps(body).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {u.hostname}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode()
    with socket.create_connection((u.hostname, u.port), timeout=30) as s:
        s.sendall(head + data)
        got = 0
        while got < read_bytes:
            chunk = s.recv(256)
            if not chunk:
                break
            got += len(chunk)


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def test_hostile_requests_get_4xx_and_disconnects_free_the_cache(live_server):
    base = live_server.base_url
    reqs = _requests()
    assert len(reqs) >= 200
    long_body = {"model": MODEL, "messages": [{"role": "user", "content": "tell me everything"}], "max_tokens": 400,
                 "stream": True}
    threads = [threading.Thread(target=_disconnect, args=(base, long_body, 1 + (i % 3) * 300)) for i in range(12)]
    threads += [threading.Thread(target=_disconnect, args=(base, dict(long_body, stream=False), 0)) for _ in range(6)]
    with httpx.Client(base_url=base, timeout=60) as client, ThreadPoolExecutor(8) as pool:
        for t in threads:
            t.start()
        results = list(pool.map(lambda r: _send(client, *r), reqs))
        for t in threads:
            t.join(60)
        failures = [(status, what) for status, payload, what in results
                    if not 400 <= status < 500 or not isinstance(payload, dict)
                    or set(payload.get("error", {})) != {"message", "type", "param", "code"}]
        assert not failures, f"{len(failures)} bad answers, e.g. {failures[:5]}\n{live_server.log()}"
        # cancelled requests leave the engine and free their cache; the server keeps serving
        deadline = time.time() + 120
        while True:
            m = client.get("/metrics").text
            if _metric(m, "k3_running") == 0 and _metric(m, "k3_waiting") == 0:
                break
            assert time.time() < deadline, "requests of disconnected clients were not cancelled"
            time.sleep(0.5)
        assert _metric(m, "k3_http_aborted_requests") >= 1
        assert "k3_http_status_500" not in m
        assert client.get("/health").status_code == 200
        ok = client.post("/v1/chat/completions", json=_chat(max_tokens=3))
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["role"] == "assistant"
    assert live_server.proc.poll() is None
