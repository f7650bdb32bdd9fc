"""Grouped GEMM of expert-sorted rows against packed MXFP4 expert weights (serving the MXFP4 model).

    from k3.ops.mxfp4_gemm import mxfp4_grouped_mm
    y = mxfp4_grouped_mm(x, packed, scale, offs)   # x [S, K] bf16, packed u8 [E, N, K/2], scale u8 [E, N, K/32]

On CUDA the Triton kernel of `triton_mxfp4.py` dequantises tiles in registers (the weights stay 4.25 bits
per weight in memory); on the CPU the per-expert loop of `reference.py` decodes exactly and multiplies in
fp32. Both read `offs` as torch._grouped_mm does (each expert's end row). CI runs the Triton kernel on CPU
tensors under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch

from typing import TYPE_CHECKING

from k3.ops.backend import triton_runs_on
from k3.ops.grouped_gemm.reference import check_offs
from k3.ops.mxfp4_gemm.layout import from_kernel_order, to_kernel_order
from k3.ops.mxfp4_gemm.reference import mxfp4_gmm_reference

if TYPE_CHECKING:  # the kernel module imports triton: only where it runs
    from k3.ops.mxfp4_gemm.triton_mxfp4 import Mxfp4Tiles

__all__ = ["mxfp4_grouped_mm", "mxfp4_gmm_reference", "to_kernel_order", "from_kernel_order"]


def _check(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, offs: torch.Tensor) -> None:
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"x must be a [S, K] float tensor, got {list(x.shape)} {x.dtype}")
    K = x.shape[1]
    if packed.dim() != 3 or packed.dtype != torch.uint8 or packed.shape[2] * 2 != K:
        raise ValueError(f"packed must be uint8 [E, N, K/2] with K = {K}, got {list(packed.shape)} {packed.dtype}")
    E, N = packed.shape[:2]
    if K % 32 or scale.dtype != torch.uint8 or list(scale.shape) != [E, N, K // 32]:
        raise ValueError(f"scale must be uint8 [{E}, {N}, {K // 32}] (K = {K} a multiple of 32), got "
                         f"{list(scale.shape)} {scale.dtype}")
    if not (packed.is_contiguous() and scale.is_contiguous()):
        raise ValueError("packed and scale must be contiguous")
    check_offs(offs, E)
    if not (x.device == packed.device == scale.device == offs.device):
        raise ValueError(f"x, packed, scale and offs must share a device, got {x.device}, {packed.device}, "
                         f"{scale.device}, {offs.device}")


def mxfp4_grouped_mm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, offs: torch.Tensor, *,
                     tiles: "Mxfp4Tiles | None" = None, use_triton: bool | None = None,
                     kernel_order: bool = False) -> torch.Tensor:
    """Rows of expert e times decode(packed[e], scale[e])^T.

    Args:
        x: [S, K] bf16 / fp16 / fp32, rows sorted by expert.
        packed: uint8 [E, N, K/2] (low nibble = even column), scale: uint8 [E, N, K/32] E8M0, contiguous.
        offs: [E] int32 cumulative row counts (expert e owns rows offs[e-1] .. offs[e]-1).
        tiles: Triton tile shape (default: by rows per expert, `triton_mxfp4.pick_tiles`).
        use_triton: None = Triton where it runs (CUDA, or CPU under TRITON_INTERPRET=1).
        kernel_order: packed is in the kernel's byte order (`layout.to_kernel_order`; K a multiple of 64).
    Returns:
        [S, N] of x.dtype, fp32 accumulation. Rows at or past offs[-1]: zero on the reference path,
        unwritten by the kernel.
    """
    _check(x, packed, scale, offs)
    if kernel_order and x.shape[1] % 64:
        raise ValueError(f"kernel-order bytes need K a multiple of 64, got K = {x.shape[1]}")
    if use_triton is None:
        use_triton = triton_runs_on(x)
    if use_triton:
        from k3.ops.mxfp4_gemm.triton_mxfp4 import mxfp4_gmm_triton

        return mxfp4_gmm_triton(x, packed, scale, offs, tiles, kernel_order)
    return mxfp4_gmm_reference(x, from_kernel_order(packed) if kernel_order else packed, scale, offs)
