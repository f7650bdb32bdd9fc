"""Conversations -> token ids + targets, packed into rows with document boundaries, served as the
trainer's batch source (`SFTLoader`: the same protocol and `Batch` as `k3.data.loader.PackedLoader`).

Targets: a conversation rendered by `k3.chat.render` gives ids [n] and loss_mask [n] (1 exactly on the
assistant's tokens). The target of position i is ids[i + 1] when loss_mask[i + 1] == 1, else -100; the
last position has none. So the model learns to produce every assistant token (think, response, tool
calls, the closing tags and <|end_of_msg|>) from the prefix before it, and nothing else. With a mask of
all ones this is exactly the pre-training target of one document.

Rows: whole conversations are placed into rows of T tokens (best fit, longest first); the rest of a row is
padding (its own cu_seqlens segment, targets -100). A conversation longer than T is cut to its first T
tokens (the rest is not trained on; `PackedData.truncated` counts them); one with no assistant token
left in those T tokens is dropped (`PackedData.dropped`). Every conversation starts a
cu_seqlens segment, so KDA state, the short conv and MLA attention never cross conversations.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from k3.chat.render import render
from k3.data.loader import Batch
from k3.data.packing import IGNORE_INDEX
from k3.sft.weights import encode_with_decisions, normalise

_STATE_VERSION = 1


def encode_conversation(conv: dict, tokenizer: Any, thinking_effort: str = "low") -> tuple[np.ndarray, np.ndarray]:
    """conv (see k3.sft.data) -> (ids [n] int64, targets [n] int64 with -100 off the assistant tokens)."""
    ids, mask = render(conv["messages"], tokenizer, conv.get("tools") or None,
                       thinking_effort=conv.get("thinking_effort") or thinking_effort)
    return targets_from_mask(ids, mask)


def encode_weighted(conv: dict, tokenizer: Any, thinking_effort: str, decision_weight: float,
                    think_tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`encode_conversation` plus target weights [n] float32: `decision_weight` where the target is a
    decision token of k3.sft.weights (tool name, argument value, the reasoning's first `think_tokens`),
    else 1."""
    ids, mask, decision = encode_with_decisions(conv["messages"], tokenizer, conv.get("tools") or None,
                                                conv.get("thinking_effort") or thinking_effort, think_tokens)
    x, y = targets_from_mask(ids, mask)
    w = np.ones(len(x), dtype=np.float32)
    w[:-1] = np.where(np.asarray(decision[1:], dtype=bool), np.float32(decision_weight), np.float32(1))
    return x, y, w


