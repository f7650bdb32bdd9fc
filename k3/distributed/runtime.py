"""What the trainer calls when it runs under torchrun: `Parallel` owns the mesh and applies expert
parallel, context parallel and FSDP2 to a single-device K3 model from outside."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate

from k3.distributed.fsdp import EP_LOCAL, ShardedPerHeadMuon, apply_fsdp, clip_grad_norm_, sync_expert_grads
from k3.distributed.mesh import IGNORE_INDEX, LocalBatch, Mesh, init_mesh, shard_batch


class Parallel:
    """Distributed state of one training run (one object per rank)."""

    def __init__(self, ep: int = 1, cp: int = 1, device: torch.device | str | None = None) -> None:
        self.mesh: Mesh = init_mesh(ep, cp, device)
        self.device = self.mesh.device
        self.model: nn.Module | None = None

    @property
    def is_main(self) -> bool:
        return self.mesh.is_main

    # ---- model -----------------------------------------------------------------------------------
    def setup(self, model: nn.Module, mixed_precision: bool | None = None) -> nn.Module:
        """Expert parallel (ep > 1), context parallel (cp > 1), then FSDP2; in place.
        mixed_precision: bf16 FSDP compute (default: on CUDA)."""
        m = self.mesh
        if m.ep > 1:
            from k3.distributed.ep import apply_expert_parallel
            apply_expert_parallel(model, m.ep_group)
        if m.cp > 1:
            from k3.distributed.cp import apply_context_parallel
            self.cp_context = apply_context_parallel(model, m.cp_group)
        if mixed_precision is None:
            mixed_precision = self.device.type == "cuda"
        apply_fsdp(model, m.world_mesh, mixed_precision=mixed_precision)
        self.model = model
        return model

    def optimizer(self, groups: list[dict[str, Any]], fused: bool = True, ns_dtype: str = "auto") -> ShardedPerHeadMuon:
        return ShardedPerHeadMuon(groups, fused=fused, ns_dtype=ns_dtype)

    # ---- one step --------------------------------------------------------------------------------
    def local_batch(self, input_ids: torch.Tensor, labels: torch.Tensor, cu_seqlens: torch.Tensor,
                    seq_len: int) -> LocalBatch:
        m = self.mesh
        lb = shard_batch(input_ids, labels, cu_seqlens, seq_len, m.data_rank, m.num_data_ranks, m.coords[2], m.cp)
        if m.cp > 1:
            self.cp_context.set(lb.row_cu_seqlens, lb.seg_start, lb.seg_len)
        return lb

    def loss(self, forward: Callable[..., Any], lb: LocalBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(objective to backpropagate, global-batch mean loss for logging). The objective is this
        rank's summed token loss over the global target count, so FSDP's summed gradients equal the
        single-process gradient of the global mean."""
        logits = forward(lb.input_ids, cu_seqlens=lb.cu_seqlens).logits
        s = F.cross_entropy(logits.float().flatten(0, 1), lb.labels.flatten(), ignore_index=IGNORE_INDEX,
                            reduction="sum")
        stats = torch.stack([s.detach().float(), (lb.labels != IGNORE_INDEX).sum().float()])
        dist.all_reduce(stats)
        n = stats[1].clamp(min=1)
        return s / n, stats[0] / n

    def after_backward(self) -> None:
        sync_expert_grads(self.model, self.mesh.edp_group)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        return clip_grad_norm_(self.model.parameters(), max_norm, dist.get_world_size(self.mesh.edp_group))

    def metrics(self) -> dict[str, float]:
        """Expert-parallel load (max rank load / mean rank load, averaged over MoE layers) of the
        last step, as plain EP would have it and as MoonEP's plan made it."""
        from k3.distributed.ep import EPExperts
        loads = [m.last_load for m in self.model.modules() if isinstance(m, EPExperts) and m.last_load]
        if not loads:
            return {}
        return {f"ep_load_{k.removeprefix('max_over_mean_')}": sum(d[k] for d in loads) / len(loads)
                for k in loads[0]}

    @staticmethod
    def all_reduce(t: torch.Tensor) -> None:
        """In-place sum over every rank (Quantile Balancing histograms)."""
        dist.all_reduce(t)

    def sum_scalars(self, *values: float) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    # ---- full (unsharded) state for rank-0 checkpoints and export ---------------------------------
    def _full(self, t: torch.Tensor, ep_local: bool) -> torch.Tensor:
        if isinstance(t, DTensor):
            return t.full_tensor().cpu()
        if ep_local and t.dim() > 0:
            parts = [torch.empty_like(t) for _ in range(self.mesh.ep)]
            dist.all_gather(parts, t.contiguous(), group=self.mesh.ep_group)
            return torch.cat(parts, 0).cpu()
        return t.detach().cpu()

    def _local(self, full: torch.Tensor, like: torch.Tensor, ep_local: bool) -> torch.Tensor:
        if isinstance(like, DTensor):
            rep = DTensor.from_local(full.to(like.device, like.dtype), like.device_mesh,
                                     [Replicate()] * like.device_mesh.ndim, run_check=False)
            return rep.redistribute(like.device_mesh, like.placements)
        if ep_local and like.dim() > 0:
            n = like.shape[0]
            e = dist.get_rank(self.mesh.ep_group)
            return full[e * n:(e + 1) * n].to(like.device, like.dtype)
        return full.to(like.device, like.dtype)

    def _ep_names(self) -> set[str]:
        return {n for n, p in self.model.named_parameters() if getattr(p, EP_LOCAL, False)}

    def full_model_state(self) -> dict[str, torch.Tensor]:
        """The single-device state dict (every rank must call; collective)."""
        ep = self._ep_names()
        return {k: self._full(v, k in ep) for k, v in self.model.state_dict().items()}

    def load_full_model_state(self, sd: dict[str, torch.Tensor]) -> None:
        ep = self._ep_names()
        own = self.model.state_dict()
        missing = sorted(set(own) - set(sd))
        if missing:
            raise ValueError(f"model state is missing {missing[:5]}")
        with torch.no_grad():
            for k, v in own.items():
                src = self._local(sd[k], v, k in ep)
                dst = v.to_local() if isinstance(v, DTensor) else v
                dst.copy_(src.to_local() if isinstance(src, DTensor) else src)

    def _flat_params(self, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
        return [p for g in opt.param_groups for p in g["params"]]

    def full_optimizer_state(self, opt: torch.optim.Optimizer) -> dict[str, Any]:
        sd = opt.state_dict()
        params = self._flat_params(opt)
        state = {}
        for i, p in enumerate(params):
            if i in sd["state"]:
                ep = getattr(p, EP_LOCAL, False)
                state[i] = {k: self._full(v, ep) if torch.is_tensor(v) else v for k, v in sd["state"][i].items()}
        return {"state": state, "param_groups": sd["param_groups"]}

    def load_full_optimizer_state(self, opt: torch.optim.Optimizer, full: dict[str, Any]) -> None:
        params = self._flat_params(opt)
        state = {}
        for i, st in full["state"].items():
            p = params[int(i)]
            ep = getattr(p, EP_LOCAL, False)
            state[i] = {k: (self._local(v, p, ep).float() if torch.is_tensor(v) and v.dim() > 0 else v)
                        for k, v in st.items()}
        opt.load_state_dict({"state": state, "param_groups": full["param_groups"]})

    def barrier(self) -> None:
        dist.barrier()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
