"""Chunked KDA backward kernels (Triton).

Forward per chunk (fwd_state):  Vn = U - W S,  O = qg S + P Vn,  S' = e^gl S + kg^T Vn,
with U = T (beta v), W = T (beta k e^G), T = (I + A)^-1.  Since U - W S = T R with the residual
R = beta v - Xw S (Xw = beta k e^G), the whole T / W / U branch reduces to dR = T^T dVn:
    dT = dVn R^T,  dA = -T^T dT T^T = -dR Vn^T,  d(beta v) = dR,  dXw = -dR S^T.

  1. `_kda_bwd_state`, grid (N * H, V / BV), sequential backwards over chunks:
        dVn = P^T dO + kg dS';   dR = T^T dVn;   dS = qg^T dO + e^gl dS' - W^T dVn
     stores dS' per chunk (DH), dR (DR, chunk-major) and dv = beta dR (from fp32), and the
     initial-state gradient.
  2. the split intra-chunk kernels (bwd_intra), parallel, from the saved S, DH, Vn, DR:
     value pass: dP = dO Vn^T, dA = -dR Vn^T, beta's share sum_v dR v;  key pass (per key chunk):
     dqg = dO S^T, dkg = Vn dS'^T, dXw = -dR S^T, then dA / dP through the factorised 16-row
     blocks, dG (elementwise, then a reverse cumsum) and the prologue backward (gate, L2 norm,
     sigmoid).  With the L2 norm over several key chunks a last pass projects dk_hat (kept in fp32
     scratch meanwhile); the q projection needs q_hat . dq_hat = dO . O only (O is linear in q_hat).
"""

from __future__ import annotations

import triton
import triton.language as tl

from k3.ops.kda.triton_common import (
    _beta,
    _cvt,
    _dot,
    _expw,
    _ld,
    _ld_state,
    _ldc,
    _sdot,
    _st,
    _st_state,
    _stc,
)


@triton.jit
def _kda_bwd_state(
    P, QG, KG, W, Tt, GL, beta, do, dht, dh0, DH, DR, dv,
    cu_seqlens, chunk_offsets,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
    USE_DHT: tl.constexpr, BSIG: tl.constexpr, PREC: tl.constexpr, T_PREC: tl.constexpr,
    STAGES: tl.constexpr,
):
    i_nh = tl.program_id(0)
    i_v = tl.program_id(1)
    i_n = i_nh // H
    i_h = i_nh % H
    bos = tl.load(cu_seqlens + i_n)
    eos = tl.load(cu_seqlens + i_n + 1)
    c0 = tl.load(chunk_offsets + i_n)
    nt = tl.cdiv(eos - bos, 64)
    o_k = tl.arange(0, K)
    v0 = i_v * BV
    if USE_DHT:
        dS = _ld_state(dht, i_nh.to(tl.int64) * (K * V), 0, v0, V, K, BV).to(tl.float32)
    else:
        dS = tl.zeros([K, BV], dtype=tl.float32)
    for jj in tl.range(nt, num_stages=STAGES):
        j = nt - 1 - jj
        start = bos + j * 64
        row64 = start.to(tl.int64) * H + i_h
        nr = eos - start
        tile = (c0 + j).to(tl.int64) * H + i_h
        b_do = _ld(do, row64, nr, v0, H, V, BV)
        b_p = _ldc(P, tile, 0, 64, 64)
        b_kg = _ldc(KG, tile, 0, K, K)
        b_qg = _ldc(QG, tile, 0, K, K)
        b_w = _ldc(W, tile, 0, K, K)
        b_tt = _ldc(Tt, tile, 0, 64, 64)
        b_gl = tl.load(GL + tile * K + o_k)
        b_b = _beta(beta, row64, tl.arange(0, 64) < nr, H, BSIG)
        dSc = _cvt(dS, W.dtype.element_ty)
        _st_state(DH, tile * (K * V), 0, v0, dSc, V, K, BV)
        b_dvn = _sdot(tl.trans(b_p), b_do, PREC) + _sdot(b_kg, dSc, PREC)
        # dR = T^T dVn is the gradient of the residual R = (I + A) Vn = beta v - beta k e^G S
        # (Vn = T R): dv = beta dR here, the rest of the intra-chunk backward works from dR.
        b_dr = _dot(b_tt, b_dvn, T_PREC)
        _stc(DR, tile, v0, b_dr, V, BV)
        _st(dv, row64, nr, v0, b_dr * b_b[:, None], H, V, BV)
        dS = dS * _expw(b_gl, W.dtype.element_ty == tl.float32)[:, None] + _sdot(tl.trans(b_qg), b_do, PREC) \
            - _sdot(tl.trans(b_w), _cvt(b_dvn, W.dtype.element_ty), PREC)
    _st_state(dh0, i_nh.to(tl.int64) * (K * V), 0, v0, dS, V, K, BV)
