"""Token cross-entropy, the spec (what `K3ForCausalLM` trains on).

    loss = mean over rows n with labels[n] != -100 of  logsumexp(x[n]) - x[n, labels[n]],  x = logits in fp32

in fp32, or float64 for float64 logits. With every label ignored the mean is 0 / 0 = nan, as
`F.cross_entropy(..., ignore_index=-100)` returns. The linear variant is the same loss of h @ W^T.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100


def cross_entropy_reference(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """logits [N, V] (any float dtype), labels [N] integer (-100 = ignore) -> 0-dim loss, fp32 (float64
    for float64 logits); differentiable in logits."""
    wide = torch.float64 if logits.dtype == torch.float64 else torch.float32
    x = logits.to(wide)
    valid = labels != IGNORE_INDEX
    target = x.gather(1, labels.long().clamp(min=0).unsqueeze(1)).squeeze(1)
    per_row = torch.where(valid, torch.logsumexp(x, dim=1) - target, torch.zeros((), dtype=wide, device=x.device))
    return per_row.sum() / valid.sum()


def linear_cross_entropy_reference(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """h [N, d], weight [V, d] (one dtype), labels [N] -> the loss of the logits h @ weight^T, computed
    in h's dtype (float64 inputs: all in float64); differentiable in h and weight."""
    return cross_entropy_reference(h @ weight.t(), labels)


def add_weight_grad(dw: torch.Tensor | None, g: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """dW [V, d] fp32 += g^T @ h. Half inputs: each chunk's product comes out of cuBLAS in the input
    dtype (fp32 accumulation inside) and is summed in fp32 here, so one chunk equals the unfused path's
    single rounded GEMM. (A CUDA-only fp32-output GEMM would drop that rounding for an fp32 temporary.)"""
    if dw is None:
        return torch.mm(g.t(), h).float()
    if g.dtype == torch.float32:
        return dw.addmm_(g.t(), h)
    return dw.add_(torch.mm(g.t(), h))
