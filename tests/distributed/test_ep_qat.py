"""QAT under expert parallelism: EPExperts (plain and MoonEP, 2 gloo processes) with the MXFP4 weight and
MXFP8 activation fake quantisers give the dense RoutedExperts' outputs and gradients under the same
quantisers. Run by the test as `torchrun --nproc-per-node 2 test_ep_qat.py` (the worker is this file)."""

import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
FP32 = dict(rtol=1e-4, atol=2e-6)


def test_ep_equals_dense_under_qat():
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29631",
           str(Path(__file__))]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    assert "OK ep qat" in r.stdout


def _close(name: str, a: torch.Tensor, b: torch.Tensor) -> None:
    if not torch.allclose(a.detach(), b.detach(), **FP32):
        raise AssertionError(f"{name} differs, max abs err {(a - b).abs().max().item():.3e}")


def _tiny_experts():
    """The routed experts of a tiny fp32 model with `--qat mxfp4,mxfp8` applied (8 experts, L = I = 32)."""
    from k3.config import apply_overrides, get_preset
    from k3.model.causal_lm import K3ForCausalLM
    from k3.quant.qat import QATConfig, apply_qat

    cfg = apply_overrides(get_preset("k3-tiny"), {"num_experts": 8, "num_experts_per_token": 2,
                                                  "moe_intermediate_size": 32, "routed_expert_hidden_size": 32})
    cfg.dtype = "float32"
    cfg.quantization_config = None
    model = K3ForCausalLM(cfg.validate()).init_weights(seed=0)
    apply_qat(model, QATConfig.parse("mxfp4,mxfp8"))
    return model.model.layers[1].block_sparse_moe.experts


def _worker() -> None:
    import torch.distributed as dist

    from k3.distributed.ep import EPExperts
    from k3.distributed.mesh import init_mesh
    from k3.quant.qat import qat_modules

    mesh = init_mesh(ep=2, device="cpu")
    rank = dist.get_rank()
    dense = _tiny_experts()
    assert dense.input_transform is not None and dense.weight_transform is not None
    E, N, k, L = dense.w1.shape[0], 16, 2, dense.w1.shape[2]
    g = torch.Generator().manual_seed(1)
    z_all = torch.randn(2, N, L, generator=g) * 3
    idx_all = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(2 * N)]).view(2, N, k)
    idx_all[..., 0] = torch.where(torch.rand(2, N, generator=g) < 0.6, 0, idx_all[..., 0])  # skew: MoonEP copies
    idx_all[..., 1] = torch.where(idx_all[..., 1] == idx_all[..., 0], (idx_all[..., 0] + 3) % E, idx_all[..., 1])
    w_all = torch.rand(2, N, k, generator=g)
    z_ref = z_all.clone().requires_grad_()
    ref = torch.stack([dense(z_ref[i], idx_all[i], w_all[i]) for i in range(2)])
    (ref * torch.arange(L)).sum().backward()
    # the quantisers matter here: without the activation one the outputs differ
    act = dense.input_transform
    dense.input_transform = None
    plain = dense(z_all[rank], idx_all[rank], w_all[rank])
    dense.input_transform = act
    assert (plain - ref[rank]).abs().max() > 1e-3, "the MXFP8 input quantiser changed nothing"
    for balanced in (False, True):
        ep = EPExperts(dense, mesh.ep_group, balanced=balanced)
        assert qat_modules(ep) == [ep]  # apply_qat / remove_qat find EP experts too
        z = z_all[rank].clone().requires_grad_()
        out = ep(z, idx_all[rank], w_all[rank])
        (out * torch.arange(L)).sum().backward()
        tag = "moonep" if balanced else "ep"
        _close(f"{tag} out", out, ref[rank])
        _close(f"{tag} dz", z.grad, z_ref.grad[rank])
        sl = slice(rank * E // 2, (rank + 1) * E // 2)
        for n in ("w1", "w3", "w2"):
            _close(f"{tag} d{n}", getattr(ep, n).grad, getattr(dense, n).grad[sl])
    dist.barrier()
    if rank == 0:
        print("OK ep qat")
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.manual_seed(0)
    torch.set_num_threads(1)
    _worker()
