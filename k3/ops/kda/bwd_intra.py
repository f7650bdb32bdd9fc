"""Split KDA backward intra-chunk kernels (Triton): small programs, 2-D dots only.

Inputs: the saved per-chunk state S, its gradient DH, Vn, dR from `_kda_bwd_state` (bwd_state.py);
outputs dq, dk, dg, dbeta (and the gate-parameter sums).  Three launches:

  1. `_kda_bwd_values`, grid (chunks, H): dP = dO Vn^T (kept for t >= s) and dA = -dR Vn^T
     (t > s), stored fp32 chunk-major to DPA [NC, H, 2, 64, 64]; per-row vectors to ROWS
     [NC, H, 4, 64] fp32: 1/||q||, 1/||k|| (L2), dO . O (= q_hat . dq_hat, L2) and beta's value
     share sum_v dR v.
  2. `_kda_bwd_keys`, grid (chunks * K/BK, H), one program per key chunk of BK columns (the key
     chunk varies fastest, so the programs of a chunk share dP / dO / Vn / dR in L2): prologue
     (gate, cumulative decay G, norms, beta), the A/P backward factorised by COLUMN block j (key
     rows s in [16 j, 16 j + 16), reference m_j = G at row 16 j + 7, per channel):
         exp(G_t - G_s) = exp(G_t - m_j) * exp(m_j - G_s)   for t >= s;
     row side (q_t, beta_t k_t):  F_j * (dP[:, blk j] @ (k_j exp(m_j - G_j)))      [64,16]x[16,BK]
     column side (k_s, s in j):   exp(m_j - G_j) * (dP[:, blk j]^T @ (scale q F_j)
                                                    + dA[:, blk j]^T @ (beta k F_j))  [16,64]x[64,BK]
     with F_j = exp(G - m_j) on rows t >= 16 j and 0 above (masked BEFORE the exponential: those
     rows would overflow).  Both factors stay within exp(+-40) for the rows that contribute (see
     triton_common), and no product is computed for a structurally zero block pair more than the
     masks of a 16-wide slice imply (no 4x redundant tensor work).  16-row slices of G go through an
     fp32 scratch WS [NC, H, 64, K] (this program's own [64, BK] block, re-read after a barrier:
     bit-identical to the registers' G), the column results through a second one, WC, so that the
     loop needs no barrier and Triton software-pipelines its loads (num_stages 2, as the state loop's;
     docs/kda_kernels.md).  Then the state terms
     dqg = dO S^T, dkg = Vn dS'^T, dXw = -dR S^T (bf16 / fp16 dots), dG, the reverse
     cumsum to dg, the gate backward; row sums that need all K (beta's key share, k_hat . dk_hat)
     are written per key chunk to PART [NC, H, K/BK, 2, 64] (deterministic: no atomics).
  3. `_kda_bwd_finish`, grid (chunks, H): dbeta (partials summed in key-chunk order, sigmoid
     backward) and, with the L2 norm over several key chunks, the dk projection of dk_hat (kept in
     WS meanwhile).

Dot shapes (Triton 3.6 / sm_90): every fp32 (tf32 / tf32x3) dot with M = 64 has N = BK, split over
num_warps / 4 warpgroups; N per warpgroup must stay >= 16 (tf32 wgmma with N = 8 is mis-padded,
triton-lang/triton#10629), so BK >= 4 * num_warps is enforced by the launcher.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3.ops.kda.triton_common import (
    INTERPRETED,
    _beta,
    _chunk,
    _cvt,
    _dot,
    _exp,
    _expw,
    _gate,
    _ld,
    _ld_state,
    _ldc,
    _rnorms,
    _sdot,
    _st,
    _tf32_round,
    _tf32_trunc,
)


@triton.jit
def _tdot(a, b, acc):
    """acc + a @ b on the tf32 tensor cores (fp32 operands, which the hardware truncates to tf32;
    the interpreter emulates that)."""
    if INTERPRETED:
        return tl.dot(_tf32_trunc(a), _tf32_trunc(b), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision="tf32")


@triton.jit
def _dot3(a, b, PREC: tl.constexpr, HAND: tl.constexpr):
    """a @ b of fp32 operands at PREC, fp32 accumulation.  With HAND, "tf32x3" is done by hand:
    hi = a rounded to the nearest tf32 (two integer ops), lo = a - hi (exact, truncated to tf32 by
    the tensor cores), three tf32 products, small ones first: on the GPU the same accuracy as
    Triton's tf32x3, whose split (cvt.rna emulated with inf / nan checks) costs about twice the
    instructions per element.  Under the interpreter HAND emulates that truncation, while Triton's
    tf32x3 runs as an exact fp32 dot there: fp32 inputs (not the speed target) keep Triton's split
    so that their CPU tests keep the fused kernel's margins (fp32 varlen test: ddt_bias 2.0e-5 with
    HAND vs 1.4e-5, limit 2e-5).  Other PREC go to _dot."""
    if PREC == "tf32x3" and HAND:
        ah = _tf32_round(a)
        bh = _tf32_round(b)
        acc = _tdot(ah, b - bh, tl.zeros([a.shape[0], b.shape[1]], dtype=tl.float32))
        acc = _tdot(a - ah, bh, acc)
        return _tdot(ah, bh, acc)
    else:
        return _dot(a, b, PREC)


@triton.jit
def _kda_bwd_values(
    q, k, v, do, o, VN, DR, DPA, ROWS, cu_seqlens, chunk_info,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    L2: tl.constexpr, S_PREC: tl.constexpr,
):
    """dP, dA [64, 64] fp32 -> DPA[tile] (masked causal); ROWS[tile] = (rq, rk, rowq, dbv) [4, 64]."""
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    row64, nr, tile = _chunk(cu_seqlens, chunk_info, i_c, i_h, H)
    o_t = tl.arange(0, 64)
    dP = tl.zeros([64, 64], dtype=tl.float32)
    dA = tl.zeros([64, 64], dtype=tl.float32)
    dbv = tl.zeros([64], dtype=tl.float32)
    rowq = tl.zeros([64], dtype=tl.float32)
    for vc in range(V // BV):
        b_do = _ld(do, row64, nr, vc * BV, H, V, BV)
        if L2:  # q_hat . dq_hat = dO . O  (O is linear in q_hat)
            rowq += tl.sum(b_do.to(tl.float32) * _ld(o, row64, nr, vc * BV, H, V, BV).to(tl.float32), axis=1)
        b_vnt = tl.trans(_ldc(VN, tile, vc * BV, V, BV))
        b_dr = _ldc(DR, tile, vc * BV, V, BV)
        dP += _sdot(b_do, b_vnt, S_PREC)
        dA -= _sdot(b_dr, b_vnt, S_PREC)
        dbv += tl.sum(b_dr.to(tl.float32) * _ld(v, row64, nr, vc * BV, H, V, BV).to(tl.float32), axis=1)
    offs = o_t[:, None] * 64 + o_t[None, :]
    dpa = DPA + tile * 8192
    tl.store(dpa + offs, tl.where(o_t[:, None] >= o_t[None, :], dP, 0.0))
    tl.store(dpa + 4096 + offs, tl.where(o_t[:, None] > o_t[None, :], dA, 0.0))
    rows = ROWS + tile * 256
    if L2:
        rq, rk = _rnorms(q, k, row64, nr, H, K, BK, L2)
        tl.store(rows + o_t, rq)
        tl.store(rows + 64 + o_t, rk)
        tl.store(rows + 128 + o_t, rowq)
    tl.store(rows + 192 + o_t, dbv)


@triton.jit
def _kda_bwd_keys(
    q, k, g, beta, A_log, dt_bias, Hs, DH, VN, DR, do, DPA, ROWS, WS, WC,
    dq, dk, dg, PART, dA_part, ddt_part, cu_seqlens, chunk_info, scale, lower_bound,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    GATE: tl.constexpr, L2: tl.constexpr, BSIG: tl.constexpr,
    AP_PREC: tl.constexpr, S_PREC: tl.constexpr, CUMDOT: tl.constexpr, HAND: tl.constexpr,
    AP_STAGES: tl.constexpr, AP_UNROLL: tl.constexpr, S_STAGES: tl.constexpr,
):
    """Every key-side gradient of key columns [i_k BK, i_k BK + BK) of one (chunk, head).

    Writes dq, dg (token-major, storage dtype), dk (or dk_hat fp32 into WS when L2 spans several
    key chunks), PART[tile, i_k] = (beta's key share, k_hat . dk_hat) [2, 64] fp32,
    dA_part[tile, i_k] and ddt_part[tile, cols] (gate)."""
    NK = K // BK
    i_c = tl.program_id(0) // NK
    i_k = tl.program_id(0) % NK
    i_h = tl.program_id(1)
    row64, nr, tile = _chunk(cu_seqlens, chunk_info, i_c, i_h, H)
    col0 = i_k * BK
    o_t = tl.arange(0, 64)
    o16 = tl.arange(0, 16)
    o_c = tl.arange(0, BK)
    m_t = o_t < nr
    rows = ROWS + tile * 256

    # Register budget: at most ~7 [64, BK] fp32 tiles live anywhere.  q and k are re-read
    # (L1 / L2 hits) where needed instead of being kept live through both loops.  Their loads are
    # issued before the cumulative decay so that one memory round trip covers all of them.
    graw = _ld(g, row64, nr, col0, H, K, BK).to(tl.float32)
    b_b = _beta(beta, row64, m_t, H, BSIG)
    if L2:
        rq = tl.load(rows + o_t)
        rk = tl.load(rows + 64 + o_t)
    else:
        rq = tl.full([64], 1.0, tl.float32)
        rk = tl.full([64], 1.0, tl.float32)
    qs = _ld(q, row64, nr, col0, H, K, BK).to(tl.float32) * (rq * scale)[:, None]
    kb = _ld(k, row64, nr, col0, H, K, BK).to(tl.float32) * (rk * b_b)[:, None]

    # ---- cumulative decay (kept in WS: 16-row slices are re-read bit-identical) ---------------
    b_g = _gate(graw, A_log, dt_bias, i_h, col0, m_t, lower_bound, K, BK, GATE)
    if CUMDOT:  # tf32x3 dot with the exact 0/1 lower triangle: no scan across warps
        G = _dot((o_t[None, :] <= o_t[:, None]).to(tl.float32), b_g, "tf32x3")
    else:
        G = tl.cumsum(b_g, axis=0)
    # gl must be G's last row bit for bit: kg = k e^(gl - G) is exactly k there
    gl = tl.sum(tl.where((o_t == 63)[:, None], G, 0.0), axis=0)
    ws = WS + tile * (64 * K) + col0
    offs = o_t[:, None] * K + o_c[None, :]
    tl.store(ws + offs, G)
    tl.debug_barrier()

    # ---- intra-chunk A / P backward, one 16-row column block j at a time ----------------------
    # acc_q / acc_a: row-side gradients w.r.t. the operands scale q_t (of P) and beta_t k_t (of A);
    # the column side's [16, BK] results (gradient w.r.t. k_s, already times exp(m_j - G_s))
    # replace block j's rows of G in WS.  Addresses: a loop-variant scalar base plus loop-invariant int32 offset tiles (a
    # hoisted tile of 64-bit pointers would cost two registers per element).
    dpa = DPA + tile * 8192
    o_row = o_t[:, None] * 64 + o16[None, :]  # dP[:, blk j] / dA[:, blk j]   [64, 16]
    o_col = o16[:, None] + o_t[None, :] * 64  # their transposes              [16, 64]
    o_ws = o16[:, None] * K + o_c[None, :]    # rows of block j in WS         [16, BK]
    o_k = o16[:, None] * (H * K) + o_c[None, :]
    kbase = k + row64 * K + col0
    acc_q = tl.zeros([64, BK], dtype=tl.float32)
    acc_a = tl.zeros([64, BK], dtype=tl.float32)
    wc = WC + tile * (64 * K) + col0
    for j in tl.range(0, 4, num_stages=AP_STAGES, loop_unroll_factor=AP_UNROLL):
        r0 = j * 16
        m = tl.load(ws + (r0 + 7) * K + o_c)
        e_j = _exp(m[None, :] - tl.load(ws + r0 * K + o_ws))
        k_j = tl.load(kbase + r0 * (H * K) + o_k, mask=(r0 + o16 < nr)[:, None], other=0.0).to(tl.float32)
        if L2:
            k_j = k_j * tl.load(rows + 64 + r0 + o16)[:, None]
        kc_j = k_j * e_j
        F = _exp(tl.where(o_t[:, None] >= r0, G - m[None, :], -1.0e30))
        acc_q += F * _dot3(tl.load(dpa + r0 + o_row), kc_j, AP_PREC, HAND)
        acc_a += F * _dot3(tl.load(dpa + 4096 + r0 + o_row), kc_j, AP_PREC, HAND)
        c_j = _dot3(tl.load(dpa + r0 + o_col), qs * F, AP_PREC, HAND) \
            + _dot3(tl.load(dpa + 4096 + r0 + o_col), kb * F, AP_PREC, HAND)
        tl.store(wc + r0 * K + o_ws, e_j * c_j)
    tl.debug_barrier()
    dkc = tl.load(wc + offs)

    # ---- state terms: dqg = dO S^T, dkg = Vn dS'^T, dXw = -dR S^T ------------------------------
    hbase = tile * (K * V)
    dqg = tl.zeros([64, BK], dtype=tl.float32)
    dkg = tl.zeros([64, BK], dtype=tl.float32)
    dxw = tl.zeros([64, BK], dtype=tl.float32)
    dgl_s = tl.zeros([BK], dtype=tl.float32)
    for vc in tl.range(0, V // BV, num_stages=S_STAGES):
        b_h = _ld_state(Hs, hbase, col0, vc * BV, V, BK, BV)
        b_dh = _ld_state(DH, hbase, col0, vc * BV, V, BK, BV)
        b_ht = tl.trans(b_h)
        dqg += _sdot(_ld(do, row64, nr, vc * BV, H, V, BV), b_ht, S_PREC)
        dkg += _sdot(_ldc(VN, tile, vc * BV, V, BV), tl.trans(b_dh), S_PREC)
        dxw -= _sdot(_ldc(DR, tile, vc * BV, V, BV), b_ht, S_PREC)
        dgl_s += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), axis=1)

    # ---- combine: qg = scale q e^G, kg = k e^(gl - G), Xw = beta k e^G (R = beta v - Xw S) ----
    # X: gradient w.r.t. the beta k operands (Xw, A's rows), Y: w.r.t. the k operands (kg, the
    # columns of A and P); dk = Y + beta X, dG = q dq + k (beta X - Y), dbeta_k = sum_c k X.
    eG = _expw(G, q.dtype.element_ty == tl.float32)
    b_dq = scale * (acc_q + eG * dqg)
    X = acc_a + eG * dxw
    dkg = _expw(gl[None, :] - G, q.dtype.element_ty == tl.float32) * dkg
    b_q = _ld(q, row64, nr, col0, H, K, BK).to(tl.float32) * rq[:, None]
    b_k = _ld(k, row64, nr, col0, H, K, BK).to(tl.float32) * rk[:, None]
    dgl = tl.sum(b_k * dkg, axis=0) + _expw(gl, q.dtype.element_ty == tl.float32) * dgl_s
    Y = dkc + dkg
    b_dk = Y + b_b[:, None] * X
    b_dG = b_q * b_dq + b_k * (b_b[:, None] * X - Y)
    db = tl.sum(b_k * X, axis=1)
    b_dG += tl.where((o_t == 63)[:, None], dgl[None, :], 0.0)
    b_dg = tl.cumsum(b_dG, axis=0, reverse=True)
    if GATE:  # g = lb sigmoid(z), z = e^A_log (f + dt_bias)
        a = _exp(tl.load(A_log + i_h).to(tl.float32))
        bias = tl.load(dt_bias + i_h * K + col0 + o_c).to(tl.float32)
        # f re-read rather than kept live through both loops
        z = a * (_ld(g, row64, nr, col0, H, K, BK).to(tl.float32) + bias[None, :])
        s = 1.0 / (1.0 + _exp(-z))
        dz = tl.where(m_t[:, None], b_dg * lower_bound * s * (1.0 - s), 0.0)
        _st(dg, row64, nr, col0, dz * a, H, K, BK)
        tl.store(ddt_part + tile * K + col0 + o_c, tl.sum(dz * a, axis=0))
        tl.store(dA_part + tile * NK + i_k, tl.sum(tl.sum(dz * z, axis=1), axis=0))
    else:
        _st(dg, row64, nr, col0, b_dg, H, K, BK)
    part = PART + (tile * NK + i_k) * 128
    tl.store(part + o_t, db)
    if L2:
        b_dq = rq[:, None] * (b_dq - b_q * tl.load(rows + 128 + o_t)[:, None])
    _st(dq, row64, nr, col0, b_dq, H, K, BK)
    if L2 and NK > 1:  # k_hat . dk_hat needs every key chunk: the finish kernel projects
        tl.store(part + 64 + o_t, tl.sum(b_k * b_dk, axis=1))
        tl.debug_barrier()  # WS's column results were read by other threads
        tl.store(ws + offs, b_dk)
    else:
        if L2:
            b_dk = rk[:, None] * (b_dk - b_k * tl.sum(b_k * b_dk, axis=1)[:, None])
        _st(dk, row64, nr, col0, b_dk, H, K, BK)


@triton.jit
def _kda_bwd_finish(
    k, beta, ROWS, PART, WS, dk, dbeta, cu_seqlens, chunk_info,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, NK: tl.constexpr,
    L2: tl.constexpr, BSIG: tl.constexpr,
):
    """dbeta = (sum_v dR v + sum over key chunks of the key shares) [* sigmoid'], and with L2 over
    several key chunks dk = (dk_hat - k_hat (k_hat . dk_hat)) / ||k||."""
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    row64, nr, tile = _chunk(cu_seqlens, chunk_info, i_c, i_h, H)
    o_t = tl.arange(0, 64)
    m_t = o_t < nr
    rows = ROWS + tile * 256
    db = tl.load(rows + 192 + o_t)
    rowk = tl.zeros([64], dtype=tl.float32)
    for i in range(NK):
        part = PART + (tile * NK + i) * 128
        db += tl.load(part + o_t)
        if L2 and NK > 1:
            rowk += tl.load(part + 64 + o_t)
    if BSIG:
        b_b = _beta(beta, row64, m_t, H, BSIG)
        db = db * b_b * (1.0 - b_b)
    tl.store(dbeta + row64 + o_t.to(tl.int64) * H, _cvt(db, dbeta.dtype.element_ty), mask=m_t)
    if L2 and NK > 1:
        rk = tl.load(rows + 64 + o_t)
        for kc in range(NK):
            b_k = _ld(k, row64, nr, kc * BK, H, K, BK).to(tl.float32) * rk[:, None]
            dkh = _ldc(WS, tile, kc * BK, K, BK)
            _st(dk, row64, nr, kc * BK, rk[:, None] * (dkh - b_k * rowk[:, None]), H, K, BK)


# (BK, warps) of the key kernel: a [64, 32] fp32 tile is 16 registers per thread, so the ~10 live tiles
# leave room for 2-3 programs per SM, and every tf32 dot has N = 32 on its one warpgroup (tests set others).
TILES = (32, 4)
# Software pipelining of the key kernel's A/P and state loops (the column results go to their own scratch WC).
AP_STAGES, AP_UNROLL, S_STAGES = 2, 1, 2


def split_tiles(K: int) -> tuple[int, int]:
    """(BK, warps) of the key kernel for key dim K: TILES, BK capped at K, read at call time."""
    bk, warps = TILES
    bk = min(K, bk)
    if bk < 4 * warps:
        raise ValueError(f"split backward: BK {bk} with {warps} warps gives tf32 wgmma N < 16 per "
                         "warpgroup (Triton 3.6 mis-pads N = 8, triton-lang/triton#10629); use BK >= 4 * warps")
    return bk, warps


def kda_bwd_intra(q, k, v, g, beta, A_log, dt_bias, Hs, DH, VN, DR, do, o, dq, dk, dg, dbeta,
                        meta, scale: float, lower_bound: float, l2: bool, bsig: bool, ap_prec: str,
                        s_prec: str):
    """Launch the three split kernels; fills dq, dk, dg, dbeta in place.

    Returns (dA_log [H] fp32, ddt_bias [H, K] fp32) sums when the gate is in the kernel, else
    (None, None).  Scratch (fp32): DPA [NC, H, 2, 64, 64], ROWS [NC, H, 4, 64], WS [NC, H, 64, K],
    PART [NC, H, K/BK, 2, 64]."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    NC, dev = meta.NC, q.device
    gate = A_log is not None
    bk, warps = split_tiles(K)
    nk = K // bk
    f32 = dict(device=dev, dtype=torch.float32)
    DPA = torch.empty(NC, H, 2, 64, 64, **f32)
    ROWS = torch.empty(NC, H, 4, 64, **f32)
    WS = torch.empty(NC, H, 64, K, **f32)
    PART = torch.empty(NC, H, nk, 2, 64, **f32)
    dA_part = torch.zeros(NC, H, nk, **f32) if gate else ROWS
    ddt_part = torch.zeros(NC, H, K, **f32) if gate else ROWS
    bv = min(V, 64)
    _kda_bwd_values[(NC, H)](
        q, k, v, do, o, VN, DR, DPA, ROWS, meta.cu_seqlens, meta.chunk_info,
        H=H, K=K, V=V, BK=min(K, 64), BV=bv, L2=l2, S_PREC=s_prec, num_warps=4,
    )
    # bf16 / fp16: cumulative decay as a tf32x3 dot with the 0/1 triangle (faster, bf16 errors unchanged
    # to 3 digits); fp32 inputs keep the scan (more accurate there)
    half = q.dtype != torch.float32
    cumdot = half
    WC = torch.empty(NC, H, 64, K, **f32)
    _kda_bwd_keys[(NC * nk, H)](
        q, k, g, beta, A_log if gate else ROWS, dt_bias if gate else ROWS, Hs, DH, VN, DR, do, DPA,
        ROWS, WS, WC, dq, dk, dg, PART, dA_part, ddt_part, meta.cu_seqlens, meta.chunk_info,
        scale, lower_bound,
        H=H, K=K, V=V, BK=bk, BV=bv, GATE=gate, L2=l2, BSIG=bsig, AP_PREC=ap_prec, S_PREC=s_prec,
        CUMDOT=cumdot, HAND=half, AP_STAGES=AP_STAGES, AP_UNROLL=AP_UNROLL,
        S_STAGES=S_STAGES, num_warps=warps, num_stages=1,
    )
    _kda_bwd_finish[(NC, H)](
        k, beta, ROWS, PART, WS, dk, dbeta, meta.cu_seqlens, meta.chunk_info,
        H=H, K=K, BK=bk, NK=nk, L2=l2, BSIG=bsig, num_warps=4,
    )
    if gate:
        return dA_part.sum((0, 2)), ddt_part.sum(0)
    return None, None
