"""K3's XTML chat format: renderer (messages -> prompt text / token ids + loss mask) and the
model-output parser (batch and streaming)."""

from collections.abc import Sequence
from typing import Any

from k3.chat.errors import ChatFormatError
from k3.chat.parse import ChatDelta, StreamingParser, default_tool_call_id, parse
from k3.chat.render import THINKING_EFFORTS, render, render_segments, render_text
from k3.chat.xtml import CLOSE, END_OF_MSG, IMAGE_PLACEHOLDER, OPEN, SEP, Segment

__all__ = [
    "CLOSE",
    "END_OF_MSG",
    "IMAGE_PLACEHOLDER",
    "OPEN",
    "SEP",
    "THINKING_EFFORTS",
    "ChatDelta",
    "ChatFormatError",
    "Segment",
    "StreamingParser",
    "default_tool_call_id",
    "encode_chat",
    "parse",
    "render",
    "render_segments",
    "render_text",
]


def encode_chat(tokenizer: Any, messages: Sequence[dict], tools: Sequence[dict] | None = None,
                **render_kwargs: Any) -> tuple[list[int], list[int]]:
    """Render and encode a conversation with `tokenizer` -> (ids, loss_mask); see `k3.chat.render`."""
    return render(messages, tokenizer, tools, **render_kwargs)
