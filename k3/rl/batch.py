"""Completed rollout groups -> packed training micro-batches, and the per-step rollout statistics.

Each attempt is one packed document (its whole context: prompt, sampled tokens, tool results);
`K3ForCausalLM.token_logprobs(ids, cu_seqlens=...)` gives log π_θ at every position, and only the
positions the model sampled (`gen`) enter the loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3.rl.losses import group_advantages
from k3.rl.rollout import NO_VERSION, Attempt, Group


@dataclass
class MicroBatch:
    """ids [1, T] long (packed attempts); cu_seqlens [n + 1] int32 (host); behaviour_logp [1, T] fp32;
    response_mask [1, T] bool; staleness [1, T] long (0 where not sampled); advantages [1] per
    document, expanded by `token_advantages` [1, T]."""

    ids: torch.Tensor
    cu_seqlens: torch.Tensor
    behaviour_logp: torch.Tensor
    response_mask: torch.Tensor
    staleness: torch.Tensor
    token_advantages: torch.Tensor

    @property
    def num_response(self) -> int:
        return int(self.response_mask.sum())


def attempt_advantages(groups: list[Group], eps: float) -> list[tuple[Attempt, float]]:
    """(attempt, Â) for every attempt of every group (group-normalised rewards)."""
    out: list[tuple[Attempt, float]] = []
    for g in groups:
        adv = group_advantages(torch.tensor([[a.reward for a in g.attempts]], dtype=torch.float64), eps)[0]
        out += [(a, float(x)) for a, x in zip(g.attempts, adv)]
    return out


def pack(items: list[tuple[Attempt, float]], version_now: int, max_tokens: int) -> list[MicroBatch]:
    """Greedy packing of attempts (in order) into micro-batches of at most max_tokens tokens (an
    attempt longer than that gets a micro-batch of its own). Attempts with Â = 0 or nothing sampled
    are skipped: they contribute no gradient."""
    useful = [(a, adv) for a, adv in items if adv != 0.0 and any(a.gen)]
    batches, cur = [], []
    for a, adv in useful:
        if cur and sum(len(x.ids) for x, _ in cur) + len(a.ids) > max_tokens:
            batches.append(_micro(cur, version_now))
            cur = []
        cur.append((a, adv))
    if cur:
        batches.append(_micro(cur, version_now))
    return batches


def _micro(items: list[tuple[Attempt, float]], version_now: int) -> MicroBatch:
    ids, mu, gen, stale, adv, lens = [], [], [], [], [], [0]
    for a, x in items:
        ids += a.ids
        mu += a.mu
        gen += a.gen
        stale += [version_now - v if v != NO_VERSION else 0 for v in a.version]
        adv += [x] * len(a.ids)
        lens.append(lens[-1] + len(a.ids))
    gen_t = torch.tensor([gen], dtype=torch.bool)
    gen_t[0, torch.tensor(lens[:-1])] = False  # a document's first token has no log-prob (never sampled anyway)
    return MicroBatch(ids=torch.tensor([ids], dtype=torch.long), cu_seqlens=torch.tensor(lens, dtype=torch.int32),
                      behaviour_logp=torch.tensor([mu], dtype=torch.float32), response_mask=gen_t,
                      staleness=torch.tensor([stale], dtype=torch.long),
                      token_advantages=torch.tensor([adv], dtype=torch.float32))


def cluster_se(values: list[float], clusters: list[str]) -> float:
    """Standard error of the mean of `values` with attempts clustered by task (attempts at one task are
    not independent): the standard deviation of the per-cluster means over sqrt(#clusters). nan when
    fewer than two clusters."""
    by: dict[str, list[float]] = {}
    for v, c in zip(values, clusters):
        by.setdefault(c, []).append(float(v))
    means = [sum(v) / len(v) for v in by.values()]
    k = len(means)
    if k < 2:
        return float("nan")
    mu = sum(means) / k
    return (sum((m - mu) ** 2 for m in means) / (k - 1)) ** 0.5 / k ** 0.5


def rollout_stats(groups: list[Group], efforts: tuple[str, ...]) -> dict[str, float]:
    """reward, pass rate (score >= 1), mean generated / think / answer tokens (overall and per effort),
    attempts that spanned several weight versions, mean pauses per attempt; `*_se`: standard errors
    of the reward and thinking means (clustered by task, `cluster_se`; left out below two tasks)."""
    atts = [a for g in groups for a in g.attempts]
    if not atts:
        return {}
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    rec = {"reward": mean([a.reward for a in atts]), "pass_rate": mean([float(a.score >= 1.0) for a in atts]),
           "score": mean([a.score for a in atts]), "gen_tokens": mean([a.generated for a in atts]),
           "attempts": len(atts), "multi_version": mean([float(len({v for v, g in zip(a.version, a.gen) if g}) > 1)
                                                         for a in atts]),
           "pauses_per_attempt": mean([a.pauses for a in atts])}
    se = {"reward_se": cluster_se([a.reward for a in atts], [a.task.task_id for a in atts])}
    for e in efforts:
        sel = [a for a in atts if a.effort == e]
        if sel:
            ids = [a.task.task_id for a in sel]
            se[f"reward_se_{e}"] = cluster_se([a.reward for a in sel], ids)
            se[f"think_se_{e}"] = cluster_se([a.think_tokens for a in sel], ids)
            rec[f"think_{e}"] = mean([a.think_tokens for a in sel])
            rec[f"answer_{e}"] = mean([a.answer_tokens for a in sel])
            rec[f"reward_{e}"] = mean([a.reward for a in sel])
            rec[f"pass_{e}"] = mean([float(a.score >= 1.0) for a in sel])
    for kind in sorted({g.task.kind for g in groups}):
        sel = [a for a in atts if a.task.kind == kind]
        rec[f"pass_{kind}"] = mean([float(a.score >= 1.0) for a in sel])
    return rec | {k: v for k, v in se.items() if v == v}  # no standard error from fewer than two tasks


__all__ = ["MicroBatch", "attempt_advantages", "cluster_se", "pack", "rollout_stats"]
