"""K3ForCausalLM.step_weights() over the dense weights: one compute-dtype copy per step, the same bits.

The experts' own tests (fp32, no autocast) are in test_layers.py next to `_train_weights`."""

import contextlib

import pytest
import torch

import k3.model.step_weights as sw
from k3.config import apply_overrides, k3_tiny
from k3.model.causal_lm import K3ForCausalLM
from k3.model.step_weights import StepLinear, gemm_weight

BF16 = torch.bfloat16


def _model(q_lora: bool = True) -> K3ForCausalLM:
    cfg = k3_tiny() if q_lora else apply_overrides(k3_tiny(), {"q_lora_rank": None})  # MLA's single q_proj
    return K3ForCausalLM(cfg).init_weights(seed=0).train()


def _batches(n: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randint(0, 4096, (n, T + 1)), torch.tensor([0, T // 2 - 1, T], dtype=torch.int32)  # 2 documents


def _step(model: K3ForCausalLM, ids: torch.Tensor, cu: torch.Tensor, shared: bool, autocast: bool = True
          ) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    """One optimizer step's micro-batches (row r = micro-batch r): the losses and the grads after each."""
    model.zero_grad(set_to_none=True)
    losses, grads = [], []
    with model.step_weights() if shared else contextlib.nullcontext():
        for r in range(ids.shape[0]):
            with torch.autocast("cpu", dtype=BF16, enabled=autocast):
                loss = model(ids[r:r + 1, :-1], labels=ids[r:r + 1, 1:], cu_seqlens=cu).loss
            loss.backward()
            losses.append(loss.detach())
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    return losses, grads


def _dense_names(model: K3ForCausalLM) -> set[str]:
    """The weights whose step copies step_weights() makes under autocast: every 2-D GEMM weight of the text
    model (the embedding table, the fp32 routers and the AttnRes vectors stay out) and the routed experts."""
    return {n for n, p in model.named_parameters()
            if (p.dim() == 2 and not n.endswith(("embed_tokens.weight", ".gate.weight", "_res_proj.weight")))
            or ".experts.w" in n}


def _short(name: str) -> str:
    """model.layers.1.self_attn.q_proj.weight -> q_proj; model.layers.1.block_sparse_moe.experts.w1 -> w1."""
    parts = name.split(".")
    return parts[-2] if parts[-1] == "weight" else parts[-1]


@pytest.mark.parametrize("checkpointing,q_lora", [(False, True), (True, False)],
                         ids=["plain", "checkpointing-q_proj"])
def test_bf16_autocast_loss_and_every_grad_bit_identical(checkpointing, q_lora):
    """k3-tiny (dense layer 0, KDA, MLA, LatentMoE + shared expert), bf16 autocast on CPU, 2 micro-batches
    of packed documents: the losses and every gradient, after the first micro-batch (.grad None -> copy)
    and after the second (fp32 += bf16), equal autograd's cast + accumulation bit for bit. With activation
    checkpointing the recomputation in the backward reuses the step's copies."""
    model = _model(q_lora)
    model.model.gradient_checkpointing = checkpointing
    ids, cu = _batches(2, 24)
    (la, ga), (lb, gb) = _step(model, ids, cu, shared=False), _step(model, ids, cu, shared=True)
    assert all(torch.equal(x, y) for x, y in zip(la, lb))
    for a, b in zip(ga, gb):
        assert a.keys() == b.keys() and _dense_names(model) <= a.keys()
        for n in a:
            assert b[n].dtype == torch.float32 and torch.equal(a[n], b[n]), n


def test_each_weight_cast_once_per_step(monkeypatch):
    """Inside step_weights() under autocast every dense GEMM weight (concatenated groups: KDA's six input
    projections, a GLU's gate|up) and the experts get one copy in the step's first micro-batch (bf16; the
    experts' fp32 on the CPU) and none after it; each parameter is in exactly one copy. The caches are dropped on exit. Without
    autocast only the experts are copied (the dense GEMMs run as before), and without grad nothing is."""
    made: list[tuple[torch.dtype, tuple[torch.Tensor, ...]]] = []
    forward = sw._StepWeights.forward

    def counting(ctx, dtype, dim, *params):  # noqa: ANN001
        made.append((dtype, params))
        return forward(ctx, dtype, dim, *params)

    monkeypatch.setattr(sw._StepWeights, "forward", staticmethod(counting))
    model = _model()
    ids, cu = _batches(3, 16)
    per_micro_batch = []
    with model.step_weights():
        for r in range(3):
            with torch.autocast("cpu", dtype=BF16):
                model(ids[r:r + 1, :-1], labels=ids[r:r + 1, 1:], cu_seqlens=cu).loss.backward()
            per_micro_batch.append(len(made))
    assert per_micro_batch[0] > 0 and per_micro_batch == per_micro_batch[:1] * 3
    names = {id(p): n for n, p in model.named_parameters()}
    # the dense copies in bf16; on the CPU the routed experts' GEMMs stay fp32 under autocast
    # (RoutedExperts._experts_cpu), so their copies are fp32
    experts = {"w1", "w2", "w3"}
    assert all(dtype == (torch.float32 if {_short(names[id(p)]) for p in params} <= experts else BF16)
               for dtype, params in made)
    copied = [names[id(p)] for _, params in made for p in params]
    assert len(copied) == len(set(copied)) and set(copied) == _dense_names(model)
    groups = {tuple(_short(names[id(p)]) for p in params) for _, params in made if len(params) > 1}
    assert groups == {("q_proj", "k_proj", "v_proj", "g_proj", "f_a_proj", "b_proj"), ("gate_proj", "up_proj"),
                      ("w1", "w3")}
    assert all(m.step_cache is None for m in model.modules() if hasattr(m, "step_cache"))

    made.clear()  # no autocast: the experts only (as before this change); no grad: nothing
    with model.step_weights():
        model(ids[:1, :-1], labels=ids[:1, 1:], cu_seqlens=cu).loss.backward()
        with torch.no_grad(), torch.autocast("cpu", dtype=BF16):
            model(ids[:1, :-1], labels=ids[:1, 1:], cu_seqlens=cu)
    assert {_short(names[id(p)]) for _, params in made for p in params} == {"w1", "w2", "w3"}
    assert all(dtype == torch.float32 for dtype, _ in made)


def test_step_linear_outside_a_step_is_nn_linear():
    """No cache (outside step_weights, FSDP, EP): the parameter itself goes to the GEMM, as nn.Linear."""
    lin = StepLinear(8, 4)
    x = torch.randn(3, 8)
    assert lin.gemm_weight() is lin.weight and torch.equal(lin(x), torch.nn.functional.linear(x, lin.weight))
    with torch.autocast("cpu", dtype=BF16):
        assert lin.gemm_weight() is lin.weight
        lin.step_cache = {}
        assert lin.gemm_weight().dtype == BF16 and lin.gemm_weight() is lin.gemm_weight()
        with torch.no_grad():
            assert lin.gemm_weight() is lin.weight


def test_group_copy_accumulates_slices_and_skips_frozen_params():
    """A concatenated group's copy: each param's .grad gets its own slice (copied when None, added after);
    a param that does not require grad gets none; keys never mix groups or dtypes."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, 8)) for n in (3, 5, 2)]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]  # autograd's own way
    for ps in (params, ref):
        ps[2].requires_grad_(False)
    cache: sw.StepCache = {}
    xs, gs = torch.randn(2, 4, 8), torch.randn(2, 4, 10).to(BF16)
    with torch.autocast("cpu", dtype=BF16):
        w = gemm_weight(cache, tuple(params))
        assert w.dtype == BF16 and w.shape == (10, 8) and gemm_weight(cache, tuple(params)) is w
        assert gemm_weight(cache, tuple(params[:2])) is not w and len(cache) == 2
        for x, g in zip(xs, gs):  # two micro-batches
            torch.autograd.backward(torch.nn.functional.linear(x, w), g)
            torch.autograd.backward(torch.nn.functional.linear(x, torch.cat(ref)), g)
            assert all(torch.equal(p.grad, q.grad) for p, q in zip(params[:2], ref[:2]))
    assert params[2].grad is None and params[0].grad.dtype == torch.float32


def test_nested_step_weights_raises():
    model = _model()
    with model.step_weights():
        with pytest.raises(RuntimeError, match="already active"):
            with model.step_weights():
                pass
    assert all(m.step_cache is None for m in model.modules() if hasattr(m, "step_cache"))


def test_step_copy_without_a_gradient_adds_nothing():
    """A consumer that accumulates the masters' gradient itself (k3.ops.grouped_gemm.expert_gemm) returns
    None for the step copy: the copy's backward must then not add a zero tensor (nor create `.grad`)."""

    class _Own(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):  # noqa: ANN001
            return x * w.sum()

        @staticmethod
        def backward(ctx, g):  # noqa: ANN001
            return g, None

    p = torch.nn.Parameter(torch.randn(3, 4))
    cache: sw.StepCache = {}
    w = sw.step_weight(cache, (p,), BF16)
    calls = []
    orig = sw.accumulate_grad
    sw.accumulate_grad = lambda *a: calls.append(a) or orig(*a)
    try:
        x = torch.randn(5, requires_grad=True)
        _Own.apply(x, w).sum().backward()
    finally:
        sw.accumulate_grad = orig
    assert x.grad is not None and p.grad is None and not calls
