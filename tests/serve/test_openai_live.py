"""The official `openai` client against a live `k3 serve` subprocess (k3-tiny checkpoint, CPU)."""

from __future__ import annotations

import random

import openai
import pytest

from tests.serve.conftest import WORDS

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


@pytest.fixture(scope="module")
def client(live_server):
    return openai.OpenAI(base_url=live_server.base_url + "/v1", api_key="unused", timeout=120, max_retries=0)


def test_models_and_non_stream(client):
    assert [m.id for m in client.models.list().data] == ["k3-tiny"]
    r = client.chat.completions.create(model="k3-tiny", messages=[{"role": "user", "content": "hello there"}],
                                       max_tokens=5, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 5 and r.usage.prompt_tokens > 0
    assert r.usage.prompt_tokens_details.cached_tokens >= 0
    extra = r.choices[0].message.model_extra
    assert extra["reasoning_content"] == extra["reasoning"]


def test_stream_with_include_usage(client):
    stream = client.chat.completions.create(model="k3-tiny", messages=[{"role": "user", "content": "weather data"}],
                                            max_tokens=6, temperature=0.7, seed=3, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish in (["stop"], ["length"])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens <= 6
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 0


def test_tool_call_round_trip_with_tool_call_id(client):
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model="k3-tiny", messages=msgs, tools=TOOLS, max_tokens=6,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    msg = r.choices[0].message
    # random weights never close the call: the server closes the forced call when max_tokens runs out
    assert r.choices[0].finish_reason in ("tool_calls", "length")
    (call,) = msg.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    msgs.append({"role": "assistant", "content": msg.content, "tool_calls": [call.model_dump()],
                 "reasoning_content": msg.model_extra.get("reasoning_content")})
    msgs.append({"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'})
    r2 = client.chat.completions.create(model="k3-tiny", messages=msgs, tools=TOOLS, max_tokens=4)
    assert r2.choices[0].message.role == "assistant"
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens
    bad = msgs[:-1] + [{"role": "tool", "tool_call_id": "call_unknown", "content": "x"}]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="k3-tiny", messages=bad, tools=TOOLS, max_tokens=4)


def test_multi_turn_with_reasoning_content(client):
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "plan a search"}]
    r1 = client.chat.completions.create(model="k3-tiny", messages=msgs, max_tokens=6, reasoning_effort="high")
    m1 = r1.choices[0].message
    msgs += [{"role": "assistant", "content": m1.content or "", "reasoning_content": "I planned: "
              + (m1.model_extra.get("reasoning_content") or "")}, {"role": "user", "content": "and then?"}]
    r2 = client.chat.completions.create(model="k3-tiny", messages=msgs, max_tokens=4, reasoning_effort="high",
                                        extra_body={"thinking": {"type": "enabled"}, "prompt_cache_key": "s1"})
    # turn 2 extends turn 1's prompt: its prompt end is a cached checkpoint
    assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens - 1
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="k3-tiny", messages=msgs, max_tokens=4, reasoning_effort="extreme")


def test_shared_long_prefix_reports_cached_tokens(client):
    rng = random.Random(0)
    system = " ".join(rng.choice(WORDS) for _ in range(1100))
    def ask(q):
        return client.chat.completions.create(
            model="k3-tiny", max_tokens=3,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": q}])
    first = ask("first question about the weather")
    second = ask("a different question about python files")
    assert first.usage.prompt_tokens > 1100
    assert second.usage.prompt_tokens_details.cached_tokens >= 1024


def test_completions_endpoint(client):
    r = client.completions.create(model="k3-tiny", prompt="the quick brown fox", max_tokens=4, logprobs=2,
                                  temperature=0)
    c = r.choices[0]
    assert r.object == "text_completion" and len(c.logprobs.tokens) == r.usage.completion_tokens <= 4
    assert all(len(t) <= 2 for t in c.logprobs.top_logprobs)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)


def test_chat_logprobs_and_seeded_sampling(client):
    kw = dict(model="k3-tiny", messages=[{"role": "user", "content": "data model"}], max_tokens=5, temperature=1.0,
              seed=11, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    lp = a.choices[0].logprobs.content
    assert len(lp) == a.usage.completion_tokens == 5
    assert all(e.logprob <= 0 and len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.logprob - 1e-6
               for e in lp)
    assert all(e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob for e in lp)
    assert [e.token for e in lp] == [e.token for e in b.choices[0].logprobs.content]  # same seed, same tokens
