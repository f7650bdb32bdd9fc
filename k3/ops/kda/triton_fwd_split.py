"""Split KDA forward intra-chunk kernels (Triton): small programs, 2-D dots only.

Replacement for `_kda_fwd_intra_v2` (triton_fwd_v2.py), selected with env K3_KDA_FWD_INTRA=split;
same inputs and the same outputs (W, U, P, QG, KG, GL and, when training, the transposed T in Tm;
same dtypes, chunk-major padded layouts, varlen, in-kernel gate, L2 norm, sigmoid beta, precision
knobs).  v2 runs one latency-bound program per (chunk, head) (~250 registers, 2 CTAs per SM, the
key loop, the inverse and W / U in one dependent chain); here the work is cut into four launches
whose programs are short and light, so that more of them share an SM and hide each other's
latency:

  0. `_kda_fwd_rows`, grid (chunks, H): per-row scales ROWS [NC, H, 4, 64] fp32 =
     (1/||k||, scale/||q||, beta/||k||, beta) (norms 1 without L2; beta after the sigmoid).  The
     only kernel that reads whole rows of q and k for the norms (once).
  1. `_kda_fwd_keys`, grid (chunks * K/BK, H), key chunk fastest: for its BK columns the gate, the
     cumulative decay G (stored fp32 into GS [NC, H, 64, K]; for bf16 / fp16 inputs as G log2 e,
     see triton_fwd_v2._ex), qg = scale q e^G / ||q||, kg = k e^(gl - G) / ||k||, gl.
  2. `_kda_fwd_ap`, grid (chunks * 4, H), row block fastest: row block i (rows 16 i .. 16 i + 15)
     of P and A over all key columns, v2's transposed row-block dots (reference mid_i = G[16 i + 7]):
         X[:, block i] += (k e^(mid_i - G))[64, BK] @ ([q_i | k_i] e^(G_i - mid_i))^T [BK, 32]
     with G read back from GS (the same fp32 bits the keys kernel used: no partial sums over key
     chunks are needed, so nothing is reduced across programs and no fp32 partials travel through
     memory).  Scaled by ROWS, masked, P rows stored (input dtype), A rows stored fp32 into ABUF
     (the Tm tile unless NS > 1).
  3. `_kda_fwd_finish`, grid (chunks * NS, H): the exact UT inverse of v2 (`_ut_inverse`), T^T into
     Tm when training, then W = T (beta k e^G / ||k||) (Xw rebuilt from k, GS and ROWS instead of
     being stored) and U = T (beta v).  With NS > 1 the NS programs of a (chunk, head) each redo the
     inverse (A in a separate buffer, a private 4 KB workspace each) and take every NS-th column
     block of W / U.

Deterministic: every output element is written by exactly one program, sums run in a fixed order,
no atomics.  GS, ROWS, Tm (and with NS > 1 ABUF, INVW) are fp32 scratch; for fp32 inputs GS is W
itself (the finish kernel reads a column block of G before writing that block of W, in the same
program).

Dot shapes (Triton 3.6 / sm_90): the keys kernel's cumulative-decay dots have N = BK, the row-block
dots N = 32, the inverse N = 16 / 64 (finish kernel: always 4 warps), W / U N = BK / BV.  With w
warps, N is split over w / 4 warpgroups and tf32 wgmma must keep N >= 16 per warpgroup
(triton-lang/triton#10629), hence BK >= 4 * warps (checked by `split_tiles`).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from k3.ops.kda.triton_common import (
    _beta,
    _cvt,
    _dot,
    _gate,
    _ld,
    _rnorms,
    _stc,
    _tf32_round,
)
from k3.ops.kda.triton_fwd_v2 import _dotv, _ex, _exw, _half_up, _ut_inverse


@triton.jit
def _chunk(cu_seqlens, chunk_info, i_c, i_h, H: tl.constexpr):
    """(row64, nr, tile) of chunk i_c, head i_h: first token row (int64, token-major), number of
    valid rows (may exceed 64), chunk-major tile index (int64)."""
    i_n = tl.load(chunk_info + 2 * i_c)
    start = tl.load(chunk_info + 2 * i_c + 1)
    nr = tl.load(cu_seqlens + i_n + 1) - start
    return start.to(tl.int64) * H + i_h, nr, i_c.to(tl.int64) * H + i_h


@triton.jit
def _kda_fwd_rows(
    q, k, beta, ROWS, cu_seqlens, chunk_info, scale,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, L2: tl.constexpr, BSIG: tl.constexpr,
):
    """ROWS[tile] [4, 64] fp32 = (rk, rq * scale, beta * rk, beta); rows past the end: beta 0."""
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    row64, nr, tile = _chunk(cu_seqlens, chunk_info, i_c, i_h, H)
    o_t = tl.arange(0, 64)
    b_b = _beta(beta, row64, o_t < nr, H, BSIG)
    rq, rk = _rnorms(q, k, row64, nr, H, K, BK, L2)
    rows = ROWS + tile * 256
    tl.store(rows + o_t, rk)
    tl.store(rows + 64 + o_t, rq * scale)
    tl.store(rows + 128 + o_t, b_b * rk)
    tl.store(rows + 192 + o_t, b_b)


@triton.jit
def _kda_fwd_keys(
    q, k, g, A_log, dt_bias, QG, KG, GL, GS, ROWS, cu_seqlens, chunk_info, lower_bound,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, GATE: tl.constexpr, CUMDOT: tl.constexpr,
    RADD: tl.constexpr,
):
    """Key columns [i_k BK, i_k BK + BK) of one (chunk, head): G -> GS [64, BK] (scratch domain),
    qg, kg -> QG, KG (input dtype, all 64 rows), gl -> GL (fp32, natural log domain)."""
    NK: tl.constexpr = K // BK
    i_c = tl.program_id(0) // NK
    i_k = tl.program_id(0) % NK
    i_h = tl.program_id(1)
    row64, nr, tile = _chunk(cu_seqlens, chunk_info, i_c, i_h, H)
    col0 = i_k * BK
    o_t = tl.arange(0, 64)
    o_c = tl.arange(0, BK)
    m_t = o_t < nr
    ACC: tl.constexpr = q.dtype.element_ty == tl.float32
    b_g = _gate(_ld(g, row64, nr, col0, H, K, BK).to(tl.float32), A_log, dt_bias, i_h, col0, m_t,
                lower_bound, K, BK, GATE)
    if CUMDOT:
        # as triton_fwd_v2: the 0/1 triangle is exact in tf32, two products (head + rounded
        # remainder) reach tf32x3's accuracy
        tri = (o_t[None, :] <= o_t[:, None]).to(tl.float32)
        g_hi = _tf32_round(b_g)
        if RADD:
            G = _dot(tri, g_hi, "tf32") + _dot(tri, _half_up(b_g - g_hi), "tf32")
        else:
            G = _dot(tri, g_hi, "tf32") + _dot(tri, b_g - g_hi, "tf32r")
    else:
        G = tl.cumsum(b_g, axis=0)
    if not ACC:
        G = G * 1.4426950408889634  # scratch domain (triton_fwd_v2._ex)
    tl.store(GS + tile * (64 * K) + o_t[:, None] * K + col0 + o_c[None, :], G)
    # gl: G's last row bit for bit (kg = k e^(gl - G) is exactly k there)
    gl = tl.sum(tl.where((o_t == 63)[:, None], G, 0.0), axis=0)
    rows = ROWS + tile * 256
    rk = tl.load(rows + o_t)
    rqs = tl.load(rows + 64 + o_t)
    b_q = _ld(q, row64, nr, col0, H, K, BK).to(tl.float32)
    _stc(QG, tile, col0, b_q * rqs[:, None] * _exw(G, ACC), K, BK)
    b_kn = _ld(k, row64, nr, col0, H, K, BK).to(tl.float32) * rk[:, None]
    _stc(KG, tile, col0, b_kn * _exw(gl[None, :] - G, ACC), K, BK)
    if ACC:
        tl.store(GL + tile * K + col0 + o_c, gl)
    else:
        tl.store(GL + tile * K + col0 + o_c, gl * 0.6931471805599453)


@triton.jit
def _rowblock(gs, q, k, row64, nr, col0, i, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
              AP_PREC: tl.constexpr, ACC: tl.constexpr, RADD: tl.constexpr):
    """Unscaled contribution of key columns [col0, col0 + BK) to row block i of P and A, transposed,
    as one [64, 32] fp32 tile X: X[s, c] ~ P[16 i + c, s] (c < 16), X[s, 16 + c] ~ A[16 i + c, s].

    gs points at column col0 of the (chunk, head)'s G in GS (row stride K).  As triton_fwd_v2's
    _rowblock (there G sits in a [64, BK] scratch), i is a runtime value here.  Rows s >= 16 (i + 1)
    of the left operand (above-diagonal entries only, whose factors would overflow) are masked
    before the exponential.  Operands are loaded from memory (L1 / L2 hits) in the layouts the dot
    wants."""
    o_t = tl.arange(0, 64)
    o_c = tl.arange(0, BK)
    o32 = tl.arange(0, 32)
    mid = tl.load(gs + (16 * i + 7) * K + o_c)
    Gl = tl.load(gs + o_t[:, None] * K + o_c[None, :])
    kl = tl.load(k + (row64 + o_t.to(tl.int64)[:, None] * H) * K + col0 + o_c[None, :],
                 mask=(o_t < nr)[:, None], other=0.0).to(tl.float32)
    kc = kl * _ex(tl.where(o_t[:, None] < 16 * (i + 1), mid[None, :] - Gl, -1.0e30), ACC)
    # right operand, transposed [BK, 32]: rows 16 i .. 16 i + 15 of q, then of k, times e^(G - mid_i)
    rows = 16 * i + o32 % 16
    Gi = tl.load(gs + rows[None, :] * K + o_c[:, None])
    midc = tl.load(gs + (16 * i + 7) * K + o_c)
    offs = (row64 + rows.to(tl.int64)[None, :] * H) * K + col0 + o_c[:, None]
    src = tl.where((o32 < 16)[None, :], q + offs, k + offs)
    qk = tl.load(src, mask=(rows < nr)[None, :], other=0.0).to(tl.float32) * _ex(Gi - midc[:, None], ACC)
    return _dotv(kc, qk, AP_PREC, RADD)


@triton.jit
def _kda_fwd_ap(
    q, k, P, ABUF, GS, ROWS, cu_seqlens, chunk_info,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, AP_PREC: tl.constexpr, RADD: tl.constexpr,
):
    """Row block i of P [64, 64] (input dtype, rows 16 i .. 16 i + 15, causal incl. the diagonal) and
    of the strictly lower A (fp32, ABUF tile, row stride 64)."""
    i_c = tl.program_id(0) // 4
    i = tl.program_id(0) % 4
    i_h = tl.program_id(1)
    row64, nr, tile = _chunk(cu_seqlens, chunk_info, i_c, i_h, H)
    ACC: tl.constexpr = q.dtype.element_ty == tl.float32
    gs = GS + tile * (64 * K)
    X = tl.zeros([64, 32], dtype=tl.float32)
    for kc in range(K // BK):
        X += _rowblock(gs + kc * BK, q, k, row64, nr, kc * BK, i, H, K, BK, AP_PREC, ACC, RADD)
    # row scale (key row s): 1/||k_s||; column scale (row t of P / A): scale/||q_t||, beta_t/||k_t||
    o_s = tl.arange(0, 64)
    o32 = tl.arange(0, 32)
    rows = ROWS + tile * 256
    t = 16 * i + o32 % 16
    X = X * tl.load(rows + o_s)[:, None] * tl.load(rows + 64 + (o32 // 16) * 64 + t)[None, :]
    isp = (o32 < 16)[None, :]
    offs = tile * 4096 + t[None, :] * 64 + o_s[:, None]
    tl.store(P + offs, _cvt(tl.where(o_s[:, None] <= t[None, :], X, 0.0), P.dtype.element_ty), mask=isp)
    tl.store(ABUF + offs, tl.where(o_s[:, None] < t[None, :], X, 0.0), mask=(o32 >= 16)[None, :])


@triton.jit
def _kda_fwd_finish(
    k, v, W, U, Tm, ABUF, INVW, GS, ROWS, cu_seqlens, chunk_info,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    NS: tl.constexpr, STORE_T: tl.constexpr, T_PREC: tl.constexpr, RADD: tl.constexpr,
):
    """T = (I + A)^-1 (T^T -> Tm when STORE_T), W = T Xw [64, K], U = T beta v [64, V]; program j of
    the NS programs of a (chunk, head) writes the column blocks b (W blocks first, then U) with
    b % NS == j.  NS == 1: ABUF is Tm (A read, then the workspace, then T^T)."""
    i_c = tl.program_id(0) // NS
    j = tl.program_id(0) % NS
    i_h = tl.program_id(1)
    row64, nr, tile = _chunk(cu_seqlens, chunk_info, i_c, i_h, H)
    o_t = tl.arange(0, 64)
    o_c = tl.arange(0, BK)
    ACC: tl.constexpr = k.dtype.element_ty == tl.float32
    if NS == 1:
        b_T = _ut_inverse(Tm + tile * 4096, Tm + tile * 4096, T_PREC, RADD)
    else:
        b_T = _ut_inverse(ABUF + tile * 4096, INVW + (tile * NS + j) * 1024, T_PREC, RADD)
    if STORE_T:  # transposed: the backward needs T^T dVn
        if NS == 1:
            tl.debug_barrier()  # the inverse's workspace reads are done
            tl.store(Tm + tile * 4096 + o_t[None, :] * 64 + o_t[:, None], b_T)
        else:
            if j == 0:  # T from every program is the same; one writes it
                tl.store(Tm + tile * 4096 + o_t[None, :] * 64 + o_t[:, None], b_T)
    rows = ROWS + tile * 256
    rk = tl.load(rows + o_t)
    b_b = tl.load(rows + 192 + o_t)
    gs = GS + tile * (64 * K)
    for kc in tl.static_range(K // BK):
        if kc % NS == j:
            # Xw = beta k e^G / ||k|| (as v2 writes it), rebuilt from G in GS
            b_kn = _ld(k, row64, nr, kc * BK, H, K, BK).to(tl.float32) * rk[:, None]
            G = tl.load(gs + o_t[:, None] * K + kc * BK + o_c[None, :])
            _stc(W, tile, kc * BK, _dotv(b_T, b_kn * b_b[:, None] * _exw(G, ACC), T_PREC, RADD), K, BK)
    for vc in tl.static_range(V // BV):
        if (K // BK + vc) % NS == j:
            b_v = _ld(v, row64, nr, vc * BV, H, V, BV).to(tl.float32)
            _stc(U, tile, vc * BV, _dotv(b_T, b_v * b_b[:, None], T_PREC, RADD), V, BV)


def split_tiles(K: int) -> tuple[int, int, int]:
    """(BK, warps of the keys / A-P kernels, NS); env K3_KDA_BK_FWDSPLIT (default 32, at most 64),
    K3_KDA_WARPS_FWDSPLIT (default 4), K3_KDA_NS_FWDSPLIT (default 1) override."""
    bk = min(K, 64, int(os.environ.get("K3_KDA_BK_FWDSPLIT", "32")))
    warps = int(os.environ.get("K3_KDA_WARPS_FWDSPLIT", "4"))
    ns = int(os.environ.get("K3_KDA_NS_FWDSPLIT", "1"))
    if bk < 4 * warps:
        raise ValueError(f"split forward: BK {bk} with {warps} warps gives tf32 wgmma N < 16 per "
                         "warpgroup (Triton 3.6 mis-pads N = 8, triton-lang/triton#10629); use BK >= 4 * warps")
    if ns < 1:
        raise ValueError(f"K3_KDA_NS_FWDSPLIT must be >= 1, got {ns}")
    return bk, warps, ns


def kda_fwd_intra_split(q, k, v, g, beta, A_log, dt_bias, W, U, P, QG, KG, GL, Tm, meta, scale: float,
                        lower_bound: float, l2: bool, bsig: bool, store_t: bool, ap_prec: str,
                        t_prec: str, cumdot: bool, radd: bool):
    """Launch the four split kernels; fills W, U, P, QG, KG, GL and Tm (fp32 [NC, H, 64, 64], T^T
    when store_t, else scratch) in place.

    Scratch (fp32): ROWS [NC, H, 4, 64]; GS [NC, H, 64, K] (W itself for fp32 inputs); with
    NS > 1 also ABUF [NC, H, 64, 64] and INVW [NC, H, NS, 64, 16]."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    NC, dev = meta.NC, q.device
    gate = A_log is not None
    bk, warps, ns = split_tiles(K)
    f32 = dict(device=dev, dtype=torch.float32)
    ROWS = torch.empty(NC, H, 4, 64, **f32)
    GS = W if q.dtype == torch.float32 else torch.empty(NC, H, 64, K, **f32)
    if ns > 1:
        ABUF = torch.empty(NC, H, 64, 64, **f32)
        INVW = torch.empty(NC, H, ns, 64, 16, **f32)
    else:
        ABUF = INVW = Tm
    cu, ci = meta.cu_seqlens, meta.chunk_info
    _kda_fwd_rows[(NC, H)](
        q, k, beta, ROWS, cu, ci, scale, H=H, K=K, BK=min(K, 64), L2=l2, BSIG=bsig, num_warps=4,
    )
    _kda_fwd_keys[(NC * (K // bk), H)](
        q, k, g, A_log if gate else ROWS, dt_bias if gate else ROWS, QG, KG, GL, GS, ROWS, cu, ci,
        lower_bound, H=H, K=K, BK=bk, GATE=gate, CUMDOT=cumdot, RADD=radd, num_warps=warps, num_stages=1,
    )
    _kda_fwd_ap[(NC * 4, H)](
        q, k, P, ABUF, GS, ROWS, cu, ci, H=H, K=K, BK=bk, AP_PREC=ap_prec, RADD=radd,
        num_warps=warps, num_stages=1,
    )
    _kda_fwd_finish[(NC * ns, H)](
        k, v, W, U, Tm, ABUF, INVW, GS, ROWS, cu, ci, H=H, K=K, V=V, BK=bk, BV=min(V, 64), NS=ns,
        STORE_T=store_t, T_PREC=t_prec, RADD=radd, num_warps=4, num_stages=1,
    )
