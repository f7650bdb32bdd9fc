"""The environment protocol every practice world implements, and the tool loop that drives it.

An environment is one task in one world:

    messages, tools = env.reset(seed)      # the task's opening conversation and OpenAI tool list
    results = env.step(tool_calls)         # the model's calls -> `role: tool` messages
    reward = env.verify()                  # hidden verifier: reads the world's final state only

`step` never raises on model output: unknown tools, malformed JSON, arguments that violate the
schema, tool errors, huge outputs and internal failures all come back as error observations (and
are counted in `env.stats`). Sandboxed worlds are paused between steps while the model generates
(`pause()` / `resume()`, no-ops for in-memory worlds).

An agent is anything with `act(messages, tools) -> assistant message` (OpenAI format, optionally
with `tool_calls`). `run_episode` alternates the two until the agent answers without calling a
tool, or `max_turns` is reached, and returns the transcript with the hidden verifier's reward.
"""

from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from k3.envs.schema import ToolSpec, parse_call

MAX_OBSERVATION_CHARS = 16_000


class ToolError(Exception):
    """A tool's domain error (no such message, permission denied, ...): shown to the model as-is."""


@dataclass
class Reward:
    """The hidden verifier's verdict: `score` in [0, 1] and what it checked."""

    score: float
    details: dict = field(default_factory=dict)

    @property
    def success(self) -> bool:
        return self.score >= 1.0


@dataclass(frozen=True)
class TaskInfo:
    """What identifies and describes the current task (not what solves it)."""

    world: str
    task_id: str
    seed: int
    difficulty: int = 1
    kind: str = ""
    apps: tuple[str, ...] = ()


@dataclass
class StepStats:
    """Counts of what happened to the model's tool calls in an episode."""

    calls: int = 0
    errors: int = 0
    invalid: int = 0          # unknown tool, bad JSON, schema violations
    truncated: int = 0
    internal: int = 0         # a tool raised something other than ToolError (a world bug)
    log: list[str] = field(default_factory=list)


class Agent(Protocol):
    def act(self, messages: list[dict], tools: list[dict]) -> dict:
        """The next assistant message {"role": "assistant", "content", ["reasoning_content"], ["tool_calls"]}."""
        ...


class Environment(ABC):
    """Base class of a practice world's task; subclasses implement the abstract hooks."""

    world: str = "base"
    max_observation_chars: int = MAX_OBSERVATION_CHARS

    def __init__(self) -> None:
        self.stats = StepStats()
        self.task: TaskInfo | None = None

    # ------------------------------------------------------------------ hooks for worlds
    @abstractmethod
    def _reset(self, seed: int) -> tuple[list[dict], TaskInfo]:
        """Build the world state for task `seed` -> (opening messages, task info)."""

    @abstractmethod
    def tool_specs(self) -> list[ToolSpec]:
        """The tools of the current task."""

    @abstractmethod
    def call_tool(self, name: str, args: dict) -> Any:
        """Run one validated call; return a JSON-able result or raise ToolError."""

    @abstractmethod
    def verify(self) -> Reward:
        """The hidden verifier: scores the final world state, never the transcript."""

    @abstractmethod
    def oracle(self) -> Agent:
        """A scripted agent with privileged knowledge of the task that solves it through the tools."""

    def public_check(self) -> str:
        """Feedback the agent may ask for (a weaker check than `verify`)."""
        return "no public check for this task"

    def pause(self) -> None:
        """Freeze the world while the model generates (sandboxed worlds)."""

    def resume(self) -> None:
        """Thaw it before the next tool call."""

    def close(self) -> None:
        """Release sandboxes and temporary files."""

    def __enter__(self) -> "Environment":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ protocol
    def reset(self, seed: int) -> tuple[list[dict], list[dict]]:
        """Start task `seed` -> (messages, tools in OpenAI format)."""
        self.stats = StepStats()
        messages, self.task = self._reset(seed)
        return messages, self.tools()

    def tools(self) -> list[dict]:
        return [spec.openai() for spec in self.tool_specs()]

    def step(self, tool_calls: list[dict]) -> list[dict]:
        """Run the model's calls in order -> one `role: tool` message per call."""
        if not isinstance(tool_calls, list):
            tool_calls = [tool_calls]
        return [self._one_call(call, i) for i, call in enumerate(tool_calls)]

    def _one_call(self, call: Any, index: int) -> dict:
        self.stats.calls += 1
        call_id = call.get("id") if isinstance(call, dict) else None
        name, args, problems = parse_call(call, self.tools())
        if problems:
            self.stats.invalid += 1
            return self._error(call_id, name, "invalid tool call: " + "; ".join(problems))
        try:
            result = self.call_tool(name, args)
        except ToolError as e:
            return self._error(call_id, name, str(e))
        except Exception as e:  # a world bug must not end the rollout; it is counted and logged
            self.stats.internal += 1
            return self._error(call_id, name, f"internal tool failure ({type(e).__name__}: {e})")
        text = result if isinstance(result, str) else json.dumps(result, ensure_ascii=False, default=str)
        if len(text) > self.max_observation_chars:
            self.stats.truncated += 1
            cut = len(text) - self.max_observation_chars
            text = text[: self.max_observation_chars] + f"\n... [output truncated: {cut} more characters]"
        return {"role": "tool", "tool_call_id": call_id or f"call_{index}", "name": name, "content": text}

    def _error(self, call_id: str | None, name: str, text: str) -> dict:
        self.stats.errors += 1
        self.stats.log.append(f"{name or '?'}: {text}")
        return {"role": "tool", "tool_call_id": call_id or "call_invalid", "name": name, "content": f"Error: {text}"}


@dataclass
class Episode:
    """One finished task attempt: transcript, hidden reward and what went wrong."""

    task: TaskInfo
    messages: list[dict]
    tools: list[dict]
    reward: Reward
    turns: int
    finished: bool            # the agent ended with a message without tool calls
    stats: StepStats
    agent_error: str | None = None
    seconds: float = 0.0


def run_episode(
    env: Environment,
    agent: Agent,
    seed: int,
    *,
    max_turns: int = 24,
    view: Callable[[list[dict]], list[dict]] | None = None,
) -> Episode:
    """Drive `agent` through task `seed` of `env`; the world is paused while the agent thinks.

    `view` maps the full transcript to what the agent is shown (context management: truncation
    or summaries of old turns); the transcript itself keeps everything. An agent that raises
    (a dead endpoint) ends the episode with `agent_error` set; the verifier still runs.
    """
    t0 = time.perf_counter()
    messages, tools = env.reset(seed)
    turns, finished, agent_error = 0, False, None
    while turns < max_turns:
        env.pause()
        try:
            reply = agent.act(view(messages) if view else list(messages), tools)
        except Exception as e:  # recorded, not raised: one bad endpoint reply must not end an eval
            agent_error = f"{type(e).__name__}: {e}"
            break
        finally:
            env.resume()
        turns += 1
        reply = {"role": "assistant", **{k: v for k, v in dict(reply).items() if k != "role"}}
        messages.append(reply)
        calls = reply.get("tool_calls") or []
        if not calls:
            finished = True
            break
        messages.extend(env.step(calls))
    reward = env.verify()
    return Episode(env.task, messages, tools, reward, turns, finished, env.stats, agent_error,
                   time.perf_counter() - t0)
