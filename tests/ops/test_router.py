"""k3.ops.router: fp32 router logits from split bf16 GEMMs vs the spec's fp32 product and float64."""

import pytest
import torch

from k3.ops.router import router_logits, router_logits_reference, split3


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_split3_is_exact():
    w = torch.randn(64, 256) * 0.02
    p = split3(w)
    assert p.dtype == torch.bfloat16 and p.shape == (3, 64, 256)
    assert torch.equal(p[0].float() + (p[1].float() + p[2].float()), w)


@pytest.mark.parametrize("N,d,E", [(300, 96, 16), (77, 128, 64)])
def test_forward_and_grads_match_fp32(N, d, E):
    torch.manual_seed(0)
    x = torch.randn(N, d).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(E, d) * 0.05).requires_grad_()
    g = torch.randn(N, E)
    y = router_logits(x, w)
    assert y.dtype == torch.float32 and y.shape == (N, E)
    y.backward(g)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y64 = x64 @ w64.t()
    y64.backward(g.double())
    ref = router_logits_reference(x.detach(), w.detach())
    # fp32-accumulation accuracy, as the fp32 GEMM: the same order of error vs float64
    assert _rel(y, y64) < 4 * max(_rel(ref, y64), 1e-7)
    assert _rel(w.grad, w64.grad) < 1e-6
    # dx ends in bf16: within its rounding
    assert _rel(x.grad, x64.grad) < 4e-3
    xr = x.detach().float().requires_grad_()
    (xr @ w.detach().t()).backward(g)
    assert _rel(x.grad, xr.grad.to(torch.bfloat16)) < 1e-3


def test_other_dtypes_take_the_fp32_product():
    x, w = torch.randn(5, 8), torch.randn(3, 8)
    assert torch.equal(router_logits(x, w), x @ w.t())
    xh = torch.randn(5, 8).half()
    assert torch.equal(router_logits(xh, w), xh.float() @ w.t())


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="fp32"):
        router_logits(torch.randn(2, 4).bfloat16(), torch.randn(3, 4).bfloat16())
    with pytest.raises(ValueError, match=r"\[N, d\]"):
        router_logits(torch.randn(2, 5).bfloat16(), torch.randn(3, 4))


def test_kernels_route_uses_the_split_for_bf16(monkeypatch):
    """Kernels.route on its Triton path (kernels.moe_route="triton"): bf16 x gets the split logits; against
    the fp32 GEMM of x cast to fp32 (the logits put in its place): same ids and fp32-close scores and
    weights."""
    from k3.kernel_config import KernelConfig
    from k3.model import fused

    kern = fused.EAGER.with_config(KernelConfig(moe_route="triton"))

    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(1)
    x = torch.randn(57, 48, device=dev).to(torch.bfloat16)
    wt, bias = torch.randn(16, 48, device=dev) * 0.1, torch.randn(16, device=dev) * 0.01
    i1, w1, s1 = kern.route(x, wt, bias, 4, True, 1.0)
    assert s1.dtype == torch.float32
    monkeypatch.setattr(fused, "router_logits", lambda x, w: x.float() @ w.float().t())
    i0, w0, s0 = kern.route(x, wt, bias, 4, True, 1.0)
    torch.testing.assert_close(s1, s0, rtol=1e-6, atol=1e-7)
    assert torch.equal(i1, i0)
    torch.testing.assert_close(w1, w0, rtol=1e-6, atol=1e-7)


@pytest.mark.gpu
def test_cuda_matches_fp32_gemm():
    torch.manual_seed(0)
    x = torch.randn(65536, 1024, device="cuda").to(torch.bfloat16).requires_grad_()
    w = (torch.randn(64, 1024, device="cuda") * 0.02).requires_grad_()
    g = torch.randn(65536, 64, device="cuda")
    y = router_logits(x, w)
    y.backward(g)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    (x64 @ w64.t()).backward(g.double())
    # against cuBLAS's fp32 GEMM (the path it replaces) and float64
    xr, wr = x.detach().float().requires_grad_(), w.detach().clone().requires_grad_()
    yr = xr @ wr.t()
    yr.backward(g)
    y64 = x64.detach() @ w64.detach().t()
    errs = {"y": (_rel(y, y64), _rel(yr, y64)), "dw": (_rel(w.grad, w64.grad), _rel(wr.grad, w64.grad)),
            "dx": (_rel(x.grad, x64.grad), _rel(xr.grad, x64.grad))}
    assert errs["y"][0] < 4 * max(errs["y"][1], 1e-6), errs
    # dW sums 65,536 exact products on the tensor cores, whose fp32 accumulation does not round to nearest:
    # 9.1e-6 on the H200 (2026-12-01) against 8.1e-7 for cuBLAS's fp32 GEMM, both far below bf16's 4e-3
    assert errs["dw"][0] < 2e-5, errs
    assert errs["dx"][0] < 4e-3, errs


@pytest.mark.parametrize("N,E", [(1, 3), (77, 64), (130, 20)])
def test_triton_grad_split_equals_the_torch_split(monkeypatch, N, E):
    """The backward's operand split as one Triton kernel (the interpreter here) gives the torch split's bits,
    including values whose rounding ties and tiny / huge magnitudes; and the whole backward agrees."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from k3.ops.router import split2
    from k3.ops.router.triton_split import router_grad_split

    g = torch.randn(N, E, generator=torch.Generator().manual_seed(N)) * torch.logspace(-30, 30, E)
    g[0, 0] = 1.0 + 2.0 ** -8  # a tie: rounds to even
    a, gp = router_grad_split(g)
    hi, lo = split2(g)
    assert torch.equal(a, torch.cat([hi, hi, lo], dim=1))
    assert torch.equal(gp, split3(g.t().contiguous()).reshape(3 * E, N))
    x = torch.randn(N, 32).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(E, 32) * 0.05).requires_grad_()
    router_logits(x, w).backward(g)
    gx, gw = x.grad.clone(), w.grad.clone()
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the torch split on the CPU
    x.grad = w.grad = None
    router_logits(x, w).backward(g)
    assert torch.equal(x.grad, gx) and torch.equal(w.grad, gw)
