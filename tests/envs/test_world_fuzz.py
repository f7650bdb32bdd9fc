"""Fuzzing the practice worlds with schema-valid calls whose strings are plausible ids and values:
domain errors only (ToolError observations), never an internal failure, never a success."""

import json
import random

import pytest

from k3.envs.agents import random_value
from k3.envs.base import run_episode
from k3.envs.worlds import make_world

POOL = [f"{p}{i}" for p in "mtpard" for i in range(1, 30)] + [
    "tasks", "general", "random", "engineering", "design", "ops", "sales", "support", "alice", "bruno", "chen", "sam",
    "a@b.com", "Done", "Todo", "2026-03-20", "bio210", "x", "", "inbox", "newsletter", "#general", "@dana"]


class Fuzzer:
    """25 calls of random declared tools; every string argument is drawn from POOL."""

    def __init__(self, seed):
        self.rng, self.n = random.Random(seed), 0

    def _sub(self, v):
        if isinstance(v, str):
            return self.rng.choice(POOL)
        if isinstance(v, list):
            return [self._sub(x) for x in v]
        if isinstance(v, dict):
            return {k: self._sub(x) for k, x in v.items()}
        return v

    def act(self, messages, tools):
        self.n += 1
        if self.n > 25:
            return {"role": "assistant", "content": "done"}
        fn = self.rng.choice(tools)["function"]
        args = self._sub(random_value(fn["parameters"], self.rng))
        if fn["name"] == "add_row":
            args["cells"] = {self.rng.choice(["Name", "Owner", "Status", "Due", "Bogus"]): self.rng.choice(POOL) for _ in range(3)}
        return {"role": "assistant", "content": "", "tool_calls": [
            {"id": "f", "type": "function", "function": {"name": fn["name"], "arguments": json.dumps(args)}}]}


@pytest.mark.parametrize("name", ["mail", "chat", "notes", "course", "assistant"])
def test_fuzz_no_internal_failures(name):
    env = make_world(name)
    for seed in range(25):
        ep = run_episode(env, Fuzzer(seed), seed, max_turns=30)
        assert env.stats.internal == 0, env.stats.log
        assert not ep.reward.success and 0.0 <= ep.reward.score < 1.0
        assert all(m["content"] for m in ep.messages if m["role"] == "tool")
