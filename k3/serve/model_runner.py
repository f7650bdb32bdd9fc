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

Speculative verify steps are buckets (b, p, max_new) of the same runner: [b, max_new] tokens per step
(rows with fewer real tokens are padded inside the row), the same kernels per token as a decode step,
and instead of writing the KDA slots the step records the state after every token; `commit_verify`
then selects each row's state after its kept tokens (a gather, itself one graph per row bucket). The
steps also return the target's hidden states at `capture_layers` (a learned draft's features).
`capture_graph` is the one capture routine (the draft proposer's chain uses it too).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from k3.serve.cache_manager import BlockPool, StaticDecodeCache, select_kda_steps


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


def capture_graph(fn: Callable[[], Any], device: torch.device, mempool: Any) -> tuple[Any, Any]:
    """Capture `fn()` (shape-static, no host reads) as a CUDA graph in `mempool` -> (graph, fn's outputs,
    which the graph rewrites on every replay). A warm-up run on a side stream first: Triton compilation,
    cuBLAS workspaces and lazily allocated buffers must not happen inside the capture."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: a capture here must not fail because another thread (the HTTP server's) runs
    with torch.cuda.graph(graph, pool=mempool, capture_error_mode="thread_local"):
        out = fn()
    return graph, out


class DecodeRunner:
    """Runs decode steps ([N, 1] new tokens) and speculative verify steps ([N, T] tokens, T <= max_new) of
    `model` against the block pool, bucketed and static.

    max_batch: the most rows in one step (the engine's max_running); max_len: the longest context
    (cached tokens + new ones) a bucketed step serves; longer ones get `None` from `decode` / `run`
    (run them eagerly). use_graphs: capture and replay CUDA graphs (CUDA only), else run the static
    forward eagerly. paged_mla: MLA decode attention by the paged Triton kernel (None: on CUDA) instead
    of the gather + dense reference path (CPU tensors need TRITON_INTERPRET=1 for the kernel).
    max_new: the most tokens per row of a verify step (speculative decoding: k + 1; 1 = decode only).
    capture_layers: target layers whose hidden states every step also returns (a learned draft's features).
    """

    def __init__(self, model: Any, pool: BlockPool, *, max_batch: int, max_len: int, use_graphs: bool,
                 paged_mla: bool | None = None, max_new: int = 1, capture_layers: Sequence[int] = ()) -> None:
        for name, v in (("max_batch", max_batch), ("max_len", max_len), ("max_new", max_new)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"DecodeRunner {name} must be a positive integer, got {v!r}")
        if use_graphs and pool.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA pool, got device {pool.device}")
        self.model, self.pool, self.use_graphs = model, pool, use_graphs
        self.paged_mla = pool.device.type == "cuda" if paged_mla is None else bool(paged_mla)
        self.capture_layers = list(capture_layers)
        layout = pool.layout
        self.page_size, self.slot_blocks, self.max_new = layout.page_size, layout.slot_blocks, max_new
        self.max_pages = layout.pages_for(max_len)
        self.batch_buckets, self.page_buckets = bucket_sizes(max_batch), bucket_sizes(self.max_pages)
        # one int64 buffer, one host->device copy per step; columns:
        # [token ids (max_new) | cached length | real new tokens (0: padding) | slot blocks | page table]
        self._len, self._real, self._slot = max_new, max_new + 1, max_new + 2
        self._cols = max_new + 2 + self.slot_blocks
        self._io = torch.zeros(max_batch, self._cols + self.max_pages, dtype=torch.long, device=pool.device)
        self._kept = torch.zeros(max_batch, dtype=torch.long, device=pool.device)
        self._pin = pool.device.type == "cuda"  # host staging in pinned memory: asynchronous copies
        # per KDA layer: the states / conv inputs of the last verify step, shared by every verify graph
        self._steps: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._last_rows, self._last_key = 0, (0, 0, 0)
        self.commit_graphs: dict[int, tuple[Any, Any]] = {}  # row bucket -> the graph of `_select`
        self.graphs: dict[tuple[int, int, int], tuple[Any, tuple[torch.Tensor, torch.Tensor | None]]] = {}
        self.num_captures = 0
        self.capture_error: Exception | None = None
        self._mempool = None

    @property
    def mempool(self) -> Any:
        """The memory pool every graph of this runner (and the draft proposer's) is captured in."""
        if self._mempool is None:
            self._mempool = torch.cuda.graph_pool_handle()
        return self._mempool

    def bucket(self, num_rows: int, num_pages: int, num_new: int = 1) -> tuple[int, int, int] | None:
        """Smallest (rows, pages, tokens) bucket holding the step, or None when none does. Decode steps
        use 1 token per row, verify steps always `max_new` (one graph per row/page bucket)."""
        b = next((x for x in self.batch_buckets if x >= num_rows), None)
        p = next((x for x in self.page_buckets if x >= num_pages), None)
        t = 1 if num_new == 1 else self.max_new if num_new <= self.max_new else None
        return None if b is None or p is None or t is None else (b, p, t)

    @torch.inference_mode()
    def decode(self, token_ids: Sequence[int], past_lens: Sequence[int], slots: Sequence[Sequence[int]],
               page_tables: Sequence[Sequence[int]]) -> torch.Tensor | None:
        """One decode step; returns logits [N, vocab] (a view, valid until the next step), or None when
        the step fits no bucket (too many rows or too long a context; nothing was run then).

        Row i feeds `token_ids[i]` at position `past_lens[i]`; `slots[i]` are its KDA slot blocks and
        `page_tables[i]` its pages (covering position past_lens[i]; extra pages are ignored). The KDA
        state in the slots and the latent at that position are updated in the pool.
        """
        out = self.run([[t] for t in token_ids], past_lens, slots, page_tables)
        return None if out is None else out[0][:, 0]

    @torch.inference_mode()
    def run(self, tokens: Sequence[Sequence[int]], past_lens: Sequence[int], slots: Sequence[Sequence[int]],
            page_tables: Sequence[Sequence[int]], draft_ids: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """A decode step (every row one token) or a verify step (rows of 1..max_new tokens, at least one
        longer than 1) -> (logits [N, T, vocab], captured states [N, T, F] or None), views valid until the
        next step (T: the bucket's tokens; positions past a row's tokens are garbage), or None when the
        step fits no bucket. Row i feeds tokens[i] at positions past_lens[i]...; page_tables[i] must cover
        them. A decode step updates the KDA slots; a verify step leaves them and records the state after
        every token: call `commit_verify` with the tokens each row keeps before the next step.
        draft_ids: [N, k] long on the device, k < max_new: tokens 1..k of every row taken from here
        instead of `tokens` (whose lengths still say how many are real): drafts need no host round trip."""
        n = len(tokens)
        if not n == len(past_lens) == len(slots) == len(page_tables):
            raise ValueError("tokens, past_lens, slots and page_tables must have one entry per row")
        if any(len(t) < 1 for t in tokens):
            raise ValueError("every row needs at least one token")
        num_new = max((len(t) for t in tokens), default=1)
        need = max((p + len(t) - 1) // self.page_size + 1 for p, t in zip(past_lens, tokens)) if n else 1
        key = self.bucket(n, need, num_new)
        if key is None:
            return None
        for i, (p, tab, s, t) in enumerate(zip(past_lens, page_tables, slots, tokens)):
            if len(tab) <= (p + len(t) - 1) // self.page_size:
                raise ValueError(f"row {i}: page table of {len(tab)} pages does not cover position {p + len(t) - 1}")
            if len(s) != self.slot_blocks:
                raise ValueError(f"row {i}: a slot has {self.slot_blocks} blocks, got {len(s)}")
        if self.use_graphs and key not in self.graphs:
            try:
                self.capture(*key)
            except Exception as e:  # serve on without graphs rather than fail every decode step
                warnings.warn(f"CUDA graph capture failed, decoding eagerly from now on: {type(e).__name__}: {e}",
                              RuntimeWarning, stacklevel=2)
                self.use_graphs, self.capture_error = False, e
        self._load(key, tokens, past_lens, slots, page_tables)
        if draft_ids is not None:
            if draft_ids.shape[0] != n or draft_ids.shape[1] >= self.max_new:
                raise ValueError(f"draft_ids must be [{n}, < {self.max_new}], got {list(draft_ids.shape)}")
            self._io[:n, 1: 1 + draft_ids.shape[1]].copy_(draft_ids)
        self._last_rows, self._last_key = n, key
        if not self.use_graphs:
            logits, aux = self._step(*key)
        else:
            graph, (logits, aux) = self.graphs[key]
            graph.replay()
        return logits[:n], (aux[:n] if aux is not None else None)

    def commit_verify(self, kept: Sequence[int]) -> None:
        """After a verify `run` of N rows: write each row's KDA slot as the state after its first kept[i]
        tokens (1 <= kept[i] <= its tokens; from the states the step recorded: no recomputation). One
        host->device copy, no host read; with graphs one replay per row bucket (padding rows select
        into the zero block, which is re-zeroed)."""
        n = self._last_rows
        if len(kept) != n or any(not 1 <= k <= self.max_new for k in kept):
            raise ValueError(f"commit_verify needs one kept count in 1..{self.max_new} per row of the last run ({n})")
        if not self._steps or n == 0:
            return
        b = self._last_key[0]
        host = torch.ones(b, dtype=torch.long, pin_memory=self._pin)
        host[:n] = torch.tensor(list(kept), dtype=torch.long)
        self._kept[:b].copy_(host, non_blocking=True)
        if not self.use_graphs:
            return self._select(b)
        if b not in self.commit_graphs:
            self.commit_graphs[b] = capture_graph(lambda: self._select(b), self.pool.device, self.mempool)
        self.commit_graphs[b][0].replay()

    def _select(self, b: int) -> None:
        """`select_kda_steps` over the first b rows of the last verify step's buffers (static shapes)."""
        steps = {layer: (s[:b], e[:b]) for layer, (s, e) in self._steps.items()}
        select_kda_steps(self.pool, self._io[:b, self._slot: self._cols].reshape(-1), steps, self._kept[:b])
        self.pool.storage[0].zero_()  # padding rows selected into the zero block

    def _load(self, key: tuple[int, int, int], tokens: Sequence[Sequence[int]], past_lens: Sequence[int],
              slots: Sequence[Sequence[int]], page_tables: Sequence[Sequence[int]]) -> None:
        """Fill the first b rows of the buffer (rows past the requests are padding: all zeros)."""
        b, p, _ = key
        width = self._cols + p
        host = torch.zeros(b, width, dtype=torch.long, pin_memory=self._pin)
        for i, (t, pl, s, pt) in enumerate(zip(tokens, past_lens, slots, page_tables)):
            host[i, : len(t)] = torch.tensor(list(t), dtype=torch.long)
            host[i, self._len], host[i, self._real] = pl, len(t)
            host[i, self._slot: self._cols] = torch.tensor(list(s), dtype=torch.long)
            pages = list(pt[:p])
            host[i, self._cols: self._cols + len(pages)] = torch.tensor(pages, dtype=torch.long)
        self._io[:b, :width].copy_(host, non_blocking=True)  # pinned: no wait for the device to drain

    def _step(self, b: int, p: int, t: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The static forward of bucket (b, p, t) over the buffer: (logits [b, t, vocab], captured states
        [b, t, F] or None). t > 1 (verify) copies every KDA layer's per-token states into `_steps`."""
        io = self._io[:b]
        c = self._cols
        cache = StaticDecodeCache(self.pool, io[:, self._len], io[:, c: c + p], io[:, self._slot: c], io[:, self._real],
                                  num_new=t, paged_mla=self.paged_mla, keep_steps=t > 1)
        h, hidden = self.model.model(io[:, :t], cache=cache, hidden_state_layers=self.capture_layers or None)
        cache.commit()
        if cache.kda_steps:
            for layer, (inter, ext) in cache.kda_steps.items():
                if layer not in self._steps:  # allocated outside any capture (the warm-up run comes first)
                    self._steps[layer] = (inter.new_zeros(self._io.shape[0], *inter.shape[1:]),
                                          ext.new_zeros(self._io.shape[0], *ext.shape[1:]))
                self._steps[layer][0][:b].copy_(inter)
                self._steps[layer][1][:b].copy_(ext)
        aux = torch.cat([hidden[i] for i in self.capture_layers], -1) if self.capture_layers else None
        return self.model.lm_head(h), aux

    def buckets_for(self, max_rows: int, min_len: int, max_len: int, num_new: int = 1) -> list[tuple[int, int, int]]:
        """Every bucket that steps of 1..max_rows rows with contexts of min_len..max_len tokens (the
        token being decoded included) and `num_new` tokens per row use; contexts beyond `max_len` of the
        runner are left out."""
        t = self.bucket(1, 1, num_new)[2]
        rows = sorted({self.bucket(n, 1)[0] for n in range(1, min(max_rows, self.batch_buckets[-1]) + 1)})
        lo, hi = ((max(n, 1) - 1) // self.page_size + 1 for n in (min_len, max_len))
        pages = sorted({self.bucket(1, n)[1] for n in range(lo, min(hi, self.max_pages) + 1)})
        return [(b, p, t) for b in rows for p in pages]

    def warmup(self, max_rows: int, min_len: int, max_len: int, num_new: int = 1) -> int:
        """Capture now every bucket of `buckets_for(...)`, so that no capture happens later (e.g. in a
        timed region). Returns the number of new captures; 0 without graphs."""
        if not self.use_graphs:
            return 0
        before = self.num_captures
        for key in self.buckets_for(max_rows, min_len, max_len, num_new):
            self.capture(*key)
        return self.num_captures - before

    @torch.inference_mode()
    def capture(self, b: int, p: int, t: int = 1) -> None:
        """Capture bucket (b, p, t) as a CUDA graph (a warm-up run first: Triton compilation and cuBLAS
        workspaces must not happen inside the capture). Runs on an all-padding buffer, so the warm-up
        writes nothing but zeros into block 0."""
        if (b, p, t) in self.graphs:
            return
        self._load((b, p, t), [], [], [], [])
        graph, out = capture_graph(lambda: self._step(b, p, t), self.pool.device, self.mempool)
        self.graphs[(b, p, t)] = (graph, out)
        self.num_captures += 1
