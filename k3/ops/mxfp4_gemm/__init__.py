"""Grouped GEMM of expert-sorted rows against packed MXFP4 expert weights (serving the MXFP4 model).

    from k3.ops.mxfp4_gemm import mxfp4_grouped_mm
    y = mxfp4_grouped_mm(x, packed, scale, offs)   # x [S, K] bf16, packed u8 [E, N, K/2], scale u8 [E, N, K/32]

On CUDA the Triton kernel of `triton_mxfp4.py` dequantises tiles in registers (the weights stay 4.25 bits
per weight in memory); with many rows per expert (bf16 prefill, `Mxfp4GemmConfig`) it instead decodes the
experts into a bf16 scratch and runs torch._grouped_mm (the decode is then small next to the GEMM); on
the CPU the per-expert loop of `reference.py` decodes exactly and multiplies in fp32. Both read `offs` as torch._grouped_mm does (each expert's end row). CI runs the Triton kernel on CPU
tensors under TRITON_INTERPRET=1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from k3.ops.backend import triton_runs_on
from k3.ops.grouped_gemm.reference import check_offs
from k3.ops.mxfp4_gemm.layout import from_kernel_order, to_kernel_order
from k3.ops.mxfp4_gemm.reference import mxfp4_gmm_reference

if TYPE_CHECKING:  # the kernel module imports triton: only where it runs
    from k3.ops.mxfp4_gemm.triton_mxfp4 import Mxfp4Tiles

__all__ = ["Mxfp4GemmConfig", "mxfp4_grouped_mm", "mxfp4_dequant", "mxfp4_gmm_reference", "to_kernel_order",
           "from_kernel_order", "uses_dequant"]


@dataclass(frozen=True)
class Mxfp4GemmConfig:
    """Which GPU path a bf16 call takes (host values only: no device reads, CUDA-graph friendly).

    dequant_rows_per_expert: from this many rows per expert (S / E) on, the experts are first decoded
        into a bf16 scratch [E, N, K] (`mxfp4_dequant`, ~2.5 bytes of traffic per weight) and multiplied by
        torch._grouped_mm; below it the fused kernel dequantises tiles in registers. 0 = never.
    dequant_max_bytes: the scratch's limit (kimi-k3's w13 stack alone is 39 GB in bf16): larger stacks
        always take the fused kernel."""

    dequant_rows_per_expert: int = 512
    dequant_max_bytes: int = 1 << 30

    def __post_init__(self):
        if self.dequant_rows_per_expert < 0 or self.dequant_max_bytes < 0:
            raise ValueError(f"Mxfp4GemmConfig fields must be >= 0, got {self}")


DEFAULT_CONFIG = Mxfp4GemmConfig()


def uses_dequant(rows: int, experts: int, n: int, k: int, dtype: torch.dtype,
                 config: Mxfp4GemmConfig = DEFAULT_CONFIG) -> bool:
    """Whether `mxfp4_grouped_mm` (Triton, default tiles) decodes the [experts, n, k] stack into a bf16
    scratch and runs torch._grouped_mm: bf16 activations, at least config.dequant_rows_per_expert rows
    per expert, the scratch within config.dequant_max_bytes, n a multiple of 8 (torch._grouped_mm's
    16-byte alignment of the transposed weights)."""
    return (dtype == torch.bfloat16 and config.dequant_rows_per_expert > 0 and n % 8 == 0
            and rows >= config.dequant_rows_per_expert * experts and experts * n * k * 2 <= config.dequant_max_bytes)


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
                     kernel_order: bool = False, config: Mxfp4GemmConfig = DEFAULT_CONFIG) -> torch.Tensor:
    """Rows of expert e times decode(packed[e], scale[e])^T.

    Args:
        x: [S, K] bf16 / fp16 / fp32, rows sorted by expert.
        packed: uint8 [E, N, K/2] (low nibble = even column), scale: uint8 [E, N, K/32] E8M0, contiguous.
        offs: [E] int32 cumulative row counts (expert e owns rows offs[e-1] .. offs[e]-1).
        tiles: Triton tile shape (default: by rows per expert, `triton_mxfp4.pick_tiles`).
        use_triton: None = Triton where it runs (CUDA, or CPU under TRITON_INTERPRET=1).
        kernel_order: packed is in the kernel's byte order (`layout.to_kernel_order`; K a multiple of 64).
        config: the fused kernel vs decode + torch._grouped_mm (`uses_dequant`; only without tiles).
    Returns:
        [S, N] of x.dtype, fp32 accumulation. Rows at or past offs[-1]: zero on the reference path,
        unwritten by the kernel (torch._grouped_mm's choice on the decode path).
    """
    _check(x, packed, scale, offs)
    if kernel_order and x.shape[1] % 64:
        raise ValueError(f"kernel-order bytes need K a multiple of 64, got K = {x.shape[1]}")
    if use_triton is None:
        use_triton = triton_runs_on(x)
    if use_triton:
        from k3.ops.mxfp4_gemm.triton_mxfp4 import mxfp4_gmm_triton

        E, N = packed.shape[:2]
        if tiles is None and uses_dequant(x.shape[0], E, N, x.shape[1], x.dtype, config):
            w = mxfp4_dequant(packed, scale, kernel_order=kernel_order, use_triton=True)
            return torch._grouped_mm(x.contiguous(), w.transpose(-2, -1), offs=offs)
        return mxfp4_gmm_triton(x, packed, scale, offs, tiles, kernel_order)
    return mxfp4_gmm_reference(x, from_kernel_order(packed) if kernel_order else packed, scale, offs)


def mxfp4_dequant(packed: torch.Tensor, scale: torch.Tensor, *, kernel_order: bool = False,
                  dtype: torch.dtype = torch.bfloat16, use_triton: bool | None = None) -> torch.Tensor:
    """packed uint8 [E, N, K/2], scale uint8 [E, N, K/32] (contiguous) -> decoded weights [E, N, K] of
    dtype, K in order. Triton (where it runs): exact for E8M0 bytes 34..160 (the GEMM's range); otherwise
    `k3.quant.mxfp4.decode_mxfp4` on the whole stack."""
    if packed.dtype != torch.uint8 or packed.dim() < 2 or scale.dtype != torch.uint8 \
            or list(scale.shape) != [*packed.shape[:-1], packed.shape[-1] // 16] or packed.shape[-1] % 16:
        raise ValueError(f"packed must be uint8 [..., N, K/2] and scale uint8 [..., N, K/32] (K a multiple of "
                         f"32), got {list(packed.shape)} {packed.dtype}, {list(scale.shape)} {scale.dtype}")
    if not (packed.is_contiguous() and scale.is_contiguous()):
        raise ValueError("packed and scale must be contiguous")
    if use_triton is None:
        use_triton = triton_runs_on(packed)
    if use_triton:
        from k3.ops.mxfp4_gemm.triton_mxfp4 import mxfp4_dequant_triton

        return mxfp4_dequant_triton(packed, scale, kernel_order, dtype)
    from k3.quant.mxfp4 import decode_mxfp4

    p = from_kernel_order(packed) if kernel_order else packed
    return decode_mxfp4(p, scale, dtype=dtype)
