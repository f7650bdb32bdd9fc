"""KDA's short convolution: depthwise causal conv (width W, no bias) + SiLU over packed documents.

    from k3.ops.short_conv import short_conv_silu
    q, k, v = short_conv_silu(x, weight, streams=3, cu_seqlens=cu)     # 3 x [B, T, C]

`reference.py` is the spec (float64 loops); `triton_conv.py` the fused Triton forward/backward used
on CUDA tensors (and under TRITON_INTERPRET=1 on CPU, which is how CI tests it).
"""

from __future__ import annotations

import torch

__all__ = ["short_conv_silu", "document_starts"]


def document_starts(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """First row of each token's document: cu_seqlens [N + 1] -> int32 [total] (no host sync)."""
    cu = cu_seqlens.to(torch.int64)
    t = torch.arange(total, device=cu.device)
    seq = torch.searchsorted(cu, t, right=True) - 1
    return cu[seq.clamp(0, cu.numel() - 2)].to(torch.int32)


def short_conv_silu(x: torch.Tensor, weight: torch.Tensor, *, streams: int = 1,
                    cu_seqlens: torch.Tensor | None = None, starts: torch.Tensor | None = None,
                    passthrough: tuple[int, ...] = ()) -> tuple[torch.Tensor, ...]:
    """SiLU(depthwise causal conv(x)) with no history before each document, split into streams.

    Args:
        x: [B, T, S*C + sum(passthrough)] bf16/fp16/fp32 (the last dim must be contiguous; e.g. a slice of a
            fused projection). Packed documents: B = 1 and cu_seqlens [N + 1] (or their `starts`).
        weight: [S*C, 1, W] or [S*C, W]; the conv runs in fp32 (tap W-1 is the current token).
        streams: S (1 to 4), the number of equal channel groups returned separately (q, k, v -> 3).
        starts: int32 [T], the first row of each token's document (`document_starts`), to share it
            across layers instead of passing cu_seqlens.
        passthrough: widths of column groups after the S*C conv channels that are returned untouched, as
            views of x (a fused projection's other outputs: KDA's gate, forget-gate and beta inputs). Their
            gradients are written next to the conv's in the one [B, T, width] gradient of x, so no
            concatenation of the pieces' gradients is needed (autograd's split backward would copy all of
            them; the conv kernels write theirs in place, and up to 3 groups' gradients are copied by extra
            programs of the same launch, cast to x's dtype).
    Returns:
        a tuple of S separate contiguous [B, T, C] tensors in x's dtype, stream s = channels
        [s*C, (s+1)*C), then the passthrough views; differentiable in x and weight. The backward reads
        each stream's gradient where it lies (no [S, B, T, C] stack of them); an unused output (gradient
        None) counts as zeros.
    """
    from k3.ops.short_conv.triton_conv import MAX_STREAMS, ShortConvSiLU

    if x.dim() != 3:
        raise ValueError(f"x must be [B, T, S*C], got shape {list(x.shape)}")
    B, T, width = x.shape
    SC = width - sum(passthrough)
    if any(n < 1 for n in passthrough) or SC < 1:
        raise ValueError(f"passthrough widths {passthrough} must be >= 1 and leave conv channels in x's {width}")
    if not 1 <= streams <= MAX_STREAMS:
        raise ValueError(f"streams must be 1 to {MAX_STREAMS} (the kernels' stream pointers), got {streams}")
    if SC % streams:
        raise ValueError(f"{SC} channels do not split into {streams} streams")
    w = weight.reshape(weight.shape[0], -1)
    if w.shape[0] != SC:
        raise ValueError(f"weight has {w.shape[0]} channels, x has {SC}")
    if (cu_seqlens is not None or starts is not None) and B != 1:
        raise ValueError(f"packed documents need B = 1, got B = {B}")
    if starts is None and cu_seqlens is not None:
        starts = document_starts(cu_seqlens.to(x.device), T)
    if starts is not None and starts.shape != (T,):
        raise ValueError(f"starts must be [{T}], got {list(starts.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    starts = starts.to(torch.int32).contiguous() if starts is not None else None
    return ShortConvSiLU.apply(x, w.float().contiguous(), starts, streams, tuple(passthrough))
