"""The environment protocol: tool-call validation, error observations, the episode loop."""

import json

from k3.envs.base import Environment, Reward, TaskInfo, ToolError, run_episode
from k3.envs.schema import ToolSpec, parse_call, validate


class Counter(Environment):
    """Toy world: reach `target` by calling add(n)."""

    world = "counter"

    def _reset(self, seed):
        self.value, self.target, self.paused = 0, 3 + seed % 4, 0
        return [{"role": "user", "content": f"reach {self.target}"}], TaskInfo(self.world, f"t{seed}", seed)

    def tool_specs(self):
        return [ToolSpec("add", "add n", {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1}},
                                           "required": ["n"], "additionalProperties": False}),
                ToolSpec("boom", "raises", {"type": "object", "properties": {}})]

    def call_tool(self, name, args):
        if name == "boom":
            raise RuntimeError("bug")
        if self.value + args["n"] > self.target:
            raise ToolError("overshoot")
        self.value += args["n"]
        return {"value": self.value, "blob": "x" * (20_000 if args["n"] == 1 and self.value == 1 else 0)}

    def verify(self):
        return Reward(float(self.value == self.target), {"value": self.value})

    def oracle(self):
        env = self

        class Oracle:
            def act(self, messages, tools):
                left = env.target - env.value
                if left == 0:
                    return {"content": "done"}
                return {"content": "", "tool_calls": [{"id": "c", "type": "function",
                                                       "function": {"name": "add", "arguments": json.dumps({"n": 1})}}]}
        return Oracle()

    def pause(self):
        self.paused += 1


def _call(name, args):
    return {"id": "x", "type": "function", "function": {"name": name, "arguments": args}}


def test_validate_subset():
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {"enum": [1, 2]}},
                                               "b": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
              "required": ["a"], "additionalProperties": False}
    assert validate({"a": [1, 2], "b": None}, schema) == []
    errs = validate({"a": [3], "b": 1, "c": True}, schema)
    assert len(errs) == 3 and any("unexpected field 'c'" in e for e in errs)
    assert validate({}, schema) == ["arguments: missing required field 'a'"]
    assert validate(True, {"type": "integer"}) == ["arguments: expected integer, got boolean"]


def test_bad_calls_become_error_observations():
    env = Counter()
    _, tools = env.reset(0)
    assert parse_call(_call("add", '{"n": 1}'), tools)[2] == []
    out = env.step([_call("nope", "{}"), _call("add", "{bad"), _call("add", '{"n": "1"}'), _call("add", "[1]"),
                    _call("boom", "{}"), _call("add", '{"n": 99}'), "garbage"])
    assert [m["role"] for m in out] == ["tool"] * 7
    assert all(m["content"].startswith("Error:") for m in out)
    assert "unknown tool 'nope'" in out[0]["content"] and "not valid JSON" in out[1]["content"]
    assert "expected integer" in out[2]["content"] and "overshoot" in out[5]["content"]
    assert env.stats.invalid == 5 and env.stats.internal == 1 and env.stats.errors == 7
    assert env.value == 0


def test_episode_oracle_and_truncation():
    env = Counter()
    ep = run_episode(env, env.oracle(), seed=2)
    assert ep.reward.success and ep.finished and ep.turns == env.target + 1
    assert env.paused == ep.turns and env.stats.truncated == 1
    assert "[output truncated" in ep.messages[2]["content"]


def test_agent_failure_is_recorded():
    class Dead:
        def act(self, messages, tools):
            raise ConnectionError("endpoint down")

    ep = run_episode(Counter(), Dead(), seed=1)
    assert ep.agent_error.startswith("ConnectionError") and ep.reward.score == 0.0 and not ep.finished
