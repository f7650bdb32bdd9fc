"""Image-question-answer chat rows for joint text + vision training, batched with their images.

An example (``k3.data.synth_vision.VisionExample``: ``image`` PIL RGB, ``question``, ``answer``,
``kind``, ``choices``) becomes one chat row rendered by ``k3.chat.render`` in non-thinking mode:
a user turn holding the image prompt (``<|media_begin|>image<|media_content|>`` + n pads +
``<|media_end|>``, n = ceil(H/28) * ceil(W/28)) and the question, then the assistant answer. The
loss covers exactly the assistant tokens (the answer and its closing tags).

Training batches pack the rows into one ``[1, total]`` sequence with ``cu_seqlens`` (no padding
waste, and they concatenate with the packed text batch); ``collate_examples`` gives right-padded
``[B, T]`` rows instead (pad id after each row's end; causal mixers never look right, so padding
does not change the real positions). Either way the images come in row order and the model
splices them into the media-pad positions in row-major order.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from k3.chat.media import image_prompt
from k3.chat.render import render
from k3.data.packing import IGNORE_INDEX
from k3.vision_config import VisionConfig, num_media_tokens

__all__ = ["RenderedExample", "VisionBatch", "VisionLoader", "collate_examples", "pack_examples", "render_example"]

_STATE_VERSION = 1


@dataclass
class RenderedExample:
    """ids / loss_mask: the rendered chat (length L); image: uint8 [3, H, W] (4x smaller than the
    float pixels, which a pool of thousands of examples keeps in memory)."""

    ids: list[int]
    loss_mask: list[int]
    image: torch.Tensor

    @property
    def pixels(self) -> torch.Tensor:
        """float32 [3, H, W] normalised as (x / 255 - 0.5) / 0.5, i.e. in [-1, 1]."""
        return (self.image.to(torch.float32) / 255.0 - 0.5) / 0.5


@dataclass
class VisionBatch:
    """input_ids: [B, T] int64 right-padded with the pad id, or packed [1, total] with cu_seqlens
    [B+1]. labels: same shape, already shifted (labels[..., t] is the target of input_ids[..., t]),
    IGNORE_INDEX outside the assistant tokens. media: B images float [3, H, W], row order.
    num_targets: labels != IGNORE_INDEX."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    media: list[torch.Tensor]
    num_targets: int
    cu_seqlens: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    def to(self, device: torch.device | str) -> VisionBatch:
        cu = None if self.cu_seqlens is None else self.cu_seqlens.to(device)
        return VisionBatch(self.input_ids.to(device), self.labels.to(device), [m.to(device) for m in self.media],
                           self.num_targets, cu)


def render_example(example: Any, tokenizer: Any, cfg: VisionConfig, answer: str | None = None) -> RenderedExample:
    """Render one example (optionally with another `answer`, for scoring candidates)."""
    image = torch.from_numpy(np.array(example.image.convert("RGB"), dtype=np.uint8)).permute(2, 0, 1).contiguous()
    n = num_media_tokens(int(image.shape[1]), int(image.shape[2]), cfg)
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": example.question}]},
        {"role": "assistant", "content": example.answer if answer is None else answer},
    ]
    ids, mask = render(messages, tokenizer, thinking=False, image_prompts=[image_prompt(n)])
    if not any(mask):
        raise ValueError(f"example {example.question!r}: the rendered chat has no assistant tokens")
    return RenderedExample(ids, mask, image)


def _labels(r: RenderedExample) -> torch.Tensor:
    """Shifted targets of one row: the next token where it is an assistant token, else IGNORE_INDEX."""
    x = torch.tensor(r.ids, dtype=torch.int64)
    keep = torch.tensor(r.loss_mask[1:] + [0], dtype=torch.bool)
    return torch.where(keep, torch.cat([x[1:], x[:1]]), IGNORE_INDEX)


def pack_examples(rows: Sequence[RenderedExample]) -> VisionBatch:
    """Concatenate rendered rows into one packed [1, total] batch with cu_seqlens [B+1] (int32)."""
    if not rows:
        raise ValueError("rows: empty batch")
    ids = torch.tensor([t for r in rows for t in r.ids], dtype=torch.int64)[None]
    labels = torch.cat([_labels(r) for r in rows])[None]
    cu = torch.tensor([0] + [len(r.ids) for r in rows]).cumsum(0).to(torch.int32)
    return VisionBatch(ids, labels, [r.pixels for r in rows], int((labels != IGNORE_INDEX).sum()), cu)


def collate_examples(rows: Sequence[RenderedExample], pad_id: int) -> VisionBatch:
    """Right-pad rendered rows into one batch; labels are the next token where it is an assistant token."""
    if not rows:
        raise ValueError("rows: empty batch")
    t = max(len(r.ids) for r in rows)
    ids = torch.full((len(rows), t), pad_id, dtype=torch.int64)
    labels = torch.full((len(rows), t), IGNORE_INDEX, dtype=torch.int64)
    for b, r in enumerate(rows):
        ids[b, :len(r.ids)] = torch.tensor(r.ids, dtype=torch.int64)
        labels[b, :len(r.ids)] = _labels(r)
    return VisionBatch(ids, labels, [r.pixels for r in rows], int((labels != IGNORE_INDEX).sum()))


class VisionLoader:
    """Endless, deterministic, resumable packed batches (`pack_examples`) over a fixed pool of
    rendered examples.

    Epoch e visits the pool in ``numpy.random.default_rng([seed, e]).permutation(len(pool))``,
    ``batch_size`` rows per batch; the < batch_size rows left at an epoch's end are skipped.
    """

    def __init__(self, rows: Sequence[RenderedExample], batch_size: int, seed: int = 0) -> None:
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if len(rows) < batch_size:
            raise ValueError(f"batch_size={batch_size}: the pool has only {len(rows)} examples")
        if not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        self.rows, self.batch_size, self.seed = list(rows), batch_size, seed
        self.epoch = self.cursor = 0
        self._order: tuple[int, np.ndarray] | None = None

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, np.random.default_rng([self.seed, epoch]).permutation(len(self.rows)))
        return self._order[1]

    def __iter__(self) -> Iterator[VisionBatch]:
        return self

    def __next__(self) -> VisionBatch:
        if self.cursor + self.batch_size > len(self.rows):
            self.epoch, self.cursor = self.epoch + 1, 0
        idx = self._epoch_order(self.epoch)[self.cursor:self.cursor + self.batch_size]
        self.cursor += self.batch_size
        return pack_examples([self.rows[int(i)] for i in idx])

    def state_dict(self) -> dict[str, Any]:
        return {"version": _STATE_VERSION, "seed": self.seed, "epoch": self.epoch, "cursor": self.cursor,
                "batch_size": self.batch_size, "num_rows": len(self.rows)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"state_dict: unsupported vision loader state version {state.get('version')!r}")
        for key, mine in (("seed", self.seed), ("batch_size", self.batch_size), ("num_rows", len(self.rows))):
            if state.get(key) != mine:
                raise ValueError(f"state_dict: {key} {state.get(key)!r} does not match this loader's {mine!r} "
                                 f"(resume needs the same vision data settings)")
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
