"""Sampling: the batched sampler's distributions, per-request seeds, stop strings/ids, logprobs."""

from __future__ import annotations

import random

import pytest
import torch

from k3.serve.sampling import Detokenizer, SamplingParams, make_rng, sample_batch
from tests.serve.conftest import random_prompt


def test_sampling_params_validation():
    for bad in (dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-1), dict(max_tokens=0),
                dict(max_tokens=True), dict(logprobs=21), dict(stop=("",)), dict(seed="x")):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_greedy_top_k_1_and_vocab_limit():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g)
    logits[:, 45] = 100.0  # beyond the limit: must never be picked
    ps = [SamplingParams(temperature=0), SamplingParams(temperature=1.3, top_k=1),
          SamplingParams(temperature=0.7, top_p=1e-6), SamplingParams(temperature=0)]
    res = sample_batch(logits, ps, [make_rng(p) for p in ps], vocab_limit=40)
    assert res.token_ids == logits[:, :40].argmax(-1).tolist()
    assert res.logprobs == [None] * 4


def test_sampled_frequencies_follow_temperature_top_k_top_p():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 20000
    cases = [(SamplingParams(temperature=0.8), None),
             (SamplingParams(temperature=1.0, top_k=3), 3),
             (SamplingParams(temperature=1.0, top_p=0.8), None)]
    for p, k in cases:
        rng = random.Random(1)
        res = sample_batch(logits.expand(n, -1), [p] * n, [rng] * n)
        freq = torch.bincount(torch.tensor(res.token_ids), minlength=6).float() / n
        probs = torch.softmax(logits / p.temperature, -1)
        if k:
            probs[k:] = 0
        if p.top_p < 1:
            keep = (probs.cumsum(-1) - probs) < p.top_p
            probs = probs * keep
        probs = probs / probs.sum()
        assert torch.all(freq[probs == 0] == 0)
        torch.testing.assert_close(freq, probs, atol=0.015, rtol=0)


def test_logprobs_are_model_log_softmax():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 30, generator=g)
    ps = [SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=1, seed=5, logprobs=0),
          SamplingParams(temperature=0)]
    res = sample_batch(logits, ps, [make_rng(p) for p in ps])
    lsm = torch.log_softmax(logits, -1)
    for i in (0, 1):
        assert res.logprobs[i] == pytest.approx(lsm[i, res.token_ids[i]].item(), abs=1e-6)
    top = lsm[0].topk(3)
    assert [t for t, _ in res.top[0]] == top.indices.tolist()
    assert res.top[1] == [] and res.logprobs[2] is None and res.top[2] is None


def test_seeded_sampling_does_not_depend_on_the_batch(make_engine, tokenizer):
    rng = random.Random(3)
    prompts = [random_prompt(rng, n, tokenizer.base_size) for n in (6, 15, 9)]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=10, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    alone = make_engine().generate([prompts[0]], seeded)[0].token_ids
    mixed = make_engine().generate(prompts, [other, seeded, other])
    again = make_engine().generate([prompts[1], prompts[0]], [other, seeded])
    assert again[1].token_ids == alone
    assert make_engine().generate([prompts[1]], seeded)[0].token_ids == mixed[1].token_ids
    unseeded = [make_engine().generate([prompts[0]], other)[0].token_ids for _ in range(2)]
    assert unseeded[0] != unseeded[1]  # 10 tokens from a ~400-way distribution


def test_stop_token_ids_and_max_tokens(make_engine, tokenizer):
    rng = random.Random(4)
    prompt = random_prompt(rng, 10, tokenizer.base_size)
    free = make_engine().generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 6
    stop_at = free.token_ids[3]
    k = free.token_ids.index(stop_at)
    out = make_engine().generate([prompt], SamplingParams(temperature=0, max_tokens=6, stop_token_ids=(stop_at,),
                                                          skip_special_tokens=False))[0]
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[: k + 1]
    assert out.text == tokenizer.decode(free.token_ids[:k])  # the stop id is in the ids, not the text


def test_stop_strings_in_the_engine(make_engine, tokenizer):
    rng = random.Random(5)
    prompt = random_prompt(rng, 10, tokenizer.base_size)
    keep = dict(skip_special_tokens=False)  # compare with tokenizer.decode, which names special tokens
    free = make_engine().generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, **keep))[0]
    stop = free.text[len(free.text) // 2: len(free.text) // 2 + 3]
    cut = free.text.index(stop)
    out = make_engine().generate([prompt], SamplingParams(temperature=0, max_tokens=8, stop=(stop,), **keep))[0]
    assert out.finish_reason == "stop" and out.text == free.text[:cut]
    assert tokenizer.decode(out.token_ids) == free.text[: len(tokenizer.decode(out.token_ids))]


class _ByteTok:
    """token id = one byte (ids >= 256 are two-byte UTF-8 halves of 'é')."""

    def token_bytes(self, i: int) -> bytes:
        return bytes([i]) if i < 256 else "é".encode()[i - 256: i - 255]


def test_detokenizer_holds_back_possible_stop_prefixes():
    d = Detokenizer(_ByteTok(), stop=("END", "xy"))
    released = []
    for ch in "abcEN":
        assert not d.add(ord(ch))
        released.append(d.release(False))
    assert "".join(t for _, t in released) == "abc"  # "EN" may start "END"
    assert d.add(ord("D"))
    ids, text = d.release(True)
    assert text == "" and d.text == "abc" and ids == []
    d2 = Detokenizer(_ByteTok(), stop=("zz",))
    for i in (ord("a"), 256, 257, ord("b")):
        d2.add(i)
    ids, text = d2.release(True)
    assert text == "aéb" and ids == [ord("a"), 256, 257, ord("b")]
    d3 = Detokenizer(_ByteTok(), stop=("b",))
    for i in (ord("a"), ord("b"), ord("c")):
        if d3.add(i):
            break
    assert d3.release(True) == ([ord("a")], "a")
