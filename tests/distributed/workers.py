"""Multi-process checks, run by the tests as `torchrun --nproc-per-node 2 workers.py NAME`.

Each check compares the distributed computation with the single-process one on the same global
batch, computed in the same process before anything is sharded; a failed comparison raises."""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.distributed as dist

from k3.config import apply_overrides, get_preset
from k3.model.causal_lm import K3ForCausalLM
from k3.optim import HeadGeometry, PerHeadMuon, build_param_groups

MODEL = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "q_lora_rank": 64, "kv_lora_rank": 32,
         "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16, "num_experts": 8,
         "num_experts_per_token": 2, "moe_intermediate_size": 32, "routed_expert_hidden_size": 32,
         "linear_attn_config": {"num_heads": 2, "head_dim": 16}}
DEVICE = os.environ.get("K3_TEST_DEVICE", "cpu")  # "cuda": the same checks over NCCL, fp32
FP32 = dict(rtol=1e-4, atol=2e-6)  # fp32, different reduction order (sharded sums, split documents)


def tiny_model() -> K3ForCausalLM:
    cfg = apply_overrides(get_preset("k3-tiny"), dict(MODEL, bos_token_id=256, eos_token_id=258,
                                                       pad_token_id=511, media_placeholder_token_id=277))
    cfg.dtype = "float32"
    cfg.quantization_config = None
    return K3ForCausalLM(cfg.validate()).init_weights(seed=0).to(DEVICE).set_kda_backend("torch")


