"""Split KDA forward intra-chunk kernels (Triton): small programs, 2-D dots only.

Outputs W, U, P, QG, KG, GL and, when training, the transposed T in Tm (chunk-major padded layouts,
varlen, in-kernel gate, L2 norm, sigmoid beta).  The work is cut into three launches whose programs
are short and light, so that several share an SM and hide each other's latency (one program per
(chunk, head) doing everything is latency-bound; docs/kda_kernels.md):

  1. `_kda_fwd_keys`, grid (chunks * K/BK, H), key chunk fastest: for its BK columns the gate and
     the cumulative decay G -> GS [NC, H, 64, K] fp32 (for bf16 / fp16 inputs as G log2 e, see
     fwd_intra_blocks._ex), gl -> GL.  Reads g only.
  2. `_kda_fwd_ap`, grid (chunks * 4, H), row block fastest: row block i (rows 16 i .. 16 i + 15)
     of P and A over all key columns with the transposed row-block dots (reference
     mid_i = G[16 i + 7]):
         X[:, block i] += (k e^(mid_i - G))[64, BK] @ ([q_i | k_i] e^(G_i - mid_i))^T [BK, 32]
     G read back from GS (the bits the keys kernel wrote).  Splitting by row block instead of by
     key chunk leaves nothing to reduce across programs: no fp32 partial A / P through memory
     (with K/BK key-chunk programs those would be K/BK x 32 KB per (chunk, head), ~1.6 GB written
     and read at B1 T8192 H96 K128).  The L2 norms are summed from the same loads (whole rows of k,
     the rows of block i of q), so q and k need no separate norm pass.  Then: scale, mask, P rows
     (input dtype), A rows (fp32, in the Tm tile), ROWS [NC, H, 4, 64] fp32 =
     (1/||k||, scale/||q||, beta/||k||, beta) for the rows of block i, and qg = scale q e^G / ||q||,
     kg = k e^(gl - G) / ||k|| for the rows of block i (a second pass over the key chunks).
  3. `_kda_fwd_finish`, grid (chunks, H): the exact three-level UT inverse (`_ut_inverse`), T^T into
     Tm when training, W = T (beta k e^G / ||k||) (Xw rebuilt from k, GS and ROWS) and U = T (beta v).

Deterministic: every output element is written by exactly one program, every sum runs in a fixed
order, no atomics.  Scratch (fp32): GS (W itself for fp32 inputs: the finish kernel reads a column
block of G before it writes that block of W, in the same program), ROWS, Tm (also without
training).

Dot shapes (Triton 3.6 / sm_90): the keys kernel's cumulative-decay dots have N = BK, the row-block
dots N = 32, the inverse N = 16 / 64 (finish kernel: always 4 warps), W / U N = BK / BV.  With w
warps N is split over w / 4 warpgroups and tf32 wgmma must keep N >= 16 per warpgroup
(triton-lang/triton#10629), hence BK >= 4 * warps (checked by `split_tiles`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3.ops.kda.triton_common import (
    _chunk,
    _cvt,
    _exp,
    _gate,
    _ld,
    _stc,
)
from k3.ops.kda.fwd_intra_blocks import _cumdecay_scr, _dotv, _exw, _rowblock, _ut_inverse


@triton.jit
def _kda_fwd_keys(
    g, A_log, dt_bias, GL, GS, cu_seqlens, chunk_info, lower_bound,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, GATE: tl.constexpr, ACC: tl.constexpr,
):
    """Key columns [i_k BK, i_k BK + BK) of one (chunk, head): the gate and the cumulative decay
    G -> GS [64, BK] (fp32, scratch domain: G for fp32 inputs (ACC), G log2 e otherwise), gl = G's
    last row -> GL (fp32, natural log)."""
    NK: tl.constexpr = K // BK
    i_c = tl.program_id(0) // NK
    i_k = tl.program_id(0) % NK
    i_h = tl.program_id(1)
    row64, nr, tile = _chunk(cu_seqlens, chunk_info, i_c, i_h, H)
    col0 = i_k * BK
    o_t = tl.arange(0, 64)
    o_c = tl.arange(0, BK)
    b_g = _gate(_ld(g, row64, nr, col0, H, K, BK).to(tl.float32), A_log, dt_bias, i_h, col0, o_t < nr,
                lower_bound, K, BK, GATE)
    G = _cumdecay_scr(b_g, ACC)
    tl.store(GS + tile * (64 * K) + o_t[:, None] * K + col0 + o_c[None, :], G)
    # gl: G's last row bit for bit (the A-P kernel reads it back from GS for kg = k e^(gl - G))
    gl = tl.sum(tl.where((o_t == 63)[:, None], G, 0.0), axis=0)
    if ACC:
        tl.store(GL + tile * K + col0 + o_c, gl)
    else:
        tl.store(GL + tile * K + col0 + o_c, gl * 0.6931471805599453)


@triton.jit
def _kda_fwd_ap(
    q, k, beta, P, QG, KG, Tm, GS, ROWS, cu_seqlens, chunk_info, scale,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, L2: tl.constexpr, BSIG: tl.constexpr,
    AP_PREC: tl.constexpr,
):
    """Rows 16 i .. 16 i + 15 (row block i) of: P [64, 64] (input dtype, causal incl. the diagonal),
    the strictly lower A (fp32, the Tm tile, row stride 64), qg = scale q e^G / ||q|| and
    kg = k e^(gl - G) / ||k|| (QG, KG, input dtype), and ROWS [4, 64] fp32 = (1/||k||,
    scale/||q||, beta/||k||, beta) (norms 1 without L2, beta after the sigmoid, 0 past the end).

    The L2 norms come from the key pass's own loads (whole rows of k and the rows of block i of q
    are read anyway): no separate norm pass, and q / k rows are read from DRAM once per chunk."""
    i_c = tl.program_id(0) // 4
    i = tl.program_id(0) % 4
    i_h = tl.program_id(1)
    row64, nr, tile = _chunk(cu_seqlens, chunk_info, i_c, i_h, H)
    ACC: tl.constexpr = q.dtype.element_ty == tl.float32
    gs = GS + tile * (64 * K)
    X = tl.zeros([64, 32], dtype=tl.float32)
    sk = tl.zeros([64], dtype=tl.float32)
    sqk = tl.zeros([32], dtype=tl.float32)
    for kc in range(K // BK):
        dX, dsk, dsqk = _rowblock(gs + kc * BK, q, k, row64, nr, kc * BK, i, H, K, BK, K, AP_PREC, ACC)
        X += dX
        if L2:
            sk += dsk
            sqk += dsqk
    o_s = tl.arange(0, 64)
    o32 = tl.arange(0, 32)
    t = 16 * i + o32 % 16
    # beta of rows t (row block i, repeated for both halves of X)
    b_t = tl.load(beta + row64 + t.to(tl.int64) * H, mask=t < nr, other=0.0).to(tl.float32)
    if BSIG:
        b_t = tl.where(t < nr, 1.0 / (1.0 + _exp(-b_t)), 0.0)
    if L2:
        rs = tl.rsqrt(sk + 1e-6)  # key rows s
        r32 = tl.rsqrt(sqk + 1e-6)  # 1/||q_t|| (first half), 1/||k_t|| (second half)
    else:
        rs = tl.full([64], 1.0, tl.float32)
        r32 = tl.full([32], 1.0, tl.float32)
    # column scale: scale/||q_t|| for P, beta_t/||k_t|| for A
    cs = tl.where(o32 < 16, r32 * scale, r32 * b_t)
    rows = ROWS + tile * 256
    tl.store(rows + 64 + t, cs, mask=o32 < 16)
    tl.store(rows + t, r32, mask=o32 >= 16)
    tl.store(rows + 128 + t, cs, mask=o32 >= 16)
    tl.store(rows + 192 + t, b_t, mask=o32 >= 16)
    X = X * rs[:, None] * cs[None, :]
    offs = tile * 4096 + t[None, :] * 64 + o_s[:, None]
    tl.store(P + offs, _cvt(tl.where(o_s[:, None] <= t[None, :], X, 0.0), P.dtype.element_ty),
             mask=(o32 < 16)[None, :])
    tl.store(Tm + offs, tl.where(o_s[:, None] < t[None, :], X, 0.0), mask=(o32 >= 16)[None, :])

    # qg, kg of the rows of block i, every key column (the row scales go through ROWS: [16]
    # vectors in the tiles' row layout; this program's own stores, visible after the barrier)
    tl.debug_barrier()
    o16 = tl.arange(0, 16)
    o_c = tl.arange(0, BK)
    r16 = 16 * i + o16
    rq16 = tl.load(rows + 64 + r16)
    rk16 = tl.load(rows + r16)
    m16 = (r16 < nr)[:, None]
    for kc in range(K // BK):
        col0 = kc * BK
        G = tl.load(gs + r16[:, None] * K + col0 + o_c[None, :])
        gl = tl.load(gs + 63 * K + col0 + o_c)
        o_in = (row64 + r16.to(tl.int64)[:, None] * H) * K + col0 + o_c[None, :]
        b_q = tl.load(q + o_in, mask=m16, other=0.0).to(tl.float32)
        b_k = tl.load(k + o_in, mask=m16, other=0.0).to(tl.float32)
        o_out = tile * (64 * K) + r16[:, None] * K + col0 + o_c[None, :]
        tl.store(QG + o_out, _cvt(b_q * rq16[:, None] * _exw(G, ACC), QG.dtype.element_ty))
        tl.store(KG + o_out, _cvt(b_k * rk16[:, None] * _exw(gl[None, :] - G, ACC), KG.dtype.element_ty))


@triton.jit
def _kda_fwd_finish(
    k, v, W, U, Tm, GS, ROWS, cu_seqlens, chunk_info,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    STORE_T: tl.constexpr, T_PREC: tl.constexpr,
):
    """T = (I + A)^-1 (T^T -> Tm when STORE_T), W = T Xw [64, K], U = T beta v [64, V].  The Tm tile
    holds A on entry, then serves as the inverse's workspace, then receives T^T."""
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    row64, nr, tile = _chunk(cu_seqlens, chunk_info, i_c, i_h, H)
    o_t = tl.arange(0, 64)
    o_c = tl.arange(0, BK)
    ACC: tl.constexpr = k.dtype.element_ty == tl.float32
    b_T = _ut_inverse(Tm + tile * 4096, Tm + tile * 4096, T_PREC)
    if STORE_T:  # transposed: the backward needs T^T dVn
        tl.debug_barrier()  # the inverse's workspace reads are done
        tl.store(Tm + tile * 4096 + o_t[None, :] * 64 + o_t[:, None], b_T)
    rows = ROWS + tile * 256
    rk = tl.load(rows + o_t)
    b_b = tl.load(rows + 192 + o_t)
    gs = GS + tile * (64 * K)
    for kc in tl.static_range(K // BK):
        # Xw = beta k e^G / ||k||, rebuilt from G in GS
        b_kn = _ld(k, row64, nr, kc * BK, H, K, BK).to(tl.float32) * rk[:, None]
        G = tl.load(gs + o_t[:, None] * K + kc * BK + o_c[None, :])
        _stc(W, tile, kc * BK, _dotv(b_T, b_kn * b_b[:, None] * _exw(G, ACC), T_PREC), K, BK)
    for vc in tl.static_range(V // BV):
        b_v = _ld(v, row64, nr, vc * BV, H, V, BV).to(tl.float32)
        _stc(U, tile, vc * BV, _dotv(b_T, b_v * b_b[:, None], T_PREC), V, BV)


# (BK: key-chunk width, at most 64; warps of the keys / A-P kernels), the fastest measured
# (docs/kda_kernels.md); tests set others.
TILES = (32, 4)


def split_tiles(K: int) -> tuple[int, int]:
    """(BK, warps) for key dim K: TILES, BK capped at min(K, 64), read at call time."""
    bk, warps = TILES
    bk = min(K, 64, bk)
    if bk < 4 * warps:
        raise ValueError(f"split forward: BK {bk} with {warps} warps gives tf32 wgmma N < 16 per "
                         "warpgroup (Triton 3.6 mis-pads N = 8, triton-lang/triton#10629); use BK >= 4 * warps")
    return bk, warps


def kda_fwd_intra(q, k, v, g, beta, A_log, dt_bias, W, U, P, QG, KG, GL, Tm, meta, scale: float,
                        lower_bound: float, l2: bool, bsig: bool, store_t: bool, ap_prec: str,
                        t_prec: str):
    """Launch the three split kernels; fills W, U, P, QG, KG, GL and Tm (fp32 [NC, H, 64, 64], T^T
    when store_t, else scratch) in place.  Inputs: q, k [B, T, H, K], v [B, T, H, V], g, beta as
    chunk_kda receives them (contiguous); W, QG, KG [NC, H, 64, K], U [NC, H, 64, V], P [NC, H, 64,
    64] in the input dtype, GL [NC, H, K] fp32.

    Scratch (fp32): ROWS [NC, H, 4, 64]; GS [NC, H, 64, K] (W itself for fp32 inputs)."""
    H, K = q.shape[-2:]
    V = v.shape[-1]
    NC, dev = meta.NC, q.device
    gate = A_log is not None
    bk, warps = split_tiles(K)
    f32 = {"device": dev, "dtype": torch.float32}
    ROWS = torch.empty(NC, H, 4, 64, **f32)
    GS = W if q.dtype == torch.float32 else torch.empty(NC, H, 64, K, **f32)
    cu, ci = meta.cu_seqlens, meta.chunk_info
    _kda_fwd_keys[(NC * (K // bk), H)](
        g, A_log if gate else ROWS, dt_bias if gate else ROWS, GL, GS, cu, ci, lower_bound,
        H=H, K=K, BK=bk, GATE=gate, ACC=q.dtype == torch.float32,
        num_warps=warps, num_stages=1,
    )
    _kda_fwd_ap[(NC * 4, H)](
        q, k, beta, P, QG, KG, Tm, GS, ROWS, cu, ci, scale, H=H, K=K, BK=bk, L2=l2, BSIG=bsig,
        AP_PREC=ap_prec, num_warps=warps, num_stages=1,
    )
    _kda_fwd_finish[(NC, H)](
        k, v, W, U, Tm, GS, ROWS, cu, ci, H=H, K=K, V=V, BK=bk, BV=min(V, 64),
        STORE_T=store_t, T_PREC=t_prec, num_warps=4, num_stages=1,
    )
