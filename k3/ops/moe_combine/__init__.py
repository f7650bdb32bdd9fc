"""MoE token permutation: dispatch (each token's row to its k expert-sorted slots) and combine (each
token's k expert outputs, weighted and summed), forward and backward.

    from k3.ops.moe_combine import moe_combine, moe_dispatch
    xs = moe_dispatch(z, inv, k)        # z [N, L] -> [N*k, L], row inv[n*k + j] = z[n]
    out = moe_combine(y, w, inv)        # y [N*k, L] sorted slots, w [N, k] fp32, inv [N*k] -> [N, L]

`reference.py` is the spec; `triton_combine.py` the Triton kernels used on CUDA tensors (and under
TRITON_INTERPRET=1 on CPU, which is how CI tests them). Each program reads its tokens' slot indices
and weights once and gathers whole row blocks; the backward writes each slot's gradient row exactly
once (inv is a permutation: no atomics) and the weights' gradient as per-column-block partials.
Dispatch is the transpose: its forward reads each token row once and writes its k slots; its
backward is combine's forward with unit weights (a gather and an fp32 k-way sum, no atomics).
"""

from __future__ import annotations

import torch

__all__ = ["moe_combine", "moe_dispatch"]


def _check_inv(inv: torch.Tensor, rows: int) -> None:
    if inv.dim() != 1 or inv.shape[0] != rows:
        raise ValueError(f"inv must be [{rows}], got {list(inv.shape)}")
    if inv.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"inv must be int32 or int64, got {inv.dtype}")


def moe_dispatch(z: torch.Tensor, inv: torch.Tensor, k: int) -> torch.Tensor:
    """Each token's row copied to its k expert-sorted slots: out[inv[n*k + j]] = z[n].

    Args:
        z: [N, L] bf16 / fp16 / fp32 token rows.
        inv: [N*k] integer, the sorted slot of (token n, choice j) at n*k + j; must be a permutation.
        k: choices per token (>= 1).
    Returns:
        [N*k, L] in z's dtype; differentiable in z (the gradient sums each token's k slot rows in fp32,
        j = 0 .. k-1, cast to z's dtype).
    """
    from k3.ops.moe_combine.triton_combine import MoEDispatch

    if z.dim() != 2 or k < 1:
        raise ValueError(f"expected z [N, L] and k >= 1; got {list(z.shape)}, k = {k}")
    if not z.is_floating_point() or z.dtype == torch.float64:
        raise ValueError(f"z must be bf16, fp16 or fp32, got {z.dtype}")
    _check_inv(inv, z.shape[0] * k)
    return MoEDispatch.apply(z.contiguous(), inv.contiguous(), int(k))


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
    _check_inv(inv, N * k)
    return MoECombine.apply(y.contiguous(), w.float().contiguous(), inv.contiguous())
