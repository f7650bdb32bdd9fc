"""KDA forget gate: raw gate pre-activations -> per-channel natural-log decay g (fp32)."""

from __future__ import annotations

import torch


def kda_gate(
    f: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float | None = -5.0,
) -> torch.Tensor:
    """K3 bounded gate  g = L * sigmoid(exp(A_log[h]) * (f + dt_bias)),  L = lower_bound in [-5, 0).

    With `lower_bound=None` this is the Kimi-Linear form  g = -exp(A_log[h]) * softplus(f + dt_bias).

    Args:
        f: [..., H, K] low-rank gate projection output (any float dtype).
        A_log: [H] fp32.  dt_bias: [H * K] or [H, K] fp32.
    Returns:
        g: [..., H, K] float32, in (lower_bound, 0) for the bounded form.
    """
    H, K = f.shape[-2:]
    if A_log.shape != (H,):
        raise ValueError(f"A_log must have shape [{H}], got {list(A_log.shape)}")
    if dt_bias.numel() != H * K:
        raise ValueError(f"dt_bias must have {H * K} elements, got {dt_bias.numel()}")
    x = f.float() + dt_bias.float().view(H, K)
    a = A_log.float().exp()[:, None]
    if lower_bound is None:
        return -a * torch.nn.functional.softplus(x)
    if not -5.0 <= lower_bound < 0.0:
        raise ValueError(f"lower_bound must be in [-5, 0), got {lower_bound}")
    return lower_bound * torch.sigmoid(a * x)
