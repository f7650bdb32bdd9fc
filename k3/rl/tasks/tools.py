"""An embedded tool world (no download): look a value up through a tool and submit it.

The user names a key; `lookup(key)` returns its number from a seeded table; `submit(answer)`
records the answer. The hidden verifier reads only the final state: 1.0 when the submitted
answer equals the key's value. A reference trajectory is two calls and a short reply.

Shaped credit (`partial` P > 0, for models that cannot yet solve the task): a wrong or missing
submission earns P·k/3, k the number of milestones reached of (1) a parseable tool call of any
name, (2) a valid call of a declared tool, (3) a lookup of the target key. P = 0 is the plain
verifier; the pass rate counts correct submissions (score 1) only.
"""

from __future__ import annotations

import random
from typing import Any

from k3.envs.base import Agent, Environment, Reward, TaskInfo, ToolError
from k3.envs.schema import ToolSpec
from k3.reward.verifiers import world_score
from k3.rl.tasks.base import Task, split_seed

_KEYS = ("red", "blue", "green", "gold", "gray", "pink", "teal", "plum")


class LookupWorld(Environment):
    """One task per seed: a table of 4 keys -> 2-digit values, a target key."""

    world = "lookup"

    def __init__(self, partial: float = 0.0) -> None:
        if not 0.0 <= partial < 1.0:
            raise ValueError(f"partial credit must be in [0, 1), got {partial}")
        super().__init__()
        self.partial = partial

    def _reset(self, seed: int) -> tuple[list[dict], TaskInfo]:
        rng = random.Random(seed * 31337 + 5)
        keys = rng.sample(_KEYS, 4)
        self.table = {k: rng.randint(10, 99) for k in keys}
        self.target = rng.choice(keys)
        self.submitted: int | None = None
        self.valid_calls = 0
        self.looked_up_target = False
        msg = f"Use the lookup tool to find the value of {self.target}, then submit it."
        return [{"role": "user", "content": msg}], TaskInfo(self.world, f"lookup-{seed}", seed)

    def tool_specs(self) -> list[ToolSpec]:
        return [
            ToolSpec("lookup", "Value stored under a key.",
                     {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}),
            ToolSpec("submit", "Submit the final answer.",
                     {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}),
        ]

    def call_tool(self, name: str, args: dict) -> Any:
        self.valid_calls += 1  # the schema check passed (k3.envs.base.Environment.step)
        if name == "lookup":
            if args["key"] not in self.table:
                raise ToolError(f"no key {args['key']!r}; keys: {', '.join(sorted(self.table))}")
            self.looked_up_target |= args["key"] == self.target
            return {"value": self.table[args["key"]]}
        self.submitted = int(args["answer"])
        return "submitted"

    def verify(self) -> Reward:
        expected = self.table[self.target]
        info = {"submitted": self.submitted, "expected": expected}
        if self.submitted == expected:
            return Reward(1.0, info)
        milestones = (self.stats.calls > 0) + (self.valid_calls > 0) + self.looked_up_target
        return Reward(self.partial * milestones / 3, info | {"milestones": milestones})

    def oracle(self) -> Agent:
        raise NotImplementedError("the lookup world's reference is `reference_text`")


def lookup_task(split: str, index: int, partial: float = 0.0) -> Task:
    """Task `index` of `split`; partial: the world's shaped credit (module docstring)."""
    seed = split_seed(split, index)
    probe = LookupWorld()
    messages, tools = probe.reset(seed)
    value = probe.table[probe.target]
    ref = (f'<lookup key="{probe.target}"> {{"value": {value}}} <submit answer="{value}"> submitted '
           f"The value of {probe.target} is {value}.")

    def make_env() -> LookupWorld:
        env = LookupWorld(partial)
        env.reset(seed)
        return env

    def score(msg: dict, env: Any) -> float:
        return world_score(env) if env is not None else 0.0

    return Task(task_id=f"lookup-{split}-{index}", kind="world", messages=messages, tools=tools, reference=ref,
                score=score, make_env=make_env, meta={"answer": value})


def lookup_tasks(split: str, n: int, partial: float = 0.0) -> list[Task]:
    return [lookup_task(split, i, partial) for i in range(n)]
