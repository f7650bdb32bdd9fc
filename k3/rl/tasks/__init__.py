"""Embedded RL task sources (no download): generated math, generated Python with unit tests, tool
worlds (the embedded lookup world, plus k3.envs.agents worlds when that module is present), and
open-ended questions without a verifier ("open": scored by the judge, k3.rl.judged).

    build_tasks(("math", "worlds"), "train", 64) -> list[Task]
"""

from __future__ import annotations

import importlib.util
from typing import Any

from k3.reward.verifiers import CodeRunner
from k3.rl.tasks.base import Task, split_seed
from k3.rl.tasks.code import code_tasks
from k3.rl.tasks.math import math_tasks
from k3.rl.tasks.open import open_tasks
from k3.rl.tasks.tools import lookup_task

TASK_KINDS = ("math", "worlds", "code", "open")
JUDGED_KINDS = ("open",)  # kinds without a verifier: they need a judge


def parse_kinds(text: str) -> tuple[str, ...]:
    out = tuple(k.strip() for k in text.split(",") if k.strip())
    bad = [k for k in out if k not in TASK_KINDS]
    if not out or bad:
        raise ValueError(f"--tasks: expected a comma-separated subset of {','.join(TASK_KINDS)}, got {text!r}")
    return out


def world_task(name: str, split: str, index: int) -> Task:
    """A task of a k3.envs.agents world (`make_world(name)` -> Environment); scored by its hidden verifier."""
    from k3.envs.agents import make_world  # the worlds package is optional at import time
    from k3.reward.verifiers import world_score

    seed = split_seed(split, index)
    probe = make_world(name)
    messages, tools = probe.reset(seed)
    probe.close()

    def make_env() -> Any:
        env = make_world(name)
        env.reset(seed)
        return env

    return Task(task_id=f"{name}-{split}-{index}", kind="world", messages=messages, tools=tools,
                reference=messages[-1].get("content") or "", make_env=make_env,
                score=lambda msg, env: world_score(env) if env is not None else 0.0)


def build_tasks(kinds: tuple[str, ...], split: str, n: int, *, runner: CodeRunner | None = None,
                worlds: tuple[str, ...] = (), math_levels: tuple[int, ...] = (1, 2),
                math_partial: float = 0.0, tool_partial: float = 0.0) -> list[Task]:
    """n tasks per kind, interleaved. "code" needs a sandbox `runner`; `worlds` names extra
    k3.envs.agents worlds mixed into "worlds" (the embedded lookup world is always there).
    math_partial / tool_partial: shaped credit of the math verifier / the lookup world (0 = exact)."""
    per_kind: list[list[Task]] = []
    for kind in kinds:
        if kind == "math":
            per_kind.append(math_tasks(split, n, math_levels, math_partial))
        elif kind == "open":
            per_kind.append(open_tasks(split, n))
        elif kind == "code":
            if runner is None:
                raise ValueError("code tasks need a sandbox (k3.envs.sandbox) to run the unit tests")
            per_kind.append(code_tasks(split, n, runner))
        elif kind == "worlds":
            if worlds and importlib.util.find_spec("k3.envs.agents") is None:
                raise ValueError("world tasks other than the embedded lookup world need k3.envs.agents")
            names = ("lookup",) + tuple(worlds)
            per_kind.append([lookup_task(split, i, tool_partial) if names[i % len(names)] == "lookup"
                             else world_task(names[i % len(names)], split, i) for i in range(n)])
        else:
            raise ValueError(f"unknown task kind {kind!r} (expected one of {', '.join(TASK_KINDS)})")
    return [t for group in zip(*per_kind) for t in group]


__all__ = ["JUDGED_KINDS", "TASK_KINDS", "Task", "build_tasks", "parse_kinds", "split_seed", "world_task"]
