"""Effort budgets (spec k3_posttraining.md §3): every task has an answer-length budget b (tokens);
each effort level e has a permitted multiple m_e (low < high < max). An attempt of length ℓ with
verifier score s in [0, 1] earns s·f(ℓ), the length factor

    f(ℓ) = 1                                      if ℓ <= m_e·b
    f(ℓ) = 1 − α·min(1, (ℓ − m_e·b) / (m_e·b))    otherwise.

For a correct attempt (s = 1) this is the spec's formula; a wrong attempt (s = 0) earns 0 at any
length (never a bonus for brevity). Partial credit (the shaped math reward, unit-test fractions) is
scaled by the same factor (`scale_partial`, default on): a small model is almost never exactly right,
so with the penalty on s = 1 only, the budget would never act on it. ℓ counts every
token the model generated in the attempt (thinking, answer and tool calls of all turns). Sampling
stops at cap_factor·m_e·b tokens per attempt: past 2·m_e·b the penalty is saturated (α), so longer
generation only spends compute. The effort reaches the model as XTML's `thinking_effort` system
message (chat spec §2.5), rendered by `k3.chat.render(..., thinking_effort=e)`.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

EFFORTS = ("low", "high", "max")


@dataclass
class EffortConfig:
    """multiples: m_e per effort (strictly increasing low < high < max). alpha: the largest penalty.
    cap_factor: the sampling cap in units of m_e·b. min_budget: floor of b (tokens).
    scale_partial: apply the length factor to partial scores 0 < s < 1 too (False: only s >= 1)."""

    multiples: dict[str, float] = field(default_factory=lambda: {"low": 1.0, "high": 2.0, "max": 4.0})
    alpha: float = 0.5
    cap_factor: float = 2.0
    min_budget: int = 4
    scale_partial: bool = True

    def validate(self) -> "EffortConfig":
        unknown = set(self.multiples) - set(EFFORTS)
        if unknown:
            raise ValueError(f"unknown effort levels {sorted(unknown)} (expected {', '.join(EFFORTS)})")
        ms = [self.multiples[e] for e in EFFORTS if e in self.multiples]
        if any(m <= 0 for m in ms) or any(a >= b for a, b in zip(ms, ms[1:])):
            raise ValueError(f"effort multiples must be positive and increase low < high < max, got {self.multiples}")
        if not 0 <= self.alpha <= 1:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha}")
        if self.cap_factor < 1 or self.min_budget < 1:
            raise ValueError("cap_factor must be >= 1 and min_budget >= 1")
        return self

    def multiple(self, effort: str) -> float:
        if effort not in self.multiples:
            raise ValueError(f"unknown effort {effort!r} (configured: {', '.join(self.multiples)})")
        return self.multiples[effort]


def effort_reward(score: float, length: int, budget: float, effort: str, cfg: EffortConfig) -> float:
    """The verifier's score in [0, 1] times the effort budget's length factor (module docstring); a
    score of 0 stays 0, and with `scale_partial` off only a fully correct attempt (>= 1) is scaled."""
    if score <= 0.0 or (score < 1.0 and not cfg.scale_partial):
        return float(score)
    allowed = cfg.multiple(effort) * max(budget, cfg.min_budget)
    if length <= allowed:
        return float(score)
    return float(score) * (1.0 - cfg.alpha * min(1.0, (length - allowed) / allowed))


def max_tokens_for(budget: float, effort: str, cfg: EffortConfig) -> int:
    """The sampling cap of one attempt at this effort: ceil(cap_factor·m_e·b)."""
    return max(1, math.ceil(cfg.cap_factor * cfg.multiple(effort) * max(budget, cfg.min_budget)))


class BudgetTracker:
    """b(x) per task: the task's reference length until `min_samples` correct attempts were seen, then
    the median length of the correct attempts (the spec's "median of correct earlier samples").
    Only attempts at the largest effort that ended on their own (not cut at the sampling cap) update
    it: low-effort brevity cannot shrink the budget the other efforts are measured against, and an
    attempt that ran into its cap says nothing about the length the task needs (counting those lets
    a model that never stops grow its own budget without bound)."""

    def __init__(self, min_samples: int = 4, keep: int = 32, update_effort: str = "max") -> None:
        self.min_samples, self.keep, self.update_effort = min_samples, keep, update_effort
        self.lengths: dict[str, list[int]] = {}

    def budget(self, task_id: str, reference: float) -> float:
        seen = self.lengths.get(task_id, [])
        return float(statistics.median(seen)) if len(seen) >= self.min_samples else float(reference)

    def observe(self, task_id: str, effort: str, correct: bool, length: int, capped: bool = False) -> None:
        if correct and not capped and effort == self.update_effort:
            seen = self.lengths.setdefault(task_id, [])
            seen.append(int(length))
            del seen[:-self.keep]

    def state_dict(self) -> dict:
        return {"lengths": {k: list(v) for k, v in self.lengths.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.lengths = {k: list(v) for k, v in state.get("lengths", {}).items()}


def parse_efforts(text: str) -> tuple[str, ...]:
    """'low,high,max' -> ('low', 'high', 'max'); ValueError naming a bad entry."""
    out = tuple(e.strip() for e in text.split(",") if e.strip())
    bad = [e for e in out if e not in EFFORTS]
    if not out or bad:
        raise ValueError(f"--efforts: expected a comma-separated subset of {','.join(EFFORTS)}, got {text!r}")
    return out


__all__ = ["EFFORTS", "BudgetTracker", "EffortConfig", "effort_reward", "max_tokens_for", "parse_efforts"]
