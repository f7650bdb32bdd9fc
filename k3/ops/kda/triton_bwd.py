"""Chunked KDA backward kernels (Triton).

Forward per chunk (triton_fwd):  Vn = U - W S,  O = qg S + P Vn,  S' = e^gl S + kg^T Vn,
with U = T (beta v), W = T (beta k e^G), T = (I + A)^-1.  Since U - W S = T R with the residual
R = beta v - Xw S (Xw = beta k e^G), the whole T / W / U branch reduces to dR = T^T dVn:
    dT = dVn R^T,  dA = -T^T dT T^T = -dR Vn^T,  d(beta v) = dR,  dXw = -dR S^T.

  1. `_kda_bwd_state`, grid (N * H, V / BV), sequential backwards over chunks:
        dVn = P^T dO + kg dS';   dR = T^T dVn;   dS = qg^T dO + e^gl dS' - W^T dVn
     stores dS' per chunk (DH), dR (DR, chunk-major) and dv = beta dR (from fp32), and the
     initial-state gradient.
  2. `_kda_bwd_intra`, grid (chunks, H), parallel, from the saved per-chunk state S, DH, Vn, DR:
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
    _chunk,
    _cumdecay,
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


@triton.jit
def _kda_bwd_intra(
    q, k, v, g, beta, A_log, dt_bias,
    Hs, DH, VN, DR, do, o, dk32,
    dq, dk, dg, dbeta, dA_part, ddt_part,
    cu_seqlens, chunk_info,
    scale, lower_bound,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    GATE: tl.constexpr, L2: tl.constexpr, BSIG: tl.constexpr,
    AP_PREC: tl.constexpr, S_PREC: tl.constexpr, CUMDOT: tl.constexpr,
):
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    row64, nr, tile = _chunk(cu_seqlens, chunk_info, i_c, i_h, H)
    o_t = tl.arange(0, 64)
    o_s = tl.arange(0, 64)
    o4 = tl.arange(0, 4)
    m_t = o_t < nr
    hbase = tile * (K * V)

    b_b = _beta(beta, row64, m_t, H, BSIG)
    rq, rk = _rnorms(q, k, row64, nr, H, K, BK, L2)

    # ---- value pass: dP = dO Vn^T, dA = -dR Vn^T, beta's share through beta v ------------------
    dP = tl.zeros([64, 64], dtype=tl.float32)
    dA = tl.zeros([64, 64], dtype=tl.float32)
    db = tl.zeros([64], dtype=tl.float32)
    rowq = tl.zeros([64], dtype=tl.float32)
    for vc in range(V // BV):
        b_do = _ld(do, row64, nr, vc * BV, H, V, BV)
        if L2:  # q_hat . dq_hat = dO . O  (O is linear in q_hat)
            rowq += tl.sum(b_do.to(tl.float32) * _ld(o, row64, nr, vc * BV, H, V, BV).to(tl.float32), axis=1)
        b_vn = _ldc(VN, tile, vc * BV, V, BV)
        b_dr = _ldc(DR, tile, vc * BV, V, BV)
        b_vnt = tl.trans(b_vn)
        dP += _sdot(b_do, b_vnt, S_PREC)
        dA -= _sdot(b_dr, b_vnt, S_PREC)
        db += tl.sum(b_dr.to(tl.float32) * _ld(v, row64, nr, vc * BV, H, V, BV).to(tl.float32), axis=1)
    dA3 = tl.reshape(tl.where(o_t[:, None] > o_s[None, :], dA, 0.0), (4, 16, 64))
    dP3 = tl.reshape(tl.where(o_t[:, None] >= o_s[None, :], dP, 0.0), (4, 16, 64))
    dA3t = tl.permute(dA3, (0, 2, 1))
    dP3t = tl.permute(dP3, (0, 2, 1))
    cmask4 = o_s[None, :] < 16 * (o4[:, None] + 1)

    # ---- key pass: every key-side gradient of this key chunk ------------------------------------
    dAlog = tl.sum(tl.zeros([64], dtype=tl.float32), axis=0)
    rowk = tl.zeros([64], dtype=tl.float32)
    for kc in range(K // BK):
        b_q = _ld(q, row64, nr, kc * BK, H, K, BK).to(tl.float32) * rq[:, None]
        b_k = _ld(k, row64, nr, kc * BK, H, K, BK).to(tl.float32) * rk[:, None]
        graw = _ld(g, row64, nr, kc * BK, H, K, BK).to(tl.float32)
        b_g = _gate(graw, A_log, dt_bias, i_h, kc * BK, m_t, lower_bound, K, BK, GATE)
        G3, G, mid, gl = _cumdecay(b_g, BK, CUMDOT)
        eG = _expw(G, q.dtype.element_ty == tl.float32)
        dqg = tl.zeros([64, BK], dtype=tl.float32)
        dkg = tl.zeros([64, BK], dtype=tl.float32)
        dxw = tl.zeros([64, BK], dtype=tl.float32)
        dgl_s = tl.zeros([BK], dtype=tl.float32)
        for vc in range(V // BV):
            b_h = _ld_state(Hs, hbase, kc * BK, vc * BV, V, BK, BV)
            b_dh = _ld_state(DH, hbase, kc * BK, vc * BV, V, BK, BV)
            b_ht = tl.trans(b_h)
            dqg += _sdot(_ld(do, row64, nr, vc * BV, H, V, BV), b_ht, S_PREC)
            dkg += _sdot(_ldc(VN, tile, vc * BV, V, BV), tl.trans(b_dh), S_PREC)
            dxw -= _sdot(_ldc(DR, tile, vc * BV, V, BV), b_ht, S_PREC)
            dgl_s += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), axis=1)
        # direct terms: qg = scale q e^G, kg = k e^(gl - G), Xw = beta k e^G (R = beta v - Xw S)
        b_dq = scale * eG * dqg
        b_dG = b_q * b_dq
        b_dk = _expw(gl[None, :] - G, q.dtype.element_ty == tl.float32) * dkg
        b_dG -= b_k * b_dk
        dgl = tl.sum(b_k * b_dk, axis=0) + _expw(gl, q.dtype.element_ty == tl.float32) * dgl_s
        xw = b_k * b_b[:, None] * eG
        b_dk += b_b[:, None] * eG * dxw
        b_dG += xw * dxw
        db += tl.sum(dxw * b_k * eG, axis=1)
        # intra-chunk A / P through the factorised 16-row blocks
        Fr3 = _exp(G3 - mid[:, None, :])
        Qr3 = tl.reshape(b_q * scale, (4, 16, BK)) * Fr3
        Kr3 = tl.reshape(b_k * b_b[:, None], (4, 16, BK)) * Fr3
        ec4 = _exp(tl.where(cmask4[:, :, None], mid[:, None, :] - G[None, :, :], -1.0e30))
        kc4 = b_k[None, :, :] * ec4
        rq3 = _dot(dP3, kc4, AP_PREC)
        rk3 = _dot(dA3, kc4, AP_PREC)
        col4 = _dot(dP3t, Qr3, AP_PREC) + _dot(dA3t, Kr3, AP_PREC)
        dkc = tl.sum(col4 * ec4, axis=0)
        Fr = tl.reshape(Fr3, (64, BK))
        dqP = scale * Fr * tl.reshape(rq3, (64, BK))
        dkbA = Fr * tl.reshape(rk3, (64, BK))
        b_dq += dqP
        b_dG += b_q * dqP + (b_k * b_b[:, None]) * dkbA - b_k * dkc
        b_dk += dkc + b_b[:, None] * dkbA
        db += tl.sum(dkbA * b_k, axis=1)
        b_dG += tl.where((o_t == 63)[:, None], dgl[None, :], 0.0)
        b_dg = tl.cumsum(b_dG, axis=0, reverse=True)
        # gate backward (per channel sums of this chunk for dt_bias, one scalar for A_log)
        if GATE:
            a = _exp(tl.load(A_log + i_h).to(tl.float32))
            bias = tl.load(dt_bias + i_h * K + kc * BK + tl.arange(0, BK)).to(tl.float32)
            z = a * (graw + bias[None, :])
            s = 1.0 / (1.0 + _exp(-z))
            dz = tl.where(m_t[:, None], b_dg * lower_bound * s * (1.0 - s), 0.0)
            _st(dg, row64, nr, kc * BK, dz * a, H, K, BK)
            tl.store(ddt_part + tile * K + kc * BK + tl.arange(0, BK), tl.sum(dz * a, axis=0))
            dAlog += tl.sum(tl.sum(dz * z, axis=1), axis=0)
        else:
            _st(dg, row64, nr, kc * BK, b_dg, H, K, BK)
        if L2:
            b_dq = rq[:, None] * (b_dq - b_q * rowq[:, None])
            if K == BK:  # whole rows in this chunk: project right away
                b_dk = rk[:, None] * (b_dk - b_k * tl.sum(b_k * b_dk, axis=1)[:, None])
            else:  # keep dk_hat (fp32) until the row dot is complete
                rowk += tl.sum(b_k * b_dk, axis=1)
        _st(dq, row64, nr, kc * BK, b_dq, H, K, BK)
        if L2 and K != BK:
            _st(dk32, row64, nr, kc * BK, b_dk, H, K, BK)
        else:
            _st(dk, row64, nr, kc * BK, b_dk, H, K, BK)
    if GATE:
        tl.store(dA_part + tile, dAlog)
    if BSIG:
        db = db * b_b * (1.0 - b_b)
    tl.store(dbeta + row64 + o_t.to(tl.int64) * H, _cvt(db, dbeta.dtype.element_ty), mask=m_t)

    # ---- last pass (L2 norm, several key chunks): dk = (dk_hat - k_hat (k_hat . dk_hat)) / ||k|| --
    if L2 and K != BK:
        tl.debug_barrier()
        for kc in range(K // BK):
            b_k = _ld(k, row64, nr, kc * BK, H, K, BK).to(tl.float32) * rk[:, None]
            dkh = _ld(dk32, row64, nr, kc * BK, H, K, BK)
            _st(dk, row64, nr, kc * BK, rk[:, None] * (dkh - b_k * rowk[:, None]), H, K, BK)
