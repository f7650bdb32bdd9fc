"""SiTU-GLU on gate|up packed side by side (one GEMM's output), forward and backward.

    from k3.ops.situ import situ_glu
    h = situ_glu(ab, beta=4.0, beta_lin=25.0)        # ab [..., 2I] -> h [..., I]

`reference.py` is the spec (torch maths in fp32 / float64); `triton_situ.py` the Triton kernels
used on CUDA tensors (and under TRITON_INTERPRET=1 on CPU, which is how CI tests them).
"""

from __future__ import annotations

import torch

__all__ = ["situ_glu"]


def situ_glu(ab: torch.Tensor, beta: float, beta_lin: float) -> torch.Tensor:
    """beta tanh(a/beta) sigmoid(a) * beta_lin tanh(b/beta_lin) for ab = [a | b].

    Args:
        ab: [..., 2I] bf16 / fp16 / fp32, gate a in the first half of the last dim, up b in the
            second; the last dim must be contiguous (rows may be strided).
        beta, beta_lin: positive SiTU parameters (4 and 25 in K3).
    Returns:
        [..., I] in ab's dtype (fp32 maths); differentiable in ab (the gradient is one [..., 2I] tensor).
    """
    from k3.ops.situ.triton_situ import SiTUGLU

    if ab.dim() < 1 or ab.shape[-1] % 2:
        raise ValueError(f"ab must be [..., 2I] (gate | up), got shape {list(ab.shape)}")
    if not ab.is_floating_point() or ab.dtype == torch.float64:
        raise ValueError(f"ab must be bf16, fp16 or fp32, got {ab.dtype}")
    if not (beta > 0 and beta_lin > 0):
        raise ValueError(f"SiTU betas must be positive, got beta={beta}, beta_lin={beta_lin}")
    lead = ab.shape[:-1]
    flat = ab.reshape(-1, ab.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    return SiTUGLU.apply(flat, float(beta), float(beta_lin)).view(*lead, ab.shape[-1] // 2)
