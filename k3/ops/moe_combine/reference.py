"""MoE dispatch and combine, the spec (k3_model.md: bf16 expert outputs, fp32 weighted sum, cast to bf16).

    dispatch:  xs[inv[n, j]] = z[n]                  (backward: dz[n] = sum_j g[inv[n, j]], in fp32)
    combine:   out[n] = sum_j w[n, j] * y[inv[n, j]]  j = 0 .. k-1, summed in fp32 (float64 stays float64)

y: [N*k, L] expert outputs in expert-sorted slot order; w: [N, k] routing weights (fp32); inv: [N*k]
int64, the sorted slot of (token n, choice j) at n*k + j (a permutation of 0..N*k-1).
"""

from __future__ import annotations

import torch


def moe_combine_reference(y: torch.Tensor, w: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """[N*k, L], [N, k], [N*k] -> [N, L] in y's dtype; a loop over the k choices, fp32 (or float64) sums."""
    N, k = w.shape
    wide = torch.float64 if y.dtype == torch.float64 else torch.float32
    slots = inv.view(N, k)
    out = torch.zeros(N, y.shape[-1], dtype=wide, device=y.device)
    for j in range(k):
        out += w[:, j:j + 1].to(wide) * y[slots[:, j]].to(wide)
    return out.to(y.dtype)


def moe_dispatch_reference(z: torch.Tensor, inv: torch.Tensor, k: int) -> torch.Tensor:
    """[N, L], [N*k], k -> [N*k, L]: row inv[n*k + j] is z[n] (autograd gives the k-way sum backward)."""
    out = z.new_empty(z.shape[0] * k, z.shape[1])
    return out.index_copy(0, inv.long(), z.repeat_interleave(k, dim=0))
