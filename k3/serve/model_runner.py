"""Decode model runner: the batched decode step on static-shape tensors, replayed as CUDA graphs.

A decode step of N requests is padded to a *bucket* (b, p): b rows (1, 2, 4, ... up to
`max_batch`) and page tables of p pages (1, 2, 4, ... up to `max_pages`). Inside a bucket every
tensor shape is fixed, and the forward reads nothing from the host: the token ids, cached lengths,
KDA slot blocks, page tables and a valid flag per row live in one device buffer that the runner
fills before each step, and `StaticDecodeCache` turns them into gathers and scatters on the block
pool (MLA decode attention reads each row's valid latent pages in place with the paged Triton
kernel of `k3.ops.mla_decode`, or, on the reference path, attends over all p * page_size gathered
latent rows with a length mask; routed experts
use grouped GEMMs with device offsets; KDA runs the Triton recurrent kernel). On CUDA each bucket is
captured once, lazily, as a CUDA graph and replayed afterwards; elsewhere the same static forward
runs eagerly (the CPU tests compare it against the dynamic path).

Padding rows have a zero length and point every page and slot entry at block 0, the pool's all-zero
block: they write zeros there, and the step re-zeroes block 0 after their KDA state write, so
padding never disturbs a live request. Pages are bucketed as well as rows: the gather path costs
what the padded table holds, and the paged kernel fixes its number of sequence splits per bucket.

Graphs share one memory pool; their outputs stay referenced, so one graph's replay never
overwrites another's result, and the runner hands out a view of the logits that is valid until the
next step.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch

from k3.serve.cache_manager import BlockPool, StaticDecodeCache


def bucket_sizes(limit: int) -> list[int]:
    """Powers of two below `limit`, then `limit`: [1, 2, 4, ..., limit]."""
    if limit < 1:
        raise ValueError(f"bucket limit must be >= 1, got {limit}")
    out, b = [], 1
    while b < limit:
        out.append(b)
        b *= 2
    return out + [limit]


def graphs_supported(model: Any, device: torch.device) -> bool:
    """CUDA graphs need CUDA and bf16 weights: the other MoE paths size expert groups on the host."""
    return device.type == "cuda" and model.lm_head.weight.dtype == torch.bfloat16


class DecodeRunner:
    """Runs decode steps ([N, 1] new tokens) of `model` against the block pool, bucketed and static.

    max_batch: the most rows in one step (the engine's max_running); max_len: the longest context
    (cached tokens + 1) a bucketed step serves; longer ones get `None` from `decode` (run them
    eagerly). use_graphs: capture and replay CUDA graphs (CUDA only), else run the static forward
    eagerly. paged_mla: MLA decode attention by the paged Triton kernel (None: on CUDA) instead of
    the gather + dense reference path (CPU tensors need TRITON_INTERPRET=1 for the kernel).
    """

    def __init__(self, model: Any, pool: BlockPool, *, max_batch: int, max_len: int, use_graphs: bool,
                 paged_mla: bool | None = None) -> None:
        for name, v in (("max_batch", max_batch), ("max_len", max_len)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"DecodeRunner {name} must be a positive integer, got {v!r}")
        if use_graphs and pool.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA pool, got device {pool.device}")
        self.model, self.pool, self.use_graphs = model, pool, use_graphs
        self.paged_mla = pool.device.type == "cuda" if paged_mla is None else bool(paged_mla)
        layout = pool.layout
        self.page_size, self.slot_blocks = layout.page_size, layout.slot_blocks
        self.max_pages = layout.pages_for(max_len)
        self.batch_buckets, self.page_buckets = bucket_sizes(max_batch), bucket_sizes(self.max_pages)
        # one int64 buffer, one host->device copy per step; columns:
        # [token id | cached length | valid | slot blocks (slot_blocks) | page table (max_pages)]
        self._cols = 3 + self.slot_blocks
        self._io = torch.zeros(max_batch, self._cols + self.max_pages, dtype=torch.long, device=pool.device)
        self.graphs: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}
        self.num_captures = 0
        self.capture_error: Exception | None = None
        self._mempool = None

    def bucket(self, num_rows: int, num_pages: int) -> tuple[int, int] | None:
        """Smallest (rows, pages) bucket holding the step, or None when none does."""
        b = next((x for x in self.batch_buckets if x >= num_rows), None)
        p = next((x for x in self.page_buckets if x >= num_pages), None)
        return None if b is None or p is None else (b, p)

    @torch.inference_mode()
    def decode(self, token_ids: Sequence[int], past_lens: Sequence[int], slots: Sequence[Sequence[int]],
               page_tables: Sequence[Sequence[int]]) -> torch.Tensor | None:
        """One decode step; returns logits [N, vocab] (a view, valid until the next step), or None when
        the step fits no bucket (too many rows or too long a context; nothing was run then).

        Row i feeds `token_ids[i]` at position `past_lens[i]`; `slots[i]` are its KDA slot blocks and
        `page_tables[i]` its pages (covering position past_lens[i]; extra pages are ignored). The KDA
        state in the slots and the latent at that position are updated in the pool.
        """
        n = len(token_ids)
        if not n == len(past_lens) == len(slots) == len(page_tables):
            raise ValueError("token_ids, past_lens, slots and page_tables must have one entry per row")
        need = max(p // self.page_size + 1 for p in past_lens) if n else 1
        key = self.bucket(n, need)
        if key is None:
            return None
        for i, (p, t, s) in enumerate(zip(past_lens, page_tables, slots)):
            if len(t) <= p // self.page_size:
                raise ValueError(f"row {i}: page table of {len(t)} pages does not cover position {p}")
            if len(s) != self.slot_blocks:
                raise ValueError(f"row {i}: a slot has {self.slot_blocks} blocks, got {len(s)}")
        if self.use_graphs and key not in self.graphs:
            try:
                self.capture(*key)
            except Exception as e:  # serve on without graphs rather than fail every decode step
                warnings.warn(f"CUDA graph capture failed, decoding eagerly from now on: {type(e).__name__}: {e}",
                              RuntimeWarning, stacklevel=2)
                self.use_graphs, self.capture_error = False, e
        self._load(key, token_ids, past_lens, slots, page_tables)
        if not self.use_graphs:
            return self._step(*key)[:n]
        graph, out = self.graphs[key]
        graph.replay()
        return out[:n]

    def _load(self, key: tuple[int, int], token_ids: Sequence[int], past_lens: Sequence[int],
              slots: Sequence[Sequence[int]], page_tables: Sequence[Sequence[int]]) -> None:
        """Fill the first b rows of the buffer (rows past the requests are padding: all zeros)."""
        b, p = key
        width = self._cols + p
        rows = [[t, pl, 1, *s, *pt[:p]] for t, pl, s, pt in zip(token_ids, past_lens, slots, page_tables)]
        host = torch.zeros(b, width, dtype=torch.long)
        for i, r in enumerate(rows):
            host[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        self._io[:b, :width].copy_(host)

    def _step(self, b: int, p: int) -> torch.Tensor:
        """The static forward of bucket (b, p) over the buffer: logits [b, vocab]."""
        io = self._io[:b]
        c = self._cols
        cache = StaticDecodeCache(self.pool, io[:, 1], io[:, c: c + p], io[:, 3: c], io[:, 2] != 0,
                                  paged_mla=self.paged_mla)
        h, _ = self.model.model(io[:, 0:1], cache=cache)
        cache.commit()
        return self.model.lm_head(h[:, -1])

    def buckets_for(self, max_rows: int, min_len: int, max_len: int) -> list[tuple[int, int]]:
        """Every bucket that steps of 1..max_rows rows with contexts of min_len..max_len tokens (the
        token being decoded included) use; contexts beyond `max_len` of the runner are left out."""
        rows = sorted({self.bucket(n, 1)[0] for n in range(1, min(max_rows, self.batch_buckets[-1]) + 1)})
        lo, hi = ((max(n, 1) - 1) // self.page_size + 1 for n in (min_len, max_len))
        pages = sorted({self.bucket(1, n)[1] for n in range(lo, min(hi, self.max_pages) + 1)})
        return [(b, p) for b in rows for p in pages]

    def warmup(self, max_rows: int, min_len: int, max_len: int) -> int:
        """Capture now every bucket of `buckets_for(...)`, so that no capture happens later (e.g. in a
        timed region). Returns the number of new captures; 0 without graphs."""
        if not self.use_graphs:
            return 0
        before = self.num_captures
        for key in self.buckets_for(max_rows, min_len, max_len):
            self.capture(*key)
        return self.num_captures - before

    @torch.inference_mode()
    def capture(self, b: int, p: int) -> None:
        """Capture bucket (b, p) as a CUDA graph (a warm-up run first: Triton compilation and cuBLAS
        workspaces must not happen inside the capture). Runs on an all-padding buffer, so the warm-up
        writes nothing but zeros into block 0."""
        if (b, p) in self.graphs:
            return
        self._load((b, p), [], [], [], [])
        side = torch.cuda.Stream(self.pool.device)
        side.wait_stream(torch.cuda.current_stream(self.pool.device))
        with torch.cuda.stream(side):
            self._step(b, p)
        torch.cuda.current_stream(self.pool.device).wait_stream(side)
        if self._mempool is None:
            self._mempool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: a capture here must not fail because another thread (the HTTP server's) runs
        with torch.cuda.graph(graph, pool=self._mempool, capture_error_mode="thread_local"):
            out = self._step(b, p)
        self.graphs[(b, p)] = (graph, out)
        self.num_captures += 1
