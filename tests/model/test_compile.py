"""compile_model: the compiled elementwise regions give the eager results.

The whole k3-tiny is traced with the `aot_eager` backend (Dynamo + AOTAutograd, every region with
fullgraph=True, so any graph break fails); Inductor code generation is exercised on one region
(compiling all of k3-tiny with Inductor takes minutes on 2 CPU cores)."""

from __future__ import annotations

import pytest
import torch

from k3.config import apply_overrides, k3_tiny
from k3.model.causal_lm import K3ForCausalLM
from k3.model.common import situ_glu
from k3.model.compile import compile_model, uncompile_model
from k3.model.fused import EAGER, Kernels

FP32 = dict(atol=2e-5, rtol=1e-4)  # rounding order of fused regions vs eager kernels


def _model() -> K3ForCausalLM:
    """k3-tiny cut to 3 layers (dense KDA, KDA + MoE, MLA + MoE; AttnRes blocks of 2, so mixes of 2 and
    3 candidates): every region and variant of the full model, half the tracing time."""
    torch.manual_seed(0)
    cfg = apply_overrides(k3_tiny(), {"num_hidden_layers": 3, "attn_res_block_size": 2,
                                      "linear_attn_config": {"full_attn_layers": [3], "kda_layers": [1, 2]}})
    m = K3ForCausalLM(cfg).init_weights(seed=0)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("res_proj.weight"):
                p.normal_(0, 0.1)
    return m


