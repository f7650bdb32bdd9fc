"""Block Attention Residuals' aggregation (k3_model.md section 5.4), the spec as plain loops.

For candidates V_0 .. V_{n-1} (completed block sums, then the running prefix), per token:

    key_i   = V_i * rsqrt(mean(V_i^2) + eps)              (RMS-normalised, no weight)
    logit_i = sum_c key_i[c] * w_norm[c] * w_proj[c]
    p       = softmax_i(logit)
    mix     = sum_i p_i V_i                                (raw V; cast to the last candidate's dtype)

in float32 (float64 for float64 inputs).
"""

from __future__ import annotations

import torch


def attn_res_reference(cands: list[torch.Tensor], w_norm: torch.Tensor, w_proj: torch.Tensor,
                       eps: float) -> torch.Tensor:
    """cands: n >= 1 tensors [..., d]; w_norm: [d]; w_proj: [d] or [1, d] -> mix [..., d] in cands[-1]'s dtype."""
    wide = torch.float64 if cands[-1].dtype == torch.float64 else torch.float32
    w = w_norm.to(wide) * w_proj.to(wide).reshape(-1)
    logits = []
    for v in cands:
        v = v.to(wide)
        key = v * torch.rsqrt(v.square().mean(-1, keepdim=True) + eps)
        logits.append((key * w).sum(-1))
    p = torch.softmax(torch.stack(logits), dim=0)
    mix = torch.zeros_like(cands[-1], dtype=wide)
    for i, v in enumerate(cands):
        mix = mix + p[i].unsqueeze(-1) * v.to(wide)
    return mix.to(cands[-1].dtype)
