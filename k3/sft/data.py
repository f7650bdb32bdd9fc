"""Conversations for SFT: reading JSONL / folders / Parquet, and checking each one before it is trained on.

A conversation is a dict {"messages": [OpenAI messages], "tools": [...] | None, "thinking_effort": str |
None, "source": "FILE:LINE"}. A JSONL line holds either such an object or a bare list of messages; a
Parquet row has a `messages` column (a list, or the JSON text of one) and optional `tools` /
`thinking_effort` columns. A folder contributes its *.jsonl and *.parquet files in sorted order.

`check_conversation` rejects what must never be trained on silently: unknown roles, tool results with no
matching call, tool-call arguments that are not a JSON object, no assistant turn, anything the XTML
renderer refuses. Problems come back as `BadConversation(source, reason)`; the caller skips or stops.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from k3.chat.errors import ChatFormatError
from k3.chat.render import ROLES, THINKING_EFFORTS, render_segments
from k3.config import ConfigError

CONVERSATION_EXTENSIONS = (".jsonl", ".parquet")


@dataclass(frozen=True)
class BadConversation:
    """A rejected conversation: where it came from (FILE:LINE or FILE:row N) and why."""

    source: str
    reason: str

    def __str__(self) -> str:
        return f"{self.source}: {self.reason}"


def conversation(messages: list[dict], tools: list[dict] | None = None, thinking_effort: str | None = None,
                 source: str = "<generated>", **meta: Any) -> dict:
    """The conversation record every SFT stage passes around (extra keys go to `meta`)."""
    return {"messages": messages, "tools": tools, "thinking_effort": thinking_effort, "source": source, "meta": meta}


# ----------------------------------------------------------------------------- reading


def iter_records(path: str | Path) -> Iterator[tuple[str, Any]]:
    """(source "FILE:LINE", decoded JSON or BadConversation) for every record under `path`."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in CONVERSATION_EXTENSIONS and p.is_file())
        if not files:
            raise FileNotFoundError(f"{path}: no *.jsonl or *.parquet conversation files")
        for f in files:
            yield from iter_records(f)
        return
    if not path.exists():
        raise FileNotFoundError(f"SFT data not found: {path}")
    if path.suffix == ".parquet":
        yield from _iter_parquet(path)
        return
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            src = f"{path}:{lineno}"
            try:
                yield src, json.loads(line)
            except json.JSONDecodeError as e:
                yield src, BadConversation(src, f"not valid JSON ({e.msg} at column {e.colno})")


def _iter_parquet(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"reading Parquet ({path}) needs pyarrow: pip install pyarrow") from None
    table = pq.read_table(path)
    if "messages" not in table.column_names:
        raise ConfigError(f"{path}: Parquet file has no 'messages' column (columns: {table.column_names})")
    for i, row in enumerate(table.to_pylist()):
        src = f"{path}:row {i}"
        rec = dict(row)
        for key in ("messages", "tools"):
            if isinstance(rec.get(key), str):
                try:
                    rec[key] = json.loads(rec[key])
                except json.JSONDecodeError as e:
                    rec = BadConversation(src, f"{key} is not valid JSON ({e.msg})")
                    break
        yield src, rec


def to_conversation(src: str, rec: Any) -> dict | BadConversation:
    """A decoded record -> a conversation record, or why it is not one."""
    if isinstance(rec, BadConversation):
        return rec
    if isinstance(rec, list):
        rec = {"messages": rec}
    if not isinstance(rec, dict) or not isinstance(rec.get("messages"), list):
        return BadConversation(src, "expected an object with a `messages` list (or a list of messages)")
    tools = rec.get("tools")
    if tools is not None and not isinstance(tools, list):
        return BadConversation(src, f"`tools` must be a list, got {type(tools).__name__}")
    effort = rec.get("thinking_effort")
    if effort is not None and effort not in THINKING_EFFORTS:
        return BadConversation(src, f"thinking_effort {effort!r} is not one of {THINKING_EFFORTS}")
    return conversation(rec["messages"], tools, effort, src)


# ----------------------------------------------------------------------------- checking


def check_conversation(conv: dict) -> str | None:
    """Why `conv` must not be trained on, or None when it is fine (see the module docstring)."""
    msgs = conv["messages"]
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            return f"messages[{i}] is not an object"
        if m.get("role") not in ROLES:
            return f"messages[{i}]: unknown role {m.get('role')!r}"
        for k, call in enumerate(m.get("tool_calls") or [] if m["role"] == "assistant" else []):
            problem = _call_problem(call)
            if problem:
                return f"messages[{i}].tool_calls[{k}]: {problem}"
    if not any(m["role"] == "assistant" for m in msgs):
        return "no assistant message (nothing to train on)"
    try:
        render_segments(msgs, conv.get("tools"), thinking_effort=conv.get("thinking_effort") or "max")
    except ChatFormatError as e:
        return str(e)
    return None


def _call_problem(call: Any) -> str | None:
    fn = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        return "no function name"
    args = fn.get("arguments")
    if isinstance(args, str) and args.strip():
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            return f"arguments are not valid JSON ({e.msg} at position {e.pos})"
    elif isinstance(args, str):
        args = None
    if args is not None and not isinstance(args, dict):
        return f"arguments must be a JSON object, got {type(args).__name__}"
    return None


def load_conversations(path: str | Path, on_bad: str = "skip") -> tuple[list[dict], list[BadConversation]]:
    """Read and check every conversation under `path` -> (good ones, rejected ones).

    on_bad="error" raises ConfigError naming every bad FILE:LINE; "skip" returns them for the caller
    to report. Nothing bad is ever in the first list.
    """
    good, bad = [], []
    for src, rec in iter_records(path):
        conv = to_conversation(src, rec)
        if isinstance(conv, dict):
            reason = check_conversation(conv)
            conv = conv if reason is None else BadConversation(src, reason)
        (good if isinstance(conv, dict) else bad).append(conv)
    if bad and on_bad == "error":
        shown = "\n  ".join(str(b) for b in bad[:20])
        more = f"\n  ... and {len(bad) - 20} more" if len(bad) > 20 else ""
        raise ConfigError(f"{len(bad)} malformed conversation(s) in {path} (--on-bad skip drops them):\n  {shown}{more}")
    if not good:
        raise ConfigError(f"{path}: no usable conversations" + (f" ({len(bad)} malformed, first: {bad[0]})" if bad else ""))
    return good, bad
