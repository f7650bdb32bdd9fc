"""The kernel order of packed MXFP4 bytes: the official layout's nibbles re-arranged so that the Triton
kernel's wgmma register operand comes from consecutive bytes with no shuffles (`triton_mxfp4`, perm 4).

Official layout (k3.quant.mxfp4): byte b of a row holds weight 2b (low nibble) and 2b + 1 (high nibble).
Kernel order, per 64-weight chunk c of a row (32 bytes; K a multiple of 64): byte 32c + 8q + 2j + t
(q, j < 4, t < 2) holds weight 64c + 8j + 2q + t in its low nibble and weight 64c + 32 + 8j + 2q + t in
its high one -- low nibbles belong to the chunk's first 32-weight scale group, high nibbles to the
second, and lane q of a wgmma register fragment (columns 2q, 2q + 1 plus multiples of 8) reads the bytes
8q .. 8q + 7 of each chunk. The scales are unchanged. Both directions are exact byte permutations.
"""

from __future__ import annotations

import torch


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., B] -> [..., B, 2] (low, high nibble)."""
    if packed.dtype != torch.uint8 or packed.dim() < 1 or packed.shape[-1] % 32:
        raise ValueError(f"packed must be uint8 [..., K/2] with K a multiple of 64, got "
                         f"{list(packed.shape)} {packed.dtype}")
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1)


def _bytes(nib: torch.Tensor, lead: torch.Size) -> torch.Tensor:
    """[..., 2] nibbles (low, high) -> uint8 bytes reshaped to lead + [K/2]."""
    return (nib[..., 0] | (nib[..., 1] << 4)).reshape(*lead, -1)


def _per_matrix(fn, packed: torch.Tensor) -> torch.Tensor:
    """fn over packed[i] one leading index at a time (the nibble temporaries of a whole [E, N, K/2]
    stack would take 4x its memory)."""
    if packed.dim() <= 2:
        return fn(packed)
    out = torch.empty_like(packed)
    for i in range(packed.shape[0]):
        out[i] = _per_matrix(fn, packed[i])
    return out


def to_kernel_order(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] in the official layout -> the same shape in kernel order (module docstring)."""
    return _per_matrix(_to_kernel_order, packed)


def from_kernel_order(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `to_kernel_order`."""
    return _per_matrix(_from_kernel_order, packed)


def _to_kernel_order(packed: torch.Tensor) -> torch.Tensor:
    lead, n = packed.shape[:-1], len(packed.shape) - 1
    w = _nibbles(packed).reshape(*lead, -1, 2, 4, 4, 2)  # weight 64c + 32h + 8j + 2q + t: [c, h, j, q, t]
    w = w.permute(*range(n + 1), n + 3, n + 2, n + 4, n + 1)  # [c, q, j, t, h]
    return _bytes(w.contiguous(), lead)


def _from_kernel_order(packed: torch.Tensor) -> torch.Tensor:
    lead, n = packed.shape[:-1], len(packed.shape) - 1
    w = _nibbles(packed).reshape(*lead, -1, 4, 4, 2, 2)  # [c, q, j, t, h]
    w = w.permute(*range(n + 1), n + 4, n + 2, n + 1, n + 3)  # [c, h, j, q, t]: weights in order
    return _bytes(w.reshape(*lead, -1, 2), lead)
