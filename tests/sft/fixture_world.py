"""A tiny practice world for the SFT tests, shaped like k3.envs.worlds: look a key up, submit its value.

`module()` returns an object with the k3.envs.worlds API (WORLDS, make_world, task_seeds,
oracle_trajectories) so k3.sft.sources can be pointed at it.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

from k3.envs.base import Environment, Reward, TaskInfo, ToolError, run_episode
from k3.envs.schema import ToolSpec

TOOLS = [
    ToolSpec("lookup", "Read the value stored under a key.",
             {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"],
              "additionalProperties": False}),
    ToolSpec("submit", "Submit the final answer.",
             {"type": "object", "properties": {"value": {"type": "integer"}}, "required": ["value"],
              "additionalProperties": False}),
]


class KeyWorld(Environment):
    world = "keys"

    def _reset(self, seed):
        rng = random.Random(seed)
        self.store = {f"k{i}": rng.randint(0, 99) for i in range(5)}
        self.key, self.answer = f"k{rng.randint(0, 4)}", None
        msgs = [{"role": "system", "content": "You are an agent. Use the tools."},
                {"role": "user", "content": f"What is stored under {self.key}? Look it up and submit it."}]
        return msgs, TaskInfo("keys", str(seed), seed, difficulty=1 + (seed // 2) % 2)

    def tool_specs(self):
        return TOOLS

    def call_tool(self, name, args):
        if name == "lookup":
            if args["key"] not in self.store:
                raise ToolError(f"no key {args['key']}")
            return {"value": self.store[args["key"]]}
        self.answer = args["value"]
        return "submitted"

    def verify(self):
        return Reward(1.0 if self.answer == self.store[self.key] else 0.0)

    def oracle(self):
        return Oracle(self)


class Oracle:
    def __init__(self, env):
        self.env = env

    def act(self, messages, tools):
        turn = sum(m["role"] == "assistant" for m in messages)
        if turn == 0:
            return {"role": "assistant", "reasoning_content": "Look it up.", "content": "",
                    "tool_calls": [{"id": "call_0", "type": "function",
                                    "function": {"name": "lookup", "arguments": f'{{"key": "{self.env.key}"}}'}}]}
        if turn == 1:
            v = self.env.store[self.env.key]
            return {"role": "assistant", "reasoning_content": "Submit it.", "content": "",
                    "tool_calls": [{"id": "call_0", "type": "function",
                                    "function": {"name": "submit", "arguments": f'{{"value": {v}}}'}}]}
        return {"role": "assistant", "reasoning_content": "", "content": "Done."}


def task_seeds(split, n, world="keys", start=0):
    """Even seeds train, odd seeds held out."""
    out, s = [], start
    while len(out) < n:
        if s % 2 == (split != "train"):
            out.append(s)
        s += 1
    return out


def oracle_trajectories(world, seeds):
    out = []
    for seed in seeds:
        env = KeyWorld()
        ep = run_episode(env, _Lazy(env), seed)
        out.append({"messages": ep.messages, "tools": ep.tools,
                    "meta": {"world": world, "seed": seed, "difficulty": ep.task.difficulty,
                             "reward": ep.reward.score}})
    return out


class _Lazy:
    """The oracle needs the reset world: build it on the first act."""

    def __init__(self, env):
        self.env = env

    def act(self, messages, tools):
        return self.env.oracle().act(messages, tools)


def module():
    return SimpleNamespace(WORLDS={"keys": KeyWorld}, make_world=lambda name: KeyWorld(), task_seeds=task_seeds,
                           oracle_trajectories=oracle_trajectories)
