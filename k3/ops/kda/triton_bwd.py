"""Chunked KDA backward kernels (Triton).

Forward per chunk (triton_fwd):  Vn = U - W S,  O = qg S + P Vn,  S' = e^gl S + kg^T Vn,
with U = T (beta v), W = T (beta k e^G), T = (I + A)^-1.

  1. `_kda_bwd_state`, grid (N * H, V / BV), sequential backwards over chunks:
        dVn = P^T dO + kg dS';   dS = qg^T dO + e^gl dS' - W^T dVn
     stores dS' per chunk (DH), dVn (DVN) and the initial-state gradient.
  2. `_kda_bwd_intra`, grid (chunks, H), parallel: everything else, from the saved per-chunk
     state S, DH, Vn, DVN and T:
        dqg = dO S^T, dkg = Vn dS'^T, dW = -dVn S^T, dP = dO Vn^T, dU = dVn
        dT = dW Xw^T + dU Xu^T,  dXw = T^T dW,  dXu = T^T dU,  dA = -T^T dT T^T
     then dA/dP through the factorised 16-row blocks, dG (elementwise, then a reverse cumsum),
     and the prologue backward (gate, L2 norm, sigmoid).
"""

from __future__ import annotations

import triton
import triton.language as tl

from k3.ops.kda.triton_common import _cumdecay, _dot, _prologue


