"""FSDP2 for K3 and the optimizer pieces that work on sharded parameters.

* `apply_fsdp`: `fully_shard` on every decoder layer, then on the root (embeddings, final norm,
  lm_head). On CUDA parameters are all-gathered in bf16 and gradients reduced in fp32, except
  modules that own parameters the official math keeps in fp32 (KDA's A_log / dt_bias / conv /
  o_norm): those are sharded as their own FSDP unit with an fp32 policy. Expert weights that expert
  parallel already split (plain tensors on each rank, see k3.distributed.ep) are left out of FSDP
  and their gradients are all-reduced over the expert-data-parallel group.
* `ShardedPerHeadMuon`: Per-Head Muon on DTensor (Shard(0)) parameters. Momentum buffers stay
  sharded (the update is elementwise up to Newton-Schulz); the Nesterov update of each parameter
  is all-gathered (`DTensor.full_tensor()`), every rank orthogonalises the same full blocks and
  keeps its own shard of the result. Exactly the single-device maths, at the cost of one
  all-gather and redundant Newton-Schulz per parameter (see docs/distributed.md).
* `clip_grad_norm_`: global gradient norm over sharded, expert-parallel and replicated gradients.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate

from k3.model.common import KEEP_FP32
from k3.optim.muon import PerHeadMuon

EP_LOCAL = "_k3_ep_local"  # set on expert parameters that expert parallel split over `ep`


def _owns_fp32(module: nn.Module) -> bool:
    return any(getattr(p, KEEP_FP32, False) for p in module.parameters(recurse=False))


def apply_fsdp(model: nn.Module, mesh, mixed_precision: bool) -> nn.Module:
    """Shard `model` (a K3ForCausalLM) in place over `mesh` (1-D DeviceMesh); returns it.

    mixed_precision: bf16 parameters in compute and fp32 gradient reduction (CUDA); otherwise
    everything stays in the parameters' dtype. Gradients are summed (divide factor 1): the caller's
    loss is already this rank's share of the global-batch mean."""
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    policy = bf16 if mixed_precision else MixedPrecisionPolicy()
    keep = fp32 if mixed_precision else MixedPrecisionPolicy()
    ignored = {p for p in model.parameters() if getattr(p, EP_LOCAL, False)}
    for layer in model.model.layers:
        if mixed_precision:
            for sub in layer.modules():
                if sub is not layer and _owns_fp32(sub):
                    fully_shard(sub, mesh=mesh, mp_policy=keep, ignored_params=ignored or None)
        fully_shard(layer, mesh=mesh, mp_policy=policy, ignored_params=ignored or None)
    fully_shard(model, mesh=mesh, mp_policy=policy, ignored_params=ignored or None)
    for m in model.modules():
        if hasattr(m, "set_gradient_divide_factor"):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)
    return model


def sync_expert_grads(model: nn.Module, edp_group: dist.ProcessGroup) -> None:
    """Sum the gradients of expert-parallel weights over the ranks that hold the same experts."""
    if dist.get_world_size(edp_group) == 1:
        return
    for p in model.parameters():
        if getattr(p, EP_LOCAL, False) and p.grad is not None:
            dist.all_reduce(p.grad, group=edp_group)


@torch.no_grad()
def clip_grad_norm_(params: Iterable[torch.Tensor], max_norm: float, edp_size: int) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ (L2) over every rank's gradients; returns the total norm (fp32).

    DTensor gradients are sharded over all ranks (each element counted once); expert-parallel
    gradients are replicated over `edp_size` ranks (counted once by dividing by it)."""
    params = [p for p in params if p.grad is not None]
    dev = params[0].grad.device if params else torch.device("cpu")
    sq = torch.zeros((), dtype=torch.float32, device=dev)
    for p in params:
        g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        s = g.float().pow(2).sum()
        sq += s if isinstance(p.grad, DTensor) else s / edp_size
    dist.all_reduce(sq)
    norm = sq.sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in params:
        g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        g.mul_(coef.to(g.dtype))
    return norm


class ShardedPerHeadMuon(PerHeadMuon):
    """PerHeadMuon whose parameters may be FSDP2 DTensors (any placements on one mesh).

    Muon: momentum on local shards; the Nesterov update is all-gathered, orthogonalised block by
    block exactly as on one device, and each rank applies its own shard. AdamW: elementwise, so it
    runs on the local shards directly. Plain-tensor parameters (e.g. expert-parallel experts,
    whose blocks are whole experts) take the single-device path unchanged."""

    def _full(self, update: Tensor) -> Tensor:
        return update.full_tensor() if isinstance(update, DTensor) else update

    def _apply_delta(self, param: Tensor, delta: Tensor, lr: float, wd: float, scale: float) -> None:
        if isinstance(param, DTensor):
            # Replicate -> param's placements is a local slice (no communication).
            full = DTensor.from_local(delta, param.device_mesh, [Replicate()] * param.device_mesh.ndim,
                                      run_check=False)
            delta = full.redistribute(param.device_mesh, param.placements).to_local()
            param = param.to_local()
        super()._apply_delta(param, delta, lr, wd, scale)

    def _local(self, t: Tensor) -> Tensor:
        return t.to_local() if isinstance(t, DTensor) else t
