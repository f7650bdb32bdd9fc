"""Deterministic, resumable batches of packed rows, flattened into one varlen row.

A batch takes B rows of T tokens (see `k3.data.packing.PackedRows`) and concatenates them into
ONE packed sequence [1, B*T] with `cu_seqlens` marking a boundary at every row start and at every
document start inside a row, so KDA resets its state and MLA masks per document.

Order: epoch e visits the rows of the current T in the permutation
`numpy.random.default_rng([seed, e, T]).permutation(num_rows)` (identity when shuffle=False),
B rows per batch; the < B rows left at the end of an epoch are skipped and epoch e+1 begins.
The position is (epoch, cursor) where cursor = rows of this epoch's order already consumed.

Stage switch rule (`set_shape`): the token offset into the epoch, cursor * T_old, is kept;
the new cursor is ceil(cursor * T_old / T_new) in the order of the new T (same epoch, new
permutation). The cursor is a multiple of B, so with tokens per step held constant
(B_new * T_new == B_old * T_old) the offset is a whole number of new rows: no rounding happens. The switch is a pure
function of the state, so a checkpoint taken before or after it resumes exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch

from k3.data.packing import IGNORE_INDEX, PackedRows, TokenStream

_STATE_VERSION = 1


@dataclass
class Batch:
    """One packed training batch.

    input_ids: [1, B*T] int64. labels: [1, B*T] int64, IGNORE_INDEX (-100) where the target
        crosses a document boundary (labels are already shifted: labels[i] is the target of
        input_ids[i]; do not shift again).
    cu_seqlens: [N+1] int32, 0 = cu_seqlens[0] < ... < cu_seqlens[N] = B*T.
    num_tokens: B*T input tokens; num_targets: labels != -100 (divide the summed loss by it).
    max_seqlen: the longest segment (max diff of cu_seqlens).
    loss_weights: None (every target counts the same), or [1, B*T] float32 per-target weights with mean 1
        over the batch's targets, for sources whose loss is a weighted mean (k3 sft's decision weights).
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    cu_seqlens: torch.Tensor
    num_tokens: int
    num_targets: int
    max_seqlen: int
    seq_len: int
    batch_size: int
    loss_weights: torch.Tensor | None = None

    def split_rows(self, rows: int) -> list["Batch"]:
        """Consecutive groups of `rows` rows (the last may be shorter), each a Batch of its own with
        cu_seqlens re-based to 0: the micro-batches of gradient accumulation. rows >= batch_size
        returns [self]."""
        if not isinstance(rows, int) or rows < 1:
            raise ValueError(f"rows must be a positive int, got {rows!r}")
        if rows >= self.batch_size:
            return [self]
        T, cu, out = self.seq_len, self.cu_seqlens, []
        for r0 in range(0, self.batch_size, rows):
            n = min(rows, self.batch_size - r0)
            a, b = r0 * T, (r0 + n) * T
            sub_cu = cu[(cu >= a) & (cu <= b)] - a  # rows start documents, so a and b are entries
            labels = self.labels[:, a:b]
            w = None if self.loss_weights is None else self.loss_weights[:, a:b]
            out.append(Batch(self.input_ids[:, a:b], labels, sub_cu.to(cu.dtype), n * T,
                             int((labels != IGNORE_INDEX).sum()), int(sub_cu.diff().max()), T, n, w))
        return out

    def to(self, device: torch.device | str) -> "Batch":
        """Copy of the batch with its tensors on `device` (non-blocking from pinned memory)."""
        return Batch(self.input_ids.to(device, non_blocking=True), self.labels.to(device, non_blocking=True),
                     self.cu_seqlens.to(device, non_blocking=True), self.num_tokens, self.num_targets,
                     self.max_seqlen, self.seq_len, self.batch_size,
                     None if self.loss_weights is None else self.loss_weights.to(device, non_blocking=True))


def collate_rows(rows: PackedRows, indices: np.ndarray | list[int]) -> Batch:
    """Flatten rows[indices] (in that order) into one packed Batch."""
    T = rows.seq_len
    xs, ys, bounds = [], [], []
    for b, r in enumerate(indices):
        row = rows[int(r)]
        xs.append(row.x)
        ys.append(row.y)
        starts = row.doc_starts if len(row.doc_starts) and row.doc_starts[0] == 0 else np.concatenate([[0], row.doc_starts])
        bounds.append(starts + b * T)
    n = len(xs)
    if n == 0:
        raise ValueError("indices: empty batch")
    cu = np.concatenate(bounds + [np.array([n * T])]).astype(np.int32)
    labels = np.concatenate(ys)
    return Batch(
        input_ids=torch.from_numpy(np.concatenate(xs)).view(1, -1),
        labels=torch.from_numpy(labels).view(1, -1),
        cu_seqlens=torch.from_numpy(cu),
        num_tokens=n * T,
        num_targets=int((labels != IGNORE_INDEX).sum()),
        max_seqlen=int(np.diff(cu).max()),
        seq_len=T,
        batch_size=n,
    )


def _check_shape(rows: PackedRows, batch_size: int) -> None:
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if rows.num_rows < batch_size:
        raise ValueError(f"batch_size={batch_size} at seq_len={rows.seq_len}: the stream has only {rows.num_rows} "
                         f"rows ({rows.stream.num_tokens} tokens); lower batch_size or seq_len")


