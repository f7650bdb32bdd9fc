"""A kimi-cli style request (system prompt, 15 tools, preserved thinking, a tool round, `thinking`,
`prompt_cache_key`, a chars/4 `max_completion_tokens` far beyond the context left, streaming with
usage) replayed against the server: as-is it is a 400 unless the server clamps max tokens, with
`--clamp-max-tokens` it streams, reports the clamp, and a repeat hits the prefix cache."""

from __future__ import annotations

import json
import pathlib

import openai
import pytest
from starlette.testclient import TestClient

from k3.serve.async_engine import AsyncEngine
from k3.serve.server import ServerConfig, build_app

REQUEST = json.loads((pathlib.Path(__file__).parent / "fixtures" / "kimi_cli_request.json").read_text())


def events(resp) -> list[dict]:
    data = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


@pytest.fixture(scope="module")
def apps(model, tokenizer):
    from k3.serve.engine import Engine, EngineConfig

    def make(clamp: bool):
        eng = Engine(model, tokenizer, EngineConfig(memory_budget_bytes=64 << 20, page_size=16, unit_size=64,
                                                    max_model_len=4096))
        return build_app(AsyncEngine(eng), tokenizer, ServerConfig(model_names=("k3-tiny",), clamp_max_tokens=clamp))

    return make


def test_replay_clamped_streams_and_reuses_the_cache(apps):
    assert len(REQUEST["tools"]) == 15
    with TestClient(apps(False)) as client:
        r = client.post("/v1/chat/completions", json=REQUEST)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    with TestClient(apps(True)) as client:
        usages = []
        for _ in range(2):
            with client.stream("POST", "/v1/chat/completions", json=REQUEST) as r:
                assert r.status_code == 200
                requested, used = r.headers["x-k3-max-tokens-clamped"].split("->")
                chunks = events(r)
            assert int(requested) == 32000 and 1 <= int(used) < 100
            assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
            usage = chunks[-1]["usage"]
            assert usage["prompt_tokens"] + int(used) == 4096 and usage["completion_tokens"] <= int(used)
            finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]
                      and c["choices"][0]["finish_reason"]]
            assert finish in (["stop"], ["length"], ["tool_calls"])
            usages.append(usage)
        # the repeat reuses the conversation prefix (a checkpoint at its last message end or unit)
        assert usages[1]["prompt_tokens_details"]["cached_tokens"] >= usages[0]["prompt_tokens"] - 64


def test_replay_through_the_openai_client(live_server):
    client = openai.OpenAI(base_url=live_server.base_url + "/v1", api_key="unused", timeout=120, max_retries=0)
    kw = {k: v for k, v in REQUEST.items() if k not in ("thinking", "prompt_cache_key", "max_completion_tokens")}
    stream = client.chat.completions.create(**kw, max_completion_tokens=8, extra_body={
        "thinking": REQUEST["thinking"], "prompt_cache_key": REQUEST["prompt_cache_key"]})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens <= 8
