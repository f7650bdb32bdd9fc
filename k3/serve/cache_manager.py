"""The hybrid cache under one memory budget: a pool of uniform byte blocks.

One block is one MLA *page*: `page_size` tokens of the latent row `[kv_lora_rank + rope]` of every
MLA layer. A KDA *slot* (recurrent state [H, K, V] fp32 + conv tail [W-1, 3*H*K] of every KDA
layer) spans `slot_blocks` blocks that need not be contiguous. Running requests, prefix-cache
checkpoints and pages all come from the same free list, so long contexts and many concurrent
requests trade memory against each other (the K3 report's "one paged pool of uniform byte-size
pages"). Blocks are reference counted; block 0 is a permanent all-zero block used to pad page tables.

`PagedBatchCache` presents a batch of requests to the model as a `k3.model.cache.DecodeCache`:
`kda_state` / `conv_tail` are gathered from the slots before the forward and written back after;
`mla_append` writes the new latents into the pages and returns the gathered [N, S, D] latents.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3.config import TextConfig

_ALIGN = 16  # byte alignment of every tensor inside a slot, so typed views are legal


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclass(frozen=True)
class CacheLayout:
    """Byte geometry of pages and slots for one model config and cache dtype."""

    mla_layers: tuple[int, ...]
    kda_layers: tuple[int, ...]
    page_size: int
    latent_dim: int  # kv_lora_rank + qk_rope_head_dim
    kda_heads: int
    kda_head_dim: int
    conv_width: int
    dtype: torch.dtype

    @staticmethod
    def from_config(config: TextConfig, page_size: int, dtype: torch.dtype) -> "CacheLayout":
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        n = config.num_hidden_layers
        return CacheLayout(
            mla_layers=tuple(i for i in range(n) if config.is_mla(i)),
            kda_layers=tuple(i for i in range(n) if not config.is_mla(i)),
            page_size=page_size, latent_dim=config.kv_lora_rank + config.qk_rope_head_dim,
            kda_heads=config.kda_num_heads, kda_head_dim=config.kda_head_dim,
            conv_width=config.linear_attn_config.short_conv_kernel_size, dtype=dtype,
        )

    @property
    def esize(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()

    @property
    def block_bytes(self) -> int:
        return max(1, len(self.mla_layers)) * self.page_size * self.latent_dim * self.esize

    @property
    def state_bytes(self) -> int:
        return self.kda_heads * self.kda_head_dim * self.kda_head_dim * 4

    @property
    def tail_shape(self) -> tuple[int, int]:
        return self.conv_width - 1, 3 * self.kda_heads * self.kda_head_dim

    @property
    def tail_bytes(self) -> int:
        w, c = self.tail_shape
        return w * c * self.esize

    @property
    def layer_bytes(self) -> int:
        return _aligned(self.state_bytes) + _aligned(self.tail_bytes)

    @property
    def slot_bytes(self) -> int:
        return self.layer_bytes * len(self.kda_layers)

    @property
    def slot_blocks(self) -> int:
        return max(1, -(-self.slot_bytes // self.block_bytes))

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)


class OutOfBlocks(RuntimeError):
    """The pool has no free block left (callers evict or preempt, then retry)."""


class BlockPool:
    """`num_blocks` blocks of `layout.block_bytes` bytes on `device`, with refcounts and a free list."""

    def __init__(self, layout: CacheLayout, num_blocks: int, device: torch.device | str = "cpu") -> None:
        if num_blocks < 2:
            raise ValueError(f"the cache needs at least 2 blocks, got {num_blocks}")
        self.layout, self.num_blocks, self.device = layout, num_blocks, torch.device(device)
        self.storage = torch.zeros(num_blocks, layout.block_bytes, dtype=torch.uint8, device=self.device)
        n_mla = max(1, len(layout.mla_layers))
        self.pages = self.storage.view(layout.dtype).view(num_blocks, n_mla, layout.page_size, layout.latent_dim)
        self.mla_index = {layer: i for i, layer in enumerate(layout.mla_layers)}
        self.refcount = [0] * num_blocks
        self.refcount[0] = 1 << 30  # the zero block is never freed
        self._free = list(range(num_blocks - 1, 0, -1))

    @staticmethod
    def blocks_for_budget(layout: CacheLayout, budget_bytes: int) -> int:
        return int(budget_bytes // layout.block_bytes)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usable(self) -> int:
        return self.num_blocks - 1

    def alloc(self, n: int) -> list[int]:
        """n fresh blocks with refcount 1, or OutOfBlocks (nothing is taken then)."""
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} blocks, {len(self._free)} free")
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self.refcount[b] = 1
        return out

    def alloc_pages(self, n: int) -> list[int]:
        """Blocks for MLA pages, zeroed: unwritten rows must stay finite (they are masked, not skipped)."""
        out = self.alloc(n)
        self.zero(out)
        return out

    def zero(self, blocks: list[int]) -> None:
        if blocks:
            self.storage[torch.tensor(blocks, device=self.device)] = 0

    def incref(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.refcount[b] <= 0:
                raise RuntimeError(f"incref of free block {b}")
            self.refcount[b] += 1

    def decref(self, blocks: list[int]) -> None:
        for b in blocks:
            if b == 0:
                continue
            if self.refcount[b] <= 0:
                raise RuntimeError(f"decref of free block {b}")
            self.refcount[b] -= 1
            if self.refcount[b] == 0:
                self._free.append(b)

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Byte copy src[i] -> dst[i] (state restore, checkpoint save, copy-on-write of a page)."""
        if src:
            s = torch.tensor(src, device=self.device)
            d = torch.tensor(dst, device=self.device)
            self.storage[d] = self.storage[s]

    # ---- KDA slots -----------------------------------------------------------------------------
    def read_slots(self, slots: list[list[int]]) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        """Gather the KDA state of N slots -> ({layer: [N, H, K, V] fp32}, {layer: [N, W-1, C]})."""
        return self.gather_slots(self._slot_index(slots))

    def write_slots(self, slots: list[list[int]], states: dict[int, torch.Tensor],
                    tails: dict[int, torch.Tensor]) -> None:
        """Scatter states/tails (as returned by `read_slots`, updated by the model) back into the slots."""
        self.scatter_slots(self._slot_index(slots), states, tails)

    def _slot_index(self, slots: list[list[int]]) -> torch.Tensor:
        return torch.tensor([b for s in slots for b in s], device=self.device, dtype=torch.long)

    def gather_slots(self, index: torch.Tensor) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        """`read_slots` over a device index: index [N * slot_blocks] long, the blocks of N slots in order.

        Shapes depend only on index.numel() (no host values): usable inside a CUDA graph.
        """
        L = self.layout
        n = index.numel() // L.slot_blocks
        raw = self.storage[index].view(n, L.slot_blocks * L.block_bytes)
        states, tails = {}, {}
        H, K = L.kda_heads, L.kda_head_dim
        for j, layer in enumerate(L.kda_layers):
            off = j * L.layer_bytes
            states[layer] = raw[:, off: off + L.state_bytes].view(torch.float32).view(n, H, K, K)
            toff = off + _aligned(L.state_bytes)
            tails[layer] = raw[:, toff: toff + L.tail_bytes].view(L.dtype).view(n, *L.tail_shape)
        return states, tails

    def scatter_slots(self, index: torch.Tensor, states: dict[int, torch.Tensor],
                      tails: dict[int, torch.Tensor]) -> None:
        """`write_slots` over a device index (as for `gather_slots`); no host values involved."""
        L = self.layout
        n = index.numel() // L.slot_blocks
        raw = torch.zeros(n, L.slot_blocks * L.block_bytes, dtype=torch.uint8, device=self.device)
        for j, layer in enumerate(L.kda_layers):
            off = j * L.layer_bytes
            raw[:, off: off + L.state_bytes].view(torch.float32).copy_(states[layer].reshape(n, -1).float())
            toff = off + _aligned(L.state_bytes)
            raw[:, toff: toff + L.tail_bytes].view(L.dtype).copy_(tails[layer].reshape(n, -1).to(L.dtype))
        self.storage[index] = raw.view(n * L.slot_blocks, L.block_bytes)


