"""Triton building blocks of the split KDA forward intra-chunk kernels (fwd_intra): 2-D dots only.

* A and P by ROW block i (t in [16 i, 16 i + 16)), computed transposed (`_rowblock`).  Reference
  mid_i = G[16 i + 7] per channel:  exp(G_t - G_s) = exp(G_t - mid_i) * exp(mid_i - G_s), so
      P^T[:, block i] += (k e^(mid_i - G))[64, BK]  @  (q_i e^(G_i - mid_i))^T [BK, 16]
      A^T[:, block i] += (k e^(mid_i - G))[64, BK]  @  (k_i e^(G_i - mid_i))^T [BK, 16]
  The large left operand is shared by both dots.  Rows s >= 16 (i + 1) are masked before the
  exponential (they would overflow and feed only entries above the diagonal).
* For bf16 / fp16 inputs G is kept as G log2 e (exponentials are one ex2, `_ex`).
* UT inverse, exact, in three levels (`_ut_inverse`): 8x8 diagonal blocks by forward substitution
  (7 steps, all blocks at once), merged to 16x16 blocks (Td = T8 - T8 L8 T8), then
  T = (I + N)^-1 Td by Horner (N = Td L, N^4 = 0).
* "tf32r" operands are rounded to nearest by one integer add (`_half_up`) instead of the add +
  mask of triton_common (same values).
"""

from __future__ import annotations

import triton
import triton.language as tl

from k3.ops.kda.triton_common import (
    _dot,
    _exp,
    _exp2,
    _expw,
)


@triton.jit
def _half_up(x):
    """fp32 bits + 2^12: the tensor cores read an fp32 operand of a tf32 dot truncated to tf32
    (the low 13 bits ignored; Triton emits no cvt.rna), so this one integer add makes that read
    round to nearest, ties away, i.e. equal to _tf32_round(x), which needs an add and a mask."""
    return (x.to(tl.uint32, bitcast=True) + 0x1000).to(tl.float32, bitcast=True)


@triton.jit
def _cumdecay_scr(b_g, ACC: tl.constexpr):
    """Inclusive cumulative sum (a scan, exact in fp32) of the log-decay chunk b_g [64, BK] over its rows,
    in the scratch domain (see _ex: G for fp32 inputs (ACC), G log2 e otherwise)."""
    G = tl.cumsum(b_g, axis=0)
    if not ACC:
        G = G * 1.4426950408889634
    return G


@triton.jit
def _dotv(a, b, PREC: tl.constexpr):
    """_dot, with "tf32r" done by _half_up (the CPU interpreter's tf32 emulation truncates too, so it
    computes the same values)."""
    if PREC == "tf32r":
        return _dot(_half_up(a), _half_up(b), "tf32")
    else:
        return _dot(a, b, PREC)


@triton.jit
def _ex(x, ACC: tl.constexpr):
    """Exponential of a scratch-domain exponent: e^x for fp32 inputs (ACC: the scratch holds G),
    2^x otherwise (the scratch holds G log2 e, saving the scaling in every factor; its rounding,
    ulp(461) / 2 = 3e-5 relative in the factor, is far below the tf32 / half rounding there)."""
    if ACC:
        return _exp(x)
    else:
        return _exp2(x)


@triton.jit
def _exw(x, ACC: tl.constexpr):
    """As _ex for the wide-argument factors e^G, e^(gl - G) (fp32: the fma-corrected _expw)."""
    if ACC:
        return _expw(x, True)
    else:
        return _exp2(x)


