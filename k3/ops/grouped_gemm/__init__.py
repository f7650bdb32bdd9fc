"""The routed experts' training GEMM with its weight gradient accumulated in fp32 straight into the
master weights' `.grad`.

    from k3.ops.grouped_gemm import expert_gemm
    y = expert_gemm(x, w, offs, (w1, w3))   # x [S, K] bf16, w [E, N, K] bf16 = cat([w1, w3], 1).to(bf16)

Forward and input gradient are torch._grouped_mm on CUDA (the per-expert loop of `reference.py` on the
CPU); the weight gradient is the Triton kernel of `triton_gmm.py`, which adds per-expert g^T x into the
fp32 masters' gradients inside the GEMM (no bf16 gradient tensor, no separate accumulation pass, and no
bf16 rounding of each micro-batch's contribution). Like `k3.model.step_weights`, this bypasses autograd's
AccumulateGrad (no gradient hooks fire on the masters), so the model uses it only inside
`K3ForCausalLM.step_weights()`. On the CPU the kernel runs under TRITON_INTERPRET=1 (how CI tests it).
"""

from __future__ import annotations

import torch
from torch import Tensor

from k3.ops.grouped_gemm.reference import check_offs, gmm_reference

__all__ = ["expert_gemm"]


def _gmm(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    """a [S, K] @ b[e] [K, N] for each expert's rows."""
    if a.is_cuda:
        return torch._grouped_mm(a, b, offs=offs)
    return gmm_reference(a, b, offs)


class _ExpertGEMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, offs, masters):  # noqa: ANN001 - autograd signature
        ctx.save_for_backward(x, w, offs)
        ctx.masters = masters  # the leaves themselves (as k3.model.step_weights keeps them)
        return _gmm(x, w.transpose(-2, -1), offs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):  # noqa: ANN001
        x, w, offs = ctx.saved_tensors
        g = g.contiguous()
        dx = _gmm(g, w, offs) if ctx.needs_input_grad[0] else None
        masters = ctx.masters
        if masters[0].requires_grad:  # all or none (checked by expert_gemm)
            fresh = all(p.grad is None for p in masters)
            for p in masters:
                if p.grad is None:  # the step's first micro-batch writes, later ones add
                    p.grad = torch.empty_like(p) if fresh else torch.zeros_like(p)
            from k3.ops.grouped_gemm.triton_gmm import gmm_wgrad  # Triton: imported where it runs

            gmm_wgrad(g, x, offs, tuple(p.grad for p in masters), accumulate=not fresh)
        return dx, None, None, None


def expert_gemm(x: Tensor, w: Tensor, offs: Tensor, masters: tuple[Tensor, ...]) -> Tensor:
    """Rows of expert e times w[e]^T, with the weight gradient added into the masters' `.grad`.

    Args:
        x: [S, K] bf16 / fp16 / fp32, rows sorted by expert.
        w: [E, N, K] in x's dtype: the compute copy of `masters` concatenated along dim 1 (its own
            autograd gradient is never produced).
        offs: [E] int32 cumulative row counts (offs[-1] == S).
        masters: one or two contiguous fp32 leaves [E, N_i, K] (sum N_i == N), e.g. (w1, w3) for a packed
            gate|up GEMM; their `.grad` receives sum over rows of expert e of g^T x in fp32 (created on the
            first backward, added to afterwards).
    Returns:
        [S, N] in x's dtype; differentiable in x.
    """
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[2] or x.dtype != w.dtype:
        raise ValueError(f"expert_gemm takes x [S, K] and w [E, N, K] of one dtype, got {list(x.shape)} "
                         f"{x.dtype}, {list(w.shape)} {w.dtype}")
    E, N, K = w.shape
    check_offs(offs, E)
    if not 1 <= len(masters) <= 2 or sum(p.shape[1] for p in masters) != N or any(
            p.dtype != torch.float32 or list(p.shape) != [E, p.shape[1], K] or not p.is_contiguous()
            for p in masters):
        raise ValueError(f"expert_gemm masters must be one or two contiguous fp32 [{E}, N_i, {K}] tensors with "
                         f"sum N_i = {N}, got {[(list(p.shape), p.dtype) for p in masters]}")
    if len({p.requires_grad for p in masters}) > 1:
        raise ValueError("expert_gemm: the masters of a packed GEMM must all require grad or none")
    return _ExpertGEMM.apply(x, w, offs, tuple(masters))
