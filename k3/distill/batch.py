"""Packing of sampled attempts (k3.rl.rollout.Attempt) into distillation micro-batches, and held-out
evaluation of a policy per (domain, effort)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from k3.rl.batch import cluster_se
from k3.rl.effort import BudgetTracker, EffortConfig
from k3.rl.rollout import NO_VERSION, Attempt, RolloutConfig, RolloutManager


@dataclass
class OPDBatch:
    """ids [1, T] long (packed attempts); cu_seqlens [n + 1] int32; behaviour_logp [1, T] fp32;
    response_mask [1, T] bool (sampled tokens); staleness [1, T] long; seq_ids [1, T] long (0..n-1)."""

    ids: torch.Tensor
    cu_seqlens: torch.Tensor
    behaviour_logp: torch.Tensor
    response_mask: torch.Tensor
    staleness: torch.Tensor
    seq_ids: torch.Tensor

    @property
    def num_sequences(self) -> int:
        return int(self.cu_seqlens.numel()) - 1


def pack_attempts(attempts: list[Attempt], version_now: int, max_tokens: int) -> list[OPDBatch]:
    """Greedy packing in order into batches of at most max_tokens tokens (a longer attempt gets its own
    batch). Attempts that sampled nothing are skipped."""
    useful = [a for a in attempts if any(a.gen[1:])]
    out, cur, size = [], [], 0
    for a in useful:
        if cur and size + len(a.ids) > max_tokens:
            out.append(_batch(cur, version_now))
            cur, size = [], 0
        cur.append(a)
        size += len(a.ids)
    if cur:
        out.append(_batch(cur, version_now))
    return out


def _batch(items: list[Attempt], version_now: int) -> OPDBatch:
    ids, mu, gen, stale, seq, lens = [], [], [], [], [], [0]
    for k, a in enumerate(items):
        ids += a.ids
        mu += a.mu
        gen += [False] + list(a.gen[1:])  # a document's first token has no log-prob
        stale += [version_now - v if v != NO_VERSION else 0 for v in a.version]
        seq += [k] * len(a.ids)
        lens.append(lens[-1] + len(a.ids))
    t = lambda x, dt: torch.tensor([x], dtype=dt)  # noqa: E731
    return OPDBatch(ids=t(ids, torch.long), cu_seqlens=torch.tensor(lens, dtype=torch.int32),
                    behaviour_logp=t(mu, torch.float32), response_mask=t(gen, torch.bool),
                    staleness=t(stale, torch.long), seq_ids=t(seq, torch.long))


def attempt_stats(attempts: list[Attempt]) -> dict[str, Any]:
    """Mean reward, pass rate (score >= 1), thinking / answer / generated tokens; reward_se / think_se:
    standard errors clustered by task (k3.rl.batch.cluster_se; left out below two tasks);
    task_reward: {task_id: mean reward of its attempts} (for `paired_ratio`)."""
    if not attempts:
        return {}
    n = len(attempts)
    ids = [a.task.task_id for a in attempts]
    per_task: dict[str, list[float]] = {}
    for a in attempts:
        per_task.setdefault(a.task.task_id, []).append(a.reward)
    se = {"reward_se": cluster_se([a.reward for a in attempts], ids),
          "think_se": cluster_se([a.think_tokens for a in attempts], ids)}
    return {"reward": sum(a.reward for a in attempts) / n, "pass_rate": sum(a.score >= 1.0 for a in attempts) / n,
            "think": sum(a.think_tokens for a in attempts) / n, "answer": sum(a.answer_tokens for a in attempts) / n,
            "gen_tokens": sum(a.generated for a in attempts) / n, "attempts": float(n),
            "task_reward": {t: sum(v) / len(v) for t, v in per_task.items()}} | \
        {k: v for k, v in se.items() if v == v}  # no standard error from fewer than two tasks


def paired_ratio(teacher: dict[str, Any], student: dict[str, Any]) -> tuple[float, float]:
    """Student / teacher held-out reward on the same tasks and its standard error, paired by task.

    With per-task mean rewards t_i (teacher) and s_i (student) over the k tasks both evaluated,
    R = Σ s_i / Σ t_i and se(R) = sqrt(Σ (s_i − R·t_i)² / (k(k − 1))) / mean(t): the ratio
    estimator's delta-method error, which keeps the covariance of the two policies across tasks (an
    easy task is easy for both), unlike combining the two marginal errors. (nan, nan) when the
    teacher's reward is 0 or fewer than two tasks are shared."""
    t, s = teacher.get("task_reward") or {}, student.get("task_reward") or {}
    common = sorted(set(t) & set(s))
    k = len(common)
    tsum = sum(t[i] for i in common)
    if k < 2 or tsum <= 0:
        return float("nan"), float("nan")
    r = sum(s[i] for i in common) / tsum
    resid = sum((s[i] - r * t[i]) ** 2 for i in common)
    return r, (resid / (k * (k - 1))) ** 0.5 / (tsum / k)


def evaluate_policy(engine: Any, tokenizer: Any, tasks: dict[tuple[str, str], list], group: int,
                    rollout: RolloutConfig, effort_cfg: EffortConfig, seed: int) -> dict[str, dict[str, Any]]:
    """Held-out stats per 'domain:effort' of the policy `engine` serves: `group` sampled attempts per
    task (temperature of `rollout`, fixed seeds, no partial rollouts). tasks: (domain, effort) -> tasks."""
    pairs = [(t, e, key) for key, ts in tasks.items() for t in ts for e in [key[1]]]
    if not pairs:
        return {}
    rc = RolloutConfig(group_size=group, batch_groups=len(pairs), partial=False, temperature=rollout.temperature,
                       max_turns=rollout.max_turns, seed=seed, thinking=rollout.thinking)
    mgr = RolloutManager(engine, tokenizer, rc, effort_cfg, BudgetTracker(min_samples=10**9))
    groups = mgr.collect(iter([(t, e) for t, e, _ in pairs]))
    by_key: dict[str, list[Attempt]] = {}
    for g, (_, _, key) in zip(sorted(groups, key=lambda g: g.gid), pairs):
        by_key.setdefault(f"{key[0]}:{key[1]}", []).extend(g.attempts)
    return {k: attempt_stats(v) for k, v in by_key.items()}


__all__ = ["OPDBatch", "attempt_stats", "evaluate_policy", "pack_attempts", "paired_ratio"]
