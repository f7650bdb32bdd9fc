"""XTML primitives: the four structural markers, attribute escaping and the segment builder.

A rendered conversation is a list of `Segment`s. Control segments (the markers themselves, or
image prompts) are encoded with special tokens allowed; every other segment -- message text, tag
names, attribute keys and values -- is encoded as ordinary text, so a literal `<|open|>` typed by
a user never becomes a control token. Segments are encoded one at a time: BPE merges never cross
a segment boundary, which is what the official encoder does too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable

OPEN = "<|open|>"
CLOSE = "<|close|>"
SEP = "<|sep|>"
END_OF_MSG = "<|end_of_msg|>"
MARKERS = (OPEN, CLOSE, SEP, END_OF_MSG)
IMAGE_PLACEHOLDER = "<|kimi_image_placeholder|>"

_UNESCAPE_RE = re.compile(r"&(amp|quot);")


@dataclass(frozen=True)
class Segment:
    """One piece of rendered text.

    `special`: encode with special tokens allowed (control segment).
    `assistant`: the tokens are produced by the assistant (loss mask = 1).
    """

    text: str
    special: bool = False
    assistant: bool = False


def escape_attr(value: Any) -> str:
    """Attribute-value escaping of the official renderer: only `&` and `"` are escaped."""
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def unescape_attr(text: str) -> str:
    """Inverse of `escape_attr` (single pass, so `&amp;quot;` -> `&quot;`)."""
    return _UNESCAPE_RE.sub(lambda m: "&" if m.group(1) == "amp" else '"', text)


class SegmentBuilder:
    """Accumulates segments; `assistant` marks everything appended while it is set."""

    def __init__(self) -> None:
        self.segments: list[Segment] = []
        self.assistant = False

    def text(self, text: str) -> None:
        if text:
            self.segments.append(Segment(text, False, self.assistant))

    def control(self, text: str, *, assistant: bool | None = None) -> None:
        if text:
            flag = self.assistant if assistant is None else assistant
            self.segments.append(Segment(text, True, flag))

    def open_tag(self, tag: str, attrs: Iterable[tuple[str, Any]] = ()) -> None:
        self.control(OPEN)
        self.text(tag)
        for key, value in attrs:
            # key, `="`, value and `"` are separate segments in the official encoder
            self.text(f" {key}")
            self.text('="')
            self.text(escape_attr(value))
            self.text('"')
        self.control(SEP)

    def close_tag(self, tag: str) -> None:
        self.control(CLOSE)
        self.text(tag)
        self.control(SEP)

    def end_of_msg(self) -> None:
        self.control(END_OF_MSG)

    def joined(self) -> str:
        return "".join(s.text for s in self.segments)
