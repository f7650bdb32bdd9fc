"""Sampling completeness through the official `openai` client against a live `k3 serve` (k3-tiny):
n > 1 with one prefill, penalties, logit_bias, min_tokens, echo and batch prompts, special tokens kept
out of the text, reasoning fields omitted when empty, /v1/models/{id} and HEAD."""

from __future__ import annotations

import re
import urllib.request

import openai
import pytest


@pytest.fixture(scope="module")
def client(live_server):
    return openai.OpenAI(base_url=live_server.base_url + "/v1", api_key="unused", timeout=120, max_retries=0)


def metric(live_server, name: str) -> float:
    with urllib.request.urlopen(live_server.base_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return float(re.search(rf"^k3_{name} (\S+)$", text, re.M).group(1))


def test_n_choices_share_one_prefill(client, live_server):
    before_tokens = metric(live_server, "prompt_tokens_computed_total")
    before_forks = metric(live_server, "forked_requests_total")
    msgs = [{"role": "user", "content": "an unusual question about the lazy fox and its data model 17"}]
    r = client.chat.completions.create(model="k3-tiny", messages=msgs, n=4, max_tokens=4, temperature=1.0, seed=5,
                                       extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.completion_tokens == 16  # summed over the choices; the prompt counted once
    assert metric(live_server, "forked_requests_total") - before_forks == 3
    # the prompt was computed once (what the prefix cache did not hold), not four times
    computed = r.usage.prompt_tokens - r.usage.prompt_tokens_details.cached_tokens
    assert metric(live_server, "prompt_tokens_computed_total") - before_tokens == computed > 0
    before_tokens = metric(live_server, "prompt_tokens_computed_total")
    before_forks = metric(live_server, "forked_requests_total")
    msgs = [{"role": "user", "content": "another question about the quick dog and its python file 23"}]
    stream = client.chat.completions.create(model="k3-tiny", messages=msgs, n=4, max_tokens=3, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    finished = {c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason}
    usage = chunks[-1].usage
    assert finished == {0, 1, 2, 3} and usage.completion_tokens == 12
    assert metric(live_server, "forked_requests_total") - before_forks == 3
    computed = usage.prompt_tokens - usage.prompt_tokens_details.cached_tokens
    assert metric(live_server, "prompt_tokens_computed_total") - before_tokens == computed > 0


def test_logit_bias_min_tokens_and_penalties(client, tokenizer):
    tid = tokenizer.encode(" fox")[0]
    r = client.completions.create(model="k3-tiny", prompt="the quick brown", max_tokens=4, temperature=0,
                                  logit_bias={str(tid): 100}, extra_body={"ignore_eos": True})
    assert r.choices[0].text == tokenizer.decode([tid]) * 4
    # a bias that wins once; the penalties (2 + 2 x count after the first use) take it back
    kw = dict(model="k3-tiny", prompt="the quick brown", max_tokens=3, temperature=0, logit_bias={str(tid): 3},
              extra_body={"ignore_eos": True})
    assert client.completions.create(**kw).choices[0].text == tokenizer.decode([tid]) * 3
    r = client.completions.create(**kw, frequency_penalty=2.0, presence_penalty=2.0)
    assert r.choices[0].text.count(tokenizer.decode([tid])) == 1 and r.choices[0].text.startswith(" fox")
    eos = {str(tokenizer.eos_id): 100}
    r = client.chat.completions.create(model="k3-tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                       temperature=0, logit_bias=eos)
    assert r.usage.completion_tokens == 1 and r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(model="k3-tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                       temperature=0, logit_bias=eos, extra_body={"min_tokens": 5})
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "stop"


def _stream(client, chat: bool = True, **kw) -> tuple[str, str | None, int]:
    """(text, finish_reason, completion tokens) of a one-choice stream (chat content or completion text)."""
    kw = dict(model="k3-tiny", temperature=0, stream=True, stream_options={"include_usage": True}, **kw)
    create = client.chat.completions.create if chat else client.completions.create
    text, finish, used = "", None, None
    for chunk in create(**kw):
        for ch in chunk.choices:
            text += (ch.delta.content or "") if chat else ch.text
            finish = ch.finish_reason or finish
        used = chunk.usage.completion_tokens if chunk.usage else used
    return text, finish, used


def test_sampling_fields_streamed(client, tokenizer):
    """logit_bias, penalties, min_tokens, ignore_eos and skip_special_tokens on streams (chat and
    completions), with the same outcomes as the non-stream tests above."""
    fox = tokenizer.encode(" fox")[0]
    hi = dict(messages=[{"role": "user", "content": "hi"}], extra_body={"thinking": {"type": "disabled"}})
    assert _stream(client, max_tokens=4, logit_bias={str(fox): 100}, **{**hi, "extra_body": {
        **hi["extra_body"], "ignore_eos": True}}) == (tokenizer.decode([fox]) * 4, "length", 4)
    kw = dict(prompt="the quick brown", max_tokens=3, logit_bias={str(fox): 3}, extra_body={"ignore_eos": True})
    assert _stream(client, chat=False, **kw)[0] == tokenizer.decode([fox]) * 3
    text, _, _ = _stream(client, chat=False, **kw, frequency_penalty=2.0, presence_penalty=2.0)
    assert text.count(tokenizer.decode([fox])) == 1 and text.startswith(" fox")
    eos = {str(tokenizer.eos_id): 100}
    assert _stream(client, max_tokens=8, logit_bias=eos, **hi)[1:] == ("stop", 1)
    assert _stream(client, max_tokens=8, logit_bias=eos, **{**hi, "extra_body": {
        **hi["extra_body"], "min_tokens": 5}})[1:] == ("stop", 6)
    assert _stream(client, max_tokens=4, logit_bias=eos, **{**hi, "extra_body": {
        **hi["extra_body"], "ignore_eos": True}})[1:] == ("length", 4)
    reserved = next(i for name, i in tokenizer.special_tokens.items() if "reserved" in name)
    text, _, used = _stream(client, max_tokens=3, logit_bias={str(reserved): 100}, **hi)
    assert used == 3 and "<|" not in text
    text, _, _ = _stream(client, max_tokens=3, logit_bias={str(reserved): 100}, **{**hi, "extra_body": {
        **hi["extra_body"], "skip_special_tokens": False}})
    assert "<|reserved_token_" in text


def test_echo_and_batch_prompts(client):
    prompts = ["the quick brown", "lazy dog data"]
    r = client.completions.create(model="k3-tiny", prompt=prompts, n=2, echo=True, max_tokens=3, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for c in r.choices:
        assert c.text.startswith(prompts[c.index // 2])
    assert r.choices[0].text == r.choices[1].text  # greedy samples of one prompt agree
    stream = client.completions.create(model="k3-tiny", prompt=prompts, echo=True, max_tokens=2, stream=True)
    texts = {0: "", 1: ""}
    for c in stream:
        for ch in c.choices:
            texts[ch.index] += ch.text
    assert texts[0].startswith(prompts[0]) and texts[1].startswith(prompts[1])


def test_special_tokens_stay_out_of_text(client, tokenizer):
    reserved = next(i for name, i in tokenizer.special_tokens.items() if "reserved" in name)
    kw = dict(model="k3-tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0,
              logit_bias={str(reserved): 100}, extra_body={"thinking": {"type": "disabled"}})
    r = client.chat.completions.create(**kw)
    assert r.usage.completion_tokens == 3 and "<|" not in (r.choices[0].message.content or "")
    kw["extra_body"]["skip_special_tokens"] = False
    r = client.chat.completions.create(**kw)
    assert "<|reserved_token_" in r.choices[0].message.content
    r = client.completions.create(model="k3-tiny", prompt="hi", max_tokens=2, temperature=0,
                                  logit_bias={str(reserved): 100})
    assert r.choices[0].text == "" and r.usage.completion_tokens == 2


def test_reasoning_fields_omitted_when_empty(client):
    r = client.chat.completions.create(model="k3-tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                       extra_body={"thinking": {"type": "disabled"}})
    extra = r.choices[0].message.model_extra
    assert "reasoning_content" not in extra and "reasoning" not in extra


def test_model_retrieve_and_head(client, live_server):
    m = client.models.retrieve("k3-tiny")
    assert m.id == "k3-tiny" and m.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    for path in ("/v1/models", "/v1/models/k3-tiny", "/health", "/metrics", "/v1/chat/completions",
                 "/v1/completions", "/v1/responses", "/v1/messages"):
        req = urllib.request.Request(live_server.base_url + path, method="HEAD")
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status == 200 and r.read() == b""
