"""MoE routing Triton kernels (top-k selection, counting sort of the slots) against the spec and torch,
and the model with kernels.moe_route="triton" against the torch routing.

Without CUDA the kernels run under TRITON_INTERPRET=1 on small shapes (CI); on a GPU the same tests
plus a k3-small-sized case marked `gpu`.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from k3.kernel_config import KernelConfig  # noqa: E402
from k3.model.compile import set_kernel_config  # noqa: E402
from k3.model.fused import EAGER, route_slots  # noqa: E402
from k3.ops.moe_route import MAX_EXPERTS, sort_slots_triton, topk_route  # noqa: E402
from k3.ops.moe_route.reference import sort_slots_reference, topk_route_reference  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _distinct_ids(N, E, k, seed=0):
    g = _gen(seed)
    return torch.rand(N, E, generator=g).argsort(-1)[:, :k].to(DEV)


def _check_sort(idx, E):
    order, inv, counts = sort_slots_triton(idx, E)
    flat = idx.reshape(-1).long()
    assert order.dtype == inv.dtype == counts.dtype == torch.int64
    assert torch.equal(order, torch.argsort(flat, stable=True))
    assert torch.equal(inv[order], torch.arange(flat.numel(), device=flat.device))
    assert torch.equal(counts, torch.bincount(flat, minlength=E))
    for got, want in zip((order, inv, counts), sort_slots_reference(idx, E)):
        assert torch.equal(got, want)


# ---------------------------------------------------------------------------------------------------
# top-k


@pytest.mark.parametrize("N,E,k", [(37, 64, 8), (5, 6, 6), (9, 896, 16), (3, 1, 1), (70, 384, 16), (33, 32, 4)])
def test_topk_equals_torch(N, E, k):
    """Continuous values: the same id sets as torch.topk, and exactly the spec's order (descending)."""
    g = _gen()
    choice, bias = torch.rand(N, E, generator=g).to(DEV), (torch.randn(E, generator=g) * 0.1).to(DEV)
    got = topk_route(choice, k, bias)
    assert got.shape == (N, k) and got.dtype == torch.int64
    want = torch.topk(choice + bias, k, dim=-1).indices
    assert torch.equal(got.sort(-1).values, want.sort(-1).values)
    assert torch.equal(got, topk_route_reference(choice, k, bias))
    assert torch.equal(topk_route(choice, k), topk_route_reference(choice, k))


def test_topk_ties_smaller_id_first():
    """Many equal values (few distinct levels), +-0, infinities and NaN: exactly the stable descending
    sort (equal values smaller id first, NaN above +inf, -0 == +0)."""
    g = _gen(1)
    choice = torch.randint(0, 3, (50, 40), generator=g).float()
    choice[0] = 0.0
    choice[1, ::2] = -0.0
    choice[2, [3, 7]] = float("nan")
    choice[2, 5] = float("inf")
    choice[3, :] = float("-inf")
    choice[4, [1, 9]] = -float("nan")
    choice = choice.to(DEV)
    for k in (1, 5, 40):
        assert torch.equal(topk_route(choice, k), topk_route_reference(choice, k))
    assert topk_route(choice, 3)[0].tolist() == [0, 1, 2]


def test_topk_half_inputs_and_strided_rows():
    choice = torch.rand(20, 48, generator=_gen(2)).to(DEV)
    for c in (choice.bfloat16(), choice.half(), torch.cat([choice, choice], 1)[:, 7:55]):
        assert torch.equal(topk_route(c, 6), topk_route_reference(c, 6))


def test_topk_no_rows():
    assert topk_route(torch.zeros(0, 16, device=DEV), 4).shape == (0, 4)


def test_topk_bad_inputs_raise():
    c = torch.rand(4, 8, device=DEV)
    with pytest.raises(ValueError, match="\\[N, E\\]"):
        topk_route(c[0], 2)
    with pytest.raises(ValueError, match="k must be"):
        topk_route(c, 9)
    with pytest.raises(ValueError, match="k must be"):
        topk_route(c, 0)
    with pytest.raises(ValueError, match="fp32, bf16 or fp16"):
        topk_route(c.double(), 2)
    with pytest.raises(ValueError, match="fp32, bf16 or fp16"):
        topk_route(c.long(), 2)
    with pytest.raises(ValueError, match="bias"):
        topk_route(c, 2, torch.zeros(7, device=DEV))
    with pytest.raises(ValueError, match="number of experts"):
        topk_route(torch.rand(1, MAX_EXPERTS + 1, device=DEV), 2)


# ---------------------------------------------------------------------------------------------------
# slot sort


@pytest.mark.parametrize("N,k,E", [(37, 8, 64), (100, 3, 5), (1, 1, 1), (70, 16, 896), (130, 4, 32)])
def test_sort_distinct_ids_equals_torch(monkeypatch, N, k, E):
    """Router-like ids (distinct per row), in blocks of 256 slots (the interpreter's sort is slow; the
    default 1024 runs in the model test); N*k rarely a multiple of the block."""
    monkeypatch.setattr("k3.ops.moe_route.triton_route.TILE", (1024, 2, 256, 4))
    _check_sort(_distinct_ids(N, E, k), E)


def test_sort_random_and_equal_ids_across_blocks(monkeypatch):
    """Repeated ids within rows, all-equal ids, and several blocks of 16 slots with a short last one."""
    monkeypatch.setattr("k3.ops.moe_route.triton_route.TILE", (1024, 2, 16, 4))
    g = _gen(3)
    _check_sort(torch.randint(0, 7, (45, 3), generator=g).to(DEV), 7)
    _check_sort(torch.full((23, 2), 4, device=DEV), 5)
    _check_sort(torch.zeros(16, 1, dtype=torch.long, device=DEV), 1)
    _check_sort(torch.randint(0, 64, (61, 8), generator=g).to(DEV).int(), 64)  # int32 ids


