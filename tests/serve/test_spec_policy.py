"""The speculation batch-size policy (`k3.serve.spec_policy`, `EngineConfig.speculative_max_batch`).

A step speculates only while at most `max_batch` requests decode. Greedy outputs with the policy
switching on -> off -> on inside one request's generation equal plain decoding token for token (eager
and static decode paths, learned draft and n-gram); steps above the limit verify nothing and feed the
draft nothing; a request never drafted keeps bounded draft features."""

from __future__ import annotations

import pytest
import torch

from k3.model.draft import DraftConfig, EagleDraft
from k3.serve.draft_spec import DraftProposer
from k3.serve.engine import Engine, EngineConfig
from k3.serve.sampling import SamplingParams
from k3.serve.spec_policy import DEFAULT_SPEC_MAX_BATCH, SpecPolicy, default_max_batch, resolve_max_batch
from tests.serve.test_draft_spec import SmallVocab, _oracle, _prompts


@pytest.fixture(scope="module")
def draft(model) -> EagleDraft:
    torch.manual_seed(1)
    return EagleDraft(DraftConfig.for_target(model.config)).attach(model).eval()


def _engine(model, draft=None, **overrides) -> Engine:
    cfg = {"memory_budget_bytes": 16 << 20, "page_size": 8, "max_model_len": 1024, "enable_prefix_cache": False,
           "speculative_draft_tokens": 3, "max_running": 8, "speculative_draft_window": 64}
    cfg.update(overrides)
    return Engine(model, SmallVocab(), EngineConfig(**cfg), draft=draft)


def test_policy_decision_and_config():
    assert SpecPolicy(0).speculate(1000) and SpecPolicy(4).speculate(4) and not SpecPolicy(4).speculate(5)
    assert EngineConfig().speculative_max_batch is None  # resolved per device type by the engine
    assert default_max_batch("cuda") == DEFAULT_SPEC_MAX_BATCH["cuda"] == 8
    assert default_max_batch("cpu") == default_max_batch("mps") == SpecPolicy().max_batch == 4
    assert resolve_max_batch(None, "cuda") == 8 and resolve_max_batch(0, "cuda") == 0 and resolve_max_batch(2, "cpu") == 2
    for bad in (-1, 1.5, True, "4"):
        with pytest.raises(ValueError, match="speculation batch limit"):
            SpecPolicy(bad)
    with pytest.raises(ValueError, match="speculative_max_batch"):
        EngineConfig(speculative_max_batch=-1).validate()


def test_engine_resolves_the_device_default(model):
    assert _engine(model).spec_policy.max_batch == default_max_batch("cpu")
    assert _engine(model, speculative_max_batch=0).spec_policy.max_batch == 0


class _NgramOracle:
    """An `NgramProposer` stand-in: the plain continuation of the matching sequence, its 2nd draft wrong."""

    def __init__(self, full: list[list[int]]) -> None:
        self.full = full

    def propose(self, tokens, limit=None) -> list[int]:
        ctx = list(tokens)
        seq = next((f for f in self.full if f[: len(ctx)] == ctx), ctx)
        d = seq[len(ctx): len(ctx) + min(3, limit or 3)]
        return d[:1] + [(t + 1) % 31 for t in d[1:2]] + d[2:] if len(ctx) % 2 else d


def _staggered(eng: Engine, prompts: list[list[int]], sp: list[SamplingParams], join_at: int
               ) -> tuple[list[list[int]], list[tuple[int, bool]]]:
    """Request 0 starts alone; the others join after `join_at` steps. Returns every request's output ids
    and per step (requests decoding now or from the next step on, whether it speculated)."""
    ids = [eng.add_request(prompts[0], sp[0])]
    out: dict[str, list[int]] = {ids[0]: []}
    counts = []  # per step: decoding requests + those whose prompt completes in the step
    own_schedule = eng.scheduler.schedule

    def schedule():
        plan = own_schedule()
        counts.append(len(plan.decode) + sum(n >= r.pending - 1 for r, n in plan.prefill))
        return plan

    eng.scheduler.schedule = schedule
    trace = []
    while eng.has_unfinished():
        if len(trace) == join_at:
            for p, s in zip(prompts[1:], sp[1:]):
                ids.append(eng.add_request(p, s))
                out[ids[-1]] = []
        for o in eng.step():
            out[o.request_id] += o.new_token_ids
        trace.append((counts[-1], eng.speculating))
    return [out[i] for i in ids], trace


@pytest.mark.parametrize("kind,static", [("draft", False), ("draft", True), ("ngram", True)])
def test_greedy_equal_while_the_policy_switches_mid_run(model, draft, kind, static):
    """One long request speculates alone, three short ones join (4 decoding > limit 2: plain steps, the
    proposer is fed nothing), they finish, the long one speculates again: outputs == plain decoding."""
    prompts = _prompts(7, [9, 5, 12, 7])
    sp = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (40, 6, 8, 5)]
    plain = [o.token_ids for o in _engine(model).generate(prompts, sp)]
    spec = {"draft": draft} if kind == "draft" else {"speculative_ngram": 3, "speculative_min_match": 1}
    eng = _engine(model, static_decode=static, speculative_max_batch=2, **spec)
    full = [p + o for p, o in zip(prompts, plain)]
    if kind == "draft":  # drafts from the plain continuation (mostly): verify runs accept and reject
        _oracle(eng, full)
    else:
        eng.spec.proposer = _NgramOracle(full)
    fed = []
    own_observe = eng.spec.source.observe
    eng.spec.source.observe = lambda r, start, aux: fed.append(eng.speculating) or own_observe(r, start, aux)
    out, trace = _staggered(eng, prompts, sp, join_at=3)
    assert out == plain
    on = [s for d, s in trace if d]
    first_off = on.index(False)
    assert any(on[:first_off]) and not all(on[first_off:]) and on[-1]  # on -> off -> on again
    assert all(s == (d <= 2) for d, s in trace if d)  # exactly the configured limit decides
    s = eng.stats()
    assert s["spec_policy_plain_steps"] == sum(1 for d, _ in trace if d > 2)
    assert s["spec_accepted_tokens"] > 0
    assert all(fed)  # steps above the limit hand the proposer nothing (prefill included)


def test_draft_features_stay_bounded_when_never_drafted(model, draft):
    """A request that never drafts (e.g. grammar-constrained) keeps at most 2 x window pending features:
    the newest ones, contiguous up to its newest position."""
    prop = DraftProposer(draft, model, 3, 32, max_rows=2, window=16)
    req = type("Req", (), {"status": "running"})()
    width = 3 * model.config.text_config.hidden_size
    feats = torch.randn(100, width)
    for p in range(100):
        prop.observe(req, p, feats[p: p + 1])
    s = prop.seqs[req]
    assert 16 <= s.num_pending <= 32 and s.next_pos == 100
    assert torch.equal(torch.cat(s.pending), feats[s.pending_start:])
