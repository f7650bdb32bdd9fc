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

import math
from typing import Any, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate

from k3.model.common import KEEP_FP32
from k3.optim.muon import PerHeadMuon, _Pending, _resolve_ns_dtype, merge_blocks, newton_schulz, split_blocks

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

    def _muon_momentum(self, group: dict[str, Any]) -> list[_Pending]:
        out = []
        mu = group["momentum"]
        for p, spec in zip(group["params"], group["block_specs"]):
            if p.grad is None:
                continue
            grad = p.grad.float()
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32)
            buf = state["momentum_buffer"]
            buf.lerp_(grad, 1 - mu)
            update = grad.lerp(buf, mu) if group["nesterov"] else buf
            if isinstance(update, DTensor):
                update = update.full_tensor()
            out.append(_Pending(p, group, spec, split_blocks(update, spec)))
        return out

    def _apply_muon(self, pending: list[_Pending]) -> None:
        buckets: dict[tuple, list[int]] = {}
        for i, item in enumerate(pending):
            g = item.group
            dtype = _resolve_ns_dtype(g["ns_dtype"], item.blocks.device)
            key = (tuple(item.blocks.shape[1:]), item.blocks.device, dtype,
                   g["ns_steps"], tuple(g["ns_coefficients"]), g["eps"])
            buckets.setdefault(key, []).append(i)
        for (shape, _, dtype, steps, coeffs, eps), members in buckets.items():
            ortho = newton_schulz(torch.cat([pending[i].blocks for i in members], 0), steps, coeffs, eps, dtype)
            scale = 0.2 * math.sqrt(max(shape))
            for i, chunk in zip(members, torch.split(ortho, [pending[i].blocks.shape[0] for i in members], 0)):
                item = pending[i]
                lr, wd = item.group["lr"], item.group["weight_decay"]
                delta = merge_blocks(chunk, item.spec, item.param.shape)
                p = item.param
                if isinstance(p, DTensor):
                    # Replicate -> p's placements is a local slice (no communication).
                    full = DTensor.from_local(delta, p.device_mesh, [Replicate()] * p.device_mesh.ndim,
                                              run_check=False)
                    delta = full.redistribute(p.device_mesh, p.placements).to_local()
                    p = p.to_local()
                if wd != 0:
                    p.mul_(1 - lr * wd)
                p.add_(delta.to(p.dtype), alpha=-lr * scale)

    def _adamw_step(self, group: dict[str, Any]) -> None:
        beta1, beta2 = group["betas"]
        lr, wd, eps = group["lr"], group["weight_decay"], group["adam_eps"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "exp_avg" not in state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
            state["step"] += 1
            t = float(state["step"])
            local = (lambda x: x.to_local() if isinstance(x, DTensor) else x)
            w, grad = local(p), local(p.grad).float()
            exp_avg, exp_avg_sq = local(state["exp_avg"]), local(state["exp_avg_sq"])
            exp_avg.lerp_(grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            denom = (exp_avg_sq / (1 - beta2**t)).sqrt_().add_(eps)
            if wd != 0:
                w.mul_(1 - lr * wd)
            w.add_((exp_avg / denom).to(w.dtype), alpha=-lr / (1 - beta1**t))
