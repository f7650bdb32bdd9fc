"""Media in chat messages: the media-token layout and loading image/video content parts.

One image of n media tokens is written, with special tokens as text, as

    <|media_begin|>image<|media_content|><|media_pad|> x n<|media_end|>

(a video: ``video`` instead of ``image``); n = `num_media_tokens(H, W)` = ceil(H/28) * ceil(W/28)
for an image and `num_video_tokens(T, H, W)` for T frames. The renderer (`k3.chat.render`) puts
one such prompt wherever an image part (or `<|kimi_image_placeholder|>`) occurs, in order; the
model replaces the `<|media_pad|>` embeddings, row-major, by the encoder's output.

`load_chat_media` walks OpenAI-style messages in the order the renderer emits them, loads every
image/video part (`k3.media`: data: URIs, local paths; no network), and returns the media
tensors, their prompts and the messages with video parts rewritten as image parts (the renderer
treats every media part alike; the prompt text carries the kind).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from k3.chat.errors import ChatFormatError
from k3.chat.render import message_list, order_tool_results
from k3.chat.xtml import IMAGE_PLACEHOLDER
from k3.media import (
    MAX_IMAGE_BYTES,
    MAX_VIDEO_FRAMES,
    ImageError,
    decode_frames,
    decode_image,
    peek_source,
    stack_frames,
)
from k3.vision_config import VisionConfig, num_media_tokens, num_video_tokens

MEDIA_BEGIN = "<|media_begin|>"
MEDIA_CONTENT = "<|media_content|>"
MEDIA_END = "<|media_end|>"
MEDIA_PAD = "<|media_pad|>"
MEDIA_TOKENS = (MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, MEDIA_PAD)

IMAGE_PART_TYPES = ("image_url", "image")
VIDEO_PART_TYPES = ("video_url", "video")
MEDIA_PART_TYPES = IMAGE_PART_TYPES + VIDEO_PART_TYPES


class ChatMediaError(ImageError):
    """A media part that cannot be used; `param` names it (e.g. ``messages[0].content[1].image_url``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


# ----------------------------------------------------------------------------- prompts


def media_prompt(kind: str, num_tokens: int) -> str:
    """The media-token text of one image or video with `num_tokens` pads."""
    if kind not in ("image", "video"):
        raise ValueError(f"kind must be 'image' or 'video', got {kind!r}")
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
        raise ValueError(f"num_tokens must be a positive int, got {num_tokens!r}")
    return f"{MEDIA_BEGIN}{kind}{MEDIA_CONTENT}{MEDIA_PAD * num_tokens}{MEDIA_END}"


def image_prompt(num_tokens: int) -> str:
    """`<|media_begin|>image<|media_content|>` + n x `<|media_pad|>` + `<|media_end|>`."""
    return media_prompt("image", num_tokens)


def video_prompt(num_tokens: int) -> str:
    """`<|media_begin|>video<|media_content|>` + n x `<|media_pad|>` + `<|media_end|>`."""
    return media_prompt("video", num_tokens)


def num_tokens_for(media: torch.Tensor, cfg: VisionConfig) -> int:
    """Media tokens of an image [3, H, W] or a video [T, 3, H, W]."""
    if not isinstance(media, torch.Tensor) or media.dim() not in (3, 4) or media.shape[-3] != 3:
        shape = list(media.shape) if isinstance(media, torch.Tensor) else type(media).__name__
        raise ValueError(f"media must be an image [3, H, W] or a video [T, 3, H, W] tensor, got {shape}")
    h, w = int(media.shape[-2]), int(media.shape[-1])
    if media.dim() == 3:
        return num_media_tokens(h, w, cfg)
    return num_video_tokens(int(media.shape[0]), h, w, cfg)


def prompt_for(media: torch.Tensor, cfg: VisionConfig) -> str:
    """The prompt text of one image [3, H, W] or video [T, 3, H, W]."""
    return media_prompt("image" if media.dim() == 3 else "video", num_tokens_for(media, cfg))


def prompts_for(media: Sequence[torch.Tensor], cfg: VisionConfig) -> list[str]:
    """`prompt_for` of each item: the `image_prompts` argument of `k3.chat.render`."""
    return [prompt_for(m, cfg) for m in media]


# ----------------------------------------------------------------------------- message walking


@dataclass
class MediaPart:
    """One image/video content part, in render order. `where` names it for error messages."""

    kind: str  # "image" | "video"
    source: Any  # str / bytes / PIL image, or (video) a list of frame sources
    where: str


def _part_source(part: dict, where: str) -> MediaPart:
    kind = part["type"]
    if kind == "image_url" or kind == "video_url":
        v = part.get(kind)
        url = v.get("url") if isinstance(v, dict) else v
        if not isinstance(url, str):
            raise ChatMediaError(f"{where}.{kind}", "must be an object {'url': string} (data: URI or local path)")
        return MediaPart("image" if kind == "image_url" else "video", url, f"{where}.{kind}")
    key = kind  # {"type": "image", "image": ...} / {"type": "video", "video": ...}
    src = part.get(key, part.get("url"))
    if src is None:
        raise ChatMediaError(where, f"a {kind!r} part needs its source in the {key!r} field")
    return MediaPart(kind, src, f"{where}.{key}")


def find_media_parts(messages: Sequence[dict]) -> list[MediaPart]:
    """Every media part of `messages` in the order the renderer consumes image prompts.

    Raises ChatFormatError for malformed messages and for a literal `<|kimi_image_placeholder|>`
    in text (media must come as content parts, so typed text can never inject media tokens).
    """
    msgs = message_list(messages)
    index = {id(m.get("content")): i for i, m in enumerate(msgs)}
    parts: list[MediaPart] = []
    for m in order_tool_results(msgs):  # tool results are rendered in call order
        if m["role"] == "system" and m.get("tools"):
            continue  # a tool-declaring system message renders no content
        content = m.get("content")
        where = f"messages[{index.get(id(content), '?')}]"
        if isinstance(content, str):
            _check_text(content, f"{where}.content")
            continue
        if not isinstance(content, (list, tuple)):
            continue
        for k, part in enumerate(content):
            w = f"{where}.content[{k}]"
            if not isinstance(part, dict):
                raise ChatFormatError(f"{w} must be an object")
            if part.get("type") in MEDIA_PART_TYPES:
                parts.append(_part_source(part, w))
            elif isinstance(part.get("text"), str):
                _check_text(part["text"], w)
    return parts


def _check_text(text: str, where: str) -> None:
    if IMAGE_PLACEHOLDER in text:
        raise ChatFormatError(f"{where}: the text contains {IMAGE_PLACEHOLDER}; send images as image_url content parts")


def _as_image_parts(messages: Sequence[dict]) -> list[dict]:
    """A copy of `messages` with video parts turned into image parts (the renderer's media part)."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, (list, tuple)) and any(
                isinstance(p, dict) and p.get("type") in VIDEO_PART_TYPES for p in content):
            m = dict(m)
            m["content"] = [{"type": "image"} if isinstance(p, dict) and p.get("type") in VIDEO_PART_TYPES else p
                            for p in content]
        out.append(m)
    return out


# ----------------------------------------------------------------------------- loading


class ChatMedia(NamedTuple):
    """media: image [3, H, W] / video [T, 3, H, W] float tensors in prompt order; prompts: their
    media-token texts (`image_prompts` for the renderer); messages: what to render with them."""

    media: list[torch.Tensor]
    prompts: list[str]
    messages: list[dict]

    @property
    def num_tokens(self) -> int:
        return sum(p.count(MEDIA_PAD) for p in self.prompts)


def _head(src: Any, cfg: VisionConfig, max_bytes: int, allow_local: bool) -> tuple[Any, int, int, int]:
    """(lazy image, width, height, frames) from the header only; a PIL image is checked as is."""
    return peek_source(src, max_side=cfg.max_image_size, max_bytes=max_bytes, allow_local=allow_local)


def _load_part(part: MediaPart, cfg: VisionConfig, *, max_bytes: int, max_frames: int, allow_local: bool,
               budget: list[int]) -> torch.Tensor:
    """Load one part; `budget` = [media tokens left], checked from headers before any decoding."""

    def spend(n: int) -> None:
        if n > budget[0]:
            raise ImageError(f"the media needs {n} more tokens but only {budget[0]} are left in the context "
                             "(use fewer or smaller images)")
        budget[0] -= n

    if part.kind == "video" and isinstance(part.source, (list, tuple)):
        if not part.source:
            raise ImageError("video has no frames")
        if len(part.source) > max_frames:
            raise ImageError(f"video has {len(part.source)} frames, above the limit of {max_frames}")
        heads = [_head(s, cfg, max_bytes, allow_local) for s in part.source]
        if len({(w, h) for _, w, h, _ in heads}) > 1:
            raise ImageError("video frames must all have the same size")
        spend(num_video_tokens(len(heads), heads[0][2], heads[0][1], cfg))
        return stack_frames([decode_image(img) for img, _, _, _ in heads])
    img, w, h, n = _head(part.source, cfg, max_bytes, allow_local)
    if part.kind == "image":
        spend(num_media_tokens(h, w, cfg))
        return decode_image(img)
    if n > max_frames:
        raise ImageError(f"video has {n} frames, above the limit of {max_frames}")
    spend(num_video_tokens(n, h, w, cfg))
    return decode_frames(img, max_frames)


def load_chat_media(messages: Sequence[dict], cfg: VisionConfig, *, max_bytes: int = MAX_IMAGE_BYTES,
                    max_frames: int = MAX_VIDEO_FRAMES, max_total_tokens: int | None = None,
                    allow_local: bool = True) -> ChatMedia:
    """Load every image/video part of OpenAI-style `messages`, in render order.

    Parts: ``{"type": "image_url", "image_url": {"url": ...}}``, ``{"type": "image", "image": src}``,
    ``{"type": "video_url", "video_url": {"url": ...}}`` (an animated GIF/WebP/PNG or one image) and
    ``{"type": "video", "video": [frame sources] | src}``. Sources: data: URIs, local paths, bytes,
    PIL images. max_total_tokens: budget of media tokens, checked from image headers before
    decoding (None = unlimited).

    Raises ChatMediaError (param = the part's JSON path) for unusable media and ChatFormatError for
    malformed messages.
    """
    budget = [max_total_tokens if max_total_tokens is not None else 1 << 62]
    media, prompts = [], []
    for part in find_media_parts(messages):
        try:
            t = _load_part(part, cfg, max_bytes=max_bytes, max_frames=max_frames, allow_local=allow_local,
                           budget=budget)
        except ChatMediaError:
            raise
        except ImageError as e:
            raise ChatMediaError(part.where, str(e)) from None
        media.append(t)
        prompts.append(media_prompt(part.kind, num_tokens_for(t, cfg)))
    return ChatMedia(media, prompts, _as_image_parts(messages))
