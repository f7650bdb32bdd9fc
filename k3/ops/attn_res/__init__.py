"""Block Attention Residuals' aggregation over the candidates (completed block sums + running prefix).

    from k3.ops.attn_res import attn_res_mix
    h = attn_res_mix([b0, b1, prefix], w_norm, w_proj, eps=1e-5)     # [..., d]

`reference.py` is the spec (plain loops); `triton_attn_res.py` the Triton forward / backward kernels
used on CUDA tensors (and under TRITON_INTERPRET=1 on CPU, which is how CI tests them).
"""

from __future__ import annotations

import torch

__all__ = ["attn_res_mix", "MAX_CANDIDATES"]

MAX_CANDIDATES = 9  # K3's output mix: 8 completed blocks + the running prefix (the kernels' pointer slots)


def attn_res_mix(cands: list[torch.Tensor], w_norm: torch.Tensor, w_proj: torch.Tensor, eps: float,
                 carry: int = 0) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
    """Softmax-weighted mix of the candidates, logits from their RMS-normalised values and w_norm * w_proj.

    Args:
        cands: 2 <= n <= MAX_CANDIDATES tensors of one shape [..., d], fp32 / bf16 / fp16 (each its own dtype).
        w_norm: [d]; w_proj: [d] or [1, d] (any float dtype; the maths is fp32).
        eps: the RMS epsilon.
        carry: 0 <= carry <= n. With carry > 0 the call also returns pass-through views of cands[:carry]
            (same values): give those, not the originals, to their other consumers (the next mix; with
            carry = n also the running prefix's residual add), and the gradients those send them are
            summed inside this mix's backward kernel instead of by autograd's separate add passes.
    Returns:
        [..., d] in cands[-1]'s dtype; differentiable in every candidate, w_norm and w_proj.  With
        carry > 0: (that tensor, [the carry pass-through views]).
    """
    from k3.ops.attn_res.triton_attn_res import AttnResMix

    if not 2 <= len(cands) <= MAX_CANDIDATES:
        raise ValueError(f"attn_res_mix takes 2 to {MAX_CANDIDATES} candidates, got {len(cands)}")
    shape = cands[-1].shape
    if any(c.shape != shape for c in cands):
        raise ValueError(f"candidates must share one shape, got {[list(c.shape) for c in cands]}")
    d = shape[-1]
    if w_norm.numel() != d or w_proj.numel() != d:
        raise ValueError(f"w_norm / w_proj must have {d} elements, got {w_norm.numel()} / {w_proj.numel()}")
    if any(not c.is_floating_point() or c.dtype == torch.float64 for c in cands):
        raise ValueError(f"candidates must be fp32 / bf16 / fp16, got {[c.dtype for c in cands]}")
    if not 0 <= carry <= len(cands):
        raise ValueError(f"carry must be in [0, {len(cands)}], got {carry}")
    out, *carried = AttnResMix.apply(w_norm, w_proj, float(eps), int(carry), *cands)
    return (out, carried) if carry else out
