"""Chunked KDA forward kernels (Triton).

A forward is the split intra-chunk kernels (fwd_intra), parallel over chunks and heads: prologue
(gate, L2 norm, sigmoid), within-chunk cumulative decay G, the intra-chunk matrices
    A[t,s] = beta_t sum_c k_tc k_sc exp(G_tc - G_sc)      (s < t)
    P[t,s] = scale sum_c q_tc k_sc exp(G_tc - G_sc)       (s <= t)
the UT inverse T = (I + A)^-1, and W = T (beta k e^G), U = T (beta v), qg = scale q e^G,
kg = k e^(gl - G), gl = G[last]; then the state scan of this file:
  `_kda_fwd_state`, grid (N * H, V / BV), sequential over the chunks of one sequence:
        Vn = U - W S;  O = qg S + P Vn;  S <- e^gl * S + kg^T Vn.
     The chunk tiles are chunk-major and padded (no masks), so the loop's loads are software
     pipelined (cp.async, STAGES deep) while the previous chunk computes; for bf16 / fp16 inputs
     the dots take S and Vn in that dtype (they are stored in it for the backward anyway).
"""

from __future__ import annotations

import triton
import triton.language as tl

from k3.ops.kda.triton_common import (
    _cvt,
    _expw,
    _ld_state,
    _ldc,
    _sdot,
    _st,
    _st_state,
    _stc,
)


@triton.jit
def _kda_fwd_state(
    W, U, P, QG, KG, GL, o, h0, ht, Hs, VN,
    cu_seqlens, chunk_offsets,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
    USE_H0: tl.constexpr, STORE_HT: tl.constexpr, STORE_H: tl.constexpr,
    PREC: tl.constexpr, STAGES: tl.constexpr,
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
    if USE_H0:
        S = _ld_state(h0, i_nh.to(tl.int64) * (K * V), 0, v0, V, K, BV).to(tl.float32)
    else:
        S = tl.zeros([K, BV], dtype=tl.float32)
    # The chunk inputs do not depend on S: with STAGES > 1 the loads of the next chunks are issued
    # while this one computes.  The dots take S and Vn in the storage dtype (PREC "half" for bf16 /
    # fp16 inputs; Hs and Vn are stored in it for the backward anyway); S itself stays fp32.
    for j in tl.range(nt, num_stages=STAGES):
        start = bos + j * 64
        row64 = start.to(tl.int64) * H + i_h
        tile = (c0 + j).to(tl.int64) * H + i_h
        b_w = _ldc(W, tile, 0, K, K)
        b_qg = _ldc(QG, tile, 0, K, K)
        b_kg = _ldc(KG, tile, 0, K, K)
        b_u = _ldc(U, tile, v0, V, BV)
        b_p = _ldc(P, tile, 0, 64, 64)
        b_gl = tl.load(GL + tile * K + o_k)
        Sc = _cvt(S, W.dtype.element_ty)
        if STORE_H:
            _st_state(Hs, tile * (K * V), 0, v0, Sc, V, K, BV)
        b_vn = b_u.to(tl.float32) - _sdot(b_w, Sc, PREC)
        vnc = _cvt(b_vn, W.dtype.element_ty)
        b_o = _sdot(b_qg, Sc, PREC) + _sdot(b_p, vnc, PREC)
        _st(o, row64, eos - start, v0, b_o, H, V, BV)
        if STORE_H:
            _stc(VN, tile, v0, vnc, V, BV)
        S = S * _expw(b_gl, W.dtype.element_ty == tl.float32)[:, None] + _sdot(tl.trans(b_kg), vnc, PREC)
    if STORE_HT:
        _st_state(ht, i_nh.to(tl.int64) * (K * V), 0, v0, S, V, K, BV)
