"""Router logits in fp32 from bf16 tensor-core GEMMs: x [N, d] bf16 @ weight [E, d] fp32 ^T -> [N, E] fp32.

The spec computes the router logits as x_f32 @ W_f32^T. x is a bf16 activation, so x_f32 is exact in bf16;
W (the fp32 master weight) splits exactly into three bf16 parts, W = W_hi + W_mid + W_lo (8 mantissa bits
each, 24 in all). Every product of a bf16 x by a bf16 part is exact in fp32, so one bf16 GEMM against the
stacked parts [W_hi; W_mid; W_lo] ([3E, d], accumulated in fp32, fp32 output) gives the fp32 product to
fp32 accumulation accuracy, as the fp32 GEMM does, at tensor-core speed (`bench/router.py` times it
against the cast of x plus cuBLAS's fp32 GEMM).

The backward works the same way: dW = g^T x with g split into three bf16 parts (exact products, fp32
sums); dx = g W, which is rounded to x's bf16 at the end, from the three largest part products
(g_hi W_hi + g_hi W_mid + g_lo W_hi: ~2^-16 relative before the bf16 rounding's 2^-9). Against float64
(tests/ops/test_router.py, GPU) the logits are within ~1e-6 relative, dW ~1e-5 (long sums on the tensor
cores, whose fp32 accumulation does not round to nearest), dx ~2e-3 (the bf16 rounding of the result).

On CUDA the fp32-output GEMM is `torch.mm(..., out_dtype=torch.float32)`; elsewhere (CPU tests) the same
exact products are formed in fp32 (`a.float() @ b.float()`), so the splitting is tested on the CPU.
"""

from __future__ import annotations

import torch
from torch import Tensor

from k3.ops.backend import triton_runs_on
from k3.ops.router.reference import router_logits_reference


def split3(w: Tensor) -> Tensor:
    """fp32 w [..., E, d] -> bf16 [3, ..., E, d] with w == hi + mid + lo exactly (normal values)."""
    hi = w.to(torch.bfloat16)
    r = w - hi.float()
    mid = r.to(torch.bfloat16)
    lo = (r - mid.float()).to(torch.bfloat16)
    return torch.stack([hi, mid, lo])


def split2(g: Tensor) -> tuple[Tensor, Tensor]:
    """fp32 g -> (hi, lo) bf16 with g ~= hi + lo (16 mantissa bits)."""
    hi = g.to(torch.bfloat16)
    return hi, (g - hi.float()).to(torch.bfloat16)


def mm_f32(a: Tensor, b: Tensor) -> Tensor:
    """a [M, K] @ b [K, N], both bf16, accumulated and returned in fp32."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def mm_bf16(a: Tensor, b: Tensor) -> Tensor:
    """a [M, K] @ b [K, N], both bf16, accumulated in fp32 and rounded once to bf16 (no fp32 [M, N] pass)."""
    if a.is_cuda:
        return torch.mm(a, b)
    return (a.float() @ b.float()).to(torch.bfloat16)


class _RouterLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor) -> Tensor:  # noqa: ANN001 - autograd signature
        E = weight.shape[0]
        parts = split3(weight.detach())  # [3, E, d]
        y = mm_f32(x, parts.reshape(3 * E, -1).t())  # [N, 3E]
        ctx.save_for_backward(x, parts)
        return y[:, :E] + (y[:, E:2 * E] + y[:, 2 * E:])  # small parts first

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor | None, Tensor | None]:  # noqa: ANN001
        x, parts = ctx.saved_tensors
        E = parts.shape[1]
        g = g.float().contiguous()
        dx = dw = None
        if triton_runs_on(g):
            from k3.ops.router.triton_split import router_grad_split

            a, gp = router_grad_split(g)  # one kernel: both operands, the torch split's bits
        else:
            g_hi, g_lo = split2(g)
            a = torch.cat([g_hi, g_hi, g_lo], dim=1)  # [N, 3E]
            gp = split3(g.t().contiguous()).reshape(3 * E, -1)  # [3E, N]
        if ctx.needs_input_grad[0]:
            b = torch.cat([parts[0], parts[1], parts[0]], dim=0)  # [3E, d]
            dx = mm_bf16(a, b)  # x is bf16 on this path
        if ctx.needs_input_grad[1]:
            d3 = mm_f32(gp, x).reshape(3, E, -1)
            dw = d3[0] + (d3[1] + d3[2])
        return dx, dw


def router_logits(x: Tensor, weight: Tensor) -> Tensor:
    """x [N, d] (bf16, or any dtype: see below), weight [E, d] fp32 -> logits x_f32 @ weight^T [N, E] fp32.

    bf16 x: the split bf16 GEMMs above (differentiable in x and weight). Other dtypes (fp32 x, fp16 x,
    whose values the bf16 parts would not hold exactly): the plain fp32 product."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"router_logits: x [N, d] and weight [E, d] expected, got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if weight.dtype != torch.float32:
        raise ValueError(f"router_logits: weight must be fp32 (the master weight), got {weight.dtype}")
    if x.dtype != torch.bfloat16:
        return router_logits_reference(x, weight)
    with torch.autocast(x.device.type, enabled=False):
        return _RouterLogits.apply(x, weight)


__all__ = ["router_logits", "router_logits_reference", "split3", "split2", "mm_f32", "mm_bf16"]
