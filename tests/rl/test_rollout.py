import copy

import pytest
import torch

from k3.rl.effort import EffortConfig
from k3.rl.rollout import NO_VERSION, RolloutConfig, RolloutManager
from k3.rl.sync import copy_weights, sync_weights
from k3.rl.tasks.math import math_task
from k3.serve.engine import Engine, EngineConfig
from k3.serve.sampling import SamplingParams

from tests.rl.conftest import tiny_model

EFFORT = EffortConfig(multiples={"low": 1.0, "max": 3.0}, cap_factor=1.0, min_budget=4)


def _engine(model, tokenizer):
    return Engine(model, tokenizer, EngineConfig(memory_budget_bytes=24 << 20, page_size=8, unit_size=8,
                                                 checkpoint_every_units=4, checkpoint_min_gap=2, max_model_len=2048))


def _source():
    # long-tailed: low effort caps attempts at 1x the budget, max at 3x
    return iter([(math_task("train", i, 1), e) for i, e in enumerate(["low", "max", "low", "max"])])


def _run(model, tokenizer, partial: bool):
    mgr = RolloutManager(_engine(model, tokenizer), tokenizer,
                         RolloutConfig(group_size=2, batch_groups=4, partial=partial, threshold=0.5, seed=3), EFFORT)
    groups = mgr.collect(_source())
    rounds = 1
    while mgr.active:
        mgr.weights_updated()  # unchanged weights, new version tag
        groups += mgr.collect(None)
        rounds += 1
    return mgr, sorted(groups, key=lambda g: g.gid), rounds


def test_paused_and_resumed_rollout_matches_uninterrupted(model, tokenizer):
    """Partial rollouts with unchanged weights: exactly the tokens and log-probs of one uninterrupted run."""
    ref_mgr, ref, _ = _run(model, tokenizer, partial=False)
    mgr, got, rounds = _run(model, tokenizer, partial=True)
    assert rounds >= 2 and mgr.counters["paused"] > 0 and mgr.counters["resumed"] == mgr.counters["paused"]
    assert [g.gid for g in got] == [g.gid for g in ref] == [0, 1, 2, 3]
    spanned = 0
    for g_ref, g in zip(ref, got):
        for a_ref, a in zip(g_ref.attempts, g.attempts):
            assert a.ids == a_ref.ids
            assert a.mu == a_ref.mu                    # bit-identical behaviour log-probs
            assert a.gen == a_ref.gen and a.reward == a_ref.reward
            versions = {v for v, gen in zip(a.version, a.gen) if gen}
            assert all(v == NO_VERSION for v, gen in zip(a.version, a.gen) if not gen)
            spanned += len(versions) > 1              # this attempt spans a weight version change
            assert a.generated <= a.cap
    assert spanned > 0
    # max effort attempts (3x budget) run longer than low ones
    lengths = {e: [a.generated for g in got if g.effort == e for a in g.attempts] for e in ("low", "max")}
    assert max(lengths["low"]) < max(lengths["max"])


def test_seeded_sampling_reproducible_and_greedy_pause(model, tokenizer):
    """Engine-level pause/resume of a greedy and a seeded request changes nothing."""
    prompt = tokenizer.encode("what is 3 + 4")
    for params in (SamplingParams(temperature=0, max_tokens=12, logprobs=0),
                   SamplingParams(temperature=1.0, seed=7, max_tokens=12, logprobs=0)):
        ref = _engine(model, tokenizer).generate([prompt], params)[0]
        eng = _engine(model, tokenizer)
        rid = eng.add_request(prompt, params)
        toks, lps, steps = [], [], 0
        while eng.has_unfinished():
            for out in eng.step():
                toks += out.new_token_ids
                lps += [lp for lp, _ in out.new_logprobs]
            steps += 1
            if steps == 4:
                eng.pause(rid)
                for _ in range(3):
                    assert eng.step() == []
                eng.resume(rid)
        assert toks == ref.token_ids and lps == [lp for lp, _ in ref.logprobs]


def test_weight_sync_engine_logprobs_equal_trainer(tokenizer):
    trainer = tiny_model(tokenizer, seed=1)
    serving = copy.deepcopy(trainer)
    eng = _engine(serving, tokenizer)
    prompt = tokenizer.encode("what is the value of red")
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=10, logprobs=0)
    eng.generate([prompt], params)
    assert len(eng.prefix) > 0
    with torch.no_grad():  # the "update": perturb the trainer's weights
        for p in trainer.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    stale = eng.generate([prompt], params)[0]  # before the sync the engine still samples the old weights
    with torch.no_grad():
        lp_new = trainer.eval().token_logprobs(torch.tensor([prompt + stale.token_ids]))[0, len(prompt):]
    assert not torch.allclose(torch.tensor([x for x, _ in stale.logprobs]), lp_new, atol=2e-4, rtol=0)
    dropped = sync_weights(trainer, eng)
    assert dropped > 0 and len(eng.prefix) == 0
    out = eng.generate([prompt], params)[0]
    ids = torch.tensor([prompt + out.token_ids])
    with torch.no_grad():
        lp = trainer.eval().token_logprobs(ids)[0, len(prompt):]
    engine_lp = torch.tensor([x for x, _ in out.logprobs])
    assert torch.allclose(engine_lp, lp, atol=2e-4, rtol=0), (engine_lp - lp).abs().max()
    with pytest.raises(ValueError):
        copy_weights(torch.nn.Linear(2, 2), serving)
