"""MoE combine as Triton kernels (see k3.ops.moe_combine for the maths and the layout).

Why: Inductor's fused gather-multiply-sum does one index load per output element per choice, far
below the bandwidth (docs/dev_log.md). Here a program owns BN tokens x BL columns: it loads each choice's BN slot indices and weights once,
gathers BN row segments of y, and accumulates in fp32 in the order j = 0 .. k-1 (the reference's).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3.ops.triton_utils import cvt

TILE = (4, 512, 4)  # tokens, columns, warps per program: among the fastest of bench/moe_combine.py --sweep


@triton.jit
def _combine_fwd(Y, W, INV, OUT, N, L, K: tl.constexpr, BN: tl.constexpr, BL: tl.constexpr,
                 HAS_W: tl.constexpr):
    """OUT[n] = sum_j w[n, j] y[inv[n*k + j]] (without HAS_W unit weights: the dispatch backward)."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rl = tl.program_id(1) * BL + tl.arange(0, BL)
    mn = rn < N
    m = mn[:, None] & (rl < L)[None, :]
    tok = rn.to(tl.int64)
    acc = tl.zeros([BN, BL], dtype=tl.float32)
    for j in tl.static_range(K):
        slot = tl.load(INV + tok * K + j, mask=mn, other=0).to(tl.int64)
        yj = tl.load(Y + slot[:, None] * L + rl[None, :], mask=m, other=0.0).to(tl.float32)
        if HAS_W:
            acc += tl.load(W + tok * K + j, mask=mn, other=0.0)[:, None] * yj
        else:
            acc += yj
    tl.store(OUT + tok[:, None] * L + rl[None, :], cvt(acc, OUT.dtype.element_ty), mask=m)


@triton.jit
def _combine_bwd(Y, W, INV, GO, GY, GWP, N, L, K: tl.constexpr, BN: tl.constexpr, BL: tl.constexpr):
    """GY[slot] = w * go (each slot once: inv is a permutation); GWP[column block, n, j] = the block's
    share of <go[n], y[slot]> (summed over blocks by the caller, in a fixed order)."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rl = tl.program_id(1) * BL + tl.arange(0, BL)
    mn = rn < N
    m = mn[:, None] & (rl < L)[None, :]
    tok = rn.to(tl.int64)
    go = tl.load(GO + tok[:, None] * L + rl[None, :], mask=m, other=0.0).to(tl.float32)
    part = GWP + (tl.program_id(1) * N + tok) * K
    for j in tl.static_range(K):
        slot = tl.load(INV + tok * K + j, mask=mn, other=0).to(tl.int64)
        wj = tl.load(W + tok * K + j, mask=mn, other=0.0)
        yj = tl.load(Y + slot[:, None] * L + rl[None, :], mask=m, other=0.0).to(tl.float32)
        tl.store(part + j, tl.sum(go * yj, axis=1), mask=mn)
        tl.store(GY + slot[:, None] * L + rl[None, :], cvt(wj[:, None] * go, GY.dtype.element_ty), mask=m)


@triton.jit
def _dispatch_fwd(Z, INV, OUT, N, L, K: tl.constexpr, BN: tl.constexpr, BL: tl.constexpr):
    """OUT[inv[n*k + j]] = z[n] for every choice j: each token row read once, each slot written once."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rl = tl.program_id(1) * BL + tl.arange(0, BL)
    mn = rn < N
    m = mn[:, None] & (rl < L)[None, :]
    tok = rn.to(tl.int64)
    z = tl.load(Z + tok[:, None] * L + rl[None, :], mask=m, other=0.0)
    for j in tl.static_range(K):
        slot = tl.load(INV + tok * K + j, mask=mn, other=0).to(tl.int64)
        tl.store(OUT + slot[:, None] * L + rl[None, :], z, mask=m)


def tile() -> tuple[int, ...]:
    """TILE, read at call time (a module constant beside the kernels; tests and bench sweeps set it)."""
    return TILE


def _grid(N: int, L: int) -> tuple[tuple[int, int], int, int, int]:
    bn, bl, warps = tile()
    bl = min(bl, triton.next_power_of_2(L))
    return (triton.cdiv(N, bn), triton.cdiv(L, bl)), bn, bl, warps


def combine_fwd(y: torch.Tensor, w: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """y [N*k, L], w [N, k] fp32, inv [N*k] (all contiguous) -> [N, L] in y's dtype."""
    (N, k), L = w.shape, y.shape[1]
    out = y.new_empty(N, L)
    if N == 0 or L == 0:
        return out
    grid, bn, bl, warps = _grid(N, L)
    _combine_fwd[grid](y, w, inv, out, N, L, K=k, BN=bn, BL=bl, HAS_W=True, num_warps=warps)
    return out


def dispatch_fwd(z: torch.Tensor, inv: torch.Tensor, k: int) -> torch.Tensor:
    """z [N, L], inv [N*k] (contiguous) -> [N*k, L] in z's dtype, row inv[n*k + j] = z[n]."""
    N, L = z.shape
    out = z.new_empty(N * k, L)
    if N == 0 or L == 0:
        return out
    grid, bn, bl, warps = _grid(N, L)
    _dispatch_fwd[grid](z, inv, out, N, L, K=k, BN=bn, BL=bl, num_warps=warps)
    return out


def dispatch_bwd(g: torch.Tensor, inv: torch.Tensor, k: int) -> torch.Tensor:
    """g [N*k, L] contiguous -> [N, L] in g's dtype: each token's k slot rows summed in fp32, j = 0 .. k-1."""
    L = g.shape[1]
    N = g.shape[0] // k
    out = g.new_empty(N, L)
    if N == 0 or L == 0:
        return out.zero_()
    grid, bn, bl, warps = _grid(N, L)
    _combine_fwd[grid](g, g, inv, out, N, L, K=k, BN=bn, BL=bl, HAS_W=False, num_warps=warps)
    return out


def combine_bwd(y: torch.Tensor, w: torch.Tensor, inv: torch.Tensor, go: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (grad y [N*k, L] in y's dtype, grad w [N, k] fp32); go [N, L] contiguous."""
    (N, k), L = w.shape, y.shape[1]
    if N == 0 or L == 0:
        return torch.zeros_like(y), torch.zeros_like(w)
    grid, bn, bl, warps = _grid(N, L)
    gy = torch.empty_like(y)
    parts = torch.empty(grid[1], N, k, dtype=torch.float32, device=y.device)
    _combine_bwd[grid](y, w, inv, go, gy, parts, N, L, K=k, BN=bn, BL=bl, num_warps=warps)
    return gy, parts.sum(0)


class MoEDispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, inv, k):  # noqa: ANN001 - autograd signature
        ctx.save_for_backward(inv)
        ctx.k = k
        return dispatch_fwd(z, inv, k)

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001
        (inv,) = ctx.saved_tensors
        return dispatch_bwd(g.contiguous(), inv, ctx.k), None, None


class MoECombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, w, inv):  # noqa: ANN001 - autograd signature
        ctx.save_for_backward(y, w, inv)
        return combine_fwd(y, w, inv)

    @staticmethod
    def backward(ctx, go):  # noqa: ANN001
        y, w, inv = ctx.saved_tensors
        gy, gw = combine_bwd(y, w, inv, go.contiguous())
        return gy, gw, None
