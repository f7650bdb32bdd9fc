"""Content blocks from chat deltas, for the APIs that stream typed blocks (OpenAI Responses, Anthropic
Messages): reasoning, text and tool-call blocks in output order, each with start / delta / stop events.

The chat assembler (`k3.serve.chat_output.ChatAssembler`) yields deltas `{"reasoning_content"}`,
`{"content"}` and `{"tool_calls": [...]}` (a call's first fragment carries its id and name, the next
its arguments); `BlockTracker.feed` turns each into events, opening a new block whenever the kind
changes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Block:
    """kind: "reasoning" | "text" | "tool_call"; text: the reasoning / text / arguments JSON so far."""

    kind: str
    text: str = ""
    call_id: str = ""
    name: str = ""


@dataclass
class BlockEvent:
    """what: "start" | "delta" | "stop"; index: the block's position in the output; text: a delta's text."""

    what: str
    index: int
    block: Block
    text: str = ""


class BlockTracker:
    def __init__(self) -> None:
        self.blocks: list[Block] = []
        self._open: Block | None = None

    def _start(self, block: Block, events: list[BlockEvent]) -> None:
        events += self._stop()
        self.blocks.append(block)
        self._open = block
        events.append(BlockEvent("start", len(self.blocks) - 1, block))

    def _stop(self) -> list[BlockEvent]:
        if self._open is None:
            return []
        b, self._open = self._open, None
        return [BlockEvent("stop", len(self.blocks) - 1, b)]

    def _text(self, kind: str, text: str, events: list[BlockEvent]) -> None:
        if not text:
            return
        if self._open is None or self._open.kind != kind:
            self._start(Block(kind), events)
        self._open.text += text
        events.append(BlockEvent("delta", len(self.blocks) - 1, self._open, text))

    def feed(self, delta: dict) -> list[BlockEvent]:
        """One chat delta -> block events."""
        events: list[BlockEvent] = []
        if delta.get("reasoning_content"):
            self._text("reasoning", delta["reasoning_content"], events)
        if delta.get("content"):
            self._text("text", delta["content"], events)
        for tc in delta.get("tool_calls") or []:
            fn = tc.get("function") or {}
            if tc.get("id"):
                self._start(Block("tool_call", call_id=tc["id"], name=fn.get("name", "")), events)
            args = fn.get("arguments") or ""
            if args and self._open is not None and self._open.kind == "tool_call":
                self._open.text += args
                events.append(BlockEvent("delta", len(self.blocks) - 1, self._open, args))
        return events

    def finish(self) -> list[BlockEvent]:
        """Close the open block (end of output)."""
        return self._stop()
