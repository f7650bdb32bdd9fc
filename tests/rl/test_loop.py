import json
import os

import pytest
import torch

from k3.cli import build_parser
from k3.cli.rl import build_config
from k3.rl.effort import EffortConfig
from k3.rl.loop import RLConfig, RLTrainer
from k3.rl.rollout import RolloutConfig
from k3.train.metrics import read_metrics

from tests.rl.conftest import length_reward, tiny_model


@pytest.fixture(scope="module")
def base(tokenizer, tmp_path_factory):
    d = tmp_path_factory.mktemp("rl_base")
    tiny_model(tokenizer, seed=2).save_pretrained(d, dtype="float32")
    tokenizer.save(d)
    return str(d)


def _cfg(base, out, steps):
    return RLConfig(base=base, out=str(out), tasks=("math",), efforts=("low", "max"), max_steps=steps,
                    train_tasks=8, eval_tasks=1, eval_group=2, save_every=1, memory_budget_mb=32,
                    effort=EffortConfig(multiples={"low": 1.0, "max": 2.0}, cap_factor=1.0),
                    rollout=RolloutConfig(group_size=2, batch_groups=2, threshold=0.5), device="cpu")


def _length_reward_tasks(trainer):
    """A random model never solves arithmetic; reward the reply's length instead (`length_reward`), so
    groups have non-zero advantages and the update path runs."""
    for t in trainer.train_tasks:
        t.score = length_reward


def test_rl_loop_runs_logs_exports_and_resumes(base, tmp_path):
    trainer = RLTrainer(_cfg(base, tmp_path, 2))
    _length_reward_tasks(trainer)
    w0 = trainer.model.lm_head.weight.detach().clone()
    res = trainer.run()
    assert not torch.equal(w0, trainer.model.lm_head.weight)
    assert res.steps == 2 and "reward" in res.before and "think_low" in res.after
    recs = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "event" not in r]
    assert [r["step"] for r in recs] == [0, 1]
    assert any(r["grad_norm"] > 0 for r in recs if "grad_norm" in r)
    for key in ("reward", "pass_rate", "think_low", "answer_low", "staleness_mean", "clip_frac", "paused",
                "resumed", "rollout_tok_s", "train_tok_s"):
        assert key in recs[0], key
    assert os.path.exists(tmp_path / "final" / "config.json")
    assert os.path.exists(tmp_path / "checkpoint" / "train_state.pt") and os.path.exists(tmp_path / "rl.png")
    # resume: two more steps, metrics continue, the held-out "before" numbers are kept
    cfg = _cfg(base, tmp_path, 3)
    cfg.eval_tasks, cfg.plots = 0, False
    trainer = RLTrainer(cfg, resume=True)
    _length_reward_tasks(trainer)
    assert trainer.step == 2 and trainer.before == res.before
    res2 = trainer.run()
    recs = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "event" not in r]
    assert [r["step"] for r in recs] == [0, 1, 2] and res2.steps == 3


def test_cli_config_and_errors(base, tmp_path):
    args = build_parser().parse_args(["rl", "--base", base, "--tasks", "math", "--efforts", "low,high",
                                      "--max-steps", "3", "--no-partial", "--out", str(tmp_path)])
    cfg = build_config(args)
    assert cfg.tasks == ("math",) and cfg.efforts == ("low", "high") and not cfg.rollout.partial
    bad = build_parser().parse_args(["rl", "--base", base, "--tasks", "chess"])
    assert bad.func(bad) == 2
    with pytest.raises(FileNotFoundError):
        RLTrainer(_cfg(base, tmp_path / "none", 1), resume=True)
    json.dumps(cfg.rollout.__dict__)


def test_separate_serving_copy_is_synced_after_each_update(base, tmp_path):
    cfg = _cfg(base, tmp_path, 2)
    cfg.eval_tasks, cfg.plots, cfg.serve_dtype = 0, False, "float32"
    trainer = RLTrainer(cfg)
    _length_reward_tasks(trainer)
    assert trainer.engine.model is not trainer.model
    w0 = trainer.model.lm_head.weight.detach().clone()
    trainer.run()
    assert not torch.equal(w0, trainer.model.lm_head.weight)
    assert torch.equal(trainer.engine.model.lm_head.weight, trainer.model.lm_head.weight)
