"""K3's kernels: KDA (kda/), the fused short conv (short_conv/), paged MLA decode (mla_decode/)."""

from __future__ import annotations

import torch


def to_device_async(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Copy a small host tensor to `device` without stalling the GPU queue.

    A plain `.to("cuda")` of pageable memory synchronises the stream; from pinned memory with
    non_blocking=True the copy is just another queued operation (the caching host allocator keeps
    the pinned buffer alive until the copy has run)."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
