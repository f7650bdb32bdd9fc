"""Speculative decoding (k3.serve.speculative) on k3-tiny (random weights, CPU): the n-gram proposer,
the exactness of the acceptance rule, greedy output identical to plain decoding (drafts accepted and
rejected, stops and max_tokens inside a run), prefix caching, and the KDA rollback after a rejection.

The engines here use a 32-token vocabulary (a stub tokenizer): a random model's greedy output over
a small vocabulary repeats itself, so prompt-lookup drafts are proposed often and sometimes accepted.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from k3.serve.engine import Engine, EngineConfig
from k3.serve.sampling import SamplingParams, target_probs
from k3.serve.speculative import NgramProposer, TokenArray, accept_draft

V = 32


class SmallVocab:
    """Tokenizer stand-in: ids 0..V-1, token i spells "<i>", eos = V - 1."""

    vocab_size, eos_id = V, V - 1

    def token_bytes(self, i: int) -> bytes:
        return f"<{i}>".encode()


def _engine(model, k: int, **overrides) -> Engine:
    cfg = {"memory_budget_bytes": 16 << 20, "page_size": 8, "unit_size": 8, "checkpoint_every_units": 4,
           "checkpoint_min_gap": 2, "max_model_len": 1024, "speculative_ngram": k, "speculative_min_match": 1,
           "speculative_max_match": 3, "enable_prefix_cache": False,
           "speculative_max_batch": 0}  # the verify path at every batch size (the policy: tests/serve/test_spec_policy.py)
    cfg.update(overrides)
    return Engine(model, SmallVocab(), EngineConfig(**cfg))


def _repetitive(rng: random.Random, period: int, reps: int) -> list[int]:
    base = [rng.randrange(V - 1) for _ in range(period)]
    return base * reps


class Oracle:
    """A proposer that knows the plain-decoding continuation of each prompt and proposes it, with
    every `bad`-th proposal's last draft replaced, so runs are accepted in full, in part and not at all."""

    def __init__(self, full: list[list[int]], bad: int = 3) -> None:
        self.full, self.bad, self.calls = full, bad, 0

    def propose(self, tokens, limit: int | None = None) -> list[int]:
        tokens = [int(t) for t in tokens]
        limit = 4 if limit is None else min(limit, 4)
        for seq in self.full:
            if seq[: len(tokens)] == tokens:
                d = seq[len(tokens): len(tokens) + limit]
                self.calls += 1
                if d and self.calls % self.bad == 0:
                    d[-1] = (d[-1] + 1) % (V - 1)
                return d
        return []


# ---------------------------------------------------------------------------------------- proposer

def test_ngram_proposer_longest_most_recent_match_and_cap():
    p = NgramProposer(max_draft=3, min_match=1, max_match=3)
    # suffix [1, 2] occurs twice earlier; [9, 1, 2] once (longest wins over most recent shorter match)
    assert p.propose([9, 1, 2, 5, 6, 1, 2, 7, 8, 9, 1, 2]) == [5, 6, 1]
    # two occurrences of the longest suffix: the most recent one
    assert p.propose([1, 2, 3, 4, 1, 2, 5, 6, 1, 2]) == [5, 6, 1, 2][:3]
    assert p.propose([4, 5, 6, 7]) == []  # no earlier occurrence of 7
    assert p.propose([1]) == [] and p.propose([]) == []
    assert p.propose([1, 2, 3, 1, 2], limit=1) == [3]  # the caller's cap
    assert p.propose([1, 2, 3, 1, 2], limit=0) == []
    assert p.propose([5, 1, 2, 3, 4, 6, 7, 5]) == [1, 2, 3]  # capped at max_draft
    assert p.propose([7, 7, 7]) == [7]  # overlapping occurrence: only the tokens that exist follow
    # the engine passes an incrementally grown int64 array of the request's tokens
    arr, toks, rng = TokenArray(), [], random.Random(0)
    for _ in range(40):
        toks += [rng.randrange(5) for _ in range(rng.randrange(1, 4))]
        view = arr.sync(toks)
        assert view.tolist() == toks and p.propose(view) == p.propose(toks)
    strict = NgramProposer(max_draft=4, min_match=3, max_match=4)
    assert strict.propose([1, 2, 3, 4, 0, 2, 3]) == []  # a 2-token match is below min_match
    assert strict.propose([1, 2, 3, 4, 0, 1, 2, 3]) == [4, 0, 1, 2]
    for bad in ({"max_draft": 0, "min_match": 1, "max_match": 1}, {"max_draft": 2, "min_match": 3, "max_match": 2}):
        with pytest.raises(ValueError, match="NgramProposer"):
            NgramProposer(**bad)


