"""MoE routing bookkeeping as Triton kernels (see k3.ops.moe_route for the contracts).

Why: torch's topk, stable argsort, inverse scatter and expert counts cost milliseconds per micro-batch
for bookkeeping that moves a few MB (docs/dev_log.md).

Top-k: a program owns BN rows. Each choice value becomes an integer that orders like the float
(sign-magnitude flipped; -0.0 folded onto +0.0, every NaN above +inf, as torch sorts), packed with
(1023 - expert id) in the low 10 bits, so one int64 max per row picks the largest value and, among
equal values, the smallest id; the winner is then masked out, k times.

Slot sort, a stable counting sort in three launches, no atomics and no host sync:
  1. `_block_hist`: per block of B slots, its expert histogram (row b of hist [nblocks, E]).
  2. `_block_offsets` (a program per 32 experts): in place, for every block b and expert e, the slots
     of e in blocks < b; and the expert totals (counts).
  3. `_block_scatter`: a block sorts its keys id*B + i (unique, so stable) in registers; the slot at
     sorted position i of the block, of expert e, lands at start of e + slots of e in earlier blocks
     + i - slots of smaller experts in this block (these sort first in it).
(A one-hot alternative, ranks by a running column cumsum of a [slots, E] tile, scales badly with E.)
bench/moe_route.py times both kernels against torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3.ops.moe_route import MAX_EXPERTS

# (top-k rows x padded experts per program, warps; slots per sort block, warps)
TILE = (1024, 2, 1024, 4)  # ~16 keys per thread; the sweep of bench/moe_route.py was flat around these

_ID_MASK = tl.constexpr(MAX_EXPERTS - 1)  # the packed top-k key's low bits hold 1023 - id
_DEAD = tl.constexpr(-(2 ** 62))  # below every packed key ((-2^31) * 1024 at the least)


@triton.jit
def _order_key(x):
    """fp32 -> int32 with the same order: -0.0 == +0.0, every NaN above +inf (torch's sort order)."""
    x = tl.where(x == 0.0, 0.0, x)
    b = x.to(tl.int32, bitcast=True)
    key = tl.where(b < 0, b ^ 0x7FFFFFFF, b)
    return tl.where((b & 0x7FFFFFFF) > 0x7F800000, 0x7FFFFFFF, key)


@triton.jit
def _topk_rows(C, BIAS, IDX, N, E, stride, K: tl.constexpr, HAS_BIAS: tl.constexpr, BN: tl.constexpr,
               EP: tl.constexpr):
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    cols = tl.arange(0, EP)
    mr, mc = rows < N, cols < E
    r64 = rows.to(tl.int64)
    x = tl.load(C + r64[:, None] * stride + cols[None, :], mask=mr[:, None] & mc[None, :], other=0.0)
    x = x.to(tl.float32)
    if HAS_BIAS:
        x = x + tl.load(BIAS + cols, mask=mc, other=0.0).to(tl.float32)[None, :]
    packed = _order_key(x).to(tl.int64) * (_ID_MASK + 1) + (_ID_MASK - cols[None, :])
    packed = tl.where(mc[None, :], packed, _DEAD)
    for j in tl.static_range(K):
        best = tl.max(packed, axis=1)
        e = _ID_MASK - (best & _ID_MASK)
        tl.store(IDX + r64 * K + j, e.to(tl.int64), mask=mr)
        packed = tl.where(cols[None, :] == e[:, None], _DEAD, packed)


@triton.jit
def _block_ids(IDS, M, E, B: tl.constexpr):
    """(slot numbers, ids clamped to [0, E) (int32), valid mask) of this program's block."""
    slot = tl.program_id(0).to(tl.int64) * B + tl.arange(0, B)
    valid = slot < M
    ids = tl.load(IDS + slot, mask=valid, other=0).to(tl.int32)
    # clamped, not checked (a check would sync with the host): a bad id cannot write out of bounds
    return slot, tl.minimum(tl.maximum(ids, 0), E - 1), valid


@triton.jit
def _block_hist(IDS, HIST, M, E, B: tl.constexpr, EP: tl.constexpr):
    slot, ids, valid = _block_ids(IDS, M, E, B)
    cols = tl.arange(0, EP)
    # the tail beyond M loaded as expert 0: taken off again (tl.histogram's mask is not in every Triton)
    h = tl.histogram(ids, EP) - tl.where(cols == 0, B - tl.sum(valid.to(tl.int32), axis=0), 0)
    tl.store(HIST + tl.program_id(0).to(tl.int64) * E + cols, h, mask=cols < E)


@triton.jit
def _block_offsets(HIST, COUNTS, NB, E, BB: tl.constexpr, BE: tl.constexpr):
    """Program per BE experts: hist [NB, E] int32 -> (in place) slots of each expert in earlier blocks;
    counts [E] int64 = the totals."""
    cols = tl.program_id(0) * BE + tl.arange(0, BE)
    mc = cols < E
    carry = tl.zeros([BE], dtype=tl.int32)
    for b0 in range(0, NB, BB):
        rb = b0 + tl.arange(0, BB)
        m = (rb < NB)[:, None] & mc[None, :]
        ptr = HIST + rb.to(tl.int64)[:, None] * E + cols[None, :]
        h = tl.load(ptr, mask=m, other=0)
        tl.store(ptr, tl.cumsum(h, axis=0) - h + carry[None, :], mask=m)
        carry += tl.sum(h, axis=0)
    tl.store(COUNTS + cols, carry.to(tl.int64), mask=mc)


@triton.jit
def _block_base(OFF, COUNTS, E, EP: tl.constexpr):
    """[EP] int32: the sorted position of this block's first slot of each expert."""
    cols = tl.arange(0, EP)
    mc = cols < E
    counts = tl.load(COUNTS + cols, mask=mc, other=0).to(tl.int32)
    before = tl.load(OFF + tl.program_id(0).to(tl.int64) * E + cols, mask=mc, other=0)
    return tl.cumsum(counts, axis=0) - counts + before


@triton.jit
def _block_scatter(IDS, OFF, COUNTS, ORDER, INV, M, E, B: tl.constexpr, EP: tl.constexpr):
    slot, ids, valid = _block_ids(IDS, M, E, B)
    i = tl.arange(0, B)
    n_valid = tl.sum(valid.to(tl.int32), axis=0)
    # the slots of smaller experts come first in the sorted block: position i of expert e is rank i - lower[e]
    h = tl.histogram(ids, EP) - tl.where(tl.arange(0, EP) == 0, B - n_valid, 0)
    start = _block_base(OFF, COUNTS, E, EP) - (tl.cumsum(h, axis=0) - h)
    # unique keys (expert, position in block): the in-register sort is stable; the tail sorts last
    key = tl.sort(tl.where(valid, ids * B + i, 0x7FFFFFFF))
    ok = i < n_valid
    e = tl.where(ok, key // B, 0)
    src = tl.program_id(0).to(tl.int64) * B + (key % B)
    # start[e] per slot: through this block's own row of OFF (a gather from registers is not in every Triton)
    row = OFF + tl.program_id(0).to(tl.int64) * E
    tl.store(row + tl.arange(0, EP), start, mask=tl.arange(0, EP) < E)
    tl.debug_barrier()
    pos = (tl.load(row + e, mask=ok, other=0) + i).to(tl.int64)
    tl.store(ORDER + pos, src, mask=ok)
    tl.store(INV + src, pos, mask=ok)


def tile() -> tuple[int, ...]:
    """TILE, read at call time (a module constant beside the kernels; tests and bench sweeps set it)."""
    return TILE


def topk_rows(choice: torch.Tensor, k: int, bias: torch.Tensor | None) -> torch.Tensor:
    """choice [N, E] float with unit column stride, bias [E] or None (contiguous) -> ids [N, k] int64."""
    N, E = choice.shape
    idx = torch.empty(N, k, dtype=torch.int64, device=choice.device)
    if N == 0:
        return idx
    elems, warps = tile()[:2]
    ep = triton.next_power_of_2(E)
    bn = max(1, min(elems // ep, triton.next_power_of_2(N)))
    _topk_rows[(triton.cdiv(N, bn),)](choice, choice if bias is None else bias, idx, N, E, choice.stride(0),
                                      K=k, HAS_BIAS=bias is not None, BN=bn, EP=ep, num_warps=warps)
    return idx


def sort_flat(flat: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """flat [M] int32 / int64 contiguous ids -> (order [M], inv [M], counts [E]), all int64."""
    M, E, dev = flat.numel(), num_experts, flat.device
    order = torch.empty(M, dtype=torch.int64, device=dev)
    inv = torch.empty(M, dtype=torch.int64, device=dev)
    if M == 0:
        return order, inv, torch.zeros(E, dtype=torch.int64, device=dev)
    counts = torch.empty(E, dtype=torch.int64, device=dev)
    b, warps = tile()[2:]
    b = max(16, min(b, triton.next_power_of_2(M)))  # small inputs (decode) sort one short block
    ep = triton.next_power_of_2(E)
    nb = triton.cdiv(M, b)
    hist = torch.empty(nb, E, dtype=torch.int32, device=dev)
    _block_hist[(nb,)](flat, hist, M, E, B=b, EP=ep, num_warps=warps)
    be = min(ep, 32)
    bb = max(1, min(2048 // be, triton.next_power_of_2(nb)))
    _block_offsets[(triton.cdiv(E, be),)](hist, counts, nb, E, BB=bb, BE=be, num_warps=4)
    _block_scatter[(nb,)](flat, hist, counts, order, inv, M, E, B=b, EP=ep, num_warps=warps)
    return order, inv, counts
