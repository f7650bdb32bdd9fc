"""Effort-conditioned reasoning for the default SFT data: each generated conversation gets a
`thinking_effort` and the length of its reasoning follows it, so that after SFT the requested effort
(rendered as the effort system message, as at inference) controls how long the model thinks.

* low: the source's one-line reasoning, unchanged.
* high: a few lines: the goal restated (first turn), the source's line, the next step named.
* max: more lines, all still true of the trajectory: the goal restated (first turn), the progress so far
  (later turns), the source's line, the next step with its arguments, and the checks made before it
  (the tool is declared, the arguments fit its schema; on the final turn: nothing is left to do).

The expansions are built only from the conversation itself (the user's request, the calls made, their
names and arguments), so they are correct whenever the trajectory is: oracle trajectories are only
kept when the hidden verifier scored them 1.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

EFFORT_LEVELS = ("low", "high", "max")


def effort_for(index: int, efforts: Sequence[str] = EFFORT_LEVELS) -> str:
    """The effort of the index-th generated conversation: `efforts` in turn."""
    return efforts[index % len(efforts)]


def _call_name_args(call: dict) -> tuple[str, dict]:
    fn = call.get("function", call)
    args = fn.get("arguments") or {}
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            args = {}
    return str(fn.get("name", "")), args if isinstance(args, dict) else {}


def _next_step(calls: list[dict], with_values: bool) -> str:
    """'Next: call search_emails with query, sender.' (or with their values)."""
    parts = []
    for c in calls:
        name, args = _call_name_args(c)
        if not args:
            parts.append(f"{name} with no arguments")
        elif with_values:
            parts.append(f"{name} with " + ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in args.items()))
        else:
            parts.append(f"{name} with " + ", ".join(args))
    return "Next: call " + "; then ".join(parts) + "."


def _goal(messages: Sequence[dict]) -> str:
    user = next((m.get("content") for m in messages if m.get("role") == "user"), "")
    return f"The task: {' '.join(str(user or '').split())}"


def _turn_lines(prior: Sequence[dict], turn: dict, effort: str, first: bool) -> list[str]:
    """The reasoning lines of one assistant `turn` after the messages `prior`."""
    line = turn.get("reasoning_content") or ""
    calls = turn.get("tool_calls") or []
    done = [c for m in prior if m.get("role") == "assistant" for c in (m.get("tool_calls") or [])]
    lines = [_goal(prior)] if first else []
    if effort == "max" and not first:
        last = _call_name_args(done[-1])[0] if done else ""
        lines.append(f"Progress: {len(done)} tool call{'s' if len(done) != 1 else ''} so far"
                     + (f"; the last result came from {last}." if last else "."))
    if line:
        lines.append(line)
    if calls:
        lines.append(_next_step(calls, with_values=effort == "max"))
        if effort == "max":
            names = ", ".join(dict.fromkeys(_call_name_args(c)[0] for c in calls))
            lines.append(f"Check: {names} {'is a' if len(calls) == 1 else 'are'} declared tool"
                         f"{'' if len(calls) == 1 else 's'} and the arguments fit the schema; "
                         "only what the task asks for changes.")
    else:
        lines.append("Next: answer the user without a tool call.")
        if effort == "max":
            lines.append(f"Check: {len(done)} tool call{'s' if len(done) != 1 else ''} made; "
                         "nothing the task asks for is left.")
    return lines


def expand_trajectory(messages: Sequence[dict], effort: str) -> list[dict]:
    """A copy of `messages` whose assistant turns reason at `effort` (low: unchanged)."""
    if effort not in EFFORT_LEVELS:
        raise ValueError(f"effort must be one of {EFFORT_LEVELS}, got {effort!r}")
    if effort == "low":
        return [dict(m) for m in messages]
    out: list[dict] = []
    first = True
    for m in messages:
        if m.get("role") == "assistant":
            m = dict(m, reasoning_content="\n".join(_turn_lines(out, m, effort, first)))
            first = False
        out.append(dict(m))
    return out


def expand_instruction(prompt: str, reasoning: str, check: str, effort: str) -> str:
    """The reasoning of an instruction item at `effort` (`check`: how the constraint is verified)."""
    if effort not in EFFORT_LEVELS:
        raise ValueError(f"effort must be one of {EFFORT_LEVELS}, got {effort!r}")
    if effort == "low":
        return reasoning
    lines = [f"The request: {prompt}", reasoning]
    if effort == "max":
        lines += [f"Check: {check}", "Then write only the answer."]
    return "\n".join(lines)


def think_tokens(message: dict, tokenizer: Any) -> int:
    """Tokens of an assistant message's reasoning (0 if none)."""
    text = message.get("reasoning_content") or ""
    return len(tokenizer.encode(text)) if text else 0
