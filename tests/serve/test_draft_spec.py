"""Learned-draft (EAGLE-3) speculative decoding in the engine (k3.serve.draft_spec) on k3-tiny (random
weights, CPU, a 32-token vocabulary): greedy output identical to plain decoding (batched, varied prompt
lengths, prefix-cache hits, stops and max_tokens inside a run), exact rejection sampling with a draft
distribution q (function level and engine level), the /metrics gauge, and a clear error for a draft of
another model. Acceptance of a trained draft is measured in tests/draft (and docs/draft.md)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from k3.model.draft import DraftConfig, EagleDraft
from k3.model.safetensors_io import CheckpointError
from k3.serve.engine import Engine, EngineConfig
from k3.serve.metrics import prometheus_text
from k3.serve.acceptance import DraftIds
from k3.serve.sampling import SamplingParams, target_probs
from k3.serve.speculative import accept_draft

V = 32


class SmallVocab:
    """Tokenizer stand-in: ids 0..V-1, token i spells "<i>", eos = V - 1."""

    vocab_size, eos_id = V, V - 1

    def token_bytes(self, i: int) -> bytes:
        return f"<{i}>".encode()


def _engine(model, draft=None, k: int = 4, **overrides) -> Engine:
    cfg = {"memory_budget_bytes": 16 << 20, "page_size": 8, "unit_size": 8, "checkpoint_every_units": 2,
           "checkpoint_min_gap": 2, "max_model_len": 1024, "enable_prefix_cache": False,
           "speculative_draft_tokens": k, "speculative_max_batch": 0}  # verify at every batch size
    cfg.update(overrides)
    return Engine(model, SmallVocab(), EngineConfig(**cfg), draft=draft)


def _prompts(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(V - 1) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def draft(model) -> EagleDraft:
    torch.manual_seed(1)
    return EagleDraft(DraftConfig.for_target(model.config)).attach(model).eval()


def _oracle(eng: Engine, full: list[list[int]], bad: int = 3) -> None:
    """Replace the draft's picks by the plain-decoding continuation, except every `bad`-th one, so verify
    runs are accepted in full, in part and not at all; the draft's own forward, KV cache and the engine's
    capture / rollback all still run."""
    prop, calls = eng.spec.proposer, [0]
    own = prop.propose

    def propose(cands):
        out = []
        own_out = own(cands)
        for (r, _), (toks, q) in zip(cands, own_out):
            toks = toks.host() if hasattr(toks, "host") else list(toks)  # DraftIds: greedy drafts on the device
            for j in range(len(toks)):
                ctx = r.tokens + toks[:j]
                seq = next((f for f in full if f[: len(ctx)] == ctx and len(f) > len(ctx)), None)
                if seq is not None:
                    calls[0] += 1
                    if calls[0] % bad:
                        toks[j] = seq[len(ctx)]
            out.append((toks, q))
        if any(hasattr(d, "host") for d, _ in own_out):  # greedy drafts were on the device: hand them back there
            k = max(len(t) for t, _ in out)
            ids = torch.tensor([t + [0] * (k - len(t)) for t, _ in out], device=eng.device)
            out = [(DraftIds(ids, i, len(t)), q) for i, (t, q) in enumerate(out)]
        return out

    prop.propose = propose


def test_greedy_with_draft_equals_plain_decoding(model, draft):
    prompts = _prompts(2, [5, 17, 9, 30, 3])
    sp = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (24, 13, 30, 7, 21)]
    plain = _engine(model).generate(prompts, sp)
    alone = _engine(model, draft)
    assert [o.token_ids for o in alone.generate(prompts, sp)] == [o.token_ids for o in plain]
    eng = _engine(model, draft)
    _oracle(eng, [p + o.token_ids for p, o in zip(prompts, plain)])
    assert [o.token_ids for o in eng.generate(prompts, sp)] == [o.token_ids for o in plain]
    s = eng.stats()
    # drafts were accepted in full and rejected in part (so the KDA rollback ran)
    assert 0 < s["spec_accepted_tokens"] < s["spec_draft_tokens"] and s["spec_rerun_forwards"] > 0
    assert s["spec_mean_acceptance_length"] > 1.5
    assert "k3_spec_mean_acceptance_length " in prometheus_text(s)


def test_greedy_equality_with_prefix_hits_stops_and_k1(model, draft):
    base = _prompts(3, [20])[0]
    prompts = [base + [1, 2], base + [4], base[:17] + [5, 6, 7]]
    stop = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=(7, 11))
    plain = _engine(model, enable_prefix_cache=True).generate(prompts, stop)
    for k in (1, 3):
        eng = _engine(model, draft, k=k, enable_prefix_cache=True)
        _oracle(eng, [p + o.token_ids for p, o in zip(prompts, plain)], bad=4)
        first = eng.generate(prompts[:1], stop)  # warms the prefix cache
        rest = eng.generate(prompts[1:], stop)
        assert [o.token_ids for o in first + rest] == [o.token_ids for o in plain]
        assert [o.finish_reason for o in first + rest] == [o.finish_reason for o in plain]
        assert eng.stats()["prefix_hit_tokens"] > 0 and eng.stats()["spec_accepted_tokens"] > 0


def test_rejection_sampling_with_q_is_lossless():
    """Two chained drafts drawn from q, verified against p: the first two emitted tokens are distributed
    as p1(y1) p2(y2 | y1) (a rejected run's second token comes from the next step: p2(. | y1))."""
    W = 4
    g = torch.Generator().manual_seed(0)
    l1 = torch.randn(W, generator=g) * 1.5
    l2 = torch.randn(W, W, generator=g) * 1.5  # row y1: the target's logits after y1
    q1 = torch.softmax(torch.randn(W, generator=g), -1)
    q2 = torch.softmax(torch.randn(W, W, generator=g), -1)
    params = SamplingParams(temperature=0.8)
    p1 = target_probs(l1[None], [params])[0]
    p2 = target_probs(l2, [params] * W)
    rng = random.Random(0)
    counts: Counter = Counter()
    n = 12000
    for _ in range(n):
        d1 = rng.choices(range(W), q1.tolist())[0]
        d2 = rng.choices(range(W), q2[d1].tolist())[0]
        logits = torch.stack([l1, l2[d1], torch.zeros(W)])
        toks, _ = accept_draft(logits, [d1, d2], params, rng, torch.stack([q1, q2[d1]]))
        if len(toks) < 2:
            toks.append(rng.choices(range(W), p2[toks[0]].tolist())[0])
        counts[(toks[0], toks[1])] += 1
    expected = {(a, b): float(p1[a] * p2[a, b]) * n for a in range(W) for b in range(W)}
    chi2 = sum((counts[c] - e) ** 2 / e for c, e in expected.items())
    assert chi2 < _chi2_quantile_999(15)  # 37.7
    # the same with q = p accepts everything, with q far from p rejects often: both exact, different tau
    _, acc = accept_draft(torch.stack([l1, l2[0], torch.zeros(W)]), [0, 0], params, random.Random(1),
                          torch.stack([p1, p2[0]]))
    assert acc == 2


def test_sampled_requests_with_draft_match_the_target_distribution(model, draft):
    """Engine level: the second generated token (the first one a verify run emits: max_tokens 3 leaves
    room for one draft) over many seeded requests follows the target's exact marginal
    sum_y1 p(y1) p(y2 | y1)."""
    prompt = _prompts(4, [8])[0]
    params = SamplingParams(temperature=0.25, max_tokens=2, ignore_eos=True)
    with torch.no_grad():
        first = target_probs(model(torch.tensor([prompt])).logits[0, -1:, :V].float(), [params])[0]
        batch = torch.tensor([prompt + [y] for y in range(V)])
        second = target_probs(model(batch).logits[:, -1, :V].float(), [params] * V)
    marginal = first @ second
    n = 500
    eng = _engine(model, draft, k=2, max_running=64)
    outs = eng.generate([prompt] * n, [SamplingParams(temperature=0.25, max_tokens=3, ignore_eos=True, seed=s)
                                       for s in range(n)])
    s = eng.stats()  # (a row whose draft found no free page decodes plainly: also exact)
    assert s["spec_verify_rows"] >= 0.9 * n and 0 < s["spec_accepted_tokens"] < s["spec_draft_tokens"]
    counts = Counter(o.token_ids[1] for o in outs)
    big = [t for t in range(V) if marginal[t] * n >= 5]
    rest_e = n - sum(float(marginal[t]) * n for t in big)
    chi2 = sum((counts[t] - float(marginal[t]) * n) ** 2 / (float(marginal[t]) * n) for t in big)
    if rest_e >= 5:
        rest_o = n - sum(counts[t] for t in big)
        chi2 += (rest_o - rest_e) ** 2 / rest_e
    dof = len(big) - (0 if rest_e >= 5 else 1)
    assert chi2 < _chi2_quantile_999(dof), (chi2, dof)


def _chi2_quantile_999(dof: int) -> float:
    """The 0.999 quantile of chi-square(dof) (Wilson-Hilferty; within 1% for dof >= 3)."""
    z, a = 3.0902, 2.0 / (9 * dof)
    return dof * (1 - a + z * a ** 0.5) ** 3


def test_a_draft_of_another_model_is_refused(model):
    other = EagleDraft(DraftConfig.for_target(model.config, hidden_size=128))
    with pytest.raises(CheckpointError, match="hidden_size: draft 128, target 256"):
        _engine(model, other)
    with pytest.raises(ValueError, match="either a learned draft or n-gram"):
        _engine(model, EagleDraft(DraftConfig.for_target(model.config)), speculative_ngram=2)
    with pytest.raises(ValueError, match="speculative_draft_tokens"):
        _engine(model, None, k=0)


def test_serve_cli_draft_flags(model, draft, tokenizer, tmp_path, capsys):
    from k3.cli import build_parser
    from k3.cli.serve import build
    from k3.model.draft import save_draft

    save_draft(draft, tmp_path / "draft")
    base = ["serve", "--preset", "k3-tiny", "--tokenizer", tokenizer.directory, "--memory-budget-mb", "16",
            "--threads", "1", "--device", "cpu"]
    _, eng = build(build_parser().parse_args(base + ["--draft", str(tmp_path / "draft"), "--spec-tokens", "3"]))
    assert eng.spec.capture_layers == [1, 3, 5] and eng.spec.proposer.k == 3
    assert "k3_spec_mean_acceptance_length" in prometheus_text(eng.stats())
    save_draft(EagleDraft(DraftConfig.for_target(model.config, vocab_size=512)), tmp_path / "other")
    bad = build_parser().parse_args(base + ["--draft", str(tmp_path / "other")])
    assert bad.func(bad) == 2
    assert "vocab_size: draft 512, target 4096" in capsys.readouterr().err
