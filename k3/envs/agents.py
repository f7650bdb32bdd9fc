"""Built-in agents for the practice worlds: scripted (oracle / reward hacker), random.

All agents follow the `k3.envs.base.Agent` protocol: `act(messages, tools) -> assistant message`.

* `ScriptedAgent(script)` drives a generator: the script yields `Call(name, args, why)` steps and
  receives each call's parsed tool result (a dict/list when the result is JSON, else the text, e.g.
  "Error: ..."); its return value is the final answer. `why` becomes the message's
  `reasoning_content`, so oracle transcripts teach short reasoning as well as the calls.
* `OracleAgent(env)` / `RewardHackerAgent(env)` wrap `env.oracle()` / `env.hacker()` afresh for
  each episode (they notice a new episode by a transcript without assistant messages), so one agent
  object can be passed to `run_episode` repeatedly.
* `RandomAgent(seed)` calls random declared tools with random schema-shaped arguments for a few
  turns, then stops: the floor every world's verifier must keep near 0.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Generator

Script = Callable[[], Generator["Call", Any, str]]


@dataclass
class Call:
    """One scripted tool call with the reasoning that precedes it."""

    name: str
    args: dict = field(default_factory=dict)
    why: str = ""


def _tool_call(call_id: str, name: str, args: dict) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def _parse_result(content: Any) -> Any:
    if not isinstance(content, str):
        return content
    try:
        return json.loads(content)
    except json.JSONDecodeError:
        return content


def _new_episode(messages: list[dict]) -> bool:
    return not any(m.get("role") == "assistant" for m in messages)


class ScriptedAgent:
    """Runs one script (a generator of `Call`s) as an agent; one call per turn."""

    def __init__(self, script: Script):
        self.script = script
        self.gen: Generator | None = None
        self.n = 0

    def act(self, messages: list[dict], tools: list[dict]) -> dict:
        try:
            if self.gen is None:
                self.gen = self.script()
                step = next(self.gen)
            else:
                last = messages[-1] if messages else {}
                value = _parse_result(last.get("content")) if last.get("role") == "tool" else None
                step = self.gen.send(value)
        except StopIteration as stop:
            return {"role": "assistant", "content": stop.value or "Done."}
        self.n += 1
        msg = {"role": "assistant", "content": "", "tool_calls": [_tool_call(f"call_{self.n}", step.name, step.args)]}
        if step.why:
            msg["reasoning_content"] = step.why
        return msg


class _PerEpisode:
    """Builds a fresh scripted agent from `factory()` at the start of every episode."""

    def __init__(self, factory: Callable[[], Any]):
        self.factory = factory
        self.inner: Any = None

    def act(self, messages: list[dict], tools: list[dict]) -> dict:
        if self.inner is None or _new_episode(messages):
            self.inner = self.factory()
        if self.inner is None:
            return {"role": "assistant", "content": "I have nothing to do here."}
        return self.inner.act(messages, tools)


class OracleAgent(_PerEpisode):
    """The environment's scripted solver (privileged task knowledge, normal tool calls)."""

    def __init__(self, env: Any):
        super().__init__(env.oracle)


class RewardHackerAgent(_PerEpisode):
    """Does the minimum the task's public check looks at (`env.hacker()`; None = not hackable)."""

    def __init__(self, env: Any):
        super().__init__(lambda: env.hacker() if hasattr(env, "hacker") else None)


_WORDS = ("alpha", "report", "x", "12", "team", "urgent", "hello", "archive", "done", "m1", "general", "todo")


def random_value(schema: dict, rng: random.Random, depth: int = 0) -> Any:
    """A random value shaped like `schema` (types, enums, array items, object properties)."""
    if "enum" in schema:
        return rng.choice(schema["enum"])
    if "anyOf" in schema or "oneOf" in schema:
        return random_value(rng.choice(schema.get("anyOf") or schema["oneOf"]), rng, depth)
    kind = schema.get("type", "string")
    kind = rng.choice(kind) if isinstance(kind, list) else kind
    if kind == "integer" or kind == "number":
        lo, hi = schema.get("minimum", 0), schema.get("maximum", 50)
        return rng.randint(int(lo), int(min(hi, lo + 50)))
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "array":
        return [random_value(schema.get("items", {}), rng, depth + 1) for _ in range(rng.randint(0, 2))]
    if kind == "object" and depth < 3:
        props = schema.get("properties", {})
        keys = [k for k in props if k in schema.get("required", []) or rng.random() < 0.5]
        return {k: random_value(props[k], rng, depth + 1) for k in keys}
    if kind == "null":
        return None
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 3)))


class RandomAgent:
    """Random declared tools with random schema-shaped arguments for 1-6 turns, then a final answer."""

    def __init__(self, seed: int = 0, max_calls: int = 6):
        self.rng = random.Random(seed)
        self.max_calls = max_calls
        self.budget = 0

    def act(self, messages: list[dict], tools: list[dict]) -> dict:
        if _new_episode(messages):
            self.budget = self.rng.randint(1, self.max_calls)
        if self.budget <= 0 or not tools:
            return {"role": "assistant", "content": "I am done."}
        self.budget -= 1
        fn = self.rng.choice(tools).get("function", {})
        args = random_value(fn.get("parameters") or {"type": "object"}, self.rng)
        return {"role": "assistant", "content": "",
                "tool_calls": [_tool_call(f"call_r{self.budget}", fn.get("name", "?"), args if isinstance(args, dict) else {})]}
