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

TILE = (2, 1024, 4)  # rows, columns, warps per program: the fastest of bench/attn_res.py --sweep


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
def _attn_res_fwd(C0, C1, C2, C3, C4, C5, C6, C7, C8, W, OUT, P, R, S, M, D, eps,
                  N: tl.constexpr, NP: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr):
    """OUT = the mix; the softmax weights, rsqrt statistics and logits per (candidate, row) to P, R, S."""
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
    for d0 in range(0, D, BD):
        cols = d0 + tl.arange(0, BD)
        m = m_r[:, None] & (cols < D)[None, :]
        acc = tl.zeros([BM, BD], tl.float32)
        for i in tl.static_range(N):
            src = _pick(i, C0, C1, C2, C3, C4, C5, C6, C7, C8)
            v = tl.load(src + base + cols[None, :], mask=m, other=0.0).to(tl.float32)
            acc += _column(p, slot, i)[:, None] * v
        tl.store(OUT + base + cols[None, :], cvt(acc, OUT.dtype.element_ty), mask=m)


@triton.jit
def _attn_res_bwd(C0, C1, C2, C3, C4, C5, C6, C7, C8, G0, G1, G2, G3, G4, G5, G6, G7, G8,
                  I0, I1, I2, I3, I4, I5, I6, I7, I8, GO, W, P, R, S, GWP, M, D,
                  N: tl.constexpr, NP: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr, HAS_IN: tl.constexpr):
    """Every candidate's gradient G_i (plus the incoming gradient I_i where bit i of HAS_IN is set:
    the gradient a carried candidate collected downstream, summed here in fp32 instead of by autograd
    in a separate pass) and this program's partial w gradient, from the output gradient GO."""
    pid = tl.program_id(0)
    rows = pid * BM + tl.arange(0, BM)
    m_r = rows < M
    base = rows.to(tl.int64)[:, None] * D
    slot = tl.arange(0, NP)[None, :]
    gp = tl.zeros([BM, NP], tl.float32)  # g . V_i per row (column i)
    for d0 in range(0, D, BD):
        cols = d0 + tl.arange(0, BD)
        m = m_r[:, None] & (cols < D)[None, :]
        g = tl.load(GO + base + cols[None, :], mask=m, other=0.0).to(tl.float32)
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
        g = tl.load(GO + base + cols[None, :], mask=m, other=0.0).to(tl.float32)
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
    def forward(ctx, w_norm, w_proj, eps, carry, *cands):  # noqa: ANN001 - autograd signature
        shape, D = cands[-1].shape, cands[-1].shape[-1]
        flat = [c.reshape(-1, D).contiguous() for c in cands]
        M, N = flat[0].shape[0], len(flat)
        w = (w_norm.float() * w_proj.float().reshape(-1)).contiguous()
        out = torch.empty(M, D, dtype=cands[-1].dtype, device=w.device)
        prs = torch.empty(3, N, M, dtype=torch.float32, device=w.device)
        _launch(_attn_res_fwd, M, D, N, *_slots(flat), w, out, prs[0], prs[1], prs[2], M, D, eps)
        ctx.save_for_backward(w_norm, w_proj, w, prs, *flat)
        ctx.shapes = [c.shape for c in cands]
        ctx.set_materialize_grads(False)  # an unused pass-through (or output) gradient stays None
        return (out.view(shape), *[c.view_as(c) for c in cands[:carry]])

    @staticmethod
    def backward(ctx, go, *incoming):  # noqa: ANN001
        w_norm, w_proj, w, prs, *flat = ctx.saved_tensors
        (M, D), N = flat[0].shape, len(flat)
        go = torch.zeros(M, D, dtype=flat[-1].dtype, device=w.device) if go is None else go.reshape(M, D)
        inc = [None if g is None else g.reshape(M, D).contiguous() for g in incoming]
        has_in = sum(1 << i for i, g in enumerate(inc) if g is not None)
        inc = [g if g is not None else flat[0] for g in inc]  # unused slots: never read
        grads = [torch.empty_like(c) for c in flat]
        gwp = torch.empty(triton.cdiv(M, tile()[0]), D, dtype=torch.float32, device=w.device)  # one row a program
        _launch(_attn_res_bwd, M, D, N, *_slots(flat), *_slots(grads), *_slots(inc or flat[:1]), go.contiguous(),
                w, prs[0], prs[1], prs[2], gwp, M, D, HAS_IN=has_in)
        gw = column_sum(gwp)
        g_norm = (gw * w_proj.float().reshape(-1)).to(w_norm.dtype).reshape(w_norm.shape)
        g_proj = (gw * w_norm.float()).to(w_proj.dtype).reshape(w_proj.shape)
        return (g_norm, g_proj, None, None, *[g.view(s) for g, s in zip(grads, ctx.shapes)])
