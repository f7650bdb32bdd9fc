"""KDA forward intra-chunk kernel, version 2: 2-D dots only (select with K3_KDA_FWD_INTRA=v2).

Same contract as `triton_fwd._kda_fwd_intra` (outputs W, U, P, QG, KG, GL and, when STORE_T, the
transposed T; same dtypes, padding and precision knobs); different organisation:

* A and P by ROW block i (t in [16 i, 16 i + 16)), computed transposed.  Reference mid_i = G[16 i + 7]
  per channel:  exp(G_t - G_s) = exp(G_t - mid_i) * exp(mid_i - G_s), so
      P^T[:, block i] += (k e^(mid_i - G))[64, BK]  @  (q_i e^(G_i - mid_i))^T [BK, 16]
      A^T[:, block i] += (k e^(mid_i - G))[64, BK]  @  (k_i e^(G_i - mid_i))^T [BK, 16]
  The large left operand is shared by both dots (with a column-block reference it would not be:
  q and beta k would each need four [64, BK] factor tiles).  Rows s >= 16 (i + 1) are masked
  before the exponential (they would overflow and feed only entries above the diagonal); the
  factor bounds are version 1's (e^35 / e^40 at per-step decay -5).  Every dot is 2-D with
  M = 64, N = 16 (a valid tf32 wgmma with 4 warps = one warpgroup); the eight [64, 16]
  accumulators keep one layout through the key loop.  L2 norms, scale and beta are applied to
  the accumulators once at the end (row / column scales), so the operands use the raw inputs.
* G of the key chunk goes to a per-program fp32 scratch (the Tm tile) and every use reads it
  back after a barrier: 16-row slices and mid_i rows are bit-identical to the 64-row G, and the
  loads land directly in the layout each dot operand needs (no register layout conversions in
  the key loop).  For bf16 / fp16 inputs the scratch holds G log2 e (exponentials are one ex2).
* qg = scale q e^G, kg = k e^(gl - G), gl and Xw = beta k e^G come out of the same key pass (none
  depends on T); Xw waits in an fp32 buffer (W itself for fp32 inputs).  After the inverse the
  second pass is only W = T Xw (and U = T beta v).
* UT inverse, exact, in three levels: 8x8 diagonal blocks by forward substitution (7 steps, all
  blocks at once), merged to 16x16 blocks (Td = T8 - T8 L8 T8), then T = (I + N)^-1 Td by Horner
  (N = Td L, N^4 = 0).  Block-diagonal matrices are kept as stacked [64, 16] block columns and
  expanded through the scratch.
* "tf32r" operands are rounded by one integer add (_half_up); K3_KDA_V2_RADD=0 restores the
  add + mask rounding of triton_common (same values; a fallback in case a GPU reads tf32
  operands other than by truncation).
"""

from __future__ import annotations

import triton
import triton.language as tl

from k3.ops.kda.triton_common import (
    _beta,
    _chunk,
    _cvt,
    _dot,
    _exp,
    _exp2,
    _expw,
    _gate,
    _ld,
    _rnorms,
    _stc,
    _tf32_round,
)


@triton.jit
def _half_up(x):
    """fp32 bits + 2^12: the tensor cores read an fp32 operand of a tf32 dot truncated to tf32
    (the low 13 bits ignored; Triton emits no cvt.rna), so this one integer add makes that read
    round to nearest, ties away, i.e. equal to _tf32_round(x), which needs an add and a mask."""
    return (x.to(tl.uint32, bitcast=True) + 0x1000).to(tl.float32, bitcast=True)


@triton.jit
def _cumdecay_scr(b_g, CUMDOT: tl.constexpr, RADD: tl.constexpr, ACC: tl.constexpr):
    """Inclusive cumulative sum of the log-decay chunk b_g [64, BK] over its rows, in the scratch
    domain (see _ex: G for fp32 inputs (ACC), G log2 e otherwise).  CUMDOT: a dot with the 0/1 lower
    triangle.  The triangle is exact in tf32, so two tf32 products (b_g's tf32 head and its
    remainder) reach tf32x3's accuracy with one product less (the remainder rounded to nearest:
    unbiased, |err| <= 2^-22 |g|).  Otherwise a scan."""
    if CUMDOT:
        o_t = tl.arange(0, 64)
        tri = (o_t[None, :] <= o_t[:, None]).to(tl.float32)
        g_hi = _tf32_round(b_g)
        if RADD:
            G = _dot(tri, g_hi, "tf32") + _dot(tri, _half_up(b_g - g_hi), "tf32")
        else:
            G = _dot(tri, g_hi, "tf32") + _dot(tri, b_g - g_hi, "tf32r")
    else:
        G = tl.cumsum(b_g, axis=0)
    if not ACC:
        G = G * 1.4426950408889634
    return G