def _loss_and_grads(m: K3ForCausalLM, ids: torch.Tensor, cu: torch.Tensor) -> dict[str, torch.Tensor]:
    out = m(ids[:, :-1], labels=ids[:, 1:], cu_seqlens=cu)
    out.loss.backward()
    res = {"loss": out.loss.detach(), "logits": out.logits.detach()}
    res.update({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
    m.zero_grad(set_to_none=True)
    return res


def test_compiled_model_equals_eager():
    m = _model()
    ids = torch.randint(0, 4096, (1, 41))
    cu = torch.tensor([0, 2, 25, 40], dtype=torch.int32)  # a document shorter than the conv window
    eager = _loss_and_grads(m, ids, cu)
    compile_model(m, backend="aot_eager")
    assert all(mod.kernels.compiled for mod in m.modules() if hasattr(mod, "kernels"))
    compiled = _loss_and_grads(m, ids, cu)
    assert eager.keys() == compiled.keys()
    for name, want in eager.items():
        torch.testing.assert_close(compiled[name], want, **FP32, msg=lambda s, n=name: f"{n}: {s}")
    uncompile_model(m)
    assert all(mod.kernels is EAGER for mod in m.modules() if hasattr(mod, "kernels"))


def test_inductor_region_equals_eager():
    kern = Kernels(compiled=True, backend="inductor")
    ab = torch.randn(13, 2 * 24) * 5
    a, b = ab.split(24, dim=-1)
    a1, b1 = a.clone().requires_grad_(True), b.clone().requires_grad_(True)
    a2, b2 = a.clone().requires_grad_(True), b.clone().requires_grad_(True)
    go = torch.randn(13, 24)
    got = kern.glu(a1, b1, "situ", 4.0, 25.0)
    got.backward(go)
    want = situ_glu(a2, b2, 4.0, 25.0)
    want.backward(go)
    torch.testing.assert_close(got, want, **FP32)
    torch.testing.assert_close(a1.grad, a2.grad, **FP32)
    torch.testing.assert_close(b1.grad, b2.grad, **FP32)


def test_static_shapes_option_recompiles_per_shape():
    """dynamic=False (the trainer's choice) reaches torch.compile, and a second shape (a validation batch)
    compiles a specialised variant that computes the same values."""
    m = compile_model(_model(), backend="aot_eager", dynamic=False)
    kern = next(mod.kernels for mod in m.modules() if hasattr(mod, "kernels"))
    assert kern.options["dynamic"] is False and Kernels(compiled=True).options.get("dynamic") is None
    batches = [torch.randint(0, 4096, (1, T + 1)) for T in (17, 29)]
    got = [_loss_and_grads(m, ids, None) for ids in batches]
    uncompile_model(m)
    for ids, g in zip(batches, got):
        torch.testing.assert_close(g["loss"], _loss_and_grads(m, ids, None)["loss"], **FP32)


def test_compile_model_errors():
    with pytest.raises(ValueError, match="no K3 module"):
        compile_model(torch.nn.Linear(2, 2), backend="aot_eager")
    with pytest.raises(ValueError, match="mode"):
        compile_model(_model(), backend="aot_eager", mode="max-autotune")


def test_compiled_cross_entropy_kernel():
    kern = Kernels(compiled=True, backend="aot_eager")
    logits = torch.randn(2, 9, 40, requires_grad=True)
    labels = torch.randint(0, 40, (2, 9))
    labels[1, 0] = -100
    got = kern.cross_entropy(logits, labels)
    (g,) = torch.autograd.grad(got, logits)
    want = EAGER.cross_entropy(logits, labels)
    (w,) = torch.autograd.grad(want, logits)
    torch.testing.assert_close(got, want, **FP32)
    torch.testing.assert_close(g, w, **FP32)


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return float(a @ b / (a.norm() * b.norm()).clamp_min(1e-30))


@pytest.mark.gpu
def test_compiled_equals_eager_on_cuda_bf16():
    """The training configuration of the benchmark (CUDA, bf16 autocast, fp32 master weights, Triton
    KDA) on k3-tiny: Inductor-compiled regions vs eager. bf16 rounding differs between fused and
    unfused kernels, so the losses agree to bf16 precision, and each gradient must be as close (by
    direction) to an fp32 eager reference as the eager bf16 gradient is: small-gradient parameters
    (router, AttnRes vectors) are bf16-noisy in both, and the compiled build must not be noisier."""
    torch.manual_seed(0)
    m = K3ForCausalLM(k3_tiny()).init_weights(seed=0).cuda().set_kda_backend("triton")
    with torch.no_grad():  # AttnRes projections start at zero, which would make the norm-weight gradients zero
        for n, p in m.named_parameters():
            if n.endswith("_res_proj.weight"):
                p.normal_(0.0, 0.02)
    ids = torch.randint(0, 4096, (1, 2 * 512 + 1), device="cuda")
    cu = torch.tensor([0, 300, 512, 1024], dtype=torch.int32, device="cuda")

    def step(bf16: bool = True) -> dict[str, torch.Tensor]:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            loss = m(ids[:, :-1], labels=ids[:, 1:], cu_seqlens=cu).loss
        loss.backward()
        res = {"loss": loss.detach().float()}
        res.update({n: p.grad.float().clone() for n, p in m.named_parameters() if p.grad is not None})
        m.zero_grad(set_to_none=True)
        return res

    ref = step(bf16=False)
    eager = step()
    compile_model(m)
    for _ in range(2):  # the second step runs the cached graphs
        compiled = step()
    assert abs(float(compiled["loss"] - eager["loss"])) < 2e-2 * float(eager["loss"])
    assert set(compiled) == set(eager)
    bad = {n: (_cosine(compiled[n], g), _cosine(eager[n], g)) for n, g in ref.items()
           if n != "loss" and _cosine(compiled[n], g) < min(0.99, _cosine(eager[n], g) - 0.03)}
    # margin 0.03: on the H200 the noisiest AttnRes norm weight measured 0.948 compiled vs 0.960 eager
    assert not bad, bad  # name: (cos(compiled, fp32), cos(eager bf16, fp32))


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_training_step_never_reads_the_gpu_back(compiled: bool):
    """With host cu_seqlens (what the trainer passes) a packed varlen forward+backward of the training
    configuration (bf16 autocast, Triton KDA, MLA flash varlen path, Quantile-Balancing observers on
    every router, as `k3 train` attaches them) launches work only: every device-to-host read stalls the
    GPU queue, and a training step used to make ~30 of them (KDA checks, chunk bookkeeping, MLA's
    longest document) plus two per MoE layer (the balancer's histograms used bincount)."""
    import functools

    from k3.optim.quantile_balance import QuantileBalancer

    torch.manual_seed(0)
    m = K3ForCausalLM(k3_tiny()).init_weights(seed=0).cuda().set_kda_backend("triton")
    m.train()
    tc = m.config.text_config
    qb = QuantileBalancer(num_layers=tc.num_hidden_layers, num_experts=tc.num_experts,
                          top_k=tc.num_experts_per_token, bins=64)
    for i, layer in enumerate(m.model.layers):
        if hasattr(layer, "block_sparse_moe"):
            layer.block_sparse_moe.gate.score_observer = functools.partial(qb.observe, i)
    if compiled:
        compile_model(m)
    ids = torch.randint(0, 4096, (1, 1024 + 1), device="cuda")
    cu = torch.tensor([0, 300, 512, 1024], dtype=torch.int32)  # on the host

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = m(ids[:, :-1], labels=ids[:, 1:], cu_seqlens=cu).loss
        loss.backward()

    step()  # warm-up: compilation, autotuning and the chunk bookkeeping cache may read back
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