@triton.jit
def _rowblock(gs, q, k, row64, nr, col0, i, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
              GSTRIDE: tl.constexpr, AP_PREC: tl.constexpr, ACC: tl.constexpr):
    """Contribution of key columns [col0, col0 + BK) to row block i of P and A, transposed, as one
    [64, 32] fp32 tile X: X[s, c] ~ P[16 i + c, s] for c < 16, X[s, 16 + c] ~ A[16 i + c, s], without
    the row / column scales (L2 norms, scale, beta: applied once after the key loop).  Also returns
    the squares of this column slice summed per row, for the L2 norms: [64] over the key rows s (k),
    [32] over the operand rows (q rows of block i, then k rows of block i); unused returns cost nothing.

    gs points at the chunk's cumulative decay G for these columns, rows GSTRIDE apart (v2: a [64, BK]
    scratch; split: column col0 of G in GS, row stride K); see _ex for its domain.  i may be a
    constexpr (v2) or a runtime value (split).  Reference mid_i = G[16 i + 7]: the [64, BK] left
    operand k e^(mid_i - G) serves P and A in one dot with the right operand [q_i | k_i]^T
    e^(G_i - mid_i) [BK, 32] (N = 32: half the wgmma groups of two N = 16 dots).  Rows s >= 16 (i + 1)
    of the left operand (above-diagonal entries only, factors that would overflow) are masked before
    the exponential.  Every operand is loaded here from memory (k, q from the input, G from the
    scratch / GS: L1 / L2 hits), so Triton places the loads directly in the dot-operand layouts
    instead of converting register tiles."""
    o_t = tl.arange(0, 64)
    o_c = tl.arange(0, BK)
    o32 = tl.arange(0, 32)
    mid = tl.load(gs + (16 * i + 7) * GSTRIDE + o_c)
    Gl = tl.load(gs + o_t[:, None] * GSTRIDE + o_c[None, :])
    kl = tl.load(k + (row64 + o_t.to(tl.int64)[:, None] * H) * K + col0 + o_c[None, :],
                 mask=(o_t < nr)[:, None], other=0.0).to(tl.float32)
    kc = kl * _ex(tl.where(o_t[:, None] < 16 * (i + 1), mid[None, :] - Gl, -1.0e30), ACC)
    # right operand, transposed [BK, 32]: rows 16 i .. 16 i + 15 of q, then of k, times e^(G - mid_i)
    rows = 16 * i + o32 % 16
    Gi = tl.load(gs + rows[None, :] * GSTRIDE + o_c[:, None])
    midc = tl.load(gs + (16 * i + 7) * GSTRIDE + o_c)
    offs = (row64 + rows.to(tl.int64)[None, :] * H) * K + col0 + o_c[:, None]
    src = tl.where((o32 < 16)[None, :], q + offs, k + offs)
    qk = tl.load(src, mask=(rows < nr)[None, :], other=0.0).to(tl.float32)
    X = _dotv(kc, qk * _ex(Gi - midc[:, None], ACC), AP_PREC)
    return X, tl.sum(kl * kl, axis=1), tl.sum(qk * qk, axis=0)


@triton.jit
def _ut_inverse(a, scr, T_PREC: tl.constexpr):
    """T = (I + A)^-1 [64, 64] fp32 of the strictly lower A stored row-major at a (fp32, row stride
    64; the caller has synchronised).  scr[0:1024] (fp32) is the workspace for the stacked 16x16
    diagonal blocks; it may be a itself (A is read first, then a barrier).  The caller must
    synchronise before writing scr again."""
    o_t = tl.arange(0, 64)
    o_s = tl.arange(0, 64)
    o16 = tl.arange(0, 16)
    # Exact, in three levels (A strictly lower; blocks of 8, 16, 64 rows):
    #  1. the 8x8 diagonal blocks by forward substitution, all eight at once: row r of every block
    #     becomes e_r - sum_{s<r} A8[r, s] T8[s, :] (7 dependent steps);
    #  2. the 16x16 diagonal blocks: Td = T8 - T8 L8 T8 with L8 the lower-left 8x8 part of each
    #     16-block (exact: (T8 L8)^2 = 0);
    #  3. T = (I + N)^-1 Td = Td - N (Td - N (Td - N Td)) with N = Td L, L the strictly block-lower
    #     part at 16-row granularity (N^4 = 0).
    # Diagonal-block matrices live as stacked [64, 16] block columns (row t holds row t % 16 of
    # its block); the block-diagonal [64, 64] form is gathered from the scratch when needed.
    Ab = tl.load(a + o_t[:, None] * 64 + o_s[None, :])
    b16t = (o_t // 16)[:, None]
    b16s = (o_s // 16)[None, :]
    A8 = tl.where((o_t // 8)[:, None] == (o_s // 8)[None, :], Ab, 0.0)
    L8 = tl.where((b16t == b16s) & ((o_t // 8)[:, None] != (o_s // 8)[None, :]), Ab, 0.0)
    L = tl.where(b16t > b16s, Ab, 0.0)
    I16 = tl.where((o_t % 16)[:, None] == o16[None, :], 1.0, 0.0)
    Ts = I16
    for r in range(1, 8):
        Ts = tl.where((o_t % 8 == r)[:, None], I16 - _dotv(A8, Ts, T_PREC), Ts)
    tl.debug_barrier()  # A reads done
    tl.store(scr + o_t[:, None] * 16 + o16[None, :], Ts)
    tl.debug_barrier()
    same = b16t == b16s
    T8f = tl.load(scr + o_t[:, None] * 16 + (o_s % 16)[None, :], mask=same, other=0.0)
    Ts = Ts - _dotv(T8f, _dotv(L8, Ts, T_PREC), T_PREC)
    tl.debug_barrier()  # T8 reads done
    tl.store(scr + o_t[:, None] * 16 + o16[None, :], Ts)
    tl.debug_barrier()
    Tdf = tl.load(scr + o_t[:, None] * 16 + (o_s % 16)[None, :], mask=same, other=0.0)
    N = _dotv(Tdf, L, T_PREC)
    Z = Tdf - _dotv(N, Tdf, T_PREC)
    Z = Tdf - _dotv(N, Z, T_PREC)
    b_T = Tdf - _dotv(N, Z, T_PREC)
    return b_T