def test_engine_config_validates_speculative_fields(model):
    for bad, field in (({"speculative_ngram": -1}, "speculative_ngram"),
                       ({"speculative_min_match": 0}, "speculative_min_match"),
                       ({"speculative_min_match": 3, "speculative_max_match": 2}, "speculative_max_match")):
        with pytest.raises(ValueError, match=field):
            EngineConfig(**bad).validate()


# ---------------------------------------------------------------------------------------- acceptance

def _chi2(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs) if p > 0)


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4),
                                    SamplingParams(temperature=1.3, top_p=0.8)])
def test_acceptance_is_lossless(params):
    """With a deterministic draft, the first emitted token is distributed as the target p (whatever
    the draft), and after an accepted first draft the second token is distributed as p_1."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, generator=g) * 1.5
    p = target_probs(logits, [params] * 3)
    draft = [int(p[0].argsort()[-2]), int(p[1].argsort()[-1])]  # 2nd likeliest, then the likeliest
    n = 6000
    first, second = [0] * 6, [0] * 6
    accepted = 0
    for seed in range(n):
        toks, acc = accept_draft(logits, draft, params, random.Random(seed))
        assert len(toks) == acc + 1 and toks[:acc] == draft[:acc]
        first[toks[0]] += 1
        if acc >= 1:
            second[toks[1]] += 1
        accepted += acc
    # 5 degrees of freedom: P(chi2 > 25) < 2e-4; fixed seeds make the test deterministic
    assert _chi2(first, p[0].tolist()) < 25
    assert all(c == 0 for c, q in zip(first, p[0].tolist()) if q == 0)  # filtered tokens never appear
    assert _chi2(second, p[1].tolist()) < 25
    assert abs(first[draft[0]] / n - float(p[0, draft[0]])) < 0.03
    assert accepted > 0


def test_acceptance_greedy_and_shapes():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    greedy = SamplingParams(temperature=0)
    assert accept_draft(logits, [1, 0], greedy, random.Random(0)) == ([1, 0, 2], 2)  # all + bonus
    assert accept_draft(logits, [1, 2], greedy, random.Random(0)) == ([1, 0], 1)  # corrected
    assert accept_draft(logits, [2, 0], greedy, random.Random(0)) == ([1], 0)
    # a draft of probability 1 is always accepted, one of probability 0 never
    sure = torch.tensor([[0.0, 100.0, 0.0], [0.0, 0.0, 0.0]])
    assert accept_draft(sure, [1], SamplingParams(top_k=1), random.Random(3))[1] == 1
    assert accept_draft(sure, [0], SamplingParams(top_k=1), random.Random(3)) == ([1], 0)
    with pytest.raises(ValueError, match="rows"):
        accept_draft(logits, [1], greedy, random.Random(0))


# ---------------------------------------------------------------------------------------- engine

def _spec_stats(eng: Engine) -> dict:
    return {k: v for k, v in eng.stats().items() if k.startswith("spec_")}


def test_greedy_ngram_speculation_equals_plain_decoding(model):
    rng = random.Random(0)
    prompts = [_repetitive(rng, 4, 4), _repetitive(rng, 6, 3), _repetitive(rng, 3, 5) + [7, 8]]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = _engine(model, 0).generate(prompts, params)
    eng = _engine(model, 4)
    spec = eng.generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    s = _spec_stats(eng)
    assert 0 < s["spec_accepted_tokens"] < s["spec_draft_tokens"]  # accepted and rejected drafts
    assert s["spec_verify_forwards"] > 0 and s["spec_rerun_forwards"] > 0
    assert eng.pool.num_free == eng.pool.usable  # rejected-draft pages were released too


def test_greedy_oracle_drafts_with_stops_inside_runs(model):
    """Drafts from the true continuation (every third one spoiled): long accepted runs, partial
    rejections, and a stop id, a stop string and max_tokens landing inside or at the end of a run;
    the output, finish reasons, text and logprobs equal plain decoding's."""
    rng = random.Random(1)
    prompts = [_repetitive(rng, 5, 2), [rng.randrange(V - 1) for _ in range(9)], _repetitive(rng, 2, 4)]
    free = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ref = _engine(model, 0).generate(prompts, free)
    full = [p + o.token_ids for p, o in zip(prompts, ref)]
    stop_tok = ref[0].token_ids[13]
    stop_str = SmallVocab().token_bytes(ref[1].token_ids[11]).decode()
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=(stop_tok,), logprobs=2),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=(stop_str,), logprobs=0),
              SamplingParams(temperature=0, max_tokens=17, ignore_eos=True, logprobs=1)]
    plain_eng = _engine(model, 0)
    plain = plain_eng.generate(prompts, params)
    eng = _engine(model, 4, static_decode=True)  # rows without drafts take the runner's static decode
    eng.spec.proposer = Oracle(full)
    spec = eng.generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert [o.finish_reason for o in spec] == [o.finish_reason for o in plain] == ["stop", "stop", "length"]
    assert [o.text for o in spec] == [o.text for o in plain]
    assert len(spec[2].token_ids) == 17
    for a, b in zip(spec, plain):
        assert len(a.logprobs) == len(b.logprobs) == len(a.token_ids)
        for (lp_a, top_a), (lp_b, top_b) in zip(a.logprobs, b.logprobs):
            assert math.isclose(lp_a, lp_b, abs_tol=1e-3)
            assert [t for t, _ in top_a] == [t for t, _ in top_b]
    s = _spec_stats(eng)
    assert s["spec_accepted_tokens"] > s["spec_draft_tokens"] / 2 and s["spec_rerun_forwards"] > 0
    assert eng.stats()["generated_tokens"] == plain_eng.stats()["generated_tokens"]  # nothing sampled past a stop


