"""Harness variation: the same task shown through differently built agent harnesses.

A model trained through one harness learns that harness (its tool names, its prompt, its way of
showing history). K3's practice worlds vary the harness per episode so the model learns tool use in
general. A `HarnessProfile` fixes one harness:

* system prompt: a template around the world's own system message (`{task_context}`);
* tool names: snake_case (as declared), camelCase, PascalCase, or MCP-style `mcp__<world>__<name>`;
* schema style: verbose (as declared) or terse (first sentence of each description, no property
  descriptions); `strict` adds `additionalProperties: false` to every object with properties;
* an optional memory tool (a scratchpad kept by the harness, not the world);
* context management: keep everything, keep the last K turns, or keep every turn but replace old
  tool results by a one-line digest;
* interaction style: the task as a chat message, an issue-tracker ticket, or a bare goal.

`HarnessEnv(env, profile)` is an `Environment` that applies a profile to any world: tool names go
out renamed and come back mapped, the memory tool is answered by the harness, the opening messages
are rewritten, and `view` (pass it to `run_episode`) implements the context management. Its
`oracle()` wraps the world's oracle (names mapped both ways), so the oracle scores 100% under every
profile. The profiles below are modelled on public agent CLIs; their prompts are written here.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
from dataclasses import dataclass
from typing import Any

from k3.envs.base import Agent, Environment, Reward, TaskInfo, ToolError
from k3.envs.schema import ToolSpec

NAMINGS = ("snake", "camel", "pascal", "mcp")
SCHEMA_STYLES = ("verbose", "terse")
CONTEXTS = ("all", "last_k", "digest")
INTERACTIONS = ("chat", "ticket", "goal")
MAX_TOOL_NAME = 64  # OpenAI's limit on function names


@dataclass(frozen=True)
class HarnessProfile:
    """One harness. system_template: str.format template with {task_context} (the world's system
    message, or "") and {world}. memory_tool: name of the scratchpad tool as declared (before the
    naming style is applied), or None. keep_turns: assistant turns shown in full by last_k / digest."""

    name: str
    system_template: str = "{task_context}"
    naming: str = "snake"
    schema_style: str = "verbose"
    strict: bool = False
    memory_tool: str | None = None
    context: str = "all"
    keep_turns: int = 6
    interaction: str = "chat"

    def __post_init__(self) -> None:
        for field_name, allowed in (("naming", NAMINGS), ("schema_style", SCHEMA_STYLES), ("context", CONTEXTS),
                                    ("interaction", INTERACTIONS)):
            if getattr(self, field_name) not in allowed:
                raise ValueError(f"HarnessProfile.{field_name} must be one of {allowed}, "
                                 f"got {getattr(self, field_name)!r}")
        if self.keep_turns < 1:
            raise ValueError(f"HarnessProfile.keep_turns must be >= 1, got {self.keep_turns}")


PROFILES: dict[str, HarnessProfile] = {
    # the world as declared: no rewriting at all (the reference harness)
    "plain": HarnessProfile("plain"),
    # a terminal coding agent in the style of Codex CLI: short imperative instructions, autonomy,
    # snake_case tools with strict compact schemas, a plan tool, old tool output digested
    "codex-like": HarnessProfile(
        "codex-like",
        system_template=("You are a coding and operations agent working in the user's environment ({world}). "
                         "Work autonomously until the task is done; do not ask for confirmation. Keep the user "
                         "informed with brief updates, and keep a short plan with the plan tool for longer work. "
                         "When finished, reply with a concise summary.\n\n{task_context}"),
        naming="snake", schema_style="terse", strict=True, memory_tool="update_plan", context="digest",
        keep_turns=4, interaction="goal"),
    # an assistant CLI in the style of Claude Code: PascalCase tools with detailed descriptions, a
    # to-do list tool, the whole history kept, tasks arrive as chat messages
    "claude-code-like": HarnessProfile(
        "claude-code-like",
        system_template=("You are an interactive assistant that helps the user with tasks in {world} using the "
                         "tools below. Read before you change anything, prefer the dedicated tools, and track "
                         "multi-step work in the to-do tool. Be concise; answer in plain text when done.\n\n"
                         "<environment>\n{task_context}\n</environment>"),
        naming="pascal", schema_style="verbose", memory_tool="todo_write", context="all", interaction="chat"),
    # an agent CLI in the style of Kimi CLI: tools reached through MCP servers (prefixed names), a
    # notes tool, tasks as tickets, only the recent turns kept in context
    "kimi-cli-like": HarnessProfile(
        "kimi-cli-like",
        system_template=("You are an agent running in a command-line harness. Tools come from connected MCP "
                         "servers and are named mcp__<server>__<tool>. Context is limited: older turns are "
                         "dropped, so record anything you will need later with the notes tool.\n\n"
                         "# Context\n{task_context}"),
        naming="mcp", schema_style="verbose", strict=False, memory_tool="notes", context="last_k", keep_turns=4,
        interaction="ticket"),
    # an API-first assistant: camelCase function names, terse schemas, the goal only
    "api-camel": HarnessProfile(
        "api-camel",
        system_template="{task_context}\n\nCall functions as needed; finish with a short answer.",
        naming="camel", schema_style="terse", strict=True, context="all", interaction="goal"),
}


def get_profile(name: str) -> HarnessProfile:
    if name not in PROFILES:
        raise ValueError(f"unknown harness profile {name!r}; available: {', '.join(PROFILES)}, random")
    return PROFILES[name]


def sample_profile(rng: random.Random, *, mix: float = 0.3) -> HarnessProfile:
    """A profile for one episode: a named profile, each of whose interaction style, context
    management and schema style is independently resampled with probability `mix`."""
    p = PROFILES[rng.choice(sorted(PROFILES))]
    changes: dict[str, Any] = {}
    if rng.random() < mix:
        changes["interaction"] = rng.choice(INTERACTIONS)
    if rng.random() < mix:
        changes["context"] = rng.choice(CONTEXTS)
        changes["keep_turns"] = rng.randint(2, 8)
    if rng.random() < mix:
        changes["schema_style"] = rng.choice(SCHEMA_STYLES)
    if changes:
        p = dataclasses.replace(p, name=p.name + "+mix", **changes)
    return p


# ------------------------------------------------------------------------------------------- naming


def rename(name: str, naming: str, world: str) -> str:
    """A declared (snake_case) tool name in the given naming style."""
    words = [w for w in re.split(r"[_\-\s]+", name) if w]
    if naming == "camel" and words:
        return words[0][:1].lower() + words[0][1:] + "".join(w[:1].upper() + w[1:] for w in words[1:])
    if naming == "pascal":
        return "".join(w[:1].upper() + w[1:] for w in words)
    if naming == "mcp":
        return f"mcp__{re.sub(r'[^A-Za-z0-9_-]', '_', world)}__{name}"
    return name


def name_map(names: list[str], naming: str, world: str) -> dict[str, str]:
    """inner name -> outer name, one-to-one; a name whose renaming collides or is too long stays."""
    out: dict[str, str] = {}
    taken = set()
    for n in names:
        r = rename(n, naming, world)
        if r in taken or len(r) > MAX_TOOL_NAME or not r or (r != n and r in names):
            r = n
        out[n] = r
        taken.add(r)
    return out


# ------------------------------------------------------------------------------------------- schemas


def _first_sentence(text: str) -> str:
    text = " ".join(str(text).split())
    m = re.match(r"(.+?[.!?])(\s|$)", text)
    return m.group(1) if m else text


def restyle_schema(schema: Any, terse: bool, strict: bool) -> Any:
    """Copy of a JSON schema with property descriptions dropped (terse) and closed objects (strict)."""
    if isinstance(schema, list):
        return [restyle_schema(s, terse, strict) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if terse and k == "description":
            continue
        if k == "properties" and isinstance(v, dict):
            out[k] = {p: restyle_schema(s, terse, strict) for p, s in v.items()}
        elif k in ("items", "anyOf", "oneOf", "additionalProperties"):
            out[k] = restyle_schema(v, terse, strict)
        else:
            out[k] = v
    if strict and isinstance(out.get("properties"), dict) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def memory_spec(name: str, terse: bool) -> ToolSpec:
    desc = ("Scratchpad kept by the harness across turns." if terse else
            "A scratchpad kept by the harness, not by the world: `append` adds a line, `read` returns all lines, "
            "`clear` empties it. Use it to remember facts and plans when older turns leave the context.")
    return ToolSpec(name, desc, {"type": "object", "properties": {
        "op": {"type": "string", "enum": ["append", "read", "clear"]},
        "text": {"type": "string", "description": "the line to append"}},
        "required": ["op"], "additionalProperties": False})


# ------------------------------------------------------------------------------------------- messages


def restyle_task(text: str, interaction: str, task_id: str) -> str:
    """The user's task text in the profile's interaction style (the content itself is kept whole)."""
    if interaction == "ticket":
        title = _first_sentence(text)[:80]
        return (f"Ticket {task_id}\nTitle: {title}\nStatus: assigned to you\n\nDescription:\n{text}\n\n"
                "Resolve the ticket with the available tools, then reply with a short resolution note.")
    if interaction == "goal":
        return f"Goal: {text}\n\nNo one will answer questions; work until the goal is reached, then stop."
    return text


def _digest(m: dict) -> dict:
    text = m.get("content") if isinstance(m.get("content"), str) else json.dumps(m.get("content"), default=str)
    head = " ".join(text.split())[:80]
    return dict(m, content=f"[digest of an earlier result: {len(text)} chars] {head}{'...' if len(text) > 80 else ''}")


def manage_context(messages: list[dict], context: str, keep_turns: int) -> list[dict]:
    """What the agent is shown: all messages, the last `keep_turns` assistant turns (with their
    tool results) after the opening messages, or all turns with older tool results digested.
    Turn boundaries are respected, so every tool result still follows its call."""
    if context == "all":
        return list(messages)
    starts = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if len(starts) <= keep_turns:
        return list(messages)
    first, cut = starts[0], starts[-keep_turns]
    if context == "last_k":
        dropped = len(starts) - keep_turns
        note = {"role": "system", "content": f"[context: {dropped} earlier turns were removed to save space]"}
        return messages[:first] + [note] + messages[cut:]
    return messages[:first] + [_digest(m) if m.get("role") == "tool" else m for m in messages[first:cut]] + \
        messages[cut:]


# ------------------------------------------------------------------------------------------- environment


class HarnessEnv(Environment):
    """`env` seen through harness `profile` (see the module docstring)."""

    def __init__(self, env: Environment, profile: HarnessProfile) -> None:
        super().__init__()
        self.inner, self.profile = env, profile
        self.world = env.world
        self.max_observation_chars = env.max_observation_chars
        self.memory: list[str] = []

    # ---- names ---------------------------------------------------------------------------------------
    def _names(self) -> dict[str, str]:
        inner = [s.name for s in self.inner.tool_specs()]
        memory = self._memory_key(inner)
        return name_map(inner + ([memory] if memory else []), self.profile.naming, self.world)

    def _memory_key(self, inner: list[str]) -> str | None:
        """The memory tool's declared name (prefixed with harness_ if the world has a tool of that name)."""
        m = self.profile.memory_tool
        return None if m is None else f"harness_{m}" if m in inner else m

    @property
    def memory_name(self) -> str | None:
        """The memory tool's name as the agent sees it (None without one)."""
        key = self._memory_key([s.name for s in self.inner.tool_specs()])
        return self._names()[key] if key else None

    def to_outer(self, name: str) -> str:
        return self._names().get(name, name)

    def to_inner(self, name: str) -> str:
        back = {v: k for k, v in self._names().items()}
        return back.get(name, name)

    # ---- Environment hooks -----------------------------------------------------------------------------
    def _reset(self, seed: int) -> tuple[list[dict], TaskInfo]:
        messages, _ = self.inner.reset(seed)
        self.memory = []
        task = self.inner.task
        return self._opening(messages, task), task

    def _opening(self, messages: list[dict], task: TaskInfo) -> list[dict]:
        p = self.profile
        sys_text = "\n\n".join(m["content"] for m in messages if m.get("role") == "system"
                               and isinstance(m.get("content"), str))
        out = [{"role": "system", "content": p.system_template.format(task_context=sys_text, world=self.world).strip()}]
        if not out[0]["content"]:
            out = []
        for m in messages:
            if m.get("role") == "system":
                continue
            if m.get("role") == "user" and isinstance(m.get("content"), str):
                m = dict(m, content=restyle_task(m["content"], p.interaction, task.task_id))
            out.append(m)
        return out

    def tool_specs(self) -> list[ToolSpec]:
        p = self.profile
        terse = p.schema_style == "terse"
        names = self._names()
        inner = self.inner.tool_specs()
        specs = [ToolSpec(names[s.name], _first_sentence(s.description) if terse else s.description,
                          restyle_schema(s.parameters, terse, p.strict)) for s in inner]
        memory = self._memory_key([s.name for s in inner])
        if memory:
            specs.append(memory_spec(names[memory], terse))
        return specs

    def call_tool(self, name: str, args: dict) -> Any:
        if self.profile.memory_tool and name == self.memory_name:
            return self._memory(args)
        return self.inner.call_tool(self.to_inner(name), args)

    def _memory(self, args: dict) -> Any:
        op = args["op"]
        if op == "append":
            if not args.get("text"):
                raise ToolError("append needs a non-empty `text`")
            self.memory.append(args["text"])
            return {"ok": True, "lines": len(self.memory)}
        if op == "clear":
            self.memory = []
            return {"ok": True, "lines": 0}
        return {"lines": list(self.memory)}

    def verify(self) -> Reward:
        return self.inner.verify()

    def public_check(self) -> str:
        return self.inner.public_check()

    def pause(self) -> None:
        self.inner.pause()

    def resume(self) -> None:
        self.inner.resume()

    def close(self) -> None:
        self.inner.close()

    def view(self, messages: list[dict]) -> list[dict]:
        """The profile's context management (pass as `run_episode(..., view=env.view)`)."""
        return manage_context(messages, self.profile.context, self.profile.keep_turns)

    def oracle(self) -> Agent:
        return MappedAgent(self, self.inner.oracle())

    def hacker(self) -> Agent | None:
        """The world's reward hacker (if it has one) through this harness."""
        inner = self.inner.hacker() if hasattr(self.inner, "hacker") else None
        return MappedAgent(self, inner) if inner is not None else None


class MappedAgent:
    """Runs an agent written for the bare world under a harness: it sees inner tool names and the
    world's tools; its calls go out under the harness's names."""

    def __init__(self, env: HarnessEnv, agent: Agent) -> None:
        self.env, self.agent = env, agent

    def act(self, messages: list[dict], tools: list[dict]) -> dict:
        reply = dict(self.agent.act([self._inward(m) for m in messages], self.env.inner.tools()))
        if reply.get("tool_calls"):
            reply["tool_calls"] = [self._outward(c) for c in reply["tool_calls"]]
        return reply

    def _inward(self, m: dict) -> dict:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            calls = [dict(c, function=dict(c["function"], name=self.env.to_inner(c["function"]["name"])))
                     if isinstance(c, dict) and isinstance(c.get("function"), dict) else c for c in m["tool_calls"]]
            return dict(m, tool_calls=calls)
        if m.get("role") == "tool" and isinstance(m.get("name"), str):
            return dict(m, name=self.env.to_inner(m["name"]))
        return m

    def _outward(self, c: Any) -> Any:
        if isinstance(c, dict) and isinstance(c.get("function"), dict):
            return dict(c, function=dict(c["function"], name=self.env.to_outer(c["function"]["name"])))
        return c
