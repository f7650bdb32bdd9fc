"""`k3 rl` under torchrun: the trainer side data-parallel with FSDP2, rollouts on rank 0.

    torchrun --nproc-per-node 2 -m k3 rl --base DIR ...      (gloo on CPU, NCCL on GPUs)

* The policy's fp32 masters are sharded with FSDP2 (`k3.distributed.Parallel`, as `k3 train` /
  `k3 sft`; ep = cp = 1) and stepped with the sharded Per-Head Muon (the single-device maths).
* Rank 0 owns the engine, on a separate full copy of the weights (in `serve_dtype` when set), and
  samples every group (partial rollouts and all). The other ranks' RolloutManager has no engine; it
  only keeps the weight version.
* Each step rank 0 packs the completed groups into micro-batches (advantages, behaviour log-probs,
  staleness computed there) and broadcasts them; micro-batch i is trained by rank i mod world. FSDP
  needs the same number of forward/backward passes on every rank, so a rank with fewer micro-batches
  repeats one with weight 0. Every rank's loss is its micro-batches' share of the step's mean
  (shares from the global token count), and FSDP sums gradients: the step's gradient is the
  single-process one.
* Weight sync: after the update every sharded tensor is all-gathered (`DTensor.full_tensor`) and rank
  0 copies it into its serving model in place (the gather is the multi-rank counterpart of
  `k3.rl.sync.sync_weights`; with an engine on every rank, `k3.rl.sync.broadcast_weights` would send
  the copy on).
* Held-out evaluation runs on rank 0 and its numbers are broadcast; checkpoints and the export gather
  the full state to rank 0, which writes them.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def wants_distributed() -> bool:
    """Under torchrun with more than one process."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


class DistRL:
    """One object per rank. device: None = cuda:LOCAL_RANK when CUDA is available, else CPU (gloo)."""

    def __init__(self, device: str | torch.device | None = None) -> None:
        from k3.distributed.runtime import Parallel

        self.par = Parallel(1, 1, device)
        self.device = self.par.device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    # ---- setup ---------------------------------------------------------------------------------------
    def make_engine(self, trainer: Any, serve_dtype: str | None) -> Any:
        """Rank 0: an engine on a full serving copy of the checkpoint; other ranks: None."""
        if self.rank != 0:
            return None
        from k3.model.causal_lm import K3ForCausalLM

        serving = K3ForCausalLM.from_pretrained(trainer.checkpoint, dtype=serve_dtype or torch.float32)
        return trainer.new_engine(serving.to(self.device).eval())

    def shard(self, model: torch.nn.Module) -> None:
        self.par.setup(model)

    def optimizer(self, groups: list[dict], fused: bool = True) -> torch.optim.Optimizer:
        return self.par.optimizer(groups, fused=fused)

    # ---- one step ------------------------------------------------------------------------------------
    def collect(self, rollouts: Any, source: Iterator) -> list:
        """Rank 0's completed groups; [] elsewhere (their tensors arrive through `broadcast`)."""
        return rollouts.collect(source) if self.rank == 0 else []

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's picklable `obj` on every rank (micro-batches of CPU tensors, metric dicts)."""
        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def my_share(self, micro: list) -> list[tuple[Any, bool]]:
        """This rank's micro-batches as (batch, real); padded with (micro[0], False) to the largest
        share so every rank runs the same number of FSDP forward/backward passes."""
        per = -(-len(micro) // self.world)
        mine = [(mb, True) for mb in micro[self.rank::self.world]]
        return mine + [(micro[0], False)] * (per - len(mine))

    def reduce_metrics(self, agg: dict[str, float], maxed: tuple[str, ...] = ()) -> dict[str, float]:
        """Sum every metric over ranks (they are share-weighted partial sums), max for `maxed`."""
        keys = sorted(agg)
        t = torch.tensor([agg[k] for k in keys], dtype=torch.float64, device=self.device)
        m = t.clone()
        dist.all_reduce(t)
        dist.all_reduce(m, op=dist.ReduceOp.MAX)
        return {k: float(m[i] if k in maxed else t[i]) for i, k in enumerate(keys)}

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        return self.par.clip_grad_norm(max_norm)

    @torch.no_grad()
    def sync_to_engine(self, model: torch.nn.Module, engine: Any) -> None:
        """All-gather every sharded tensor; rank 0 copies it into its serving model (in place)."""
        dst = engine.model.state_dict() if engine is not None else None
        for name, t in model.state_dict().items():
            full = t.full_tensor() if isinstance(t, DTensor) else t
            if dst is not None:
                dst[name].copy_(full)
        if engine is not None:
            engine.on_weights_updated()

    def any_flag(self, flag: bool) -> bool:
        t = torch.tensor([1.0 if flag else 0.0], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def on_main(self, fn: Callable[[], Any]) -> Any:
        """fn() on rank 0, its (picklable) result on every rank."""
        return self.broadcast(fn() if self.rank == 0 else None)

    # ---- full state ------------------------------------------------------------------------------------
    def full_state(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[dict, dict]:
        """The single-device model and optimizer state dicts (collective; meaningful on rank 0)."""
        return self.par.full_model_state(), self.par.full_optimizer_state(opt)

    def load_full_state(self, model: torch.nn.Module, opt: torch.optim.Optimizer, model_sd: dict, opt_sd: dict) -> None:
        self.par.load_full_model_state(model_sd)
        self.par.load_full_optimizer_state(opt, opt_sd)

    def full_model(self, model: torch.nn.Module, checkpoint: str) -> Any:
        """Rank 0: an unsharded fp32 copy with the trained weights (for export); None elsewhere."""
        sd = self.par.full_model_state()
        if self.rank != 0:
            return None
        from k3.model.causal_lm import K3ForCausalLM

        full = K3ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
        full.load_state_dict(sd)
        return full

    def barrier(self) -> None:
        dist.barrier()

    def close(self) -> None:
        self.par.close()


__all__ = ["DistRL", "wants_distributed"]
