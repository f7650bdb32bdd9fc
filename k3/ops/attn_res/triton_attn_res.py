"""Block-AttnRes aggregation as Triton kernels: one program per block of rows, all candidates at once.

Forward: pass 1 reads every candidate row once for its logit (V . w and mean(V^2) in one sweep),
softmax over the candidates in registers, pass 2 re-reads them for the weighted sum (expected from
L2: the program's rows were just read). Backward: pass 1 gp_i = g . V_i, then the softmax and RMS
terms per row, pass 2 writes every candidate's gradient and a per-program partial sum of the w
gradient (summed afterwards in a fixed order: deterministic, no atomics). So each candidate comes
from memory about once per direction; the compiled elementwise regions are expected to read it two
to three times (a row-reduction kernel, then elementwise and column-reduction kernels):
bench/attn_res.py measures both.

Candidates arrive as separate pointers (up to MAXN; each its own dtype, contiguous [M, D]);
unused slots repeat the first one and are never read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3.ops.attn_res import MAX_CANDIDATES as MAXN  # the kernels' pointer slots
from k3.ops.triton_utils import column_sum, cvt

TILE = (2, 1024, 4)  # rows, columns, warps per program: the fastest of bench/attn_res.py --sweep on an H200


@triton.jit
def _pick(i: tl.constexpr, C0, C1, C2, C3, C4, C5, C6, C7, C8):
    """The i-th of nine pointers (i is a compile-time constant: no branch survives)."""
    if i == 0:
        p = C0
    elif i == 1:
        p = C1
    elif i == 2:
        p = C2
    elif i == 3:
        p = C3
    elif i == 4:
        p = C4
    elif i == 5:
        p = C5
    elif i == 6:
        p = C6
    elif i == 7:
        p = C7
    else:
        p = C8
    return p


@triton.jit
def _column(x, slot, i: tl.constexpr):
    """Column i of a [BM, NP] tile as [BM]."""
    return tl.sum(tl.where(slot == i, x, 0.0), 1)


@triton.jit
def _out_grad(GO, HS, W2, rn, mean, base, cols, m, D, NORM: tl.constexpr):
    """The mix's output gradient on a [BM, BD] tile: GO itself, or with NORM the norm's input gradient
    rn * (GO * W2 - n * mean), n = mix * rn, rounded to the mix's dtype."""
    go = tl.load(GO + base + cols[None, :], mask=m, other=0.0).to(tl.float32)
    if NORM:
        w2 = tl.load(W2 + cols, mask=cols < D, other=0.0).to(tl.float32)
        n = tl.load(HS + base + cols[None, :], mask=m, other=0.0).to(tl.float32) * rn[:, None]
        go = cvt(rn[:, None] * (go * w2[None, :] - n * mean[:, None]), HS.dtype.element_ty).to(tl.float32)
    return go


