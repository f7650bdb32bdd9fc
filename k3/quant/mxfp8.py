"""MXFP8 (OCP Microscaling, E4M3 elements + E8M0 block scales) fake quantisation for activations.

Format (OCP MX v1.0, spec k3_posttraining.md §6): blocks of 32 consecutive elements along the LAST
dim (the reduction dim of the GEMM the activation feeds); each block has one E8M0 scale 2^k and
32 FP8 E4M3 elements (largest finite magnitude 448 = 1.75 * 2^8, subnormals down to 2^-9).

* Scale rule (FLOOR, as for MXFP4): k = floor(log2(amax)) - 8, 8 = emax of E4M3, clamped to the
  E8M0 range [-127, 127]; an all-zero block gets k = -127 (any k reproduces zeros).
* Elements: x / 2^k rounded to nearest E4M3, ties to even (torch's float8_e4m3fn cast), after
  saturating to +-448: amax / 2^k lies in [256, 512), so the block's largest values may clip to
  448 * 2^k -- the OCP rule's known saturation, kept here so that training sees what an MX kernel
  computes.

x / 2^k and the way back are multiplications by exact powers of two (built from bit patterns), so
`quantize_dequantize_mxfp8` is decode(encode(x)) bit for bit in float32 (and in bf16, which holds
every E4M3 value times any power of two within its range).
"""

from __future__ import annotations

import torch

from k3.quant.mxfp4 import straight_through

__all__ = ["E4M3_MAX", "MXFP8_BLOCK", "mxfp8_exponents", "quantize_dequantize_mxfp8", "fake_quant_mxfp8"]

MXFP8_BLOCK = 32
E4M3_MAX = 448.0
E4M3_EMAX = 8


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """int64 k in [-127, 127] -> float32 2^k, exact (2^-127 is a float32 subnormal: mantissa bit 22)."""
    bits = torch.where(k >= -126, (k + 127) << 23, torch.full_like(k, 1 << 22))
    return bits.to(torch.int32).view(torch.float32)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError("x: expected a floating-point tensor")
    if x.dim() < 1 or x.shape[-1] % MXFP8_BLOCK:
        raise ValueError(f"x: last dim {tuple(x.shape)[-1:]} must be a multiple of {MXFP8_BLOCK}")
    return x.detach().float().reshape(*x.shape[:-1], x.shape[-1] // MXFP8_BLOCK, MXFP8_BLOCK)


def mxfp8_exponents(x: torch.Tensor) -> torch.Tensor:
    """Shared exponents k (int64 [..., n/32]) of x [..., n] by the OCP FLOOR rule (module docstring).
    Non-finite blocks raise: a NaN/inf activation has no MXFP8 encoding."""
    blocks = _blocks(x)
    amax = blocks.abs().amax(dim=-1)
    if not torch.isfinite(amax).all():
        raise ValueError("x: contains inf/NaN; MXFP8 cannot encode non-finite activations")
    _, e = torch.frexp(amax)  # amax = m * 2^e, m in [0.5, 1): floor(log2(amax)) = e - 1
    k = (e.long() - 1 - E4M3_EMAX).clamp(-127, 127)
    return torch.where(amax == 0, torch.full_like(k, -127), k)


def quantize_dequantize_mxfp8(x: torch.Tensor) -> torch.Tensor:
    """decode(encode(x)) for MXFP8 E4M3 with 32-element blocks along the last dim.

    Args:
        x: float [..., n], n a multiple of 32, finite.
    Returns:
        [..., n] of x.dtype.
    """
    blocks = _blocks(x)
    k = mxfp8_exponents(x).unsqueeze(-1)
    scaled = (blocks * _pow2(-k)).clamp(-E4M3_MAX, E4M3_MAX)  # exact: a power-of-two multiple
    q = scaled.to(torch.float8_e4m3fn).float() * _pow2(k)
    return q.reshape(x.shape).to(x.dtype)


def fake_quant_mxfp8(x: torch.Tensor) -> torch.Tensor:
    """MXFP8 E4M3 fake quantisation for QAT: forward = `quantize_dequantize_mxfp8`, backward = identity.

    Args:
        x: float [..., n], n a multiple of 32.
    Returns:
        [..., n] of x.dtype.
    """
    return straight_through(quantize_dequantize_mxfp8, x)
