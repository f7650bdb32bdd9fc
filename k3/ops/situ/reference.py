"""SiTU-GLU, the spec (k3_model.md section 5.5), in plain PyTorch at the input precision or float64.

    act = beta * tanh(a / beta) * sigmoid(a) * beta_lin * tanh(b / beta_lin)

a: gate pre-activation, b: up pre-activation ([..., I] each); computed in float32 (or float64 for
float64 inputs) and cast back to a's dtype, as the official model does.
"""

from __future__ import annotations

import torch


def situ_glu_reference(a: torch.Tensor, b: torch.Tensor, beta: float, beta_lin: float) -> torch.Tensor:
    """a, b: [..., I] -> act [..., I] in a's dtype; the maths in fp32 (float64 stays float64)."""
    wide = torch.float64 if a.dtype == torch.float64 else torch.float32
    af, bf = a.to(wide), b.to(wide)
    act = beta * torch.tanh(af / beta) * torch.sigmoid(af) * (beta_lin * torch.tanh(bf / beta_lin))
    return act.to(a.dtype)
