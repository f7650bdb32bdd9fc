"""Grouped GEMM over expert-sorted rows with MXFP4 weights dequantised in registers (Triton).

y[rows of e] = x[rows of e] @ W_e^T, W_e = decode(packed[e], scale[e]) (official layout, k3.quant.mxfp4):
Hopper has no FP4 tensor cores, so each program loads a [BN, BK/2] tile of packed bytes plus its E8M0
bytes, expands the nibbles to float32 with integer ops (sign bit 3, E2M1 magnitude from bit patterns),
multiplies by 2^(s-127) and feeds tl.dot in the activation dtype (exact: an E2M1 value times a power of
two is a bf16 number; the dequantisation is four integer ops and one multiply per weight, see
`_raw_lo_hi`). Weight bytes read are 4.25 bits per weight instead of 16: at decode, where the
expert GEMMs are bound by weight bandwidth, that is the speed-up.

Even and odd input columns live in one byte's two nibbles, so a K tile is computed as two dots --
x[:, 0::2] @ W_lo^T + x[:, 1::2] @ W_hi^T -- instead of interleaving the nibbles in registers.

Grid (CUDA-graph friendly: no host reads of the routing): (N tiles, min(E, S) slots, M splits). Program
(n, slot, m) finds the slot-th expert that received rows by a prefix sum over `offs` (E <= a few
thousand, one vector op), then loops over that expert's row tiles m, m + M splits, ... Experts without
rows cost no program beyond the min(E, S) slots, so decode with a few active experts launches few
programs. Rows at or past offs[-1] are not written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from k3.ops.triton_utils import INTERPRETED


@triton.jit
def _raw_lo_hi(p):
    """int32 bytes (0..255) -> (low nibble, high nibble) as float32 E2M1 values times 2^-126.

    The nibble's 3 magnitude bits go straight to the two lowest exponent bits and the top mantissa bit
    (its sign to bit 31): code c = (e1 e0 m) reads 2^(e-127) (1 + m/2) for e >= 1 and, as a float32
    subnormal, m * 2^-127 for e = 0 -- the E2M1 value times 2^-126 in every case, in four integer ops."""
    lo = ((p & 7) << 22) | ((p & 8) << 28)
    hi = ((p & 0x70) << 18) | ((p & 0x80) << 24)
    return lo.to(tl.float32, bitcast=True), hi.to(tl.float32, bitcast=True)


@triton.jit
def _e8m0_shifted(s, SHIFT: tl.constexpr):
    """int32 E8M0 bytes -> float32 2^(s - 127 + 126 - SHIFT), the factor that turns `_raw_lo_hi` values into
    the weights times 2^-SHIFT. Bytes up to 127 + SHIFT are exact (SHIFT = 32: |W| < 6 * 2^33, far beyond
    any trained weight); larger bytes give inf (NaN for zero nibbles), byte 255 NaN."""
    e = s + (126 - SHIFT)  # biased exponent of 2^(s - 1 - SHIFT): >= 1 for SHIFT <= 125
    bits = tl.where(e >= 255, 0x7F800000, e << 23)
    return tl.where(s == 255, 0x7FC00000, bits).to(tl.float32, bitcast=True)


@triton.jit
def _mxfp4_gmm(X, P, S, Y, offs_ptr, N, K, E, stride_xm, stride_ym,
               EP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
               M_SPLIT: tl.constexpr, F32_DOT: tl.constexpr):
    """Y[r, n] = sum_k X[r, k] W_e[n, k] for the rows r of expert e. X [S, K] (unit column stride),
    P uint8 [E, N, K/2], S uint8 [E, N, K/32] contiguous, Y [S, N]; BK divides K."""
    SHIFT: tl.constexpr = 32
    X_UP: tl.constexpr = 4294967296.0  # 2^SHIFT
    pn = tl.program_id(0)
    slot = tl.program_id(1)
    pm = tl.program_id(2)
    # the slot-th expert with rows: rank experts by a prefix sum of "has rows"
    es = tl.arange(0, EP)
    ends = tl.load(offs_ptr + es, mask=es < E, other=0)
    starts = tl.load(offs_ptr + es - 1, mask=(es > 0) & (es < E), other=0)
    active = ends > starts
    hit = active & (tl.cumsum(active.to(tl.int32), 0) == slot + 1)
    e = tl.sum(tl.where(hit, es, 0)).to(tl.int64)
    r0 = tl.sum(tl.where(hit, starts, 0))
    r1 = tl.sum(tl.where(hit, ends, 0))  # no such expert: r0 = r1 = 0, no row tiles
    KH = K // 2
    KB = K // 32
    ns = pn * BN + tl.arange(0, BN)
    nmask = ns < N
    jh = tl.arange(0, BK // 2)  # byte columns of one K tile
    p_base = P + e * N * KH + ns[:, None].to(tl.int64) * KH + jh[None, :]
    s_base = S + e * N * KB + ns[:, None].to(tl.int64) * KB + (jh // 16)[None, :]
    for m0 in range(r0 + pm * BM, r1, BM * M_SPLIT):
        ms = m0 + tl.arange(0, BM)
        mmask = ms < r1
        x_base = X + ms[:, None].to(tl.int64) * stride_xm + 2 * jh[None, :]
        acc = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, K, BK):
            pk = tl.load(p_base + k0 // 2, mask=nmask[:, None], other=0).to(tl.int32)
            sc = _e8m0_shifted(tl.load(s_base + k0 // 32, mask=nmask[:, None], other=127).to(tl.int32), SHIFT)
            w_lo, w_hi = _raw_lo_hi(pk)
            w_lo *= sc  # = W * 2^-SHIFT: one multiply per weight
            w_hi *= sc
            x_ev = tl.load(x_base + k0, mask=mmask[:, None], other=0.0)
            x_od = tl.load(x_base + k0 + 1, mask=mmask[:, None], other=0.0)
            if F32_DOT or INTERPRETED:  # fp32 exactly; the interpreter's half-precision dot is wrong
                acc = tl.dot(x_ev.to(tl.float32), tl.trans(w_lo), acc, input_precision="ieee")
                acc = tl.dot(x_od.to(tl.float32), tl.trans(w_hi), acc, input_precision="ieee")
            else:
                acc = tl.dot(x_ev, tl.trans(w_lo.to(x_ev.dtype)), acc)
                acc = tl.dot(x_od, tl.trans(w_hi.to(x_ev.dtype)), acc)
        y_ptrs = Y + ms[:, None].to(tl.int64) * stride_ym + ns[None, :]
        # times 2^SHIFT: exact, undoes the weights' 2^-SHIFT
        tl.store(y_ptrs, (acc * X_UP).to(Y.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


@dataclass(frozen=True)
class Mxfp4Tiles:
    """Tile shape and launch parameters. BK: a multiple of 32 (clipped to one dividing K)."""

    bm: int
    bn: int
    bk: int
    warps: int
    stages: int


DECODE_TILES = Mxfp4Tiles(bm=16, bn=64, bk=256, warps=4, stages=4)
PREFILL_TILES = Mxfp4Tiles(bm=64, bn=128, bk=128, warps=8, stages=3)


def pick_tiles(rows: int, experts: int) -> Mxfp4Tiles:
    """Decode tiles when experts average <= 16 rows (each expert's weights read once, many N tiles),
    prefill tiles otherwise."""
    return DECODE_TILES if rows <= 16 * experts else PREFILL_TILES


def _fit_bk(bk: int, K: int) -> int:
    bk = max(32, min(bk, triton.next_power_of_2(K)))
    while K % bk:
        bk //= 2
    return bk


def mxfp4_gmm_triton(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, offs: torch.Tensor,
                     tiles: Mxfp4Tiles | None = None) -> torch.Tensor:
    """See `k3.ops.mxfp4_gemm.mxfp4_grouped_mm` (arguments checked there)."""
    S, K = x.shape
    E, N = packed.shape[:2]
    t = tiles or pick_tiles(S, E)
    bk = _fit_bk(t.bk, K)
    x = x if x.stride(1) == 1 else x.contiguous()
    y = torch.empty(S, N, dtype=x.dtype, device=x.device)
    slots = max(1, min(E, S))
    m_split = max(1, min(64, triton.cdiv(triton.cdiv(S, slots), t.bm)))
    grid = (triton.cdiv(N, t.bn), slots, m_split)
    _mxfp4_gmm[grid](x, packed, scale, y, offs, N, K, E, x.stride(0), y.stride(0),
                     EP=triton.next_power_of_2(E), BM=t.bm, BN=t.bn, BK=bk, M_SPLIT=m_split,
                     F32_DOT=x.dtype == torch.float32, num_warps=t.warps, num_stages=t.stages)
    return y