class PackedLoader:
    """Endless iterator of Batches over a TokenStream (epochs roll over; see module docstring).

    stream: training TokenStream. seq_len T, batch_size B: the current stage's shape.
    seed: non-negative int for the per-epoch permutations. val_stream: optional, for val_batches.
    """

    def __init__(self, stream: TokenStream, seq_len: int, batch_size: int, seed: int = 0, shuffle: bool = True,
                 val_stream: TokenStream | None = None) -> None:
        if not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        self.stream = stream
        self.val_stream = val_stream
        self.seed = seed
        self.shuffle = bool(shuffle)
        self.epoch = 0
        self.cursor = 0
        self._set(seq_len, batch_size)

    # ---- shape
    def _set(self, seq_len: int, batch_size: int) -> None:
        rows = PackedRows(self.stream, seq_len)
        _check_shape(rows, batch_size)
        self.rows, self.batch_size = rows, batch_size
        self._order_key: tuple[int, int] | None = None
        self._order = np.empty(0, dtype=np.int64)

    @property
    def seq_len(self) -> int:
        return self.rows.seq_len

    @property
    def tokens_into_epoch(self) -> int:
        """Token offset of the next batch within the current epoch's order (cursor * T)."""
        return self.cursor * self.seq_len

    def set_shape(self, seq_len: int, batch_size: int) -> None:
        """Switch to a new stage (T, B); the position keeps its token offset into the epoch
        (cursor -> ceil(cursor * T_old / T_new)). Same shape: no-op."""
        offset = self.tokens_into_epoch
        self._set(seq_len, batch_size)
        self.cursor = -(-offset // seq_len)

    # ---- order
    def _epoch_order(self, epoch: int) -> np.ndarray:
        key = (epoch, self.seq_len)
        if self._order_key != key:
            n = self.rows.num_rows
            if self.shuffle:
                self._order = np.random.default_rng([self.seed, epoch, self.seq_len]).permutation(n)
            else:
                self._order = np.arange(n)
            self._order_key = key
        return self._order

    def _next_position(self) -> tuple[int, int]:
        if self.cursor + self.batch_size > self.rows.num_rows:
            return self.epoch + 1, 0
        return self.epoch, self.cursor

    def peek_rows(self) -> np.ndarray:
        """Row indices (at the current T) of the next batch, without advancing."""
        epoch, cursor = self._next_position()
        return self._epoch_order(epoch)[cursor:cursor + self.batch_size].copy()

    # ---- iteration
    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        self.epoch, self.cursor = self._next_position()
        idx = self._epoch_order(self.epoch)[self.cursor:self.cursor + self.batch_size]
        self.cursor += self.batch_size
        return collate_rows(self.rows, idx)

    # ---- checkpointing
    def state_dict(self) -> dict[str, Any]:
        """Plain ints/str/bool (JSON-safe); load_state_dict resumes at the very next batch."""
        return {"version": _STATE_VERSION, "seed": self.seed, "shuffle": self.shuffle, "epoch": self.epoch,
                "cursor": self.cursor, "seq_len": self.seq_len, "batch_size": self.batch_size,
                "num_tokens": self.stream.num_tokens, "fingerprint": self.stream.fingerprint}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore position and shape; the stream, seed and shuffle must match the saved ones."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"state_dict: unsupported loader state version {state.get('version')!r}")
        missing = {"seed", "shuffle", "epoch", "cursor", "seq_len", "batch_size", "num_tokens", "fingerprint"} - set(state)
        if missing:
            raise ValueError(f"state_dict: missing keys {sorted(missing)}")
        for key, mine in (("seed", self.seed), ("shuffle", self.shuffle), ("num_tokens", self.stream.num_tokens),
                          ("fingerprint", self.stream.fingerprint)):
            if state[key] != mine:
                raise ValueError(f"state_dict: {key} {state[key]!r} does not match this loader's {mine!r} "
                                 f"(resume needs the same data, tokenizer, seed and shuffle)")
        self._set(int(state["seq_len"]), int(state["batch_size"]))
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])

    # ---- validation
    def val_batches(self, max_tokens: int | None = None, seq_len: int | None = None,
                    batch_size: int | None = None) -> Iterator[Batch]:
        """`iter_val_batches` over the loader's val_stream at the current shape by default."""
        if self.val_stream is None:
            raise ValueError("val_batches: this loader was built without a val_stream")
        return iter_val_batches(self.val_stream, seq_len or self.seq_len, batch_size or self.batch_size, max_tokens)


def iter_val_batches(stream: TokenStream, seq_len: int, batch_size: int, max_tokens: int | None = None) -> Iterator[Batch]:
    """Deterministic validation batches: k = min(num_rows, max(1, max_tokens // T)) rows spread
    evenly over the stream (all rows when max_tokens is None), in stream order, batch_size rows
    per batch (the last batch may hold fewer). Same arguments -> same batches, every time."""
    rows = PackedRows(stream, seq_len)
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1 or None, got {max_tokens}")
    n = rows.num_rows
    k = n if max_tokens is None else min(n, max(1, max_tokens // seq_len))
    # spacing (n-1)/(k-1) >= 1, so rounding keeps the indices distinct
    idx = np.round(np.linspace(0, n - 1, k)).astype(np.int64) if k > 1 else np.array([0])
    for i in range(0, k, batch_size):
        yield collate_rows(rows, idx[i:i + batch_size])