@triton.jit
def _attn_res_fwd(C0, C1, C2, C3, C4, C5, C6, C7, C8, W, OUT, P, R, S, HS, W2, RN, M, D, eps, eps2,
                  N: tl.constexpr, NP: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr, NORM: tl.constexpr):
    """OUT = the mix; with NORM, OUT = KimiRMSNorm(mix) with weight W2 (the mix itself goes to HS and
    its per-row rsqrt to RN, for the backward)."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    m_r = rows < M
    base = rows.to(tl.int64)[:, None] * D
    slot = tl.arange(0, NP)[None, :]
    s = tl.zeros([BM, NP], tl.float32)  # V_i . w per row (column i)
    q = tl.zeros([BM, NP], tl.float32)  # sum of V_i^2 per row
    for d0 in range(0, D, BD):
        cols = d0 + tl.arange(0, BD)
        m_c = cols < D
        w = tl.load(W + cols, mask=m_c, other=0.0)
        for i in tl.static_range(N):
            src = _pick(i, C0, C1, C2, C3, C4, C5, C6, C7, C8)
            v = tl.load(src + base + cols[None, :], mask=m_r[:, None] & m_c[None, :], other=0.0).to(tl.float32)
            s += tl.where(slot == i, tl.sum(v * w[None, :], 1)[:, None], 0.0)
            q += tl.where(slot == i, tl.sum(v * v, 1)[:, None], 0.0)
    pm = m_r[:, None] & (slot < N)
    r = 1.0 / tl.sqrt(q / D + eps)
    logit = tl.where(slot < N, s * r, float("-inf"))
    e = tl.exp(logit - tl.max(logit, 1)[:, None])  # padding slots: exp(-inf) = 0
    p = e / tl.sum(e, 1)[:, None]
    tl.store(P + slot * M + rows[:, None], p, mask=pm)
    tl.store(R + slot * M + rows[:, None], r, mask=pm)
    tl.store(S + slot * M + rows[:, None], s, mask=pm)
    ss = tl.zeros([BM], tl.float32)  # sum of the rounded mix's squares (NORM)
    for d0 in range(0, D, BD):
        cols = d0 + tl.arange(0, BD)
        m = m_r[:, None] & (cols < D)[None, :]
        acc = tl.zeros([BM, BD], tl.float32)
        for i in tl.static_range(N):
            src = _pick(i, C0, C1, C2, C3, C4, C5, C6, C7, C8)
            v = tl.load(src + base + cols[None, :], mask=m, other=0.0).to(tl.float32)
            acc += _column(p, slot, i)[:, None] * v
        h = cvt(acc, OUT.dtype.element_ty)
        if NORM:
            tl.store(HS + base + cols[None, :], h, mask=m)
            hf = h.to(tl.float32)
            ss += tl.sum(hf * hf, 1)
        else:
            tl.store(OUT + base + cols[None, :], h, mask=m)
    if NORM:  # the mix's rows are complete: normalise them (re-read from HS, this program's own writes)
        rn = 1.0 / tl.sqrt(ss / D + eps2)
        tl.store(RN + rows, rn, mask=m_r)
        tl.debug_barrier()
        for d0 in range(0, D, BD):
            cols = d0 + tl.arange(0, BD)
            m_c = cols < D
            m = m_r[:, None] & m_c[None, :]
            hf = tl.load(HS + base + cols[None, :], mask=m, other=0.0).to(tl.float32)
            n = cvt(hf * rn[:, None], OUT.dtype.element_ty).to(tl.float32)
            w2 = tl.load(W2 + cols, mask=m_c, other=0.0).to(tl.float32)
            tl.store(OUT + base + cols[None, :], cvt(w2[None, :] * n, OUT.dtype.element_ty), mask=m)


@triton.jit
def _attn_res_bwd(C0, C1, C2, C3, C4, C5, C6, C7, C8, G0, G1, G2, G3, G4, G5, G6, G7, G8,
                  I0, I1, I2, I3, I4, I5, I6, I7, I8, GO, W, P, R, S, GWP, HS, W2, RN, GW2P, M, D,
                  N: tl.constexpr, NP: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr, HAS_IN: tl.constexpr,
                  NORM: tl.constexpr):
    """Every candidate's gradient G_i (plus the incoming gradient I_i where bit i of HAS_IN is set:
    the gradient a carried candidate collected downstream, summed here in fp32 instead of by autograd
    in a separate pass) and this program's partial w gradient. With NORM, GO is the gradient of the
    normalised output: first the norm's backward (its weight's partial gradient to GW2P), whose input
    gradient, rounded to the mix's dtype as the unfused norm stores it, is the mix's output gradient."""
    pid = tl.program_id(0)
    rows = pid * BM + tl.arange(0, BM)
    m_r = rows < M
    base = rows.to(tl.int64)[:, None] * D
    slot = tl.arange(0, NP)[None, :]
    rn = tl.zeros([BM], tl.float32)
    mean = tl.zeros([BM], tl.float32)
    if NORM:  # mean(g_n . n) per row, g_n = GO * W2, n = mix * rn; W2's gradient sum_rows GO * round(n)
        rn = tl.load(RN + rows, mask=m_r, other=0.0)
        for d0 in range(0, D, BD):
            cols = d0 + tl.arange(0, BD)
            m_c = cols < D
            m = m_r[:, None] & m_c[None, :]
            gy = tl.load(GO + base + cols[None, :], mask=m, other=0.0).to(tl.float32)
            n = tl.load(HS + base + cols[None, :], mask=m, other=0.0).to(tl.float32) * rn[:, None]
            w2 = tl.load(W2 + cols, mask=m_c, other=0.0).to(tl.float32)
            mean += tl.sum(gy * w2[None, :] * n, 1)
            n_used = cvt(n, HS.dtype.element_ty).to(tl.float32)
            tl.store(GW2P + pid.to(tl.int64) * D + cols, tl.sum(gy * n_used, 0), mask=m_c)
        mean = mean / D
    gp = tl.zeros([BM, NP], tl.float32)  # g . V_i per row (column i)
    for d0 in range(0, D, BD):
        cols = d0 + tl.arange(0, BD)
        m = m_r[:, None] & (cols < D)[None, :]
        g = _out_grad(GO, HS, W2, rn, mean, base, cols, m, D, NORM)
        for i in tl.static_range(N):
            src = _pick(i, C0, C1, C2, C3, C4, C5, C6, C7, C8)
            v = tl.load(src + base + cols[None, :], mask=m, other=0.0).to(tl.float32)
            gp += tl.where(slot == i, tl.sum(g * v, 1)[:, None], 0.0)
    pm = m_r[:, None] & (slot < N)
    p = tl.load(P + slot * M + rows[:, None], mask=pm, other=0.0)
    r = tl.load(R + slot * M + rows[:, None], mask=pm, other=0.0)
    s = tl.load(S + slot * M + rows[:, None], mask=pm, other=0.0)
    glog = p * (gp - tl.sum(p * gp, 1)[:, None])  # softmax backward
    a = glog * r  # coefficient of w in d logit / d V
    c = a * s * r * r / D  # coefficient of -V
    for d0 in range(0, D, BD):
        cols = d0 + tl.arange(0, BD)
        m_c = cols < D
        m = m_r[:, None] & m_c[None, :]
        g = _out_grad(GO, HS, W2, rn, mean, base, cols, m, D, NORM)
        w = tl.load(W + cols, mask=m_c, other=0.0)
        gw = tl.zeros([BD], tl.float32)
        for i in tl.static_range(N):
            src = _pick(i, C0, C1, C2, C3, C4, C5, C6, C7, C8)
            dst = _pick(i, G0, G1, G2, G3, G4, G5, G6, G7, G8)
            v = tl.load(src + base + cols[None, :], mask=m, other=0.0).to(tl.float32)
            a_i = _column(a, slot, i)[:, None]
            grad = g * _column(p, slot, i)[:, None] + a_i * w[None, :] - _column(c, slot, i)[:, None] * v
            if (HAS_IN >> i) & 1:
                inc = _pick(i, I0, I1, I2, I3, I4, I5, I6, I7, I8)
                grad += tl.load(inc + base + cols[None, :], mask=m, other=0.0).to(tl.float32)
            tl.store(dst + base + cols[None, :], cvt(grad, dst.dtype.element_ty), mask=m)
            gw += tl.sum(a_i * v, 0)
        tl.store(GWP + pid.to(tl.int64) * D + cols, gw, mask=m_c)


def tile() -> tuple[int, ...]:
    """TILE, read at call time (a module constant beside the kernels; tests and bench sweeps set it)."""
    return TILE


def _launch(kernel, M: int, D: int, N: int, *args, **flags) -> None:  # noqa: ANN001, ANN003
    """One program per BM rows of the [M, D] candidates, N of them; flags: the kernel's other constexprs."""
    bm, bd, warps = tile()
    kernel[(triton.cdiv(M, bm),)](*args, N=N, NP=max(2, triton.next_power_of_2(N)), BM=bm,
                                  BD=min(bd, triton.next_power_of_2(D)), num_warps=warps, **flags)


