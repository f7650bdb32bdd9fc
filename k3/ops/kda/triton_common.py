"""Triton building blocks shared by the chunked KDA kernels (forward, backward).

Conventions used by every kernel in triton_fwd.py / triton_bwd.py:
  * chunk size 64 = 4 sub-blocks of 16 rows; per-chunk tiles are [64, K] / [64, V];
  * G is the within-chunk inclusive cumulative log-decay, built as G = r_blk + cumsum_in_block(g)
    so that every kernel derives bitwise the same G from the same g;
  * mid[i] = G at row 16 i + 7 (the middle of sub-block i) is the reference of the factorised
    exponentials  exp(G_t - G_s) = exp(G_t - mid_i) * exp(mid_i - G_s)  for row block i.  With a
    per-step log-decay >= -5 both factors stay within exp(+-40) for s, t inside block i, and for
    s in an earlier block the column factor is <= 1, so every intra-chunk product is one dot.
"""

from __future__ import annotations

import triton
import triton.language as tl

BT = 64  # chunk length (rows per chunk); sub-blocks of 16


@triton.jit
def _blk(x3, i, NB: tl.constexpr):
    """Sub-block i of a [NB, 16, N] tile, as [16, N] (selection by masked sum: exact)."""
    sel = tl.arange(0, NB)[:, None, None] == i
    return tl.sum(tl.where(sel, x3, 0.0), axis=0)


@triton.jit
def _vec(x2, i, NB: tl.constexpr):
    """Row i of a [NB, N] tile, as [N]."""
    sel = tl.arange(0, NB)[:, None] == i
    return tl.sum(tl.where(sel, x2, 0.0), axis=0)


@triton.jit
def _prologue(q, k, g, beta, A_log, dt_bias, tok64, m_t, i_h, scale, lower_bound,
              H: tl.constexpr, K: tl.constexpr,
              GATE: tl.constexpr, L2: tl.constexpr, BSIG: tl.constexpr):
    """Load one chunk of q, k, g, beta and apply the fused prologue.

    Returns q_hat [64,K] (L2-normalised if L2, not yet scaled), k_hat [64,K], g [64,K] log-decay
    (0 on rows past the sequence end), beta [64] (0 past the end), rq/rk [64] (1/norm, or 1).
    """
    o_k = tl.arange(0, K)
    m_tk = m_t[:, None] & (o_k[None, :] < K)
    p_qk = tok64[:, None] * (H * K) + i_h * K + o_k[None, :]
    b_q = tl.load(q + p_qk, mask=m_tk, other=0.0).to(tl.float32)
    b_k = tl.load(k + p_qk, mask=m_tk, other=0.0).to(tl.float32)
    b_g = tl.load(g + p_qk, mask=m_tk, other=0.0).to(tl.float32)
    if GATE:
        a = tl.exp(tl.load(A_log + i_h).to(tl.float32))
        bias = tl.load(dt_bias + i_h * K + o_k).to(tl.float32)
        b_g = tl.where(m_tk, lower_bound / (1.0 + tl.exp(-a * (b_g + bias[None, :]))), 0.0)
    b_b = tl.load(beta + tok64 * H + i_h, mask=m_t, other=0.0).to(tl.float32)
    if BSIG:
        b_b = tl.where(m_t, 1.0 / (1.0 + tl.exp(-b_b)), 0.0)
    if L2:
        rq = tl.rsqrt(tl.sum(b_q * b_q, axis=1) + 1e-6)
        rk = tl.rsqrt(tl.sum(b_k * b_k, axis=1) + 1e-6)
        b_q = b_q * rq[:, None]
        b_k = b_k * rk[:, None]
    else:
        rq = tl.full([64], 1.0, tl.float32)
        rk = tl.full([64], 1.0, tl.float32)
    return b_q, b_k, b_g, b_b, rq, rk


@triton.jit
def _cumdecay(b_g, K: tl.constexpr):
    """Within-chunk cumulative decay.  Returns G3 [4,16,K], G [64,K], mid [4,K], gl [K] (= G row 63)."""
    g3 = tl.reshape(b_g, (4, 16, K))
    c3 = tl.cumsum(g3, axis=1)
    bs = tl.sum(g3, axis=1)
    r = tl.cumsum(bs, axis=0) - bs
    G3 = r[:, None, :] + c3
    o16 = tl.arange(0, 16)
    mid = tl.sum(tl.where((o16 == 7)[None, :, None], G3, 0.0), axis=1)
    G = tl.reshape(G3, (64, K))
    gl = tl.sum(tl.where((tl.arange(0, 64) == 63)[:, None], G, 0.0), axis=0)
    return G3, G, mid, gl


@triton.jit
def _colfac(G, mid, i, K: tl.constexpr):
    """exp(mid_i - G_s) for columns s of rows-block i (s < 16 (i + 1)), 0 for later columns: [64, K]."""
    mid_i = _vec(mid, i, 4)
    o_s = tl.arange(0, 64)
    arg = tl.where((o_s < 16 * (i + 1))[:, None], mid_i[None, :] - G, -1.0e30)
    return tl.exp(arg)


@triton.jit
def _dot(a, b, PREC: tl.constexpr, DT: tl.constexpr):
    """Tensor-core dot: fp32 operands with PREC ("tf32" / "tf32x3" / "ieee") when DT is fp32,
    else both operands cast to DT (bf16 / fp16) with fp32 accumulation.  DT is the kernels'
    DOT_DT argument: the storage dtype on GPU, fp32 under the interpreter (whose half-precision
    dot is not usable)."""
    if DT == tl.float32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PREC)
    else:
        return tl.dot(a.to(DT), b.to(DT))


@triton.jit
def _dotf(a, b, PREC: tl.constexpr):
    """fp32 dot (fp32 operands) at precision PREC."""
    return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PREC)
