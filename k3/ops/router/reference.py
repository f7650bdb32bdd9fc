"""The spec's router logits: logits = x_f32 @ W_f32^T (k3_model.md, MoE router), fp32 whatever autocast says."""

from __future__ import annotations

import torch
from torch import Tensor


def router_logits_reference(x: Tensor, weight: Tensor) -> Tensor:
    """x [N, d] any float dtype, weight [E, d] -> [N, E] fp32."""
    with torch.autocast(x.device.type, enabled=False):
        return x.float() @ weight.float().t()
