"""Judged tasks (no verifier): the GenRM scores each finished group inside the rollout path, with a
scripted judge; malformed judge output and failing scorers give the documented fallback, never a crash."""

import math
import re

import pytest

from k3.cli import build_parser
from k3.cli.rl import build_config
from k3.reward.genrm import GenRM, GenRMConfig
from k3.rl.effort import EffortConfig
from k3.rl.judged import answer_text, build_genrm, genrm_scorer, task_text
from k3.rl.loop import RLConfig, RLTrainer
from k3.rl.rollout import RolloutConfig, RolloutManager
from k3.rl.tasks import build_tasks
from k3.rl.tasks.open import open_task
from k3.train.metrics import read_metrics

from tests.rl.conftest import tiny_model
from tests.rl.test_tool_loop import ScriptedEngine, _assistant_tokens

RUBRIC = "- names the concept (weight 2)\n- one sentence (weight 1)"
VERDICT = {"alpha": 9, "beta": 5, "gamma": 1}  # the scripted judge's score of each answer word


def content_judge(messages):
    """Scripted judge backend: a rubric first, then `Candidate k: s` by the answer word shown as k."""
    text = messages[0]["content"]
    if "Rubric:" not in text:
        return RUBRIC
    body = text.split("Rubric:", 1)[1]
    lines = []
    k = 1
    while f"Candidate {k}:\n" in body:
        cand = body.split(f"Candidate {k}:\n", 1)[1].split("\n\n", 1)[0].strip()
        lines.append(f"Candidate {k}: {VERDICT.get(cand, 0)}")
        k += 1
    return "\n".join(lines)


def _manager(tokenizer, task, answers, scorer, **kw):
    turns = [_assistant_tokens(tokenizer, task.messages, None,
                               {"role": "assistant", "reasoning_content": "hm", "content": a}) for a in answers]
    cfg = RolloutConfig(group_size=len(answers), batch_groups=1, **kw)
    effort = EffortConfig(min_budget=1000)  # no length penalty: the rewards are the judge's scores
    return RolloutManager(ScriptedEngine(turns), tokenizer, cfg, effort, group_scorer=scorer)


def test_genrm_scores_a_judged_group(tokenizer):
    task = open_task("train", 0)
    assert task.score is None and task.kind == "open" and task_text(task) == task.messages[0]["content"]
    rm = GenRM(content_judge, GenRMConfig(beta=0.0))
    mgr = _manager(tokenizer, task, ["gamma", "alpha", "beta"], genrm_scorer(rm))
    [group] = mgr.collect(iter([(task, "high")]))
    rewards = [a.reward for a in group.attempts]
    assert rewards == pytest.approx([0.1, 0.9, 0.5])
    assert rm.stats["fallback_rewards"] == 0 and mgr.counters["judge_failures"] == 0
    assert answer_text({"content": "x", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}).startswith("x\n")


@pytest.mark.parametrize("reply", ["", "Candidate 1: banana", "Candidate 9: 99", None, "\x00\xff", "nan nan"])
def test_malformed_judge_output_gives_genrm_fallback(tokenizer, reply):
    rm = GenRM(lambda m: RUBRIC if "Rubric:" not in m[0]["content"] else reply, GenRMConfig(fallback=0.25))
    task = open_task("train", 1)
    mgr = _manager(tokenizer, task, ["alpha", "beta"], genrm_scorer(rm))
    [group] = mgr.collect(iter([(task, "low")]))
    assert [a.reward for a in group.attempts] == [0.25, 0.25]
    assert rm.stats["fallback_rewards"] == 2


@pytest.mark.parametrize("scorer", [
    lambda task, msgs, envs: 1 / 0,                       # raises
    lambda task, msgs, envs: [0.5],                       # wrong length
    lambda task, msgs, envs: [math.nan, 0.1],             # not finite
    lambda task, msgs, envs: ["x", "y"],                  # not numbers
    lambda task, msgs, envs: None,                        # not a list
])
def test_failing_scorer_gives_rollout_fallback(tokenizer, scorer):
    task = open_task("train", 2)
    mgr = _manager(tokenizer, task, ["alpha", "beta"], scorer, judge_fallback=0.125)
    [group] = mgr.collect(iter([(task, "max")]))
    assert [a.reward for a in group.attempts] == [0.125, 0.125]
    assert mgr.counters["judge_failures"] == 1


def test_scores_clamped_and_judge_required(tokenizer):
    task = open_task("train", 3)
    mgr = _manager(tokenizer, task, ["alpha", "beta"], lambda t, m, e: [7.0, -2.0])
    [group] = mgr.collect(iter([(task, "max")]))
    assert [a.score for a in group.attempts] == [1.0, 0.0]
    with pytest.raises(ValueError, match="needs a judge"):
        _manager(tokenizer, task, ["alpha"], None).collect(iter([(task, "low")]))
    with pytest.raises(ValueError, match="no verifier"):
        RLConfig(base="x", tasks=("math", "open")).validate()
    args = build_parser().parse_args(["rl", "--base", "x", "--tasks", "open", "--judge", "http://h:1/v1#m",
                                      "--judge-mode", "pairwise"])
    cfg = build_config(args)
    assert cfg.judge == "http://h:1/v1#m" and cfg.genrm.mode == "pairwise"


def test_k3_rl_trains_on_judged_tasks_and_checkpoint_judge_never_crashes(tokenizer, tmp_path):
    base = tmp_path / "base"
    tiny_model(tokenizer, seed=2).save_pretrained(base, dtype="float32")
    tokenizer.save(base)
    # a random-weight k3 checkpoint as the in-process judge: garbage replies, fallback rewards, no crash
    rm = build_genrm(str(base), GenRMConfig(fallback=0.0), max_tokens=4, memory_budget_mb=16)
    task = build_tasks(("open",), "heldout", 1)[0]
    assert genrm_scorer(rm)(task, [{"content": "a"}, {"content": "b"}], [None, None]) == [0.0, 0.0]
    assert rm.stats["calls"] >= 2
    # k3 rl on open tasks with a scripted GenRM preferring longer answers: groups get advantages, it trains
    def by_length(messages):
        text = messages[0]["content"]
        if "Rubric:" not in text:
            return RUBRIC
        cands = re.findall(r"Candidate (\d+):\n(.*?)(?:\n\n|$)", text.split("Rubric:", 1)[1], re.S)
        return "\n".join(f"Candidate {k}: {min(10, len(c))}" for k, c in cands)

    scripted = GenRM(by_length, GenRMConfig(beta=0.0))
    cfg = RLConfig(base=str(base), out=str(tmp_path / "run"), tasks=("open",), efforts=("low",), max_steps=1,
                   train_tasks=4, eval_tasks=0, memory_budget_mb=32, device="cpu", judge="scripted", plots=False,
                   effort=EffortConfig(multiples={"low": 1.0}, cap_factor=1.0),
                   rollout=RolloutConfig(group_size=3, batch_groups=1, threshold=1.0))
    res = RLTrainer(cfg, group_scorer=genrm_scorer(scripted)).run()
    [rec] = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "event" not in r]
    assert res.steps == 1 and rec["judge_failures"] == 0 and scripted.stats["calls"] >= 2