@triton.jit
def _kda_bwd_state(
    P, QG, KG, W, GL, do, dht, dh0, DH, DVN,
    cu_seqlens, chunk_offsets,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
    USE_DHT: tl.constexpr, PREC: tl.constexpr, DOT_DT: tl.constexpr,
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
    if USE_DHT:
        dS = tl.load(dht + i_nh.to(tl.int64) * (K * V) + p_kv).to(tl.float32)
    else:
        dS = tl.zeros([K, BV], dtype=tl.float32)
    for jj in range(nt):
        j = nt - 1 - jj
        tl.store(DH + ((c0 + j) * H + i_h).to(tl.int64) * (K * V) + p_kv, dS.to(SDT))
        tok = bos + j * 64 + o_t
        m_t = tok < eos
        tok64 = tok.to(tl.int64)
        m_tk = m_t[:, None] & (o_k[None, :] < K)
        p_tk = tok64[:, None] * (H * K) + i_h * K + o_k[None, :]
        p_tv = tok64[:, None] * (H * V) + i_h * V + o_v[None, :]
        m_tv = m_t[:, None] & (o_v[None, :] < V)
        b_do = tl.load(do + p_tv, mask=m_tv, other=0.0)
        b_p = tl.load(P + tok64[:, None] * (H * 64) + i_h * 64 + o_s[None, :],
                      mask=m_t[:, None] & (o_s[None, :] < 64), other=0.0)
        b_kg = tl.load(KG + p_tk, mask=m_tk, other=0.0)
        b_qg = tl.load(QG + p_tk, mask=m_tk, other=0.0)
        b_w = tl.load(W + p_tk, mask=m_tk, other=0.0)
        b_gl = tl.load(GL + ((c0 + j) * H + i_h).to(tl.int64) * K + o_k)
        b_dvn = _dot(tl.trans(b_p), b_do, PREC, DOT_DT) + _dot(b_kg, dS, PREC, DOT_DT)
        tl.store(DVN + p_tv, b_dvn.to(SDT), mask=m_tv)
        dS = dS * tl.exp(b_gl)[:, None] + _dot(tl.trans(b_qg), b_do, PREC, DOT_DT) \
            - _dot(tl.trans(b_w), b_dvn, PREC, DOT_DT)
    tl.store(dh0 + i_nh.to(tl.int64) * (K * V) + p_kv, dS)


@triton.jit
def _kda_bwd_intra(
    q, k, v, g, beta, A_log, dt_bias,
    Tm, Hs, DH, VN, DVN, do,
    dq, dk, dv, dg, dbeta, dA_part, ddt_part,
    cu_seqlens, chunk_info,
    scale, lower_bound,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
    GATE: tl.constexpr, L2: tl.constexpr, BSIG: tl.constexpr,
    AP_PREC: tl.constexpr, T_PREC: tl.constexpr, DOT_DT: tl.constexpr,
):
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    SDT: tl.constexpr = Hs.dtype.element_ty
    i_n = tl.load(chunk_info + 2 * i_c)
    start = tl.load(chunk_info + 2 * i_c + 1)
    eos = tl.load(cu_seqlens + i_n + 1)
    o_t = tl.arange(0, 64)
    o_s = tl.arange(0, 64)
    o_k = tl.arange(0, K)
    o4 = tl.arange(0, 4)
    tok = start + o_t
    m_t = tok < eos
    tok64 = tok.to(tl.int64)
    m_tk = m_t[:, None] & (o_k[None, :] < K)
    p_tk = tok64[:, None] * (H * K) + i_h * K + o_k[None, :]
    p_ts = tok64[:, None] * (H * 64) + i_h * 64 + o_s[None, :]
    m_ts = m_t[:, None] & (o_s[None, :] < 64)

    b_q, b_k, b_g, b_b, rq, rk = _prologue(q, k, g, beta, A_log, dt_bias, tok64, m_t, i_h, scale,
                                           lower_bound, H, K, GATE, L2, BSIG)
    G3, G, mid, gl = _cumdecay(b_g, K)
    b_T = tl.load(Tm + p_ts, mask=m_ts, other=0.0)
    b_Tt = tl.trans(b_T)

    # ---- value side: loop over V blocks --------------------------------------------------------
    dqg = tl.zeros([64, K], dtype=tl.float32)
    dkg = tl.zeros([64, K], dtype=tl.float32)
    dWn = tl.zeros([64, K], dtype=tl.float32)
    dP = tl.zeros([64, 64], dtype=tl.float32)
    dT = tl.zeros([64, 64], dtype=tl.float32)
    db = tl.zeros([64], dtype=tl.float32)
    dgl_s = tl.zeros([K], dtype=tl.float32)
    p_h = (i_c * H + i_h).to(tl.int64) * (K * V)
    for iv in tl.static_range(V // BV):
        o_v = iv * BV + tl.arange(0, BV)
        p_kv = p_h + o_k[:, None] * V + o_v[None, :]
        p_tv = tok64[:, None] * (H * V) + i_h * V + o_v[None, :]
        m_tv = m_t[:, None] & (o_v[None, :] < V)
        b_h = tl.load(Hs + p_kv)
        b_dh = tl.load(DH + p_kv)
        b_do = tl.load(do + p_tv, mask=m_tv, other=0.0)
        b_vn = tl.load(VN + p_tv, mask=m_tv, other=0.0)
        b_dvn = tl.load(DVN + p_tv, mask=m_tv, other=0.0)
        b_v = tl.load(v + p_tv, mask=m_tv, other=0.0).to(tl.float32)
        b_ht = tl.trans(b_h)
        dqg += _dot(b_do, b_ht, T_PREC, DOT_DT)
        dkg += _dot(b_vn, tl.trans(b_dh), T_PREC, DOT_DT)
        dWn += _dot(b_dvn, b_ht, T_PREC, DOT_DT)
        dP += _dot(b_do, tl.trans(b_vn), T_PREC, DOT_DT)
        xu = b_v * b_b[:, None]
        dT += _dot(b_dvn, tl.trans(xu), T_PREC, DOT_DT)
        dxu = tl.dot(b_Tt, b_dvn.to(tl.float32), input_precision=T_PREC)
        tl.store(dv + p_tv, (dxu * b_b[:, None]).to(dv.dtype.element_ty), mask=m_tv)
        db += tl.sum(dxu * b_v, axis=1)
        dgl_s += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), axis=1)

    # ---- direct terms: qg = scale q e^G, kg = k e^(gl-G), Xw = beta k e^G --------------------
    eG = tl.exp(G)
    b_dq = scale * eG * dqg
    b_dG = b_q * b_dq
    b_dk = tl.exp(gl[None, :] - G) * dkg
    b_dG -= b_k * b_dk
    dgl = tl.sum(b_k * b_dk, axis=0) + tl.exp(gl) * dgl_s
    xw = b_k * b_b[:, None] * eG
    dW = -dWn
    dT += tl.dot(dW, tl.trans(xw), input_precision=T_PREC)
    dxw = tl.dot(b_Tt, dW, input_precision=T_PREC)
    b_dk += b_b[:, None] * eG * dxw
    b_dG += xw * dxw
    db += tl.sum(dxw * b_k * eG, axis=1)
    dA = -tl.dot(tl.dot(b_Tt, dT, input_precision=T_PREC), b_Tt, input_precision=T_PREC)
    dA = tl.where(o_t[:, None] > o_s[None, :], dA, 0.0)
    dP = tl.where(o_t[:, None] >= o_s[None, :], dP, 0.0)

    # ---- intra-chunk A / P through the factorised 16-row blocks ------------------------------
    Fr3 = tl.exp(G3 - mid[:, None, :])
    Qr3 = tl.reshape(b_q * scale, (4, 16, K)) * Fr3
    Kr3 = tl.reshape(b_k * b_b[:, None], (4, 16, K)) * Fr3
    dP3 = tl.reshape(dP, (4, 16, 64))
    dA3 = tl.reshape(dA, (4, 16, 64))
    rq3 = tl.zeros([4, 16, K], dtype=tl.float32)
    rk3 = tl.zeros([4, 16, K], dtype=tl.float32)
    dkc = tl.zeros([64, K], dtype=tl.float32)
    for i in tl.static_range(4):
        sel = (o4 == i)[:, None, None]
        mid_i = tl.sum(tl.where((o4 == i)[:, None], mid, 0.0), axis=0)
        ec = tl.exp(tl.where((o_s < 16 * (i + 1))[:, None], mid_i[None, :] - G, -1.0e30))
        kc = b_k * ec
        dp_i = tl.sum(tl.where(sel, dP3, 0.0), axis=0)
        da_i = tl.sum(tl.where(sel, dA3, 0.0), axis=0)
        rq3 = tl.where(sel, tl.dot(dp_i, kc, input_precision=AP_PREC)[None, :, :], rq3)
        rk3 = tl.where(sel, tl.dot(da_i, kc, input_precision=AP_PREC)[None, :, :], rk3)
        col = tl.dot(tl.trans(dp_i), tl.sum(tl.where(sel, Qr3, 0.0), axis=0), input_precision=AP_PREC) \
            + tl.dot(tl.trans(da_i), tl.sum(tl.where(sel, Kr3, 0.0), axis=0), input_precision=AP_PREC)
        dkc += col * ec
    Fr = tl.reshape(Fr3, (64, K))
    dqP = scale * Fr * tl.reshape(rq3, (64, K))
    dkbA = Fr * tl.reshape(rk3, (64, K))
    b_dq += dqP
    b_dG += b_q * dqP + (b_k * b_b[:, None]) * dkbA - b_k * dkc
    b_dk += dkc + b_b[:, None] * dkbA
    db += tl.sum(dkbA * b_k, axis=1)
    b_dG += tl.where((o_t == 63)[:, None], dgl[None, :], 0.0)
    b_dg = tl.cumsum(b_dG, axis=0, reverse=True)

    # ---- prologue backward ----------------------------------------------------------------------
    if L2:
        b_dq = rq[:, None] * (b_dq - b_q * tl.sum(b_q * b_dq, axis=1)[:, None])
        b_dk = rk[:, None] * (b_dk - b_k * tl.sum(b_k * b_dk, axis=1)[:, None])
    tl.store(dq + p_tk, b_dq.to(dq.dtype.element_ty), mask=m_tk)
    tl.store(dk + p_tk, b_dk.to(dk.dtype.element_ty), mask=m_tk)
    if GATE:
        a = tl.exp(tl.load(A_log + i_h).to(tl.float32))
        bias = tl.load(dt_bias + i_h * K + o_k).to(tl.float32)
        f = tl.load(g + p_tk, mask=m_tk, other=0.0).to(tl.float32)
        z = a * (f + bias[None, :])
        s = tl.sigmoid(z)
        dz = tl.where(m_tk, b_dg * lower_bound * s * (1.0 - s), 0.0)
        df = dz * a
        tl.store(dg + p_tk, df.to(dg.dtype.element_ty), mask=m_tk)
        tl.store(ddt_part + (i_c * H + i_h).to(tl.int64) * K + o_k, tl.sum(df, axis=0))
        tl.store(dA_part + i_c * H + i_h, tl.sum(tl.sum(dz * z, axis=1), axis=0))
    else:
        tl.store(dg + p_tk, b_dg.to(dg.dtype.element_ty), mask=m_tk)
    if BSIG:
        db = db * b_b * (1.0 - b_b)
    tl.store(dbeta + tok64 * H + i_h, db.to(dbeta.dtype.element_ty), mask=m_t)
