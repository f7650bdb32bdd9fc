"""MoE combine and dispatch Triton kernels against the spec (float64) and the model's torch regions (bf16).

Without CUDA the kernels run under TRITON_INTERPRET=1 on small shapes (CI); on a GPU the same tests
plus a k3-small-sized case marked `gpu`.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from k3.kernel_config import KernelConfig  # noqa: E402
from k3.model.fused import EAGER as PLAIN  # noqa: E402
from k3.model.fused import sort_slots  # noqa: E402
from k3.ops.moe_combine import moe_combine, moe_dispatch  # noqa: E402
from k3.ops.moe_combine.reference import moe_combine_reference, moe_dispatch_reference  # noqa: E402

EAGER = PLAIN.with_config(KernelConfig(moe_combine="torch", moe_dispatch="torch"))  # the torch regions

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(N, k, L, E, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)]) if N else torch.zeros(0, k).long()
    order, inv = sort_slots(idx)
    y = torch.randn(N * k, L, generator=g).to(DEV, dtype)
    w = torch.rand(N, k, generator=g).to(DEV)
    return y, w, order.to(DEV), inv.to(DEV)


def _grads(fn, y, w, go):
    y, w = y.detach().requires_grad_(), w.detach().requires_grad_()
    out = fn(y, w)
    out.backward(go.to(out.dtype))
    return out, y.grad, w.grad


@pytest.mark.parametrize("N,k,L", [(37, 3, 70), (8, 1, 256), (5, 8, 513), (64, 2, 24)])
def test_fp32_against_float64(N, k, L):
    """Output and both gradients within fp32 rounding of the float64 spec (autograd through it)."""
    y, w, _, inv = _inputs(N, k, L, E=2 * k + 1, dtype=torch.float32)
    go = torch.randn(N, L, dtype=torch.float64, device=DEV)
    out, gy, gw = _grads(lambda y, w: moe_combine(y, w, inv), y, w, go)
    ref, ry, rw = _grads(lambda y, w: moe_combine_reference(y, w, inv), y.double(), w.double(), go)
    assert out.shape == (N, L) and out.dtype == torch.float32 and gw.dtype == torch.float32
    for got, want in ((out, ref), (gy, ry), (gw, rw)):
        assert (got.double() - want).abs().max() <= 1e-6 * max(1.0, want.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_matches_the_model_region(dtype):
    """bf16 / fp16: the same fp32 sums as the torch region, so outputs and y gradients agree to one
    rounding of the storage dtype and w's gradient (fp32) to fp32 rounding; int32 slot indices."""
    N, k, L = 45, 4, 96
    y, w, order, inv = _inputs(N, k, L, E=9, dtype=dtype, seed=1)
    go = torch.randn(N, L, device=DEV)
    out, gy, gw = _grads(lambda y, w: moe_combine(y, w, inv.int()), y, w, go)
    ref, ry, rw = _grads(lambda y, w: EAGER.combine(y, w, order, inv), y, w, go)
    assert out.dtype == dtype and gy.dtype == dtype
    ulp = torch.finfo(dtype).eps
    torch.testing.assert_close(out.float(), ref.float(), rtol=ulp, atol=ulp * ref.abs().max().item())
    torch.testing.assert_close(gy.float(), ry.float(), rtol=ulp, atol=0.0)
    torch.testing.assert_close(gw, rw, rtol=1e-5, atol=1e-5 * rw.abs().max().item())


def test_no_tokens():
    y, w, _, inv = _inputs(0, 2, 8, E=4, dtype=torch.float32)
    out, gy, gw = _grads(lambda y, w: moe_combine(y, w, inv), y, w, torch.zeros(0, 8, device=DEV))
    assert out.shape == (0, 8) and gy.shape == (0, 8) and gw.shape == (0, 2)


def test_bad_inputs_raise():
    y, w, _, inv = _inputs(4, 2, 8, E=4, dtype=torch.float32)
    with pytest.raises(ValueError, match="N\\*k"):
        moe_combine(y[:-1], w, inv)
    with pytest.raises(ValueError, match="expected y"):
        moe_combine(y[None], w, inv)
    with pytest.raises(ValueError, match="int32 or int64"):
        moe_combine(y, w, inv.float())
    with pytest.raises(ValueError, match="bf16, fp16 or fp32"):
        moe_combine(y.double(), w, inv)


