import os

import pytest
import torch

from k3.cli import build_parser
from k3.cli.distill import build_config, format_table
from k3.data.tokenizer import load_tokenizer
from k3.distill.loop import DistillConfig, DistillTrainer
from k3.distill.teachers import ModelTeacher, TeacherSpec
from k3.rl.effort import EffortConfig
from k3.rl.rollout import RolloutConfig
from k3.train.metrics import read_metrics

from tests.rl.conftest import tiny_model


@pytest.fixture(scope="module")
def dirs(tokenizer, tmp_path_factory):
    out = {}
    for name, seed in (("student", 2), ("teacher", 5)):
        d = tmp_path_factory.mktemp(name)
        tiny_model(tokenizer, seed=seed).save_pretrained(d, dtype="float32")
        tokenizer.save(d)
        out[name] = str(d)
    return out


def _cfg(dirs, out, steps, eval_tasks=1):
    t = dirs["teacher"]
    return DistillConfig(student=dirs["student"], out=str(out), max_steps=steps, train_tasks=4, eval_tasks=eval_tasks,
                         eval_group=1, save_every=1, memory_budget_mb=32, device="cpu",
                         teachers=[TeacherSpec("math", "low", t), TeacherSpec("worlds", "max", t, weight=2.0)],
                         effort=EffortConfig(multiples={"low": 1.0, "max": 2.0}, cap_factor=1.0),
                         rollout=RolloutConfig(group_size=1, batch_groups=3, threshold=0.67, max_turns=2))


class Recorder:
    """Wraps a teacher, recording which (domain, effort) keys' attempts it scored."""

    def __init__(self, inner, name, seen):
        self.inner, self.name, self.seen = inner, name, seen

    def score(self, ids, cu):
        self.seen.append(self.name)
        return self.inner.score(ids, cu)


def test_distill_routes_trains_logs_exports_and_resumes(dirs, tmp_path):
    seen: list[str] = []
    teacher = ModelTeacher("t", tiny_model(load_tokenizer(dirs["teacher"]), seed=5))
    teachers = {("math", "low"): Recorder(teacher, "math:low", seen),
                ("worlds", "max"): Recorder(teacher, "worlds:max", seen)}
    tr = DistillTrainer(_cfg(dirs, tmp_path, 2), teachers=teachers)
    w0 = tr.model.lm_head.weight.detach().clone()
    res = tr.run()
    assert res.steps == 2 and not torch.equal(w0, tr.model.lm_head.weight)
    recs = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "event" not in r]
    assert [r["step"] for r in recs] == [0, 1]
    # every attempt was routed by its own (domain, effort): the per-teacher keys match the scorers called
    logged = {k.split("/", 1)[1] for r in recs for k in r if k.startswith("kl/")}
    assert logged and logged == set(seen) and logged <= {"math:low", "worlds:max"}
    assert all(r["reverse_kl"] > 0 for r in recs)  # different random models: KL(student || teacher) > 0
    assert set(res.after) == {"math:low", "worlds:max"} and "think" in res.after["math:low"]
    assert os.path.exists(tmp_path / "final" / "config.json") and os.path.exists(tmp_path / "distill.png")
    assert "| math:low |" in format_table(res.teachers, res.before, res.after)
    cfg = _cfg(dirs, tmp_path, 3, eval_tasks=0)
    cfg.plots = False
    tr = DistillTrainer(cfg, resume=True, teachers=teachers)
    assert tr.step == 2 and tr.draws > 0
    assert tr.run().steps == 3
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl") if "event" not in r] == [0, 1, 2]


def test_cli_config_and_errors(dirs, tmp_path):
    args = build_parser().parse_args(["distill", "--student", dirs["student"], "--teacher",
                                      f"math:low={dirs['teacher']}@3", "--teacher", f"math:max={dirs['teacher']}",
                                      "--max-steps", "2", "--out", str(tmp_path)])
    cfg = build_config(args)
    assert [(t.key, t.weight) for t in cfg.teachers] == [(("math", "low"), 3.0), (("math", "max"), 1.0)]
    for argv in (["--teacher", "math:low=x", "--teacher", "math:low=y"], [], ["--teacher", "chess:low=x"]):
        bad = build_parser().parse_args(["distill", "--student", dirs["student"], *argv])
        assert bad.func(bad) == 2
    with pytest.raises(FileNotFoundError):
        DistillTrainer(_cfg(dirs, tmp_path / "none", 1), resume=True)


def test_cli_refuses_torchrun(dirs, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = build_parser().parse_args(["distill", "--student", dirs["student"], "--teacher",
                                      f"math:low={dirs['teacher']}", "--out", str(tmp_path)])
    assert args.func(args) == 2 and "one process" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "metrics.jsonl")


def test_paired_ratio_by_hand():
    from k3.distill.batch import paired_ratio

    teacher = {"task_reward": {"a": 0.2, "b": 0.4, "c": 0.6, "only_t": 9.0}}
    student = {"task_reward": {"a": 0.1, "b": 0.5, "c": 0.6, "only_s": 9.0}}
    r, se = paired_ratio(teacher, student)
    assert r == pytest.approx(1.2 / 1.2)                                  # shared tasks only
    resid = (0.1 - 0.2) ** 2 + (0.5 - 0.4) ** 2 + 0.0                    # s_i - R t_i with R = 1
    assert se == pytest.approx((resid / (3 * 2)) ** 0.5 / 0.4)
    # a student that is the teacher scaled by 0.9 on every task has ratio 0.9 exactly and zero error
    r, se = paired_ratio(teacher, {"task_reward": {k: 0.9 * v for k, v in teacher["task_reward"].items()}})
    assert r == pytest.approx(0.9) and se == pytest.approx(0.0, abs=1e-12)
    nan_pair = paired_ratio({"task_reward": {"a": 0.0, "b": 0.0}}, student)
    assert all(x != x for x in nan_pair) and all(x != x for x in paired_ratio({}, student))
    table = format_table({"m:low": teacher | {"reward": 0.4}}, {}, {"m:low": student | {"reward": 0.4}})
    assert "100% ± 14%" in table                   # sqrt(0.02 / 6) / 0.4
