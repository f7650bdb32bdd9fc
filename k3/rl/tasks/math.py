"""Generated arithmetic with exact answers: a seeded generator over difficulty levels sized for
small models, each task with a reference solution (its length sets the effort budget).

    level 1: a + b, one-digit operands        level 2: a + b or a − b, two-digit operands
    level 3: a × b, one- by two-digit         level 4: a + b − c, two-digit operands
"""

from __future__ import annotations

import random

from k3.reward.verifiers import math_score
from k3.rl.tasks.base import Task, split_seed

LEVELS = (1, 2, 3, 4)


def make_problem(seed: int, level: int) -> tuple[str, int, str]:
    """-> (question, answer, reference thinking). Deterministic in (seed, level)."""
    if level not in LEVELS:
        raise ValueError(f"math level must be one of {LEVELS}, got {level!r}")
    rng = random.Random(seed * 7919 + level)
    if level == 1:
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        expr, ans = f"{a} + {b}", a + b
    elif level == 2:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        if rng.random() < 0.5:
            expr, ans = f"{a} + {b}", a + b
        else:
            a, b = max(a, b), min(a, b)
            expr, ans = f"{a} - {b}", a - b
    elif level == 3:
        a, b = rng.randint(2, 9), rng.randint(10, 99)
        expr, ans = f"{a} * {b}", a * b
    else:
        a, b, c = rng.randint(10, 99), rng.randint(10, 99), rng.randint(10, 99)
        expr, ans = f"{a} + {b} - {c}", a + b - c
    return f"What is {expr}?", ans, f"{expr} = {ans}"


def math_task(split: str, index: int, level: int, partial: float = 0.0) -> Task:
    """partial: shaped credit for a wrong integer (k3.reward.verifiers.math_score); pass rate still
    counts exact answers only (score >= 1)."""
    seed = split_seed(split, index)
    question, answer, thinking = make_problem(seed, level)

    def score(msg: dict, env: object = None) -> float:
        return math_score(answer, msg.get("content") or "", msg.get("reasoning_content") or "", partial=partial)

    return Task(task_id=f"math-l{level}-{split}-{index}", kind="math",
                messages=[{"role": "user", "content": question}], reference=f"{thinking}\n{answer}",
                score=score, meta={"answer": answer, "level": level})


def math_tasks(split: str, n: int, levels: tuple[int, ...] = (1, 2), partial: float = 0.0) -> list[Task]:
    """n tasks cycling through `levels`."""
    return [math_task(split, i, levels[i % len(levels)], partial) for i in range(n)]
