"""MLA's key / value expansion (per-head [k_nope | k_pe] keys and the values) for the training path.

    from k3.ops.mla_kv import mla_expand_kv
    k, v = mla_expand_kv(kv, k_pe, num_heads=H, nope=128, v_dim=128)

`reference.py` is the spec (split, expand, cat). `triton_kv.py` does the same with one kernel each way:
the backward writes kv's gradient [k_nope grad | v grad] per head and sums the heads' k_pe gradients
in one pass, where autograd runs an expand-backward sum over a strided slice and a split-backward
concatenation that reads and writes every gradient again. Used on CUDA tensors under autograd (and
under TRITON_INTERPRET=1 on CPU, which is how CI tests it).
"""

from __future__ import annotations

import torch

__all__ = ["mla_expand_kv", "mla_kv_reference"]

from k3.ops.mla_kv.reference import mla_kv_reference


def mla_expand_kv(kv: torch.Tensor, k_pe: torch.Tensor, *, num_heads: int, nope: int,
                  v_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kv [B, T, H * (nope + v_dim)] (last dim contiguous), k_pe [B, T, rope] (same dtype) ->
    k [B, T, H, nope + rope] (new, contiguous), v [B, T, H, v_dim] (a view of kv). Differentiable in
    kv and k_pe; the gradients come back in their dtypes (k_pe's summed over heads in fp32)."""
    from k3.ops.mla_kv.triton_kv import MLAExpandKV

    if kv.dim() != 3 or k_pe.dim() != 3 or kv.shape[:2] != k_pe.shape[:2]:
        raise ValueError(f"kv [B, T, H*(nope+v)] and k_pe [B, T, rope] expected, got {list(kv.shape)} and "
                         f"{list(k_pe.shape)}")
    if kv.shape[-1] != num_heads * (nope + v_dim):
        raise ValueError(f"kv's last dim {kv.shape[-1]} != num_heads * (nope + v_dim) = "
                         f"{num_heads} * ({nope} + {v_dim})")
    if kv.dtype != k_pe.dtype:
        raise ValueError(f"kv and k_pe must share a dtype, got {kv.dtype} and {k_pe.dtype}")
    if kv.stride(-1) != 1:
        kv = kv.contiguous()
    if k_pe.stride(-1) != 1:
        k_pe = k_pe.contiguous()
    return MLAExpandKV.apply(kv, k_pe, num_heads, nope, v_dim)