def test_sampling_with_speculation_is_valid_and_reproducible(model):
    rng = random.Random(2)
    prompts = [_repetitive(rng, 3, 4), _repetitive(rng, 5, 3)]
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24, ignore_eos=True, seed=7, logprobs=1)
    runs = []
    for _ in range(2):
        eng = _engine(model, 3)
        runs.append(eng.generate(prompts, params))
        assert _spec_stats(eng)["spec_verify_forwards"] > 0
    for o in runs[0]:
        assert len(o.token_ids) == 24 and o.finish_reason == "length"
        assert all(0 <= t < V for t in o.token_ids)
        assert all(math.isfinite(lp) and lp <= 0 for lp, _ in o.logprobs)
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]]


def test_sampled_path_with_a_point_mass_target_equals_greedy(model):
    """top_k=1 makes the sampled target distribution a point mass on the argmax: the sampled
    acceptance path (accept with prob p(x), residual draws, bonus draws) must then reproduce greedy
    decoding exactly, with drafts from the true continuation accepted and the spoiled ones rejected."""
    rng = random.Random(5)
    prompts = [_repetitive(rng, 4, 3), [rng.randrange(V - 1) for _ in range(7)]]
    ref = _engine(model, 0).generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    eng = _engine(model, 4)
    eng.spec.proposer = Oracle([p + o.token_ids for p, o in zip(prompts, ref)], bad=2)
    out = eng.generate(prompts, SamplingParams(temperature=0.9, top_k=1, max_tokens=20, ignore_eos=True, seed=3))
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    s = _spec_stats(eng)
    assert 0 < s["spec_accepted_tokens"] < s["spec_draft_tokens"] and s["spec_rerun_forwards"] > 0


def test_prefix_cache_with_speculation_matches_cold(model):
    rng = random.Random(3)
    turn1 = _repetitive(rng, 4, 4) + [V - 1] + _repetitive(rng, 3, 3)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    eng = _engine(model, 4, enable_prefix_cache=True)
    out1 = eng.generate([turn1], params)[0]
    turn2 = turn1 + out1.token_ids + [V - 1] + _repetitive(rng, 2, 3)
    outs = eng.generate([turn2, list(turn1)], params)
    assert outs[0].cached_tokens == len(turn1) + len(out1.token_ids) - 1  # the donated, rolled-back state
    assert outs[1].cached_tokens == len(turn1) - 1
    cold = [_engine(model, 0).generate([p], params)[0].token_ids for p in (turn1, turn2)]
    assert out1.token_ids == cold[0] == outs[1].token_ids
    assert outs[0].token_ids == cold[1]
    assert _spec_stats(eng)["spec_rerun_forwards"] > 0


