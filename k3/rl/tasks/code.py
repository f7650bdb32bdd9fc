"""Generated Python tasks with hidden unit tests, run through an injected `CodeRunner` sandbox.

Each task asks for a one-line function f(x) = a·x + b or f(x) = x·x + c (seeded), with five unit
tests of the form `f(3) == 10`; the score is the fraction passed (k3.reward.verifiers.code_score).
"""

from __future__ import annotations

import random

from k3.reward.verifiers import CodeRunner, code_score
from k3.rl.tasks.base import Task, split_seed


def make_code_problem(seed: int) -> tuple[str, str, list[str]]:
    """-> (instruction, reference solution, unit tests)."""
    rng = random.Random(seed * 104729 + 11)
    if rng.random() < 0.5:
        a, b = rng.randint(2, 9), rng.randint(0, 9)
        desc, body, fn = f"returns {a} * x + {b}", f"{a} * x + {b}", lambda x: a * x + b
    else:
        c = rng.randint(0, 9)
        desc, body, fn = f"returns x * x + {c}", f"x * x + {c}", lambda x: x * x + c
    xs = rng.sample(range(-9, 10), 5)
    tests = [f"f({x}) == {fn(x)}" for x in xs]
    ref = f"```python\ndef f(x):\n    return {body}\n```"
    return f"Write a Python function f(x) that {desc}.", ref, tests


def code_task(split: str, index: int, runner: CodeRunner, timeout_s: float = 5.0) -> Task:
    instruction, ref, tests = make_code_problem(split_seed(split, index))

    def score(msg: dict, env: object = None) -> float:
        return code_score(runner, msg.get("content") or "", tests, timeout_s)

    return Task(task_id=f"code-{split}-{index}", kind="code", messages=[{"role": "user", "content": instruction}],
                reference=ref, score=score, meta={"tests": tests})


def code_tasks(split: str, n: int, runner: CodeRunner) -> list[Task]:
    return [code_task(split, i, runner) for i in range(n)]
