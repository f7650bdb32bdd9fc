"""Reference (the spec) of KDA's short convolution: depthwise causal conv, then SiLU.

For token t of a document starting at row a (channel c, kernel width W, tap W-1 on the current token):
    y[t, c] = sum_{j < W, t - (W-1) + j >= a} w[c, j] * x[t - (W-1) + j, c],      out = silu(y).
Inputs from an earlier document never enter (a new document starts with zero history).
"""

from __future__ import annotations

import torch


def short_conv_silu_reference(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor | None = None
                              ) -> torch.Tensor:
    """x [B, T, C] (B = 1 when packed with cu_seqlens [N + 1]); weight [C, W] or [C, 1, W].
    Returns silu(conv(x)) [B, T, C] in float64, computed with plain loops over the taps."""
    B, T, C = x.shape
    w = weight.reshape(C, -1).double()
    W = w.shape[1]
    xd = x.double()
    bounds = [0, T] if cu_seqlens is None else [int(v) for v in cu_seqlens.tolist()]
    y = torch.zeros(B, T, C, dtype=torch.float64, device=x.device)
    for a, e in zip(bounds[:-1], bounds[1:]):
        for t in range(a, e):
            for j in range(W):
                s = t - (W - 1) + j
                if s >= a:
                    y[:, t] += w[:, j] * xd[:, s]
    return torch.nn.functional.silu(y)