@pytest.mark.parametrize("spoil", [2, None])
def test_kda_state_after_verify_equals_plain_decoding(model, spoil):
    """After a verify step whose draft is rejected at position `spoil` (None: all accepted), the
    request's KDA slot (recurrent state + conv tail) and length equal plain decoding's at the same
    position: the rollback restores the snapshot and recomputes exactly the accepted tokens."""
    rng = random.Random(4)
    prompt = [rng.randrange(V - 1) for _ in range(11)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = _engine(model, 0).generate([prompt], params)[0].token_ids
    eng = _engine(model, 4)
    eng.add_request(prompt, params, request_id="r")
    eng.step()  # prefill + first token
    req = eng.requests["r"]
    draft = ref[1:5]
    if spoil is not None:
        draft[spoil] = (draft[spoil] + 1) % (V - 1)
    eng.spec.proposer = type("Fixed", (), {"propose": lambda self, t, limit=None: list(draft)})()
    eng.step()
    kept = 5 if spoil is None else spoil + 1
    assert req.out_ids == ref[: 1 + kept]
    assert req.num_computed == len(prompt) + kept
    assert eng.stats()["spec_rerun_forwards"] == (0 if spoil is None else 1)

    plain = _engine(model, 0)
    plain.add_request(prompt, params, request_id="r")
    preq = plain.requests["r"]
    while preq.num_computed < req.num_computed:
        plain.step()
    assert preq.out_ids == req.out_ids
    (s_spec, t_spec), (s_plain, t_plain) = (e.pool.read_slots([r.slot]) for e, r in ((eng, req), (plain, preq)))
    for layer in s_spec:
        torch.testing.assert_close(s_spec[layer], s_plain[layer], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(t_spec[layer], t_plain[layer], atol=2e-5, rtol=1e-4)
    # the next steps continue exactly as plain decoding
    eng.spec.proposer = NgramProposer(4, 1, 3)
    while "r" in eng.requests:
        eng.step()
    assert req.out_ids == ref


def test_serve_cli_speculative_flags(tokenizer, capsys):
    from k3.cli import build_parser
    from k3.cli.serve import build

    base = ["serve", "--preset", "k3-tiny", "--tokenizer", tokenizer.directory, "--memory-budget-mb", "16",
            "--threads", "1", "--device", "cpu"]
    args = build_parser().parse_args(base + ["--speculative-ngram", "3", "--speculative-max-match", "5"])
    _, eng = build(args)
    p = eng.spec.proposer
    assert (p.max_draft, p.min_match, p.max_match) == (3, 2, 5)
    assert build(build_parser().parse_args(base))[1].spec is None
    bad = build_parser().parse_args(base + ["--speculative-ngram", "-2"])
    assert bad.func(bad) == 2
    assert "speculative_ngram" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------- GPU

def _cuda_engine(model, k: int, **overrides) -> Engine:
    return _engine(model, k, memory_budget_bytes=64 << 20, **overrides)


@pytest.mark.gpu
def test_cuda_fp32_speculation_equals_plain_decoding():
    """On CUDA (fp32, Triton KDA, paged MLA decode kernel; verify = chunked Triton KDA + absorbed
    MLA over several query tokens): oracle drafts, greedy tokens equal plain decoding's."""
    from k3.config import k3_tiny
    from k3.model.causal_lm import K3ForCausalLM

    torch.manual_seed(0)
    model = K3ForCausalLM(k3_tiny()).init_weights(seed=0).to("cuda").eval()
    rng = random.Random(6)
    prompts = [_repetitive(rng, 5, 3), [rng.randrange(V - 1) for _ in range(13)], _repetitive(rng, 2, 6)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = _cuda_engine(model, 0, static_decode=True).generate(prompts, params)
    eng = _cuda_engine(model, 4, static_decode=True)
    eng.spec.proposer = Oracle([p + o.token_ids for p, o in zip(prompts, ref)])
    out = eng.generate(prompts, params)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    s = _spec_stats(eng)
    assert s["spec_accepted_tokens"] > 0 and s["spec_rerun_forwards"] > 0
    assert eng.pool.num_free == eng.pool.usable


@pytest.mark.gpu
def test_cuda_graphs_bf16_with_speculation_runs():
    """bf16 with CUDA graphs on: rows without drafts replay graphs, rows with drafts verify eagerly;
    every request completes with the right length, finite logprobs and no leaked block. (bf16
    verify and graph decode round differently, so tokens are not compared after the first.)"""
    from k3.config import k3_tiny
    from k3.model.causal_lm import K3ForCausalLM

    torch.manual_seed(0)
    model = K3ForCausalLM(k3_tiny()).init_weights(seed=0).to_dtype(torch.bfloat16).to("cuda").eval()
    rng = random.Random(7)
    prompts = [_repetitive(rng, 4, 4), _repetitive(rng, 3, 5), [rng.randrange(V - 1) for _ in range(6)]]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=0)
    ref = _cuda_engine(model, 0).generate(prompts, params)
    eng = _cuda_engine(model, 4)
    assert eng.runner is not None and eng.runner.use_graphs
    out = eng.generate(prompts, params)
    assert [len(o.token_ids) for o in out] == [32] * 3
    assert [o.token_ids[0] for o in out] == [o.token_ids[0] for o in ref]
    assert all(math.isfinite(lp) for o in out for lp, _ in o.logprobs)
    assert _spec_stats(eng)["spec_verify_forwards"] > 0 and eng.runner.num_captures > 0
    assert eng.pool.num_free == eng.pool.usable
