"""Chunked KDA forward kernels (Triton).

Two launches per forward:
  1. `_kda_fwd_intra`, grid (chunks, H), fully parallel: prologue (gate, L2 norm, sigmoid),
     within-chunk cumulative decay G, the intra-chunk matrices
        A[t,s] = beta_t sum_c k_tc k_sc exp(G_tc - G_sc)      (s < t)
        P[t,s] = scale sum_c q_tc k_sc exp(G_tc - G_sc)       (s <= t)
     as 16-row tensor-core dots (see triton_common), the UT inverse T = (I + A)^-1 (16x16 diagonal
     blocks by forward substitution, then the block-Neumann product (I - N)(I + N^2) Td, exact since
     N is strictly block-lower with 4 blocks), and W = T (beta k e^G), U = T (beta v),
     qg = scale q e^G, kg = k e^(gl - G), gl = G[last].
  2. `_kda_fwd_state`, grid (N * H, V / BV), sequential over the chunks of one sequence:
        Vn = U - W S;  O = qg S + P Vn;  S <- e^gl * S + kg^T Vn.
"""

from __future__ import annotations

import triton
import triton.language as tl

from k3.ops.kda.triton_common import _cumdecay, _dot, _prologue


@triton.jit
def _kda_fwd_intra(
    q, k, v, g, beta, A_log, dt_bias,
    W, U, P, QG, KG, GL, Tm,
    cu_seqlens, chunk_info,
    scale, lower_bound,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
    GATE: tl.constexpr, L2: tl.constexpr, BSIG: tl.constexpr, STORE_T: tl.constexpr,
    AP_PREC: tl.constexpr, T_PREC: tl.constexpr, DOT_DT: tl.constexpr,
):
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    SDT: tl.constexpr = W.dtype.element_ty
    i_n = tl.load(chunk_info + 2 * i_c)
    start = tl.load(chunk_info + 2 * i_c + 1)
    eos = tl.load(cu_seqlens + i_n + 1)
    o_t = tl.arange(0, 64)
    o_k = tl.arange(0, K)
    o4 = tl.arange(0, 4)
    o16 = tl.arange(0, 16)
    o_s = tl.arange(0, 64)
    tok = start + o_t
    m_t = tok < eos
    tok64 = tok.to(tl.int64)

    b_q, b_k, b_g, b_b, rq, rk = _prologue(q, k, g, beta, A_log, dt_bias, tok64, m_t, i_h, scale,
                                           lower_bound, H, K, GATE, L2, BSIG)
    G3, G, mid, gl = _cumdecay(b_g, K)
    Fr3 = tl.exp(G3 - mid[:, None, :])
    Qr3 = tl.reshape(b_q * scale, (4, 16, K)) * Fr3
    Kr3 = tl.reshape(b_k * b_b[:, None], (4, 16, K)) * Fr3

    # Intra-chunk matrices, one 16-row block at a time (rows i, all earlier columns + its own block).
    A3 = tl.zeros([4, 16, 64], dtype=tl.float32)
    P3 = tl.zeros([4, 16, 64], dtype=tl.float32)
    for i in tl.static_range(4):
        sel = (o4 == i)[:, None, None]
        mid_i = tl.sum(tl.where((o4 == i)[:, None], mid, 0.0), axis=0)
        ec = tl.exp(tl.where((o_s < 16 * (i + 1))[:, None], mid_i[None, :] - G, -1.0e30))
        kct = tl.trans(b_k * ec)
        p_i = tl.dot(tl.sum(tl.where(sel, Qr3, 0.0), axis=0), kct, input_precision=AP_PREC)
        a_i = tl.dot(tl.sum(tl.where(sel, Kr3, 0.0), axis=0), kct, input_precision=AP_PREC)
        P3 = tl.where(sel, p_i[None, :, :], P3)
        A3 = tl.where(sel, a_i[None, :, :], A3)
    A = tl.where(o_t[:, None] > o_s[None, :], tl.reshape(A3, (64, 64)), 0.0)
    b_P = tl.where(o_t[:, None] >= o_s[None, :], tl.reshape(P3, (64, 64)), 0.0)

    # T = (I + A)^-1.  Diagonal 16x16 blocks by forward substitution: row t of Td becomes
    # e_t - sum_{s<t} Ad[t,s] Td[s,:]  (Ad is strictly lower, so the full product gives that row).
    eye4 = o4[:, None] == o4[None, :]
    Ad = tl.sum(tl.where(eye4[:, None, :, None], tl.reshape(A, (4, 16, 4, 16)), 0.0), axis=2)
    eye16 = tl.zeros([4, 16, 16], dtype=tl.float32) + tl.where(o16[:, None] == o16[None, :], 1.0, 0.0)[None, :, :]
    Td = eye16
    for t in range(1, 16):
        Td = tl.where((o16 == t)[None, :, None], eye16 - tl.dot(Ad, Td, input_precision=T_PREC), Td)
    # Off-diagonal blocks: T = (I - N)(I + N^2) Td with N = Td L (L = strictly block-lower part of A);
    # exact because N is strictly block-lower with 4 blocks (N^4 = 0).
    L = tl.where((o_t // 16)[:, None] > (o_s // 16)[None, :], A, 0.0)
    N = tl.reshape(tl.dot(Td, tl.reshape(L, (4, 16, 64)), input_precision=T_PREC), (64, 64))
    N2 = tl.dot(N, N, input_precision=T_PREC)
    Tdf = tl.reshape(tl.where(eye4[:, None, :, None], Td[:, :, None, :], 0.0), (64, 64))
    Y = Tdf + tl.dot(N2, Tdf, input_precision=T_PREC)
    b_T = Y - tl.dot(N, Y, input_precision=T_PREC)

    eG = tl.exp(G)
    m_tk = m_t[:, None] & (o_k[None, :] < K)
    p_tk = tok64[:, None] * (H * K) + i_h * K + o_k[None, :]
    b_w = _dot(b_T, b_k * b_b[:, None] * eG, T_PREC, DOT_DT)
    tl.store(W + p_tk, b_w.to(SDT), mask=m_tk)
    tl.store(QG + p_tk, (b_q * scale * eG).to(SDT), mask=m_tk)
    tl.store(KG + p_tk, (b_k * tl.exp(gl[None, :] - G)).to(SDT), mask=m_tk)
    tl.store(GL + (i_c * H + i_h).to(tl.int64) * K + o_k, gl)
    p_ts = tok64[:, None] * (H * 64) + i_h * 64 + o_s[None, :]
    m_ts = m_t[:, None] & (o_s[None, :] < 64)
    tl.store(P + p_ts, b_P.to(SDT), mask=m_ts)
    if STORE_T:
        tl.store(Tm + p_ts, b_T, mask=m_ts)
    for iv in tl.static_range(V // BV):
        o_v = iv * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v[None, :] < V)
        p_tv = tok64[:, None] * (H * V) + i_h * V + o_v[None, :]
        b_v = tl.load(v + p_tv, mask=m_tv, other=0.0).to(tl.float32)
        b_u = _dot(b_T, b_v * b_b[:, None], T_PREC, DOT_DT)
        tl.store(U + p_tv, b_u.to(SDT), mask=m_tv)


@triton.jit
def _kda_fwd_state(
    W, U, P, QG, KG, GL, o, h0, ht, Hs, VN,
    cu_seqlens, chunk_offsets,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
    USE_H0: tl.constexpr, STORE_HT: tl.constexpr, STORE_H: tl.constexpr,
    PREC: tl.constexpr, DOT_DT: tl.constexpr,
):
    i_nh = tl.program_id(0)
    i_v = tl.program_id(1)
    SDT: tl.constexpr = W.dtype.element_ty
    i_n = i_nh // H
    i_h = i_nh % H
    bos = tl.load(cu_seqlens + i_n)
    eos = tl.load(cu_seqlens + i_n + 1)
    c0 = tl.load(chunk_offsets + i_n)
    nt = tl.cdiv(eos - bos, 64)
    o_t = tl.arange(0, 64)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    o_s = tl.arange(0, 64)
    p_kv = o_k[:, None] * V + o_v[None, :]
    if USE_H0:
        S = tl.load(h0 + i_nh.to(tl.int64) * (K * V) + p_kv).to(tl.float32)
    else:
        S = tl.zeros([K, BV], dtype=tl.float32)
    for j in range(nt):
        tok64 = (bos + j * 64 + o_t).to(tl.int64)
        m_t = (bos + j * 64 + o_t) < eos
        if STORE_H:
            tl.store(Hs + ((c0 + j) * H + i_h).to(tl.int64) * (K * V) + p_kv, S.to(SDT))
        m_tk = m_t[:, None] & (o_k[None, :] < K)
        p_tk = tok64[:, None] * (H * K) + i_h * K + o_k[None, :]
        p_tv = tok64[:, None] * (H * V) + i_h * V + o_v[None, :]
        m_tv = m_t[:, None] & (o_v[None, :] < V)
        b_w = tl.load(W + p_tk, mask=m_tk, other=0.0)
        b_qg = tl.load(QG + p_tk, mask=m_tk, other=0.0)
        b_kg = tl.load(KG + p_tk, mask=m_tk, other=0.0)
        b_u = tl.load(U + p_tv, mask=m_tv, other=0.0).to(tl.float32)
        b_p = tl.load(P + tok64[:, None] * (H * 64) + i_h * 64 + o_s[None, :],
                      mask=m_t[:, None] & (o_s[None, :] < 64), other=0.0)
        b_gl = tl.load(GL + ((c0 + j) * H + i_h).to(tl.int64) * K + o_k)
        b_vn = b_u - _dot(b_w, S, PREC, DOT_DT)
        b_o = _dot(b_qg, S, PREC, DOT_DT) + _dot(b_p, b_vn, PREC, DOT_DT)
        tl.store(o + p_tv, b_o.to(o.dtype.element_ty), mask=m_tv)
        if STORE_H:
            tl.store(VN + p_tv, b_vn.to(SDT), mask=m_tv)
        S = S * tl.exp(b_gl)[:, None] + _dot(tl.trans(b_kg), b_vn, PREC, DOT_DT)
    if STORE_HT:
        tl.store(ht + i_nh.to(tl.int64) * (K * V) + p_kv, S)