@triton.jit
def _dotv(a, b, PREC: tl.constexpr, RADD: tl.constexpr):
    """_dot, with "tf32r" done by _half_up when RADD (the CPU interpreter's tf32 emulation
    truncates too, so it computes the same values)."""
    if PREC == "tf32r" and RADD:
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
              GSTRIDE: tl.constexpr, AP_PREC: tl.constexpr, ACC: tl.constexpr, RADD: tl.constexpr):
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
    X = _dotv(kc, qk * _ex(Gi - midc[:, None], ACC), AP_PREC, RADD)
    return X, tl.sum(kl * kl, axis=1), tl.sum(qk * qk, axis=0)


@triton.jit
def _scale_store(P, scr, tile, X, rs, i: tl.constexpr):
    """Row block i of P and A from the transposed tile X [64, 32] (see _rowblock): scale (row s:
    rs = k norm; column: scale q norm for P from scr[64:128], beta k norm for A from scr[128:192]),
    mask to the triangles, store the P half (input dtype) into the padded [64, 64] P tile and the A
    half (fp32) into scr (row stride 64; the caller has synchronised)."""
    o_s = tl.arange(0, 64)
    o32 = tl.arange(0, 32)
    isp = (o32 < 16)[None, :]
    t = 16 * i + o32 % 16
    X = X * rs[:, None] * tl.load(scr + 64 + (o32 // 16) * 64 + t)[None, :]
    pv = tl.where(o_s[:, None] <= t[None, :], X, 0.0)
    tl.store(P + tile * 4096 + t[None, :] * 64 + o_s[:, None], _cvt(pv, P.dtype.element_ty), mask=isp)
    return tl.where(o_s[:, None] < t[None, :], X, 0.0)


@triton.jit
def _st_ablock(scr, X, i: tl.constexpr):
    """Store the A half of X (row block i of A, transposed) into the scratch (row stride 64)."""
    o_s = tl.arange(0, 64)
    o32 = tl.arange(0, 32)
    tl.store(scr + (16 * i + o32 % 16)[None, :] * 64 + o_s[:, None], X, mask=(o32 >= 16)[None, :])


@triton.jit
def _ut_inverse(a, scr, T_PREC: tl.constexpr, RADD: tl.constexpr):
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
        Ts = tl.where((o_t % 8 == r)[:, None], I16 - _dotv(A8, Ts, T_PREC, RADD), Ts)
    tl.debug_barrier()  # A reads done
    tl.store(scr + o_t[:, None] * 16 + o16[None, :], Ts)
    tl.debug_barrier()
    same = b16t == b16s
    T8f = tl.load(scr + o_t[:, None] * 16 + (o_s % 16)[None, :], mask=same, other=0.0)
    Ts = Ts - _dotv(T8f, _dotv(L8, Ts, T_PREC, RADD), T_PREC, RADD)
    tl.debug_barrier()  # T8 reads done
    tl.store(scr + o_t[:, None] * 16 + o16[None, :], Ts)
    tl.debug_barrier()
    Tdf = tl.load(scr + o_t[:, None] * 16 + (o_s % 16)[None, :], mask=same, other=0.0)
    N = _dotv(Tdf, L, T_PREC, RADD)
    Z = Tdf - _dotv(N, Tdf, T_PREC, RADD)
    Z = Tdf - _dotv(N, Z, T_PREC, RADD)
    b_T = Tdf - _dotv(N, Z, T_PREC, RADD)
    return b_T


@triton.jit
def _kda_fwd_intra_v2(
    q, k, v, g, beta, A_log, dt_bias,
    W, U, P, QG, KG, GL, Tm, XW,
    cu_seqlens, chunk_info,
    scale, lower_bound,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    GATE: tl.constexpr, L2: tl.constexpr, BSIG: tl.constexpr, STORE_T: tl.constexpr,
    AP_PREC: tl.constexpr, T_PREC: tl.constexpr, CUMDOT: tl.constexpr, RADD: tl.constexpr,
):
    """One (chunk, head) program.  Inputs token-major (q, k, g [T, H, K], v [T, H, V], beta [T, H]);
    outputs chunk-major padded: W, QG, KG [NC, H, 64, K], U [NC, H, 64, V], P [NC, H, 64, 64] (input
    dtype), GL [NC, H, K] fp32, Tm [NC, H, 64, 64] fp32 (T^T when STORE_T, else scratch only; it is
    the scratch in any case), XW [NC, H, 64, K] fp32 scratch for beta k e^G (may alias W when W is
    fp32).  BK <= 64 (the G scratch is a [64, BK] slice of the Tm tile)."""
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    row64, nr, tile = _chunk(cu_seqlens, chunk_info, i_c, i_h, H)
    scr = Tm + tile * 4096
    xw = XW + tile * (64 * K)
    o_t = tl.arange(0, 64)
    o_s = tl.arange(0, 64)
    o_c = tl.arange(0, BK)
    m_t = o_t < nr
    ACC: tl.constexpr = q.dtype.element_ty == tl.float32

    b_b = _beta(beta, row64, m_t, H, BSIG)
    rq, rk = _rnorms(q, k, row64, nr, H, K, BK, L2)

    # ---- key pass: A, P row blocks (transposed); qg, kg, gl, Xw ----
    X0 = tl.zeros([64, 32], dtype=tl.float32)
    X1 = tl.zeros([64, 32], dtype=tl.float32)
    X2 = tl.zeros([64, 32], dtype=tl.float32)
    X3 = tl.zeros([64, 32], dtype=tl.float32)
    for kc in range(K // BK):
        col0 = kc * BK
        b_q = _ld(q, row64, nr, col0, H, K, BK).to(tl.float32)
        b_k = _ld(k, row64, nr, col0, H, K, BK).to(tl.float32)
        b_g = _gate(_ld(g, row64, nr, col0, H, K, BK).to(tl.float32), A_log, dt_bias, i_h, col0, m_t,
                    lower_bound, K, BK, GATE)
        G = _cumdecay_scr(b_g, CUMDOT, RADD, ACC)
        tl.debug_barrier()  # the previous key chunk's scratch reads are done
        tl.store(scr + o_t[:, None] * BK + o_c[None, :], G)
        tl.debug_barrier()
        # Everything below reads G back from the scratch: the loads land in the layout each use
        # wants (no conversions of the dot's accumulator layout), and all slices are bit-identical.
        G = tl.load(scr + o_t[:, None] * BK + o_c[None, :])
        # gl: G's last row bit for bit (kg = k e^(gl - G) is exactly k there)
        gl = tl.load(scr + 63 * BK + o_c)
        eG = _exw(G, ACC)
        b_kn = b_k * rk[:, None]
        _stc(QG, tile, col0, b_q * (rq * scale)[:, None] * eG, K, BK)
        _stc(KG, tile, col0, b_kn * _exw(gl[None, :] - G, ACC), K, BK)
        if ACC:
            tl.store(GL + tile * K + col0 + o_c, gl)
        else:
            tl.store(GL + tile * K + col0 + o_c, gl * 0.6931471805599453)
        tl.store(xw + o_t[:, None] * K + col0 + o_c[None, :], b_kn * b_b[:, None] * eG)
        X0 += _rowblock(scr, q, k, row64, nr, col0, 0, H, K, BK, BK, AP_PREC, ACC, RADD)[0]
        X1 += _rowblock(scr, q, k, row64, nr, col0, 1, H, K, BK, BK, AP_PREC, ACC, RADD)[0]
        X2 += _rowblock(scr, q, k, row64, nr, col0, 2, H, K, BK, BK, AP_PREC, ACC, RADD)[0]
        X3 += _rowblock(scr, q, k, row64, nr, col0, 3, H, K, BK, BK, AP_PREC, ACC, RADD)[0]

    # row / column scales through the scratch (16-element slices in the accumulators' layout)
    tl.debug_barrier()  # G scratch reads done
    tl.store(scr + o_t, rk)
    tl.store(scr + 64 + o_t, rq * scale)
    tl.store(scr + 128 + o_t, b_b * rk)
    tl.debug_barrier()
    rs = tl.load(scr + o_s)
    X0 = _scale_store(P, scr, tile, X0, rs, 0)
    X1 = _scale_store(P, scr, tile, X1, rs, 1)
    X2 = _scale_store(P, scr, tile, X2, rs, 2)
    X3 = _scale_store(P, scr, tile, X3, rs, 3)
    tl.debug_barrier()  # scale reads done before A overwrites them
    _st_ablock(scr, X0, 0)
    _st_ablock(scr, X1, 1)
    _st_ablock(scr, X2, 2)
    _st_ablock(scr, X3, 3)
    tl.debug_barrier()

    # ---- T = (I + A)^-1 (_ut_inverse) ----
    b_T = _ut_inverse(scr, scr, T_PREC, RADD)
    if STORE_T:  # transposed: the backward needs T^T dVn
        tl.debug_barrier()  # Td reads done
        tl.store(scr + o_s[None, :] * 64 + o_t[:, None], b_T)

    # ---- W = T Xw, U = T beta v ----
    for kc in tl.static_range(K // BK):
        b_x = tl.load(xw + o_t[:, None] * K + kc * BK + o_c[None, :])
        _stc(W, tile, kc * BK, _dotv(b_T, b_x, T_PREC, RADD), K, BK)
    for vc in tl.static_range(V // BV):
        b_v = _ld(v, row64, nr, vc * BV, H, V, BV).to(tl.float32)
        _stc(U, tile, vc * BV, _dotv(b_T, b_v * b_b[:, None], T_PREC, RADD), V, BV)
