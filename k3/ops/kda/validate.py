"""Argument checks shared by every KDA backend (one place, one wording)."""

from __future__ import annotations

import torch


def check_kda_shapes(q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, initial_state: torch.Tensor | None,
                     cu_seqlens: torch.Tensor | None, cu_seqlens_cpu: torch.Tensor | None = None) -> int:
    """Check fla-layout shapes (q may be None, e.g. for a segment transform); return the number of
    sequences N (B, or the number of packed sequences when `cu_seqlens` is given).

    `cu_seqlens_cpu`: the same offsets on the host; the offsets are then checked there instead of
    being read back from the device (a read-back stalls the GPU queue)."""
    if k.dim() != 4:
        raise ValueError(f"k must be [B, T, H, K]; got {list(k.shape)}")
    B, T, H, K = k.shape
    if q is not None and q.shape != k.shape:
        raise ValueError(f"q must match k's shape {list(k.shape)}; got {list(q.shape)}")
    if v.dim() != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"v must be [B={B}, T={T}, H={H}, V]; got {list(v.shape)}")
    if g.shape != k.shape:
        raise ValueError(f"g must be [B, T, H, K] = {list(k.shape)}; got {list(g.shape)}")
    if beta.shape != (B, T, H):
        raise ValueError(f"beta must be [B, T, H] = {[B, T, H]}; got {list(beta.shape)}")
    N = B
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"cu_seqlens requires B == 1 (packed sequences), got B={B}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError("cu_seqlens must be a 1-D int32/int64 tensor [N + 1]")
        cs = host_offsets(cu_seqlens, cu_seqlens_cpu)
        if cs[0] != 0 or cs[-1] != T or any(b < a for a, b in zip(cs, cs[1:])):
            raise ValueError(f"cu_seqlens must start at 0, end at T={T} and be non-decreasing; got {cs}")
        N = len(cs) - 1
    if initial_state is not None and initial_state.shape != (N, H, K, v.shape[-1]):
        raise ValueError(f"initial_state must be [N={N}, H={H}, K={K}, V={v.shape[-1]}]; "
                         f"got {list(initial_state.shape)}")
    return N


def host_offsets(cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor | None) -> list[int]:
    """cu_seqlens as Python ints, from the host copy when one is given (no device read-back)."""
    if cu_seqlens_cpu is None:
        return cu_seqlens.tolist()
    if cu_seqlens_cpu.device.type != "cpu" or cu_seqlens_cpu.shape != cu_seqlens.shape:
        raise ValueError(f"cu_seqlens_cpu must be a CPU tensor shaped like cu_seqlens {list(cu_seqlens.shape)}; "
                         f"got {list(cu_seqlens_cpu.shape)} on {cu_seqlens_cpu.device}")
    return cu_seqlens_cpu.tolist()