def _slots(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    return list(ts) + [ts[0]] * (MAXN - len(ts))


class AttnResMix(torch.autograd.Function):
    """cands: n tensors [..., D] (2 <= n <= MAXN, same shape) -> mix in cands[-1]'s dtype, followed by
    `carry` (<= n) pass-through views of cands[:carry]: the next mix (and, for the running prefix, its
    residual add) takes those instead of the originals, so each candidate has one consumer and the
    gradients from its other uses are summed inside this backward kernel (one read of the incoming
    gradient) rather than by autograd (a separate read-read-write add per extra consumer)."""

    @staticmethod
    def forward(ctx, w_norm, w_proj, eps, carry, norm_w, norm_eps, *cands):  # noqa: ANN001 - autograd signature
        shape, D = cands[-1].shape, cands[-1].shape[-1]
        flat = [c.reshape(-1, D).contiguous() for c in cands]
        M, N = flat[0].shape[0], len(flat)
        w = (w_norm.float() * w_proj.float().reshape(-1)).contiguous()
        out = torch.empty(M, D, dtype=cands[-1].dtype, device=w.device)
        prs = torch.empty(3, N, M, dtype=torch.float32, device=w.device)
        norm = norm_w is not None
        mix = torch.empty_like(out) if norm else out  # with the norm: the mix and its rows' rsqrt, saved
        rn = torch.empty(M if norm else 1, dtype=torch.float32, device=w.device)
        w2 = norm_w.contiguous() if norm else w
        _launch(_attn_res_fwd, M, D, N, *_slots(flat), w, out, prs[0], prs[1], prs[2], mix, w2, rn, M, D, eps,
                norm_eps, NORM=norm)
        # without the norm the output is not saved (rn stands in; the kernels read it only with the norm)
        ctx.save_for_backward(w_norm, w_proj, w, prs, mix if norm else rn, w2, rn, *flat)
        ctx.norm = norm
        ctx.shapes = [c.shape for c in cands]
        ctx.set_materialize_grads(False)  # an unused pass-through (or output) gradient stays None
        return (out.view(shape), *[c.view_as(c) for c in cands[:carry]])

    @staticmethod
    def backward(ctx, go, *incoming):  # noqa: ANN001
        w_norm, w_proj, w, prs, mix, w2, rn, *flat = ctx.saved_tensors
        (M, D), N = flat[0].shape, len(flat)
        go = torch.zeros(M, D, dtype=flat[-1].dtype, device=w.device) if go is None else go.reshape(M, D)
        inc = [None if g is None else g.reshape(M, D).contiguous() for g in incoming]
        has_in = sum(1 << i for i, g in enumerate(inc) if g is not None)
        inc = [g if g is not None else flat[0] for g in inc]  # unused slots: never read
        grads = [torch.empty_like(c) for c in flat]
        gwp = torch.empty(2 if ctx.norm else 1, triton.cdiv(M, tile()[0]), D, dtype=torch.float32,
                          device=w.device)  # one row a program (w; the norm's weight)
        _launch(_attn_res_bwd, M, D, N, *_slots(flat), *_slots(grads), *_slots(inc or flat[:1]), go.contiguous(),
                w, prs[0], prs[1], prs[2], gwp[0], mix, w2, rn, gwp[-1], M, D, HAS_IN=has_in, NORM=ctx.norm)
        gw = column_sum(gwp[0])
        g_norm = (gw * w_proj.float().reshape(-1)).to(w_norm.dtype).reshape(w_norm.shape)
        g_proj = (gw * w_norm.float()).to(w_proj.dtype).reshape(w_proj.shape)
        g_w2 = column_sum(gwp[1]).to(w2.dtype) if ctx.norm else None
        return (g_norm, g_proj, None, None, g_w2, None, *[g.view(s) for g, s in zip(grads, ctx.shapes)])
