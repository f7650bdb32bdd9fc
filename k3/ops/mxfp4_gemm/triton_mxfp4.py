"""Grouped GEMM over expert-sorted rows with MXFP4 weights dequantised in registers (Triton).

y[rows of e] = x[rows of e] @ W_e^T, W_e = decode(packed[e], scale[e]) (k3.quant.mxfp4; bytes in the
official layout or in the kernel order of `layout.py`). Hopper has no FP4 tensor cores, so each program
loads a [BN, BK/2] tile of packed bytes plus its [BN, BK/32] E8M0 bytes, expands them once per tile to
a [BN, BK] tile in the activation dtype (`_decode_tile`) and multiplies it against the [BM, BK] row tile.

The product is computed transposed, acc[BN, BM] = W_tile @ x_tile^T: the weight tile is the left operand
(Hopper's wgmma takes it from registers, where it was decoded; its M >= 64 is filled by BN) and the rows are
the small right operand, so decode with one row per expert wastes no MMA width on padding rows.

Decode (bf16 activations on the GPU, `_ASM_DECODE`): per 4 bytes two prmt, then per pair of nibbles one
and / multiply / and places the E2M1 bits straight into a bf16 pair and one bf16x2 multiply applies the
group's scale: ~2.25 instructions per weight. Which columns land in which register is set by the K order
(`_k_order`; both operands permuted alike, so the dot is unchanged): the wgmma fragment of lane q holds
columns 2q, 2q + 1 (+ multiples of 8). PERM 3 permutes K so that those come from BK / 8 consecutive
bytes (one wide shared-memory load) and a register pair is what the asm produces (no shuffles), at the
cost of permuting the x tile through registers (cheap at decode's 16 rows, not at prefill's 256);
PERM 0 keeps K in order (x copied straight to shared memory; the weight bytes are read one by one);
PERM 4 reads bytes stored in the kernel order (`layout.to_kernel_order`, how `RoutedExperts` keeps
them): both advantages, no permutation of x.

Exactness: an E2M1 value times a power of two is exact in bf16 / fp32 as long as it stays a normal number.
Tiles are decoded as W * 2^-SHIFT; for bf16 / fp32 the fp32 accumulator is multiplied by 2^SHIFT at the
store (exact). With SHIFT = 32 every E8M0 byte s in [2 + SHIFT, 128 + SHIFT] = [34, 160] -- block scales
2^-93 .. 2^33, far beyond any trained weight -- decodes exactly (larger bytes give inf, smaller ones lose
low bits as subnormals). fp32 / fp16 activations decode in fp32 (`_raw_lo_hi`); fp16 multiplies the tile
back by 2^SHIFT before the cast (the weights must lie in fp16's range to be exact: |W| in [2^-14, 65504]).

Scheduling (CUDA-graph friendly: no host reads of the routing): grid (N tiles, row-tile slots, K splits).
Row tile t is the t-th BM-row tile over all experts in order (expert e has cdiv(rows_e, BM) of them); each
program finds its expert by a prefix sum over `offs` (E <= a few thousand: one vector op). The host sizes
the grid by the bound cdiv(S, BM) + min(E, S) on the number of row tiles; slots past the last tile and
experts without rows cost a program that exits after the search. So each decoded weight tile feeds BM rows
(prefill: BM = 256), and decode (BM = 16, one tile per active expert) streams each active expert's weights
once. With K splits > 1 each program sums a K range into an fp32 partial [split, S, N]; the host adds the
partials (a fixed order: deterministic) and casts. Rows at or past offs[-1] are not written.

Split rows (`Mxfp4Tiles.split_rows`, BM >= 128): an expert's last tile rarely fills BM rows (kimi-k3
prefill 8192: ~146 rows per expert in 256-row tiles, 43% of the MMA rows padding). A tile of n <= 3 BM / 4
rows takes a branch with narrower MMAs on the same decoded weight tile: one BM / 2-row dot for n <= BM / 2,
else a BM / 2-row dot plus a BM / 8- or BM / 4-row dot for the next rows -- each weight tile is still
decoded once per K step, and 146 rows cost 128 + 32 MMA rows.

`_mxfp4_dequant` decodes whole experts into a scratch (the same decode, both byte orders): the first half
of the many-rows-per-expert path of `k3.ops.mxfp4_gemm.mxfp4_grouped_mm` (`Mxfp4GemmConfig`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from k3.ops.triton_utils import INTERPRETED, cvt


SHIFT_BITS = 32  # bf16 / fp32 tiles are decoded as the weights times 2^-SHIFT_BITS (module docstring)
SHIFT: tl.constexpr = tl.constexpr(SHIFT_BITS)


@triton.jit
def _raw_lo_hi(p):
    """uint32 bytes (0..255) -> (low nibble, high nibble) as float32 E2M1 values times 2^-126.

    A nibble's 3 magnitude bits belong in the two lowest exponent bits and the top mantissa bit (bits
    22-24) and its sign in bit 31: code c = (e1 e0 m) then reads 2^(e-127) (1 + m/2) for e >= 1 and, as a
    float32 subnormal, m * 2^-127 for e = 0 -- the E2M1 value times 2^-126 in every case. One multiply
    places two copies of the nibble (shifted by 22 and 28 for the low one, 18 and 24 for the high one;
    the copies do not overlap) and one mask keeps bits 22-24 and 31: three integer ops per weight."""
    lo = ((p & 0x0F) * 0x10400000) & 0x81C00000
    hi = ((p & 0xF0) * 0x01040000) & 0x81C00000
    return lo.to(tl.float32, bitcast=True), hi.to(tl.float32, bitcast=True)


@triton.jit
def _e8m0_factor(s, SHIFT: tl.constexpr):
    """uint32 E8M0 bytes -> float32 2^(s - 127 + 126 - SHIFT): turns `_raw_lo_hi` values into the weights
    times 2^-SHIFT. Bytes above 128 + SHIFT (255 = the E8M0 NaN included) give inf: loud, never a
    wrong finite weight."""
    return (tl.minimum(s + (126 - SHIFT), 255) << 23).to(tl.float32, bitcast=True)


# bf16 decode of 4 packed bytes per asm instance (GPU): $4 = bytes b0..b3, $5 / $6 = the bf16 factors of
# the low nibbles of elements (0, 1) / (2, 3), $7 / $8 those of the high nibbles; out $0 / $1 = low
# nibbles of (b0, b1) / (b2, b3) as bf16 pairs, $2 / $3 = high nibbles. prmt spreads two bytes to the two 16-bit halves; per half the nibble's magnitude bits go to bits
# 6-8 (the two lowest exponent bits and the top mantissa bit) and its sign to bit 15 by one multiply (two
# non-overlapping copies) and one mask: the E2M1 value times 2^-126 as a bf16 (code 1 = 0.5 a subnormal,
# which bf16 arithmetic keeps), then one bf16x2 multiply by 2^(s - 1 - SHIFT) gives the weight times
# 2^-SHIFT exactly: three integer ops and half a multiply per weight.
_ASM_DECODE: tl.constexpr = tl.constexpr("""
{
.reg .b32 z, t0, t1, a0, a1, a2, a3;
mov.b32 z, 0;
prmt.b32 t0, $4, z, 0x4140;
prmt.b32 t1, $4, z, 0x4342;
and.b32 a0, t0, 0x000F000F;
and.b32 a1, t1, 0x000F000F;
and.b32 a2, t0, 0x00F000F0;
and.b32 a3, t1, 0x00F000F0;
mul.lo.u32 a0, a0, 0x1040;
mul.lo.u32 a1, a1, 0x1040;
mul.lo.u32 a2, a2, 0x104;
mul.lo.u32 a3, a3, 0x104;
and.b32 a0, a0, 0x81C081C0;
and.b32 a1, a1, 0x81C081C0;
and.b32 a2, a2, 0x81C081C0;
and.b32 a3, a3, 0x81C081C0;
mul.rn.bf16x2 $0, a0, $5;
mul.rn.bf16x2 $1, a1, $6;
mul.rn.bf16x2 $2, a2, $7;
mul.rn.bf16x2 $3, a3, $8;
}
""")


@triton.jit
def _k_order(t, BK: tl.constexpr, PERM: tl.constexpr):
    """t [R, BK / 2, 2] (K in order: byte j's two columns 2j, 2j + 1) -> [R, BK] in the kernel's K order
    (any permutation of K applied to both operands leaves the dot unchanged). In the wgmma register operand
    a thread holds columns 2q, 2q + 1 (one 32-bit register) plus multiples of 8 (q = lane % 4).
    PERM 0: K in order: the thread's bytes are every fourth byte (one narrow load each).
    PERM 3: K = (q, j, t, h) [4, BK / 16, 2, 2] -> (j, h, q, t): the thread's bytes are BK / 8 consecutive
    ones (one wide load), and a register pair holds the same nibble of two consecutive bytes (what
    `_ASM_DECODE` produces, so no shuffles)."""
    if PERM == 3:
        t = tl.reshape(t, (t.shape[0], 4, BK // 16, 2, 2))
        t = tl.permute(t, (0, 2, 4, 1, 3))
    return tl.reshape(t, (t.shape[0], BK))


@triton.jit
def _bf16_factor(s):
    """uint8 E8M0 bytes -> bf16 2^(s - 1 - SHIFT) (inf above 128 + SHIFT): `_ASM_DECODE`'s factors."""
    return (tl.minimum(s.to(tl.uint32) + (126 - SHIFT), 255) << 7).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _lo_hi(p, f_lo, f_hi, WDT: tl.constexpr, W_UP: tl.constexpr, ASM: tl.constexpr):
    """uint8 bytes p and the E8M0 bytes of their low / high nibbles (broadcastable) -> (low, high) nibbles'
    weights times W_UP * 2^-SHIFT in WDT (exact)."""
    if ASM:
        lo, hi = tl.inline_asm_elementwise(_ASM_DECODE, "=r,=r,=r,=r,r,r,r,r,r",
                                           [p, _bf16_factor(f_lo), _bf16_factor(f_hi)],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        lo, hi = _raw_lo_hi(p.to(tl.uint32))
        lo = lo * _e8m0_factor(f_lo.to(tl.uint32), SHIFT)
        hi = hi * _e8m0_factor(f_hi.to(tl.uint32), SHIFT)
        if W_UP != 1.0:  # fp16: the weights themselves (2^-SHIFT of them is below fp16's range)
            lo = lo * W_UP
            hi = hi * W_UP
        lo = cvt(lo, WDT)
        hi = cvt(hi, WDT)
    return lo, hi


@triton.jit
def _decode_tile(p, s, WDT: tl.constexpr, W_UP: tl.constexpr, BK: tl.constexpr, PERM: tl.constexpr,
                 ASM: tl.constexpr):
    """p uint8 [BN, G, 16] (16 bytes = one 32-element group; PERM 4: bytes in kernel order, `layout.py`),
    s uint8 [BN, G] E8M0 -> [BN, 32 G] of WDT in the kernel's K order (`_k_order`; PERM 4: K in order):
    the weights times W_UP * 2^-SHIFT. ASM (bf16, GPU only): `_ASM_DECODE`."""
    BN: tl.constexpr = p.shape[0]
    if PERM == 4:
        C: tl.constexpr = BK // 64
        s_lo, s_hi = tl.split(tl.reshape(s, (BN, C, 2)))  # chunk c's groups 2c (low nibbles), 2c + 1
        lo, hi = _lo_hi(tl.reshape(p, (BN, C, 4, 4, 2)), s_lo[:, :, None, None, None],
                        s_hi[:, :, None, None, None], WDT, W_UP, ASM)
        w = tl.permute(tl.join(lo, hi), (0, 1, 5, 3, 2, 4))  # [BN, c, q, j, t, h] -> [BN, c, h, j, q, t]
        return tl.reshape(w, (BN, BK))
    lo, hi = _lo_hi(p, s[:, :, None], s[:, :, None], WDT, W_UP, ASM)
    w = tl.join(lo, hi)  # [BN, G, 16, 2]: column 2j from byte j's low nibble, 2j + 1 from its high one
    return _k_order(tl.reshape(w, (BN, BK // 2, 2)), BK, PERM)


@triton.jit
def _find_tile(offs_ptr, E, t, EP: tl.constexpr, BM: tl.constexpr):
    """Row tile t over all experts (each expert's rows cut in BM-row tiles, experts in order) ->
    (expert, first row, the expert's end row); first row >= end row when there is no tile t."""
    es = tl.arange(0, EP)
    inb = es < E
    ends = tl.load(offs_ptr + es, mask=inb, other=0)
    starts = tl.load(offs_ptr + es - 1, mask=inb & (es > 0), other=0)
    tiles = tl.where(inb, (ends - starts + BM - 1) // BM, 0)
    cum = tl.cumsum(tiles, 0)
    e = tl.sum((cum <= t).to(tl.int32))  # experts whose tiles all come before tile t
    hit = es == e  # none when t is past the last tile
    first_tile = tl.sum(tl.where(hit, cum - tiles, 0))
    r0 = tl.sum(tl.where(hit, starts, 0)) + (t - first_tile) * BM
    r1 = tl.sum(tl.where(hit, ends, 0))
    return tl.minimum(e, E - 1), tl.where(e < E, r0, 0), r1


@triton.jit
def _x_part(X, m0, r1, stride_xm, BM: tl.constexpr, BK: tl.constexpr):
    """Pointers to the first K tile of rows m0 .. m0 + BM - 1 of X, and the mask of those below r1."""
    ms = m0 + tl.arange(0, BM)
    return X + ms.to(tl.int64)[:, None] * stride_xm + tl.arange(0, BK)[None, :], ms < r1


@triton.jit
def _x_tile(x_ptrs, mmask, kt, BM: tl.constexpr, BK: tl.constexpr, PERM: tl.constexpr):
    """K tile kt of a row part ([BM, BK], zero rows past the mask) in the kernel's K order."""
    xt = tl.load(x_ptrs + kt * BK, mask=mmask[:, None], other=0.0)
    if PERM != 4:  # kernel-order bytes are decoded in K order
        xt = _k_order(tl.reshape(xt, (BM, BK // 2, 2)), BK, PERM)
    return xt


@triton.jit
def _store_part(Y, acc, ks, m0, r1, ns, nmask, stride_ym, stride_ys, BM: tl.constexpr, Y_UP: tl.constexpr):
    """acc [BN, BM] (rows m0 .. m0 + BM - 1, those below r1 stored) times Y_UP = 2^SHIFT (1 for fp16):
    exact, undoes the weights' 2^-SHIFT."""
    ms = m0 + tl.arange(0, BM)
    y_ptrs = Y + ks.to(tl.int64) * stride_ys + ms.to(tl.int64)[None, :] * stride_ym + ns[:, None]
    tl.store(y_ptrs, cvt(acc * Y_UP, Y.dtype.element_ty), mask=nmask[:, None] & (ms < r1)[None, :])


@triton.jit
def _tile(X, P, S, Y, e, m0, r1, pn, ks, N, K, stride_xm, stride_ym, stride_ys, stride_pe, stride_pn,
          stride_se, stride_sn, BM: tl.constexpr, BMB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
          W_UP: tl.constexpr, Y_UP: tl.constexpr, F32_DOT: tl.constexpr, PERM: tl.constexpr,
          ASM: tl.constexpr):
    """Rows m0 .. min(m0 + BM + BMB, r1) - 1 of expert e times N tile pn over K split ks (`_mxfp4_gmm`):
    one decoded weight tile per K step feeds a BM-row dot and, if BMB > 0, a BMB-row dot for the next
    BMB rows (so an expert's 146 rows cost 128 + 32 MMA rows, not 256)."""
    # this program's K tiles (loop over tile indices: offsets are constant multiples, so the compiler
    # knows their alignment and vectorises the loads)
    kt_all = K // BK
    kt_per = tl.cdiv(kt_all, tl.num_programs(2))
    kt_lo = ks * kt_per
    kt_hi = tl.where(m0 < r1, tl.minimum(kt_all, kt_lo + kt_per), kt_lo)  # no rows: an empty loop
    G: tl.constexpr = BK // 32
    ns = pn * BN + tl.arange(0, BN)
    nmask = ns < N
    gs = tl.arange(0, G)
    e64 = e.to(tl.int64)
    p_ptrs = (P + e64 * stride_pe + ns.to(tl.int64)[:, None, None] * stride_pn + gs[None, :, None] * 16
              + tl.arange(0, 16)[None, None, :])
    s_ptrs = S + e64 * stride_se + ns.to(tl.int64)[:, None] * stride_sn + gs[None, :]
    x_ptrs, mmask = _x_part(X, m0, r1, stride_xm, BM, BK)
    acc = tl.zeros([BN, BM], tl.float32)
    if BMB > 0:
        xb_ptrs, mmask_b = _x_part(X, m0 + BM, r1, stride_xm, BMB, BK)
        acc_b = tl.zeros([BN, BMB], tl.float32)
    for kt in range(kt_lo, kt_hi):
        p = tl.load(p_ptrs + kt * (BK // 2), mask=nmask[:, None, None], other=0)
        s = tl.load(s_ptrs + kt * G, mask=nmask[:, None], other=127)
        xt = _x_tile(x_ptrs, mmask, kt, BM, BK, PERM)
        if F32_DOT or INTERPRETED:  # fp32 exactly; the interpreter's half-precision dot is wrong
            w = _decode_tile(p, s, tl.float32, W_UP, BK, PERM, False)
            acc = tl.dot(w, tl.trans(xt.to(tl.float32)), acc, input_precision="ieee")
            if BMB > 0:
                xb = _x_tile(xb_ptrs, mmask_b, kt, BMB, BK, PERM)
                acc_b = tl.dot(w, tl.trans(xb.to(tl.float32)), acc_b, input_precision="ieee")
        else:
            w = _decode_tile(p, s, xt.dtype, W_UP, BK, PERM, ASM and xt.dtype == tl.bfloat16)
            acc = tl.dot(w, tl.trans(xt), acc)
            if BMB > 0:
                acc_b = tl.dot(w, tl.trans(_x_tile(xb_ptrs, mmask_b, kt, BMB, BK, PERM)), acc_b)
    _store_part(Y, acc, ks, m0, r1, ns, nmask, stride_ym, stride_ys, BM, Y_UP)
    if BMB > 0:
        _store_part(Y, acc_b, ks, m0 + BM, r1, ns, nmask, stride_ym, stride_ys, BMB, Y_UP)


@triton.jit
def _mxfp4_gmm(X, P, S, Y, offs_ptr, N, K, E, stride_xm, stride_ym, stride_ys, stride_pe, stride_pn,
               stride_se, stride_sn, EP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
               W_UP: tl.constexpr, Y_UP: tl.constexpr, F32_DOT: tl.constexpr, PERM: tl.constexpr,
               ASM: tl.constexpr, SPLIT_ROWS: tl.constexpr):
    """Y[k split, r, n] = 2^SHIFT sum over k in the split's range of X[r, k] W_e[n, k] * 2^-SHIFT for the
    rows r of expert e. X [S, K] unit column stride; P uint8 [E, N, K/2], S uint8 [E, N, K/32] with unit
    last stride; BK (a power of two >= 32) divides K. Grid: (cdiv(N, BN), row-tile slots, K splits).
    SPLIT_ROWS (BM >= 128): a tile of n <= 3 BM / 4 rows (an expert's last) runs narrower MMAs on the one
    decoded weight tile: BM / 2 rows if n <= BM / 2, else BM / 2 + BM / 8 or BM / 2 + BM / 4."""
    pn = tl.program_id(0)
    e, m0, r1 = _find_tile(offs_ptr, E, tl.program_id(1), EP, BM)
    ks = tl.program_id(2)
    if SPLIT_ROWS:
        n = r1 - m0
        if n > (3 * BM) // 4:
            _tile(X, P, S, Y, e, m0, r1, pn, ks, N, K, stride_xm, stride_ym, stride_ys, stride_pe, stride_pn,
                  stride_se, stride_sn, BM, 0, BN, BK, W_UP, Y_UP, F32_DOT, PERM, ASM)
        elif n <= BM // 2:
            _tile(X, P, S, Y, e, m0, r1, pn, ks, N, K, stride_xm, stride_ym, stride_ys, stride_pe, stride_pn,
                  stride_se, stride_sn, BM // 2, 0, BN, BK, W_UP, Y_UP, F32_DOT, PERM, ASM)
        elif n <= BM // 2 + BM // 8:
            _tile(X, P, S, Y, e, m0, r1, pn, ks, N, K, stride_xm, stride_ym, stride_ys, stride_pe, stride_pn,
                  stride_se, stride_sn, BM // 2, BM // 8, BN, BK, W_UP, Y_UP, F32_DOT, PERM, ASM)
        else:
            _tile(X, P, S, Y, e, m0, r1, pn, ks, N, K, stride_xm, stride_ym, stride_ys, stride_pe, stride_pn,
                  stride_se, stride_sn, BM // 2, BM // 4, BN, BK, W_UP, Y_UP, F32_DOT, PERM, ASM)
    else:
        _tile(X, P, S, Y, e, m0, r1, pn, ks, N, K, stride_xm, stride_ym, stride_ys, stride_pe, stride_pn,
              stride_se, stride_sn, BM, 0, BN, BK, W_UP, Y_UP, F32_DOT, PERM, ASM)


@triton.jit
def _mxfp4_dequant(P, S, W, R, K, BR: tl.constexpr, BK: tl.constexpr, Y_UP: tl.constexpr,
                   PERM: tl.constexpr, ASM: tl.constexpr):
    """W[r, k] = decode(P[r], S[r])[k] for the rows r of P uint8 [R, K/2], S uint8 [R, K/32] (contiguous)
    into W [R, K] (contiguous): the weights times 2^-SHIFT decoded as in the GEMM, times Y_UP = 2^SHIFT
    in fp32 (exact), cast. Grid: (cdiv(R, BR), K / BK)."""
    rs = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    rmask = rs < R
    kt = tl.program_id(1)
    G: tl.constexpr = BK // 32
    gs = tl.arange(0, G)
    p = tl.load(P + rs[:, None, None] * (K // 2) + kt * (BK // 2) + gs[None, :, None] * 16
                + tl.arange(0, 16)[None, None, :], mask=rmask[:, None, None], other=0)
    s = tl.load(S + rs[:, None] * (K // 32) + kt * G + gs[None, :], mask=rmask[:, None], other=127)
    w = _decode_tile(p, s, tl.bfloat16 if ASM else tl.float32, 1.0, BK, PERM, ASM)
    tl.store(W + rs[:, None] * K + kt * BK + tl.arange(0, BK)[None, :],
             cvt(w.to(tl.float32) * Y_UP, W.dtype.element_ty), mask=rmask[:, None])


@dataclass(frozen=True)
class Mxfp4Tiles:
    """Tile shape and launch parameters. bm: rows per tile (>= 16), bn: weight rows (output columns) per
    tile (>= 16), bk: a power of two >= 32 (halved until it divides K), split_k: K ranges per tile summed
    through fp32 partials (1 = none; clipped to K / bk), perm: the K order (`_k_order`; 4 = kernel-order
    bytes), asm: the inline-PTX bf16 decode, split_rows: narrower MMAs for an expert's last tile of at
    most 3 bm / 4 rows (`_mxfp4_gmm`; bm >= 128)."""

    bm: int
    bn: int
    bk: int
    warps: int
    stages: int
    split_k: int = 1
    perm: int = 3
    asm: bool = True
    split_rows: bool = False

    def __post_init__(self):
        for name in ("bm", "bn", "bk"):
            v = getattr(self, name)
            if v < (32 if name == "bk" else 16) or v & (v - 1):
                raise ValueError(f"Mxfp4Tiles.{name} must be a power of two >= {32 if name == 'bk' else 16}, "
                                 f"got {v}")
        if min(self.warps, self.stages, self.split_k) < 1:
            raise ValueError(f"Mxfp4Tiles: warps, stages and split_k must be >= 1, got {self}")
        if self.perm not in (0, 3, 4):
            raise ValueError(f"Mxfp4Tiles.perm must be 0, 3 or 4, got {self.perm}")
        if self.perm == 4 and self.bk < 64:
            raise ValueError(f"Mxfp4Tiles: perm 4 (kernel-order bytes) needs bk >= 64, got {self.bk}")
        if self.split_rows and self.bm < 128:
            raise ValueError(f"Mxfp4Tiles: split_rows needs bm >= 128 (MMAs of bm / 8 >= 16 rows), got {self.bm}")


# Defaults from the tile sweep of `bench/mxfp4_gemm.py --sweep` on an H100 (k3-small and kimi-k3 expert
# shapes, decode 1-64 and prefill 8192; docs/quantization.md): split K never won by more than noise, a
# 256-row tile won every prefill shape.
# rows per expert (S / E) <= 16: weight streaming, each active expert's weights read once
DECODE_TILES = Mxfp4Tiles(bm=16, bn=128, bk=128, warps=4, stages=3)
# up to 64 rows per expert
MID_TILES = Mxfp4Tiles(bm=64, bn=128, bk=128, warps=4, stages=3)
# prefill: every decoded weight tile feeds 256 rows; an expert's partly filled last tile runs narrower MMAs
# (split rows: the winner at kimi-k3's ~146 rows per expert, docs/quantization.md). From
# `Mxfp4GemmConfig.dequant_rows_per_expert` rows per expert the decode + grouped_mm path takes over.
PREFILL_TILES = Mxfp4Tiles(bm=256, bn=128, bk=64, warps=8, stages=3, perm=0, split_rows=True)
# fewer decode programs than this leave SMs idle (an H100 has 132): narrower N tiles instead
MIN_PROGRAMS = 128


def pick_tiles(rows: int, experts: int, n: int, k: int) -> Mxfp4Tiles:
    """Tiles by rows per expert (host values only: S, E and the weight shape). At decode the N tile is
    halved (down to 64: wgmma's M) while the (N tiles x active experts) grid is smaller than MIN_PROGRAMS
    (k3-small at one token: 64 for N = 1024 and 512)."""
    per_expert = rows / max(experts, 1)
    if per_expert > 64:
        return PREFILL_TILES
    if per_expert > 16:
        return MID_TILES
    t = DECODE_TILES
    bn = t.bn
    while bn > 64 and triton.cdiv(n, bn) * max(1, min(experts, rows)) < MIN_PROGRAMS:
        bn //= 2
    return t if bn == t.bn else dataclasses.replace(t, bn=bn)


def _fit_bk(bk: int, K: int) -> int:
    bk = max(32, min(bk, triton.next_power_of_2(K)))
    while K % bk:
        bk //= 2
    return bk


def mxfp4_gmm_triton(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, offs: torch.Tensor,
                     tiles: Mxfp4Tiles | None = None, kernel_order: bool = False) -> torch.Tensor:
    """See `k3.ops.mxfp4_gemm.mxfp4_grouped_mm` (arguments checked there)."""
    S, K = x.shape
    E, N = packed.shape[:2]
    t = tiles or pick_tiles(S, E, N, K)
    if kernel_order != (t.perm == 4):
        if tiles is not None:
            raise ValueError(f"tiles.perm must be 4 exactly for kernel-order bytes (kernel_order={kernel_order}), "
                             f"got {t.perm}")
        t = dataclasses.replace(t, perm=4 if kernel_order else 3, bk=max(t.bk, 64))
    bk = _fit_bk(t.bk, K)
    if t.perm == 4 and (bk < 64 or K % 64):
        raise ValueError(f"kernel-order bytes need K a multiple of 64, got K = {K}")
    x = x if x.stride(1) == 1 else x.contiguous()
    up = float(2 ** SHIFT_BITS)
    w_up, y_up = (up, 1.0) if x.dtype == torch.float16 else (1.0, up)
    split = max(1, min(t.split_k, K // bk))
    y = torch.empty(S, N, dtype=x.dtype, device=x.device)
    out = y if split == 1 else torch.empty(split, S, N, dtype=torch.float32, device=x.device)
    slots = max(1, triton.cdiv(S, t.bm) + min(E, S))
    grid = (triton.cdiv(N, t.bn), slots, split)
    _mxfp4_gmm[grid](x, packed, scale, out, offs, N, K, E, x.stride(0), N, S * N, N * (K // 2), K // 2,
                     N * (K // 32), K // 32, EP=triton.next_power_of_2(E), BM=t.bm, BN=t.bn, BK=bk,
                     W_UP=w_up, Y_UP=y_up, F32_DOT=x.dtype == torch.float32, PERM=t.perm, ASM=t.asm,
                     SPLIT_ROWS=t.split_rows, num_warps=t.warps, num_stages=t.stages)
    if split > 1:
        torch.sum(out, 0, out=y) if x.dtype == torch.float32 else y.copy_(out.sum(0))
    return y


def mxfp4_dequant_triton(packed: torch.Tensor, scale: torch.Tensor, kernel_order: bool = False,
                         dtype: torch.dtype = torch.bfloat16, block_rows: int = 32, warps: int = 4) -> torch.Tensor:
    """packed uint8 [..., N, K/2] (official layout, or kernel order: K a multiple of 64), scale uint8
    [..., N, K/32], both contiguous -> the decoded weights [..., N, K] of dtype (bf16 / fp16 / fp32), K in
    order. Exact over the GEMM's scale range (E8M0 bytes 34..160; above: inf); a memory-bound pass (4.25
    bits read, 16 written per bf16 weight); a program decodes block_rows rows x 256 columns."""
    K = packed.shape[-1] * 2
    R = packed.numel() // max(packed.shape[-1], 1)
    w = torch.empty(*packed.shape[:-1], K, dtype=dtype, device=packed.device)
    if R == 0 or K == 0:
        return w
    bk = _fit_bk(256, K)
    perm = 4 if kernel_order else 0
    if perm == 4 and (bk < 64 or K % 64):
        raise ValueError(f"kernel-order bytes need K a multiple of 64, got K = {K}")
    br = block_rows
    asm = packed.is_cuda and dtype == torch.bfloat16
    _mxfp4_dequant[(triton.cdiv(R, br), K // bk)](packed, scale, w, R, K, BR=br, BK=bk,
                                                   Y_UP=float(2 ** SHIFT_BITS), PERM=perm, ASM=asm,
                                                   num_warps=warps)
    return w
