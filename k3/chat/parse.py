"""Parser for K3 model output: reasoning, content and tool calls, batch or streaming.

Structure is recognised from the four control markers only. Given token ids, a marker is its
special id; text that merely looks like `<|open|>` (ordinary BPE pieces) is content. Given text,
the marker strings are the only structure that can be seen.

Tolerance rules (model output is never rejected):
* output starts inside the think channel (the generation prompt opened it) unless `start` says
  otherwise; a full `<|open|>message ...<|sep|>` header is accepted too;
* an open/close tag that is unknown, malformed or closes a channel that is not open is kept as
  literal text in the current channel; opening a channel closes the open one implicitly;
* text outside any channel goes to content; `<|end_of_msg|>` ends parsing;
* a tool call is emitted once it is complete (its close tag, or a later close of an enclosing
  tag); a tool call or a tag header cut off by the end of the output is dropped.
Every piece of work is proportional to the new input: the streaming parser never re-scans.
"""

from __future__ import annotations

import codecs
import json
import numbers
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from k3.chat.xtml import CLOSE, MARKERS, OPEN, SEP, unescape_attr

_MARKER_RE = re.compile("|".join(re.escape(m) for m in MARKERS))
_MAX_CARRY = max(len(m) for m in MARKERS) - 1
_HEADER_RE = re.compile(r'([A-Za-z_][\w-]*)((?: [\w-]+="[^"]*")*)', re.S)
_ATTR_RE = re.compile(r' ([\w-]+)="([^"]*)"')
_CHANNELS = ("think", "response")
_OPENABLE = ("message", "think", "response", "tools", "call", "argument", "json")

REASONING, CONTENT, TOOL_CALL = "reasoning", "content", "tool_call"


@dataclass
class ChatDelta:
    """One streaming event.

    kind: "reasoning" / "content" (with `text`) or "tool_call" (with `tool_call` =
    {"index", "id", "type": "function", "function": {"name", "arguments"}}, index 0-based).
    """

    kind: str
    text: str = ""
    tool_call: dict | None = None


@dataclass
class _Frame:
    name: str
    attrs: dict = field(default_factory=dict)
    buf: list = field(default_factory=list)  # argument / json text
    args: dict = field(default_factory=dict)  # call: parsed arguments
    raw: str | None = None  # call: json-block text


def default_tool_call_id(index: int, name: str) -> str:
    """Deterministic id for the index-th (0-based) call of a message: `call_<index>`."""
    return f"call_{index}"


def _convert(value: str, kind: str | None) -> Any:
    if kind == "string":
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value  # malformed typed value: keep the raw text


