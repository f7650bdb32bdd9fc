"""Sharded checkpoints with torch.distributed.checkpoint (DCP), loadable at any world size
(including a single process without a process group), and export to the official format.

Every tensor is saved under a global name with its global shape: FSDP2 parameters and their
optimizer state are DTensors already; expert-parallel weights (plain [E/ep, ...] tensors) are
viewed as DTensors sharded over `ep` and replicated over dp_shard and cp, so DCP writes each
expert once. Optimizer state is keyed by parameter name ("<param>.<state key>") rather than by
position, so the layout does not depend on how param groups are ordered.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from k3.distributed.fsdp import EP_LOCAL


def _global(t: torch.Tensor, ep_local: bool, mesh) -> torch.Tensor:
    if not ep_local or isinstance(t, DTensor) or t.dim() == 0:
        return t
    if mesh is None:
        raise ValueError("mesh: expert-parallel tensors need the run's Mesh to be saved")
    return DTensor.from_local(t, mesh.device_mesh, [Replicate(), Shard(0), Replicate()], run_check=False)


def init_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """Create zero state for every parameter that has none yet (a fresh optimizer), so DCP has
    tensors to load into. Knows PerHeadMuon's groups: "muon" (momentum_buffer) and "adamw"."""
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state[p]
            if st:
                continue
            if group.get("kind") == "muon":
                st["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32)
            else:
                st["step"] = torch.zeros((), dtype=torch.float32)
                st["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                st["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)


def dcp_state(model: nn.Module, opt: torch.optim.Optimizer | None = None, mesh=None) -> dict[str, Any]:
    """{"model": {name: tensor}, "optimizer": {"<param>.<key>": tensor}} with global shapes; the
    tensors alias the live ones, so `dcp.load` into this dict loads the model in place."""
    ep = {n for n, p in model.named_parameters() if getattr(p, EP_LOCAL, False)}
    out: dict[str, Any] = {"model": {k: _global(v, k in ep, mesh) for k, v in model.state_dict().items()}}
    if opt is not None:
        names = {id(p): n for n, p in model.named_parameters()}
        osd = {}
        for group in opt.param_groups:
            for p in group["params"]:
                name = names[id(p)]
                for key, v in opt.state[p].items():
                    if torch.is_tensor(v):
                        osd[f"{name}.{key}"] = _global(v, name in ep, mesh)
        out["optimizer"] = osd
    return out


def save_dcp(path: str | os.PathLike, model: nn.Module, opt: torch.optim.Optimizer | None = None,
             mesh=None) -> None:
    """Collective under a process group (every rank writes its shards); plain save without one."""
    dcp.save(dcp_state(model, opt, mesh), checkpoint_id=os.fspath(path))


def save_dcp_atomic(path: str | os.PathLike, model: nn.Module, opt: torch.optim.Optimizer | None,
                    mesh) -> None:
    """save_dcp into `path`.tmp, then rank 0 swaps it in for `path` (collective)."""
    path = os.fspath(path)
    tmp = path + ".tmp"
    if mesh.is_main and os.path.exists(tmp):
        shutil.rmtree(tmp)
    dist.barrier()
    save_dcp(tmp, model, opt, mesh)
    dist.barrier()
    if mesh.is_main:
        if os.path.exists(path):
            shutil.rmtree(path)
        os.replace(tmp, path)
    dist.barrier()


def load_dcp(path: str | os.PathLike, model: nn.Module, opt: torch.optim.Optimizer | None = None,
             mesh=None) -> None:
    """Load a DCP checkpoint in place, resharding to this run's layout (any world size).
    Parameters that had no optimizer state when saved (never received a gradient) get none."""
    path = os.fspath(path)
    if opt is not None:
        init_optimizer_state(opt)
    state = dcp_state(model, opt, mesh)
    if opt is not None:
        saved = set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
        names = {id(p): n for n, p in model.named_parameters()}
        for p in [p for g in opt.param_groups for p in g["params"]]:
            keys = [f"{names[id(p)]}.{k}" for k in opt.state[p]]
            if not any(f"optimizer.{k}" in saved for k in keys):
                del opt.state[p]
                for k in keys:
                    state["optimizer"].pop(k)
    dcp.load(state, checkpoint_id=path)  # in place: the dict aliases the live tensors


def export_official(path: str | os.PathLike, out_dir: str | os.PathLike, config) -> list[str]:
    """DCP checkpoint -> official single-directory format (safetensors + config.json), in one
    process: builds the single-device model, loads, `save_pretrained`."""
    from k3.model.causal_lm import K3ForCausalLM

    model = K3ForCausalLM(config)
    load_dcp(path, model)
    return model.save_pretrained(out_dir, dtype="float32" if config.dtype == "float32" else None)
