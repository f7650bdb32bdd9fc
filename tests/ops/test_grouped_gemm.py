"""The routed experts' GEMM with fp32 weight gradients accumulated in the Triton kernel, against the
per-expert loops of the spec (float64 sums).

Without CUDA the kernel runs under TRITON_INTERPRET=1 on small shapes (CI); on a GPU the same tests plus a
k3-small-sized case marked `gpu`.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from k3.ops.grouped_gemm import expert_gemm  # noqa: E402
from k3.ops.grouped_gemm.reference import gmm_reference, wgrad_reference  # noqa: E402
from k3.ops.grouped_gemm.triton_gmm import gmm_wgrad  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _offs(counts: list[int]) -> torch.Tensor:
    return torch.cumsum(torch.tensor(counts), 0).to(DEV, torch.int32)


@pytest.mark.parametrize("counts,M,N,split", [
    ([7, 0, 20, 3, 11], 48, 40, None),     # an empty expert, counts not multiples of any tile
    ([33, 1, 70], 64, 24, 32),              # two outputs (w1 / w3 halves), rows past a tile
    ([0, 0, 5], 16, 16, None),              # leading empty experts
])
@pytest.mark.parametrize("accumulate", [False, True])
def test_wgrad_kernel_against_spec(counts, M, N, split, accumulate, monkeypatch):
    """fp32 operands: the kernel's per-expert a^T b within fp32 rounding of the float64 loop; with
    accumulate the old contents are added, without it they are overwritten (stale values must vanish)."""
    monkeypatch.setattr("k3.ops.grouped_gemm.triton_gmm.WGRAD_TILE", (16, 16, 16))
    g = torch.Generator().manual_seed(1)
    offs = _offs(counts)
    S = sum(counts)
    a, b = torch.randn(S, M, generator=g).to(DEV), torch.randn(S, N, generator=g).to(DEV)
    old = torch.randn(len(counts), M, N, generator=g).to(DEV)
    outs = (old.clone(),) if split is None else tuple(t.contiguous().clone() for t in old.split([split, M - split], 1))
    gmm_wgrad(a, b, offs, outs, accumulate)
    want = wgrad_reference(a, b, offs) + (old if accumulate else 0)
    torch.testing.assert_close(torch.cat(outs, 1), want, rtol=1e-5, atol=1e-4)


def test_wgrad_kernel_rejects_bad_outputs():
    offs = _offs([3, 5])
    a, b = torch.randn(8, 32, device=DEV), torch.randn(8, 16, device=DEV)
    with pytest.raises(ValueError, match="contiguous fp32"):
        gmm_wgrad(a, b, offs, (torch.zeros(2, 32, 16, device=DEV, dtype=torch.bfloat16),), False)
    with pytest.raises(ValueError, match="contiguous fp32"):
        gmm_wgrad(a, b, offs, (torch.zeros(2, 16, 16, device=DEV),), False)
    with pytest.raises(ValueError, match="multiple of 16"):
        gmm_wgrad(a, b, offs, (torch.zeros(2, 8, 16, device=DEV), torch.zeros(2, 24, 16, device=DEV)), False)
    with pytest.raises(ValueError, match="int32"):
        gmm_wgrad(a, b, offs.long(), (torch.zeros(2, 32, 16, device=DEV),), False)


def _expert_case(dtype, counts=(9, 0, 17, 30), K=32, N1=16, N2=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    E = len(counts)
    offs = _offs(list(counts))
    x = torch.randn(sum(counts), K, generator=g).to(DEV, dtype)
    masters = tuple(torch.nn.Parameter((torch.randn(E, n, K, generator=g) * 0.1).to(DEV)) for n in (N1, N2) if n)
    return x, masters, offs


@pytest.mark.parametrize("two", [False, True])
def test_expert_gemm_against_autograd(two, monkeypatch):
    """Output, input gradient and the masters' gradients (over two backward calls: written, then added)
    against autograd through the fp32 spec loop."""
    monkeypatch.setattr("k3.ops.grouped_gemm.triton_gmm.WGRAD_TILE", (16, 128, 64))
    x, masters, offs = _expert_case(torch.float32, N2=16 if two else 0)
    w = torch.cat([p.detach() for p in masters], 1)
    gos = [torch.randn(x.shape[0], w.shape[1], device=DEV) for _ in range(2)]

    xr = x.clone().requires_grad_()
    wr = tuple(p.detach().clone().requires_grad_() for p in masters)
    for go in gos:
        yr = gmm_reference(xr, torch.cat(wr, 1).transpose(-2, -1), offs)
        yr.backward(go)

    xk = x.clone().requires_grad_()
    for go in gos:
        yk = expert_gemm(xk, w, offs, masters)
        yk.backward(go)
    torch.testing.assert_close(yk, yr, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xk.grad, xr.grad, rtol=1e-5, atol=1e-5)
    for p, r in zip(masters, wr):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-5, atol=1e-4)


def test_expert_gemm_bf16_gradients_are_fp32_sums():
    """bf16 operands: the masters' gradient is the fp32 sum of the bf16 products (no bf16 rounding of the
    result), i.e. close to the float64 sum at fp32 accuracy, not at bf16's."""
    x, masters, offs = _expert_case(torch.bfloat16, counts=(40, 25), K=48, N1=32, N2=0)
    w = masters[0].detach().to(torch.bfloat16)
    go = torch.randn(x.shape[0], w.shape[1], device=DEV).to(torch.bfloat16)
    y = expert_gemm(x.requires_grad_(), w, offs, masters)
    y.backward(go)
    want = wgrad_reference(go.float(), x.float(), offs)
    torch.testing.assert_close(masters[0].grad, want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(y.float(), gmm_reference(x.float(), w.float().transpose(-2, -1), offs),
                               rtol=2 ** -7, atol=1e-2)


def test_expert_gemm_rejects_bad_inputs():
    x, masters, offs = _expert_case(torch.float32)
    w = torch.cat([p.detach() for p in masters], 1)
    with pytest.raises(ValueError, match="one dtype"):
        expert_gemm(x.double(), w, offs, masters)
    with pytest.raises(ValueError, match="int32"):
        expert_gemm(x, w, offs.long(), masters)
    with pytest.raises(ValueError, match="masters"):
        expert_gemm(x, w, offs, masters[:1])
    with pytest.raises(ValueError, match="masters"):
        expert_gemm(x, w, offs, tuple(p.detach().to(torch.bfloat16) for p in masters))
    with pytest.raises(ValueError, match="all require grad or none"):
        expert_gemm(x, w, offs, (masters[0], masters[1].detach()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="k3-small size: GPU only")
def test_wgrad_kernel_k3_small_size():
    """k3-small's dW13 at 65,536 tokens: the kernel against fp32 GEMMs of the same bf16 operands, for a
    few experts."""
    g = torch.Generator(device="cuda").manual_seed(0)
    E, I, L, S = 64, 512, 512, 65536 * 8
    counts = torch.full((E,), S // E)
    counts[::2] += 37
    counts[1::2] -= 37
    offs = torch.cumsum(counts, 0).to("cuda", torch.int32)
    a = torch.randn(S, 2 * I, device="cuda", generator=g).to(torch.bfloat16)
    b = torch.randn(S, L, device="cuda", generator=g).to(torch.bfloat16)
    outs = (torch.zeros(E, I, L, device="cuda"), torch.zeros(E, I, L, device="cuda"))
    gmm_wgrad(a, b, offs, outs, False)
    starts = [0] + offs[:-1].tolist()
    for e in (0, 1, 31, 63):
        s, t = starts[e], int(offs[e])
        ref = a[s:t].float().t() @ b[s:t].float()
        torch.testing.assert_close(torch.cat([outs[0][e], outs[1][e]]), ref, rtol=1e-4, atol=1e-2)