def batch(rows: int = 4, T: int = 32, seed: int = 0):
    """A packed batch [1, rows*T] whose documents start at every row and at a few places inside rows."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 500, (1, rows * T), generator=g)
    labels = torch.randint(0, 500, (1, rows * T), generator=g)
    starts = set(range(0, rows * T, T)) | {5, T + 20, 2 * T + 1, 3 * T + 17}
    cu = torch.tensor(sorted(starts) + [rows * T], dtype=torch.int32)
    labels[0, cu[1:-1].long() - 1] = -100  # targets crossing a document boundary are ignored
    return ids.to(DEVICE), labels.to(DEVICE), cu.to(DEVICE), T


def close(name: str, a: torch.Tensor, b: torch.Tensor, **tol) -> None:
    a, b = a.detach().cpu(), b.detach().cpu()
    if not torch.allclose(a, b, **(tol or FP32)):
        err = (a - b).abs().max().item()
        raise AssertionError(f"rank {dist.get_rank()}: {name} differs, max abs err {err:.3e}")


def full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t


def reference(model, ids, labels, cu):
    ref = copy.deepcopy(model)
    loss = ref(ids, labels=labels, cu_seqlens=cu).loss
    loss.backward()
    return ref, loss.detach()


def check_against_reference(par, model, ref, ref_loss, ids, labels, cu, T, grads: bool = True) -> None:
    objective, loss = par.loss(model, par.local_batch(ids, labels, cu, T))
    objective.backward()
    par.after_backward()
    close("loss", loss, ref_loss)
    if grads:
        ref_grads = dict(ref.named_parameters())
        sd = par.full_model_state()  # checks the gather path too
        for n, p in model.named_parameters():
            close(f"param {n}", sd[n], ref_grads[n].detach())
        for n, p in model.named_parameters():
            if p.grad is None and ref_grads[n].grad is None:
                continue
            if p.grad is None:
                raise AssertionError(f"rank {dist.get_rank()}: no gradient for {n}")
            g = par._full(p.grad, getattr(p, "_k3_ep_local", False))
            close(f"grad {n}", g, ref_grads[n].grad)


def check_fsdp() -> None:
    from k3.distributed.runtime import Parallel
    par = Parallel(device=DEVICE)
    model = tiny_model()
    ids, labels, cu, T = batch()
    ref, ref_loss = reference(model, ids, labels, cu)
    par.setup(model, mixed_precision=False)
    check_against_reference(par, model, ref, ref_loss, ids, labels, cu, T)
    # clip + one Per-Head Muon/AdamW step on the shards == on one device
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    close("grad norm", par.clip_grad_norm(0.5), ref_norm)
    geom = HeadGeometry.from_config(ref.config.text_config)
    ref_opt = PerHeadMuon(build_param_groups(ref, geom, lr=1e-2, weight_decay=0.1))
    opt = par.optimizer(build_param_groups(model, geom, lr=1e-2, weight_decay=0.1))
    for _ in range(2):
        ref_opt.step()
        opt.step()
    sd = par.full_model_state()
    for n, p in ref.named_parameters():
        # AdamW normalises tiny gradients: a 1e-4 relative gradient difference can move an element by
        # ~1e-3 of a step (lr = 1e-2), so updated weights are compared at 2e-5 absolute.
        close(f"updated {n}", sd[n], p.detach(), rtol=1e-4, atol=2e-5)
    # optimizer state round trip through the full (single-device) format
    full_opt = par.full_optimizer_state(opt)
    ref_state = ref_opt.state_dict()["state"]
    for i, st in ref_state.items():
        for k, v in st.items():
            close(f"opt state {i}.{k}", full_opt["state"][i][k], v, rtol=1e-3, atol=1e-6)
    par.load_full_optimizer_state(opt, full_opt)
    par.load_full_model_state(sd)
    close("reloaded", par.full_model_state()["lm_head.weight"], sd["lm_head.weight"])


def check_ep() -> None:
    """EP (plain and MoonEP) == dense RoutedExperts forward/backward; MoonEP gives every rank
    exactly S*K pairs under a skewed router; then a whole model with EP + FSDP == one process."""
    from k3.distributed.ep import EPExperts
    from k3.distributed.mesh import init_mesh
    mesh = init_mesh(ep=2, device=DEVICE)
    rank = dist.get_rank()
    dense = tiny_model().model.layers[1].block_sparse_moe.experts
    E, N, k, L = dense.w1.shape[0], 24, 2, dense.w1.shape[2]
    g = torch.Generator().manual_seed(1)
    z_all = torch.randn(2, N, L, generator=g)
    # skewed router: 70% of picks land on experts 0 and 1 (both homed on rank 0)
    idx_all = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(2 * N)]).view(2, N, k)
    skew = torch.rand(2, N, generator=g) < 0.7
    idx_all[..., 0] = torch.where(skew, 0, idx_all[..., 0])
    idx_all[..., 1] = torch.where(skew, 1, torch.where(idx_all[..., 1] == 0, idx_all[..., 0], idx_all[..., 1]))
    idx_all[..., 1] = torch.where(idx_all[..., 1] == idx_all[..., 0], (idx_all[..., 0] + 3) % E, idx_all[..., 1])
    w_all = torch.rand(2, N, k, generator=g)
    z_all, idx_all, w_all = z_all.to(DEVICE), idx_all.to(DEVICE), w_all.to(DEVICE)
    z_ref = z_all.clone().requires_grad_()
    w_ref = w_all.clone().requires_grad_()
    ref_out = torch.stack([dense(z_ref[i], idx_all[i], w_ref[i]) for i in range(2)])
    (ref_out * torch.arange(L, device=DEVICE)).sum().backward()
    for balanced in (False, True):
        ep = EPExperts(dense, mesh.ep_group, balanced=balanced)
        z = z_all[rank].clone().requires_grad_()
        w = w_all[rank].clone().requires_grad_()
        out = ep(z, idx_all[rank], w)
        (out * torch.arange(L, device=DEVICE)).sum().backward()
        tag = "moonep" if balanced else "ep"
        close(f"{tag} out", out, ref_out[rank].detach())
        close(f"{tag} dz", z.grad, z_ref.grad[rank])
        close(f"{tag} dw", w.grad, w_ref.grad[rank])
        sl = slice(rank * E // 2, (rank + 1) * E // 2)
        for n in ("w1", "w3", "w2"):
            gsum = getattr(ep, n).grad.clone()
            close(f"{tag} d{n}", gsum, getattr(dense, n).grad[sl])
        if balanced:
            assert ep.last_load["max_over_mean_plain"] > 1.3, ep.last_load
            from k3.distributed.ep import plan_balanced
            counts = torch.bincount(idx_all.reshape(-1).cpu(), minlength=E)
            slots = plan_balanced(counts, 2)
            assert [sum(n for _, n in s) for s in slots] == [N * k, N * k], slots
            assert any(e // (E // 2) != r for r, s in enumerate(slots) for e, _ in s), "no redundant copy planned"
    # whole model: EP + FSDP == one process
    from k3.distributed.runtime import Parallel
    par = Parallel(ep=2, device=DEVICE)
    model = tiny_model()
    ids, labels, cu, T = batch()
    ref, ref_loss = reference(model, ids, labels, cu)
    par.setup(model, mixed_precision=False)
    check_against_reference(par, model, ref, ref_loss, ids, labels, cu, T)


def check_cp() -> None:
    """CP over 2 ranks (KDA transforms + conv halo, MLA gathered latent) == one process, with
    documents crossing the segment edge at 64 (one starting 3 tokens before it, inside the conv
    halo), a row whose edge is a document start, and one document over the whole row."""
    from k3.distributed.runtime import Parallel
    par = Parallel(cp=2, device=DEVICE)
    model = tiny_model()
    base = copy.deepcopy(model)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 500, (1, 128), generator=g)
    labels = torch.randint(0, 500, (1, 128), generator=g)
    ids, labels = ids.to(DEVICE), labels.to(DEVICE)
    for starts in ([0, 5, 61], [0, 30, 64, 100], [0]):
        cu = torch.tensor(starts + [128], dtype=torch.int32, device=DEVICE)
        ref, ref_loss = reference(base, ids, labels, cu)
        if par.model is None:
            par.setup(model, mixed_precision=False)
        else:
            model.zero_grad(set_to_none=True)
        check_against_reference(par, model, ref, ref_loss, ids, labels, cu, 128)


def train_step(par, model, opt, ids, labels, cu, T) -> float:
    objective, loss = par.loss(model, par.local_batch(ids, labels, cu, T))
    objective.backward()
    par.after_backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def check_dcp() -> None:
    """EP + FSDP on 2 ranks: one step, DCP save to argv[2], then a second step; rank 0 writes the
    losses of both steps to argv[2]/losses.json for the single-process side of the test."""
    import json
    import os
    from k3.distributed.checkpoint import save_dcp
    from k3.distributed.runtime import Parallel
    path = sys.argv[2]
    par = Parallel(ep=2, device=DEVICE)
    model = tiny_model()
    par.setup(model, mixed_precision=False)
    geom = HeadGeometry.from_config(model.config.text_config)
    opt = par.optimizer(build_param_groups(model, geom, lr=1e-2, weight_decay=0.1))
    ids, labels, cu, T = batch()
    first = train_step(par, model, opt, ids, labels, cu, T)
    save_dcp(path, model, opt, par.mesh)
    second = train_step(par, model, opt, ids, labels, cu, T)
    third = par.loss(model, par.local_batch(ids, labels, cu, T))[1].item()
    if dist.get_rank() == 0:
        with open(os.path.join(path, "losses.json"), "w") as f:
            json.dump([first, second, third], f)


if __name__ == "__main__":
    import faulthandler
    faulthandler.dump_traceback_later(40, exit=True)  # a hung collective fails with a stack
    torch.manual_seed(0)
    torch.set_num_threads(1)
    globals()[f"check_{sys.argv[1]}"]()
    dist.barrier()
    if dist.get_rank() == 0:
        print(f"OK {sys.argv[1]}")
    dist.destroy_process_group()
