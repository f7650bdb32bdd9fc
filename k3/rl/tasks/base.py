"""The task record the rollout manager consumes, and the split of seeds into train / held-out.

A Task is one prompt with its verifier. Single-turn tasks (math, code) score the final assistant
message; world tasks build an environment (`make_env`) whose tools the model calls over several
turns and whose hidden verifier scores the final state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

HELDOUT_OFFSET = 1_000_000  # held-out seeds live far from training seeds: no overlap by construction


@dataclass
class Task:
    """task_id: unique and stable (budget tracking, logs). kind: "math" | "code" | "world".
    messages / tools: the opening conversation (OpenAI format) and tool list (None = no tools).
    reference: a reference assistant output text (its token length estimates the budget).
    score: (assistant message dict, env or None) -> score in [0, 1]; must not raise. None: no
    verifier; the rollout manager's group scorer (the judge, k3.rl.judged) scores the group.
    make_env: world tasks only: () -> a reset k3.envs Environment (its tools answer the calls).
    budget_tokens: the task's own answer-length budget; None = the reference's token length."""

    task_id: str
    kind: str
    messages: list[dict]
    reference: str
    score: Callable[[dict, Any], float] | None
    tools: list[dict] | None = None
    make_env: Callable[[], Any] | None = None
    budget_tokens: int | None = None
    meta: dict = field(default_factory=dict)


def split_seed(split: str, index: int) -> int:
    """Seed of the index-th task of a split ("train" or "heldout")."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    return index + (HELDOUT_OFFSET if split == "heldout" else 0)