def targets_from_mask(ids: Sequence[int], mask: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """ids, loss_mask [n] -> (ids [n] int64, targets [n] int64): targets[i] = ids[i+1] where mask[i+1]."""
    x = np.asarray(ids, dtype=np.int64)
    m = np.asarray(mask, dtype=bool)
    if x.shape != m.shape:
        raise ValueError(f"ids and mask differ in length: {x.shape} vs {m.shape}")
    y = np.full_like(x, IGNORE_INDEX)
    y[:-1] = np.where(m[1:], x[1:], IGNORE_INDEX)
    return x, y


@dataclass
class PackedData:
    """Rows of packed conversations. x, y: [R, T] int64; starts[r]: ascending segment starts in row r
    (0 first; padding, if any, is the last segment). truncated: conversations cut at T; dropped: those
    with no assistant target within their first T tokens (not packed). w: None, or [R, T] float32 target
    weights (1 on padding) when the documents carried them."""

    x: np.ndarray
    y: np.ndarray
    starts: list[np.ndarray]
    num_conversations: int
    truncated: int
    dropped: int = 0
    w: np.ndarray | None = None

    @property
    def num_rows(self) -> int:
        return int(self.x.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.x.shape[1])

    @property
    def num_targets(self) -> int:
        return int((self.y != IGNORE_INDEX).sum())

    @property
    def fingerprint(self) -> str:
        h = hashlib.sha256(self.x.tobytes())
        h.update(self.y.tobytes())
        if self.w is not None:
            h.update(self.w.tobytes())
        return h.hexdigest()[:16]


def pack(docs: Sequence[tuple[np.ndarray, ...]], seq_len: int, pad_id: int) -> PackedData:
    """Best-fit-decreasing packing of (ids, targets) or (ids, targets, weights) documents (all of one
    kind) into rows of `seq_len` (module docstring). Deterministic: ties keep the input order."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    weighted = bool(docs) and len(docs[0]) == 3
    if any(len(d) != len(docs[0]) for d in docs):
        raise ValueError("pack: documents mix (ids, targets) and (ids, targets, weights)")
    truncated = sum(len(d[0]) > seq_len for d in docs)
    cut = [tuple(a[:seq_len] for a in d) for d in docs]
    docs = [d for d in cut if (d[1] != IGNORE_INDEX).any()]  # nothing left to learn: not packed
    order = sorted(range(len(docs)), key=lambda i: -len(docs[i][0]))
    rows: list[list[int]] = []
    free: list[int] = []
    for i in order:
        n = len(docs[i][0])
        best = -1
        for r, f in enumerate(free):  # the fullest row that still fits
            if f >= n and (best < 0 or f < free[best]):
                best = r
        if best < 0:
            rows.append([])
            free.append(seq_len)
            best = len(rows) - 1
        rows[best].append(i)
        free[best] -= n
    X = np.full((len(rows), seq_len), pad_id, dtype=np.int64)
    Y = np.full((len(rows), seq_len), IGNORE_INDEX, dtype=np.int64)
    W = np.ones((len(rows), seq_len), dtype=np.float32) if weighted else None
    starts = []
    for r, members in enumerate(rows):
        at, s = 0, []
        for i in members:
            x, y = docs[i][:2]
            X[r, at:at + len(x)], Y[r, at:at + len(x)] = x, y
            if W is not None:
                W[r, at:at + len(x)] = docs[i][2]
            s.append(at)
            at += len(x)
        if at < seq_len:
            s.append(at)  # the padding's own segment
        starts.append(np.asarray(s, dtype=np.int64))
    return PackedData(X, Y, starts, len(docs), truncated, len(cut) - len(docs), W)


def collate(data: PackedData, rows: Sequence[int]) -> Batch:
    """rows of `data` (in that order) flattened into one packed Batch [1, B*T] with cu_seqlens."""
    T = data.seq_len
    idx = np.asarray(rows, dtype=np.int64)
    if idx.size == 0:
        raise ValueError("collate: no rows")
    cu = np.concatenate([data.starts[int(r)] + b * T for b, r in enumerate(idx)] + [np.array([idx.size * T])])
    x, y = data.x[idx].reshape(1, -1), data.y[idx].reshape(1, -1)
    w = None if data.w is None else torch.from_numpy(normalise(data.w[idx].reshape(1, -1), y))
    return Batch(input_ids=torch.from_numpy(x.copy()), labels=torch.from_numpy(y.copy()),
                 cu_seqlens=torch.from_numpy(cu.astype(np.int32)), num_tokens=idx.size * T,
                 num_targets=int((y != IGNORE_INDEX).sum()), max_seqlen=int(np.diff(cu).max()), seq_len=T,
                 batch_size=int(idx.size), loss_weights=w)


class SFTLoader:
    """Endless, resumable batches of B packed rows: epoch e visits the rows in the permutation
    `numpy.random.default_rng([seed, e]).permutation(R)`, B at a time; the < B rows left at an epoch's end
    are skipped. Position (epoch, cursor) is the whole state."""

    def __init__(self, data: PackedData, batch_size: int, seed: int = 0) -> None:
        self.data, self.seed = data, seed
        self.epoch = self.cursor = 0
        self.set_shape(data.seq_len, batch_size)

    @property
    def seq_len(self) -> int:
        return self.data.seq_len

    def set_shape(self, seq_len: int, batch_size: int) -> None:
        if seq_len != self.data.seq_len:
            raise ValueError(f"SFT rows are packed at seq_len {self.data.seq_len}, not {seq_len}")
        if not isinstance(batch_size, int) or not 1 <= batch_size <= self.data.num_rows:
            raise ValueError(f"batch_size {batch_size}: the SFT data has {self.data.num_rows} rows of {seq_len} tokens; "
                             "lower tokens_per_step or give more conversations")
        self.batch_size = batch_size

    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.data.num_rows)

    def __iter__(self) -> "SFTLoader":
        return self

    def __next__(self) -> Batch:
        if self.cursor + self.batch_size > self.data.num_rows:
            self.epoch, self.cursor = self.epoch + 1, 0
        idx = self._order(self.epoch)[self.cursor:self.cursor + self.batch_size]
        self.cursor += self.batch_size
        return collate(self.data, idx)

    def state_dict(self) -> dict[str, Any]:
        return {"version": _STATE_VERSION, "seed": self.seed, "epoch": self.epoch, "cursor": self.cursor,
                "batch_size": self.batch_size, "fingerprint": self.data.fingerprint}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"unsupported SFT loader state version {state.get('version')!r}")
        for key, mine in (("seed", self.seed), ("fingerprint", self.data.fingerprint)):
            if state.get(key) != mine:
                raise ValueError(f"cannot resume: the SFT data differs from the checkpoint's ({key} "
                                 f"{state.get(key)!r} != {mine!r}; same data, tokenizer and seed needed)")
        self.set_shape(self.seq_len, int(state["batch_size"]))
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])


def val_batches(data: PackedData, batch_size: int) -> list[Batch]:
    """All rows of `data` in order, `batch_size` rows per batch (the last may hold fewer)."""
    return [collate(data, range(i, min(i + batch_size, data.num_rows))) for i in range(0, data.num_rows, batch_size)]