@pytest.mark.parametrize("N,k,L", [(37, 3, 70), (8, 1, 256), (5, 8, 513), (0, 2, 8)])
def test_dispatch_fp32_against_float64(N, k, L):
    """Dispatch copies rows exactly; its backward (fp32 k-way sums) within fp32 rounding of float64."""
    _, _, _, inv = _inputs(N, k, L, E=2 * k + 1, dtype=torch.float32)
    z = torch.randn(N, L, device=DEV)
    g = torch.randn(N * k, L, dtype=torch.float64, device=DEV)
    zt, zr = z.clone().requires_grad_(), z.double().requires_grad_()
    out, ref = moe_dispatch(zt, inv, k), moe_dispatch_reference(zr, inv, k)
    out.backward(g.float())
    ref.backward(g)
    assert out.shape == (N * k, L) and out.dtype == torch.float32 and zt.grad.dtype == torch.float32
    assert torch.equal(out.double(), ref)
    if N:
        assert (zt.grad.double() - zr.grad).abs().max().item() <= 1e-6 * max(1.0, zr.grad.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dispatch_half_matches_the_model_region(dtype, monkeypatch):
    """bf16 / fp16: the same rows as the torch region and the same fp32 k-way gradient sums, to one
    rounding of the storage dtype; int32 slot indices."""
    N, k, L = 45, 4, 96
    _, _, order, inv = _inputs(N, k, L, E=9, dtype=dtype, seed=2)
    z = torch.randn(N, L, device=DEV).to(dtype)
    g = torch.randn(N * k, L, device=DEV).to(dtype)
    zt, zr = z.clone().requires_grad_(), z.clone().requires_grad_()
    out, ref = moe_dispatch(zt, inv.int(), k), EAGER.dispatch(zr, order, inv, k)
    out.backward(g)
    ref.backward(g)
    assert torch.equal(out, ref) and zt.grad.dtype == dtype
    ulp = torch.finfo(dtype).eps
    torch.testing.assert_close(zt.grad.float(), zr.grad.float(), rtol=ulp, atol=ulp * zr.grad.abs().max().item())


def test_dispatch_bad_inputs_raise():
    _, _, _, inv = _inputs(4, 2, 8, E=4, dtype=torch.float32)
    z = torch.randn(4, 8, device=DEV)
    with pytest.raises(ValueError, match=r"inv must be \[6\]"):
        moe_dispatch(z[:-1], inv, 2)
    with pytest.raises(ValueError, match="expected z"):
        moe_dispatch(z[None], inv, 2)
    with pytest.raises(ValueError, match="k >= 1"):
        moe_dispatch(z, inv, 0)
    with pytest.raises(ValueError, match="int32 or int64"):
        moe_dispatch(z, inv.float(), 2)
    with pytest.raises(ValueError, match="bf16, fp16 or fp32"):
        moe_dispatch(z.double(), inv, 2)


def test_model_routes_dispatch_through_the_kernels(monkeypatch):
    """Kernels.dispatch with kernels.moe_dispatch="triton" (interpreter on the CPU) equals the torch region."""
    _, _, order, inv = _inputs(16, 2, 8, E=5, dtype=torch.float32, seed=3)
    z = torch.randn(16, 8, device=DEV, requires_grad=True)
    a = PLAIN.with_config(KernelConfig(moe_dispatch="triton")).dispatch(z, order, inv, 2)
    b = EAGER.dispatch(z, order, inv, 2)
    assert a.grad_fn is not None and type(a.grad_fn).__name__ != type(b.grad_fn).__name__
    assert torch.equal(a, b)


@pytest.mark.gpu
def test_k3_small_size_on_gpu(monkeypatch):
    """65,536 tokens x 8 choices of 64 experts, L 512 bf16: agrees with the torch regions."""
    N, k, L = 65536, 8, 512
    idx = torch.rand(N, 64, device=DEV).topk(k, dim=1).indices
    order, inv = sort_slots(idx)
    y = torch.randn(N * k, L, device=DEV, dtype=torch.bfloat16)
    w = torch.rand(N, k, device=DEV)
    go = torch.randn(N, L, device=DEV)
    out, gy, gw = _grads(lambda y, w: moe_combine(y, w, inv), y, w, go)
    ref, ry, rw = _grads(lambda y, w: EAGER.combine(y, w, order, inv), y, w, go)
    ulp = torch.finfo(torch.bfloat16).eps
    torch.testing.assert_close(out.float(), ref.float(), rtol=ulp, atol=ulp * ref.abs().max().item())
    torch.testing.assert_close(gy.float(), ry.float(), rtol=ulp, atol=0.0)
    torch.testing.assert_close(gw, rw, rtol=1e-4, atol=1e-4 * rw.abs().max().item())
    z = torch.randn(N, L, device=DEV, dtype=torch.bfloat16)
    zt, zr = z.clone().requires_grad_(), z.clone().requires_grad_()
    gs = torch.randn(N * k, L, device=DEV, dtype=torch.bfloat16)
    out, ref = moe_dispatch(zt, inv, k), EAGER.dispatch(zr, order, inv, k)
    out.backward(gs)
    ref.backward(gs)
    assert torch.equal(out, ref)
    torch.testing.assert_close(zt.grad.float(), zr.grad.float(), rtol=ulp, atol=ulp * zr.grad.abs().max().item())