def test_sort_no_tokens():
    order, inv, counts = sort_slots_triton(torch.zeros(0, 4, dtype=torch.long, device=DEV), 6)
    assert order.shape == inv.shape == (0,) and torch.equal(counts, torch.zeros(6, dtype=torch.long, device=DEV))


def test_sort_bad_inputs_raise():
    idx = torch.randint(0, 4, (5, 2), device=DEV)
    with pytest.raises(ValueError, match="\\[N, k\\]"):
        sort_slots_triton(idx.reshape(-1), 4)
    with pytest.raises(ValueError, match="int32 or int64"):
        sort_slots_triton(idx.float(), 4)
    with pytest.raises(ValueError, match="num_experts"):
        sort_slots_triton(idx, 0)
    with pytest.raises(ValueError, match="num_experts"):
        sort_slots_triton(idx, MAX_EXPERTS + 1)
    if DEV == "cpu":  # CUDA ids are not range-checked (a host sync); see sort_slots_triton
        with pytest.raises(ValueError, match="in \\[0, 3\\)"):
            sort_slots_triton(idx.clamp(0, 3), 3)
        with pytest.raises(ValueError, match="in \\[0, 4\\)"):
            sort_slots_triton(idx - 1, 4)


# ---------------------------------------------------------------------------------------------------
# the model's switch


def test_router_and_slots_switch(monkeypatch):
    """Kernels.route and route_slots with kernels.moe_route="triton": the same id sets, weights (per id) and
    scores as the torch region, and identical slot order / counts; also without autograd (serving)."""
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = _gen(4)
    x, wt, bias = (torch.randn(29, 24, generator=g).to(DEV), torch.randn(16, 24, generator=g).to(DEV),
                   (torch.randn(16, generator=g) * 0.1).to(DEV))
    i0, w0, s0 = EAGER.with_config(KernelConfig(moe_route="torch")).route(x, wt, bias, 4, True, 2.5)
    i1, w1, s1 = EAGER.with_config(KernelConfig(moe_route="triton")).route(x, wt, bias, 4, True, 2.5)
    assert torch.equal(s1, s0) and torch.equal(i1, topk_route_reference(s0, 4, bias))
    p0, p1 = i0.argsort(-1), i1.argsort(-1)
    assert torch.equal(i1.gather(1, p1), i0.gather(1, p0))
    torch.testing.assert_close(w1.gather(1, p1), w0.gather(1, p0), rtol=1e-6, atol=1e-7)
    with torch.no_grad():
        got = route_slots(i1, 16, "triton")
    for a, b in zip(got, route_slots(i1, 16, "torch")):
        assert torch.equal(a, b)


def test_model_with_triton_routing_matches_torch(monkeypatch):
    """k3-tiny (32 experts, top-4): loss and every parameter gradient with kernels.moe_route="triton" equal the
    torch routing's up to fp32 summation order (the rows list ids in another order, so the weight
    renormalisation and the combine add the k terms in another order): rtol 1e-5 on the loss, 1e-3
    relative to each gradient's largest entry."""
    from k3.config import k3_tiny
    from k3.model.causal_lm import K3ForCausalLM

    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(0)
    model = K3ForCausalLM(k3_tiny()).init_weights(seed=0).train().to(DEV)
    ids = torch.randint(0, 4096, (1, 40), device=DEV)
    cu = torch.tensor([0, 17, 39], dtype=torch.int32, device=DEV)

    def run():
        model.zero_grad(set_to_none=True)
        loss = model(ids[:, :-1], labels=ids[:, 1:], cu_seqlens=cu).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    set_kernel_config(model, KernelConfig(moe_route="torch"))
    loss0, g0 = run()
    set_kernel_config(model, KernelConfig(moe_route="triton"))
    loss1, g1 = run()
    loss2, g2 = run()
    assert torch.equal(loss1, loss2) and all(torch.equal(g1[n], g2[n]) for n in g1)  # deterministic
    torch.testing.assert_close(loss1, loss0, rtol=1e-5, atol=1e-6)
    assert g1.keys() == g0.keys()
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-3, atol=1e-3 * g0[n].abs().max().item() + 1e-7, msg=n)


# ---------------------------------------------------------------------------------------------------
# GPU


@pytest.mark.gpu
@pytest.mark.parametrize("N,E,k", [(65536, 64, 8), (8192, 896, 16), (8192, 384, 16)])
def test_full_size_on_gpu(N, E, k):
    """k3-small (65,536 tokens, top-8 of 64) and kimi-k3-like sizes: the spec's ids (equal to torch.topk
    as sets) and the slot sort equal to torch's stable argsort."""
    g = torch.Generator(device=DEV).manual_seed(0)
    choice = torch.rand(N, E, device=DEV, generator=g)
    bias = torch.randn(E, device=DEV, generator=g) * 1e-2
    idx = topk_route(choice, k, bias)
    assert torch.equal(idx, topk_route_reference(choice, k, bias))
    assert torch.equal(idx.sort(-1).values, torch.topk(choice + bias, k, dim=-1).indices.sort(-1).values)
    _check_sort(idx, E)
    _check_sort(torch.randint(0, E, (N, k), device=DEV, generator=g), E)