class StreamingParser:
    """Incremental parser: feed text chunks or token ids, get `ChatDelta`s back.

    tokenizer: needed to feed token ids (uses `special_id` and `token_bytes`).
    start: channel the output begins in: "think" (thinking generation prompt, default),
        "response" (non-thinking prompt) or None (output starts with its own tags).
    tool_call_id: (index, name) -> id for emitted calls (the format carries no ids).
    Call `finish()` after the last chunk; `result()` gives the accumulated message.
    """

    def __init__(
        self,
        tokenizer: Any = None,
        *,
        start: str | None = "think",
        tool_call_id: Callable[[int, str], str] = default_tool_call_id,
    ) -> None:
        if start not in ("think", "response", None):
            raise ValueError(f"start must be 'think', 'response' or None, got {start!r}")
        self._tok = tokenizer
        self._make_id = tool_call_id
        self._stack: list[_Frame] = [_Frame("message"), _Frame(start)] if start else []
        self._header: tuple[str, list[str]] | None = None  # (marker, text parts) of a tag being read
        self._carry = ""  # text-mode tail that may be the start of a marker
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._marker_ids: dict[int, str] | None = None
        self._mode: str | None = None
        self._out: list[tuple[str, Any]] = []  # pending deltas: (kind, text parts | tool call)
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._calls: list[dict] = []
        self.done = False

    # ------------------------------------------------------------------ input

    def feed(self, chunk: str | int | Sequence[int]) -> list[ChatDelta]:
        """Feed a text chunk, one token id or a sequence of token ids."""
        if isinstance(chunk, str):
            return self.feed_text(chunk)
        return self.feed_ids([chunk] if isinstance(chunk, numbers.Integral) else chunk)

    def feed_text(self, text: str) -> list[ChatDelta]:
        self._set_mode("text")
        buf, pos = self._carry + text, 0
        for m in _MARKER_RE.finditer(buf):
            self._on_text(buf[pos : m.start()])
            self._on_marker(m.group())
            pos = m.end()
        tail = buf[pos:]
        hold = 0
        for k in range(min(len(tail), _MAX_CARRY), 0, -1):
            if any(mk.startswith(tail[-k:]) for mk in MARKERS):
                hold = k
                break
        self._carry = tail[len(tail) - hold :] if hold else ""
        self._on_text(tail[: len(tail) - hold])
        return self._drain()

    def feed_ids(self, ids: Sequence[int]) -> list[ChatDelta]:
        self._set_mode("ids")
        if self._tok is None:
            raise ValueError("feeding token ids needs a tokenizer")
        if self._marker_ids is None:
            self._marker_ids = {self._tok.special_id(m): m for m in MARKERS}
        for t in ids:
            marker = self._marker_ids.get(int(t))
            if marker is None:
                self._on_text(self._decoder.decode(self._tok.token_bytes(int(t))))
            else:
                self._on_text(self._decoder.decode(b"", final=True))
                self._on_marker(marker)
        return self._drain()

    def finish(self, *, close_calls: bool = False) -> list[ChatDelta]:
        """End of output: flush held-back text; drop an unfinished tag header. An unfinished tool call is
        dropped, or emitted with the arguments read so far when `close_calls` (a forced call that the
        model ended early, e.g. with an end-of-message marker, must still come out)."""
        if self._mode == "text":
            carry, self._carry = self._carry, ""
            self._on_text(carry)
        elif self._mode == "ids":
            self._on_text(self._decoder.decode(b"", final=True))
        self._header = None
        if close_calls and "call" in self._names():
            self._close("call")
        self._stack = [f for f in self._stack if f.name in ("message",) + _CHANNELS]
        self.done = True
        return self._drain()

    def result(self) -> dict:
        """{"reasoning_content": str, "content": str, "tool_calls": [{id, type, function}]}
        accumulated so far."""
        self._reasoning[:] = ["".join(self._reasoning)]  # keep repeated calls cheap
        self._content[:] = ["".join(self._content)]
        calls = [{"id": c["id"], "type": c["type"], "function": dict(c["function"])} for c in self._calls]
        return {"reasoning_content": self._reasoning[0], "content": self._content[0], "tool_calls": calls}

    # ------------------------------------------------------------------ events

    def _set_mode(self, mode: str) -> None:
        if self._mode is None:
            self._mode = mode
        elif self._mode != mode:
            raise ValueError("cannot mix text chunks and token ids in one parser")

    def _drain(self) -> list[ChatDelta]:
        out = [ChatDelta(kind, text="".join(item)) if kind != TOOL_CALL else ChatDelta(kind, tool_call=item)
               for kind, item in self._out]
        self._out = []
        return out

    def _emit_text(self, kind: str, text: str) -> None:
        (self._reasoning if kind == REASONING else self._content).append(text)
        if self._out and self._out[-1][0] == kind:
            self._out[-1][1].append(text)  # joined once in _drain: no quadratic string growth
        else:
            self._out.append((kind, [text]))

    def _on_text(self, text: str) -> None:
        if not text or self.done:
            return
        if self._header is not None:
            self._header[1].append(text)
            return
        top = self._stack[-1].name if self._stack else None
        if top in ("argument", "json"):
            self._stack[-1].buf.append(text)
        else:
            self._emit_text(REASONING if top == "think" else CONTENT, text)

    def _on_marker(self, marker: str) -> None:
        if self.done:
            return
        if self._header is not None:
            opener, parts = self._header
            self._header = None
            if marker == SEP:
                self._on_tag(opener, "".join(parts))
                return
            self._on_text(opener + "".join(parts))  # header interrupted: it was text
        if marker in (OPEN, CLOSE):
            self._header = (marker, [])
        elif marker == SEP:
            self._on_text(SEP)
        else:
            self.done = True

    # ------------------------------------------------------------------ tags

    def _on_tag(self, opener: str, header: str) -> None:
        m = _HEADER_RE.fullmatch(header)
        if m is None:
            ok = False
        elif opener == OPEN:
            ok = self._open(m)
        else:
            ok = not m.group(2) and self._close(m.group(1))
        if not ok:
            self._on_text(opener + header + SEP)

    def _names(self) -> list[str]:
        return [f.name for f in self._stack]

    def _pop_to(self, name: str | None) -> None:
        """Pop (finalising) until `name` is on top; None pops everything."""
        while self._stack and self._stack[-1].name != name:
            self._finalize(self._stack.pop())

    def _open(self, m: re.Match) -> bool:
        name = m.group(1)
        attrs = {k: unescape_attr(v) for k, v in _ATTR_RE.findall(m.group(2))}
        names = self._names()
        if name not in _OPENABLE or (name == "call" and "tool" not in attrs):
            return False
        if name in ("argument", "json") and ("call" not in names or (name == "argument" and "key" not in attrs)):
            return False
        if name == "message":
            self._pop_to(None)
        elif name in ("argument", "json"):
            self._pop_to("call")
        elif name == "call" and "tools" in names:
            self._pop_to("tools")
        else:  # think / response / tools / call outside a tools block
            self._pop_to("message" if "message" in names else None)
            if not self._stack:
                self._stack.append(_Frame("message"))
            if name == "call":
                self._stack.append(_Frame("tools"))
        self._stack.append(_Frame(name, attrs))
        return True

    def _close(self, name: str) -> bool:
        if name not in self._names():
            return False
        while True:
            frame = self._stack.pop()
            self._finalize(frame)
            if frame.name == name:
                return True

    def _finalize(self, frame: _Frame) -> None:
        if frame.name in ("argument", "json"):
            call = self._stack[-1]  # argument/json frames only ever sit on a call
            text = "".join(frame.buf)
            if frame.name == "json":
                call.raw = (call.raw or "") + text
            else:
                call.args[frame.attrs["key"]] = _convert(text, frame.attrs.get("type"))
        elif frame.name == "call":
            self._emit_call(frame)

    def _emit_call(self, frame: _Frame) -> None:
        index = len(self._calls)
        name = frame.attrs["tool"]
        if frame.raw is not None and not frame.args:
            arguments = frame.raw
        else:
            arguments = json.dumps(frame.args, ensure_ascii=False)
        call = {"id": self._make_id(index, name), "type": "function", "function": {"name": name, "arguments": arguments}}
        self._calls.append(call)
        self._out.append((TOOL_CALL, {"index": index, **call}))


def parse(
    output: str | Sequence[int],
    tokenizer: Any = None,
    *,
    start: str | None = "think",
    tool_call_id: Callable[[int, str], str] = default_tool_call_id,
) -> dict:
    """Parse a complete model output (text, or token ids with `tokenizer`).

    Returns {"reasoning_content": str, "content": str, "tool_calls": [{"id", "type": "function",
    "function": {"name", "arguments": JSON string}}]}. Never raises on model output.
    """
    parser = StreamingParser(tokenizer, start=start, tool_call_id=tool_call_id)
    parser.feed(output)
    parser.finish()
    return parser.result()
