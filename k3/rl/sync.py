"""Weight sync trainer -> engine without a restart.

One device: the engine may serve the trainer's own module (nothing to copy), or a second copy
whose parameters and buffers are overwritten in place (`copy_`, casting e.g. fp32 masters to a
bf16 serving copy; tensors keep their storage, so CUDA graphs captured on them stay valid).
Several ranks: the trainer's full state dict is broadcast from rank 0 over torch.distributed
(`broadcast_weights`) before the local copy. Either way the engine then drops prefix-cache
checkpoints computed with the old weights (`Engine.on_weights_updated`).
"""

from __future__ import annotations

from typing import Any

import torch


@torch.no_grad()
def copy_weights(src: torch.nn.Module, dst: torch.nn.Module) -> int:
    """dst's parameters and buffers <- src's (same names and shapes; dtype cast). Returns tensors copied.
    ValueError naming the first mismatch."""
    if src is dst:
        return 0
    s = dict(src.named_parameters()) | dict(src.named_buffers())
    d = dict(dst.named_parameters()) | dict(dst.named_buffers())
    if s.keys() != d.keys():
        missing = sorted(s.keys() ^ d.keys())[:3]
        raise ValueError(f"trainer and engine models differ in tensor names (e.g. {missing})")
    for name, t in d.items():
        if t.shape != s[name].shape:
            raise ValueError(f"{name}: engine shape {tuple(t.shape)} != trainer shape {tuple(s[name].shape)}")
        t.copy_(s[name])
    return len(d)


@torch.no_grad()
def broadcast_weights(model: torch.nn.Module, src_rank: int = 0, group: Any = None) -> None:
    """Every rank's `model` <- rank src_rank's, tensor by tensor (torch.distributed must be initialised)."""
    import torch.distributed as dist

    for t in list(model.parameters()) + list(model.buffers()):
        dist.broadcast(t.data, src=src_rank, group=group)


def sync_weights(trainer_model: torch.nn.Module, engine: Any) -> int:
    """Make `engine` sample from `trainer_model`'s current weights; returns prefix checkpoints dropped."""
    copy_weights(trainer_model, engine.model)
    return engine.on_weights_updated()


__all__ = ["broadcast_weights", "copy_weights", "sync_weights"]
