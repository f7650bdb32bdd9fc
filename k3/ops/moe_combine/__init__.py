"""MoE combine: each token's k expert outputs, weighted and summed, forward and backward.

    from k3.ops.moe_combine import moe_combine
    out = moe_combine(y, w, inv)        # y [N*k, L] sorted slots, w [N, k] fp32, inv [N*k] -> [N, L]

`reference.py` is the spec; `triton_combine.py` the Triton kernels used on CUDA tensors (and under
TRITON_INTERPRET=1 on CPU, which is how CI tests them). Each program reads its tokens' slot indices
and weights once and gathers whole row blocks; the backward writes each slot's gradient row exactly
once (inv is a permutation: no atomics) and the weights' gradient as per-column-block partials.
"""

from __future__ import annotations

import torch

__all__ = ["moe_combine"]


def moe_combine(y: torch.Tensor, w: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """sum_j w[n, j] * y[inv[n*k + j]] in fp32, cast to y's dtype.

    Args:
        y: [N*k, L] bf16 / fp16 / fp32 expert outputs in expert-sorted slot order.
        w: [N, k] routing weights (fp32; another float dtype is widened).
        inv: [N*k] integer, the sorted slot of (token n, choice j) at n*k + j; must be a permutation.
    Returns:
        [N, L] in y's dtype; differentiable in y and w (grad w fp32 [N, k]).
    """
    from k3.ops.moe_combine.triton_combine import MoECombine

    if y.dim() != 2 or w.dim() != 2 or inv.dim() != 1:
        raise ValueError(f"expected y [N*k, L], w [N, k], inv [N*k]; got {list(y.shape)}, {list(w.shape)}, "
                         f"{list(inv.shape)}")
    N, k = w.shape
    if y.shape[0] != N * k or inv.shape[0] != N * k:
        raise ValueError(f"y has {y.shape[0]} rows and inv {inv.shape[0]} entries, expected N*k = {N * k}")
    if not y.is_floating_point() or y.dtype == torch.float64 or not w.is_floating_point():
        raise ValueError(f"y must be bf16, fp16 or fp32 and w floating point; got {y.dtype}, {w.dtype}")
    if inv.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"inv must be int32 or int64, got {inv.dtype}")
    return MoECombine.apply(y.contiguous(), w.float().contiguous(), inv.contiguous())