class PagedBatchCache:
    """A `k3.model.cache.DecodeCache` over the block pool for one forward of N sequences.

    page_tables[i]: block ids of sequence i's pages (enough for past + new tokens); slots[i]: its
    KDA slot blocks; past_lens[i]: tokens already cached. Call `commit()` after the forward to write
    the KDA state back.
    """

    def __init__(self, pool: BlockPool, page_tables: list[list[int]], slots: list[list[int]],
                 past_lens: list[int], new_lens: list[int], *, absorb_mla: bool, paged_mla: bool = False) -> None:
        self.pool, self.slots = pool, slots
        self.static_shapes = False
        self.num_seqs = len(slots)
        dev = pool.device
        self.lengths = torch.tensor(past_lens, dtype=torch.long, device=dev)
        self.absorb_mla = absorb_mla
        # the paged kernel serves one new token per row (decode); other forwards gather
        self.paged_mla = paged_mla and absorb_mla and all(n == 1 for n in new_lens)
        self._attend_lens = torch.tensor([p + n for p, n in zip(past_lens, new_lens)], dtype=torch.long, device=dev)
        self.kda_state, self.conv_tail = pool.read_slots(slots) if pool.layout.kda_layers else ({}, {})
        # a dict here makes every KDA layer record its inputs (KDAttention.forward): speculative rollback replays them
        self.kda_inputs: dict[int, tuple] | None = None
        page = pool.layout.page_size
        width = max(len(p) for p in page_tables)
        tables = torch.tensor([p + [0] * (width - len(p)) for p in page_tables], dtype=torch.long)
        # where each new token's latent goes: (row, column) of the padded [N, Tmax] input -> (block, offset);
        # built on the host and copied once, so a GPU forward does not synchronise here
        new_t = torch.tensor(new_lens, dtype=torch.long)
        seq = torch.repeat_interleave(torch.arange(self.num_seqs), new_t)
        col = torch.arange(int(new_t.sum())) - (torch.cumsum(new_t, 0) - new_t)[seq]
        pos = torch.tensor(past_lens, dtype=torch.long)[seq] + col
        valid = torch.zeros(self.num_seqs, max(new_lens), dtype=torch.bool)
        valid[seq, col] = True
        self._tables, self._valid = tables.to(dev), valid.to(dev)
        self._blocks, self._offs = tables[seq, pos // page].to(dev), (pos % page).to(dev)

    def mla_append(self, layer: int, new: torch.Tensor, layout) -> torch.Tensor:
        """new: [N, Tmax, D] padded latents -> written to the pages; returns [N, pages*page_size, D]."""
        g = self._write(layer, new)[self._tables]  # [N, P, page, D]
        return g.reshape(self.num_seqs, -1, g.shape[-1])

    def mla_write(self, layer: int, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """new: [N, 1, D] latents -> written to the pages; returns what the paged decode kernel reads:
        (that layer's pages [num_blocks, page, D] (a view of the pool), tables [N, P], lens [N])."""
        return self._write(layer, new), self._tables, self._attend_lens

    def _write(self, layer: int, new: torch.Tensor) -> torch.Tensor:
        """Scatter the new tokens' latents into their pages; returns that layer's pages (a view)."""
        pages = self.pool.pages[:, self.pool.mla_index[layer]]
        pages[self._blocks, self._offs] = new[self._valid].to(pages.dtype)
        return pages

    def advance(self, new_lens: torch.Tensor) -> None:
        self.lengths = self.lengths + new_lens.to(self.lengths.device)

    def commit(self) -> None:
        if self.pool.layout.kda_layers:
            self.pool.write_slots(self.slots, self.kda_state, self.conv_tail)


class StaticDecodeCache:
    """A `k3.model.cache.DecodeCache` for one decode or verify step ([N, T] input rows, T small) whose every
    shape is fixed by its index tensors, never by host values, so the forward can be captured in a CUDA graph.

    past_lens: [N] long, tokens already cached (row i's token t goes to position past_lens[i] + t).
    page_tables: [N, P] long block ids (covering every real token of valid rows; unused entries 0).
    slot_index: [N, slot_blocks] long, each row's KDA slot blocks. num_real: [N] long, the real new
    tokens of each row (0 = a padding row; tokens t >= num_real[i] are padding inside a row: their
    latents go to block 0, their outputs are garbage and must not be used).
    Padding rows must have past_lens 0 and only block 0 in their page table and slot: their latent
    writes go to block 0, and `commit` re-zeroes block 0 after their state write.
    paged_mla: MLA reads each token's past_lens + t + 1 latent rows in place with the paged decode
    kernel (`k3.ops.mla_decode`, one query row per token, its sequence splits sized for N rows as in a
    decode step, so a verify token and a decode step at the same position do the same reduction).
    Otherwise (the reference path) it attends over all P * page_size gathered rows, later positions masked.
    keep_steps (verify): KDA layers leave the slots alone and put (state after every token
    [N, T, H, K, V] fp32, [conv tail | raw inputs] [N, W-1+T, C]) into `kda_steps`, from which
    `select_kda_steps` writes the state after each row's kept tokens.
    """

    static_shapes = True  # read by GatedMLA / KDAttention: take the static decode path
    absorb_mla = True

    def __init__(self, pool: BlockPool, past_lens: torch.Tensor, page_tables: torch.Tensor,
                 slot_index: torch.Tensor, num_real: torch.Tensor, *, num_new: int = 1, paged_mla: bool = False,
                 keep_steps: bool = False) -> None:
        self.pool, self.num_seqs, self.num_new = pool, past_lens.shape[0], num_new
        self.lengths = past_lens
        self.paged_mla = paged_mla
        self.mla_split_rows = self.num_seqs
        self.kda_steps: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = {} if keep_steps else None
        self._tables, self._slot_index = page_tables, slot_index.reshape(-1)
        self.kda_state, self.conv_tail = pool.gather_slots(self._slot_index) if pool.layout.kda_layers else ({}, {})
        page = pool.layout.page_size
        pos = past_lens[:, None] + torch.arange(num_new, device=past_lens.device)[None]  # [N, T]
        self._real = torch.arange(num_new, device=past_lens.device)[None] < num_real.long()[:, None]  # [N, T]
        block = page_tables.gather(1, (pos // page).clamp(max=page_tables.shape[1] - 1))
        self._wblock = torch.where(self._real, block, torch.zeros_like(block))  # padding tokens: block 0
        self._woff = pos % page
        self._attend_lens = torch.where(self._real, pos + 1, torch.zeros_like(pos)).reshape(-1)
        self._q_tables = page_tables.repeat_interleave(num_new, 0) if num_new > 1 else page_tables

    def mla_append(self, layer: int, new: torch.Tensor, layout) -> torch.Tensor:
        """new: [N, T, D] latents -> written at past_lens + t; returns [N, P * page_size, D]."""
        pages = self._write(layer, new)
        g = pages[self._tables, self.pool.mla_index[layer]]  # [N, P, page, D]
        return g.reshape(self.num_seqs, -1, g.shape[-1])

    def mla_write(self, layer: int, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """new: [N, T, D] latents -> written at past_lens + t; returns the paged decode kernel's inputs, one
        query row per token (row i * T + t): (that layer's pages [num_blocks, page, D], a view of the
        pool; tables [N * T, P]; lens [N * T], 0 for padding)."""
        pages = self._write(layer, new)
        return pages[:, self.pool.mla_index[layer]], self._q_tables, self._attend_lens

    def _write(self, layer: int, new: torch.Tensor) -> torch.Tensor:
        if new.shape[1] != self.num_new:
            raise ValueError(f"StaticDecodeCache takes {self.num_new} new tokens per row, got {new.shape[1]}")
        pages = self.pool.pages
        row = torch.where(self._real[:, :, None], new.to(pages.dtype), torch.zeros((), dtype=pages.dtype,
                                                                                  device=new.device))
        pages[self._wblock, self.pool.mla_index[layer], self._woff] = row
        return pages

    def advance(self, new_lens: torch.Tensor) -> None:
        self.lengths = self.lengths + new_lens.to(self.lengths.device)

    def commit(self) -> None:
        if self.pool.layout.kda_layers and self.kda_steps is None:
            self.pool.scatter_slots(self._slot_index, self.kda_state, self.conv_tail)
        self.pool.storage[0].zero_()  # padding rows / tokens wrote into the zero block


def select_kda_steps(pool: BlockPool, slot_index: torch.Tensor, steps: dict[int, tuple[torch.Tensor, torch.Tensor]],
                     kept: torch.Tensor) -> None:
    """Write into N slots the KDA state after each row's first kept[i] tokens of a verify step.

    slot_index [N * slot_blocks] long; steps {layer: (states [N, T, H, K, V] fp32, [old tail | raw
    inputs] [N, W-1+T, C])} as a `StaticDecodeCache(keep_steps=True)` recorded them (row slices of);
    kept [N] long device tensor in 1..T. Device ops only (no host read)."""
    if not steps:
        return
    rows = torch.arange(kept.shape[0], device=kept.device)
    w1 = pool.layout.conv_width - 1
    cols = kept[:, None] + torch.arange(w1, device=kept.device)[None]  # the last W-1 inputs up to token kept-1
    states, tails = {}, {}
    for layer, (inter, ext) in steps.items():
        states[layer] = inter[rows, kept - 1]
        tails[layer] = ext.gather(1, cols[:, :, None].expand(-1, -1, ext.shape[-1]))
    pool.scatter_slots(slot_index, states, tails)
