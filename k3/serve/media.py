"""Images and videos in the serving engine: encoding at admission, splicing into prefill chunks,
and media-aware prefix hashing.

A request carries its media (image [3, H, W] / video [T, 3, H, W] float tensors in prompt order).
At admission the engine encodes them once (`model.encode_media`) into `[N, hidden]` rows, one per
`<|media_pad|>` of the prompt in order, and keeps them on the request (a preempted request does not
re-encode). Each prefill chunk embeds its token ids and overwrites the rows of the media pads that
fall inside the chunk (a chunk may end in the middle of an image; the next one continues with the
following rows). Only the prompt's own pad positions are replaced: a pad id the model samples later
is an ordinary token.

Prefix cache: two prompts with the same token ids but different images must not share a KDA state
or MLA pages, and the same image must. `MediaPrefixHasher` mixes a digest of each media item's pixels
(plus its first pad position) into every hash unit that overlaps the item's pads, so the chain is
unchanged up to the first image (a shared text prefix is still shared) and diverges exactly where
the pixels differ.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from k3.chat.media import MEDIA_PAD, num_tokens_for
from k3.vision_config import VisionConfig
from k3.serve.prefix_cache import PrefixHasher


def vision_config_of(model: Any) -> VisionConfig | None:
    """The model's VisionConfig when it can encode media (a `vision_config` and `encode_media`), else None."""
    vc = getattr(model.config, "vision_config", None)
    if vc is None or not callable(getattr(model, "encode_media", None)):
        return None
    if isinstance(vc, VisionConfig):
        return vc
    return VisionConfig.from_dict(vc, text_hidden_size=model.config.text_config.hidden_size)


def check_media_pad(model: Any, tokenizer: Any) -> int:
    """The model's `<|media_pad|>` id; ValueError when the tokenizer puts that token elsewhere."""
    pad = int(model.config.media_placeholder_token_id)
    if tokenizer is not None and tokenizer.special_id(MEDIA_PAD) != pad:
        raise ValueError(f"the tokenizer's {MEDIA_PAD} id is {tokenizer.special_id(MEDIA_PAD)} but the model's "
                         f"media_placeholder_token_id is {pad}: use the tokenizer the model was trained with")
    return pad


def media_digest(t: torch.Tensor) -> bytes:
    """A content digest of one media tensor: shape, dtype and the exact values."""
    a = t.detach().to("cpu").contiguous()
    d = hashlib.blake2b(digest_size=16)
    d.update(repr((tuple(a.shape), str(a.dtype))).encode())
    d.update(a.view(torch.uint8).numpy().tobytes() if a.numel() else b"")
    return d.digest()


@dataclass
class RequestMedia:
    """A request's encoded media.

    embeds: [N, hidden] in the model dtype, row i for the i-th `<|media_pad|>` of the prompt.
    positions: int64 [N], the prompt positions of those pads (increasing).
    spans: (first position, end position, digest) of each media item, for prefix hashing.
    """

    embeds: torch.Tensor
    positions: np.ndarray
    spans: list[tuple[int, int, bytes]]

    def rows_in(self, lo: int, hi: int) -> tuple[np.ndarray, slice]:
        """(positions in [lo, hi), the slice of `embeds` rows for them)."""
        a = int(np.searchsorted(self.positions, lo, side="left"))
        b = int(np.searchsorted(self.positions, hi, side="left"))
        return self.positions[a:b], slice(a, b)


def encode_request_media(model: Any, media: Sequence[torch.Tensor], prompt_ids: Sequence[int], pad_id: int,
                         device: torch.device, dtype: torch.dtype) -> RequestMedia:
    """Encode `media` once and pair its rows with the prompt's pad positions.

    ValueError when the model has no vision encoder, a tensor is malformed, the encoder fails, or the
    number of rows differs from the number of `<|media_pad|>` tokens in the prompt.
    """
    cfg = vision_config_of(model)
    if cfg is None:
        raise ValueError("this model has no vision encoder: requests with images are not supported")
    items = list(media)
    for i, m in enumerate(items):
        if not isinstance(m, torch.Tensor) or not m.is_floating_point() or m.dim() not in (3, 4) or m.shape[-3] != 3:
            shape = list(m.shape) if isinstance(m, torch.Tensor) else type(m).__name__
            raise ValueError(f"media[{i}] must be a float image [3, H, W] or video [T, 3, H, W], got {shape}")
    positions = np.nonzero(np.asarray(prompt_ids, dtype=np.int64) == pad_id)[0].astype(np.int64)
    try:
        embeds = model.encode_media([m.to(device) for m in items])
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 (an encoder failure fails this request, never the engine)
        raise ValueError(f"encoding the media failed: {type(e).__name__}: {e}") from None
    if embeds.dim() != 2 or embeds.shape[0] != len(positions):
        raise ValueError(f"the prompt has {len(positions)} <|media_pad|> tokens but its media encode to "
                         f"{tuple(embeds.shape)} rows (the media prompts do not match the images)")
    spans, row = [], 0
    for m in items:
        n = num_tokens_for(m, cfg)
        if n < 1 or row + n > len(positions) or positions[row + n - 1] - positions[row] != n - 1:
            raise ValueError("each media item's <|media_pad|> tokens must be contiguous and in media order")
        spans.append((int(positions[row]), int(positions[row + n - 1]) + 1, media_digest(m)))
        row += n
    if row != len(positions):
        raise ValueError(f"the prompt has {len(positions)} <|media_pad|> tokens but the media need {row}")
    return RequestMedia(embeds.to(device=device, dtype=dtype), positions, spans)


class MediaPrefixHasher(PrefixHasher):
    """Chained unit hashes over tokens and, for units overlapping a media item, that item's digest."""

    def __init__(self, tokens: list[int], unit: int, spans: Sequence[tuple[int, int, bytes]]) -> None:
        super().__init__(tokens, unit)
        self.spans = sorted(spans)

    def span_bytes(self, lo: int, hi: int) -> bytes:
        extra = b"".join(d + s.to_bytes(8, "little") for s, e, d in self.spans if s < hi and e > lo)
        return super().span_bytes(lo, hi) + extra


def prefill_embeds(model: Any, ids: torch.Tensor, batch: Sequence[tuple[Any, int]]) -> torch.Tensor | None:
    """Input embeddings [1, T, d] for a packed prefill of `batch` [(request, n)] with token `ids` [1, T],
    with the media rows spliced in; None when no chunk contains media pads (use the ids path)."""
    plan = []
    offset = 0
    for r, n in batch:
        rm: RequestMedia | None = getattr(r, "media", None)
        if rm is not None:
            pos, rows = rm.rows_in(r.num_computed, r.num_computed + n)
            if len(pos):
                plan.append((offset + pos - r.num_computed, rm.embeds[rows]))
        offset += n
    if not plan:
        return None
    x = model.model.embed_tokens(ids)
    for where, rows in plan:
        x[0, torch.as_tensor(where, device=x.device)] = rows.to(x.dtype)
    return x
