"""Short convolution (depthwise causal conv + SiLU) Triton kernels against the float64 loops.

Without CUDA the kernels run under TRITON_INTERPRET=1 on tiny shapes (CI); on a GPU the same tests
plus a larger bf16 case marked `gpu`.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from k3.ops.short_conv import document_starts, short_conv_silu  # noqa: E402
from k3.ops.short_conv.reference import short_conv_silu_reference  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _check(B, T, S, C, W, dtype, cu=None, sliced=False, pad=5, at=3):
    """sliced: x is columns [at, at + S*C) of a wider tensor (S*C + pad columns), like a fused projection."""
    torch.manual_seed(0)
    full = torch.randn(B, T, S * C + (pad if sliced else 0), device=DEV, dtype=dtype)
    x = (full[..., at:at + S * C] if sliced else full).detach().requires_grad_()
    w = (torch.randn(S * C, 1, W, device=DEV) * 0.5).requires_grad_()
    cu_t = torch.tensor(cu, device=DEV, dtype=torch.int32) if cu is not None else None
    out = short_conv_silu(x, w, streams=S, cu_seqlens=cu_t)
    assert out.shape == (S, B, T, C) and out.dtype == dtype
    xr = x.detach().double().requires_grad_()
    wr = w.detach().double().requires_grad_()
    ref = short_conv_silu_reference(xr, wr, cu_t)  # [B, T, S*C]
    ref_s = ref.reshape(B, T, S, C).permute(2, 0, 1, 3)
    do = torch.randn_like(ref_s)
    out.backward(do.to(dtype))
    ref_s.backward(do)
    tol = TOL[dtype]
    assert _rel(out, ref_s) < tol
    assert _rel(x.grad, xr.grad) < tol
    assert _rel(w.grad, wr.grad) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows(dtype):
    _check(2, 37, 3, 16, 4, dtype)


@pytest.fixture(params=["fused", "split", "split-half-dz"])
def bwd(request, monkeypatch):
    """The backward kernels: fused, split (default: an fp32 dz scratch, then dx / dw), and split with the
    scratch in x's dtype (K3_CONV_DZ=half)."""
    monkeypatch.setenv("K3_CONV_BWD", request.param.split("-")[0])
    monkeypatch.setenv("K3_CONV_DZ", "half" if request.param.endswith("half-dz") else "fp32")
    return request.param


def test_bf16_packed_documents(bwd):
    """bf16 inputs through every backward (the half-dtype dz scratch only differs from fp32 here): within
    bf16 tolerance of float64, across 64-row block edges."""
    _check(1, 150, 3, 48, 4, torch.bfloat16, cu=[0, 1, 3, 63, 66, 128, 129, 150], sliced=True)


def test_packed_documents_with_short_ones(bwd):
    # documents of length 1 and 2 (< W-1) and one crossing the 32-row block edge
    _check(1, 45, 3, 16, 4, torch.float32, cu=[0, 1, 3, 20, 38, 45])


@pytest.mark.parametrize("W", [2, 3, 4])
def test_backward_block_edges(W, bwd):
    # several 32-row blocks (the backward reads output rows across block edges), documents starting just
    # before / after a block edge, two channel blocks (S*C = 144 > 128), B = 2 without documents
    _check(1, 150, 3, 48, W, torch.float32, cu=[0, 1, 3, 63, 66, 128, 129, 150])
    _check(2, 131, 3, 48, W, torch.float32)


def test_tile_knobs(monkeypatch):
    # other program tiles (bench/short_conv.py --sweep) give the same results; bad values raise
    for k, v in (("FWD_BT", "64"), ("FWD_BC", "16"), ("BWD_BT", "16"), ("BWD_BC", "32"), ("BWD_WARPS", "2")):
        monkeypatch.setenv(f"K3_CONV_{k}", v)
    _check(1, 70, 3, 16, 4, torch.float32, cu=[0, 17, 70])
    monkeypatch.setenv("K3_CONV_FWD_BT", "24")
    with pytest.raises(ValueError, match="power of two"):
        short_conv_silu(torch.randn(1, 8, 12, device=DEV), torch.randn(12, 1, 4, device=DEV))
    monkeypatch.setenv("K3_CONV_FWD_BT", "32")
    monkeypatch.setenv("K3_CONV_BWD", "fast")
    x = torch.randn(1, 8, 12, device=DEV, requires_grad=True)
    with pytest.raises(ValueError, match="K3_CONV_BWD must be"):
        short_conv_silu(x, torch.randn(12, 1, 4, device=DEV)).sum().backward()
    monkeypatch.setenv("K3_CONV_BWD", "split")
    monkeypatch.setenv("K3_CONV_DZ", "bf16")
    with pytest.raises(ValueError, match="K3_CONV_DZ must be"):
        short_conv_silu(x, torch.randn(12, 1, 4, device=DEV)).sum().backward()


def test_sliced_input_and_one_stream():
    _check(1, 40, 1, 48, 3, torch.float32, cu=[0, 13, 40], sliced=True)


@pytest.mark.parametrize("pad", [8, 16, 4])
def test_row_stride_alignment(pad, bwd):
    """Rows a multiple of 8 / 16 / 4 elements apart (k3-small's fused projection: 4,232 = 8 x 529): the
    kernels get the stride as quotient x power-of-two factor; B = 2 so the batch stride is used too."""
    from k3.ops.short_conv.triton_conv import _strides

    full = torch.zeros(2, 5, 3 * 16 + pad)
    st = _strides(full[..., :48])
    assert st["VT"] * st["sxt_v"] == 48 + pad and (48 + pad) % st["VT"] == 0 and st["VT"] in (4, 8, 16)
    assert st["VB"] * st["sxb_v"] == 5 * (48 + pad)
    _check(2, 70, 3, 16, 4, torch.bfloat16, sliced=True, pad=pad, at=0)
    _check(1, 70, 3, 16, 4, torch.float32, cu=[0, 17, 70], sliced=True, pad=pad, at=0)


def test_document_starts():
    cu = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    assert document_starts(cu, 5).tolist() == [0, 0, 2, 2, 2]


def test_matches_the_model_conv():
    from k3.model.cache import SeqLayout
    from k3.model.kda import conv_silu_streams

    torch.manual_seed(1)
    cu = torch.tensor([0, 7, 30, 41], dtype=torch.int32)
    x = torch.randn(1, 41, 3 * 32)
    w = torch.randn(3 * 32, 1, 4)
    ref = conv_silu_streams(x, w, SeqLayout.build(1, 41, cu, None, x.device), 3)
    out = short_conv_silu(x.to(DEV), w.to(DEV), streams=3, cu_seqlens=cu.to(DEV))
    assert _rel(out.cpu(), ref) < 1e-6


def test_bad_input():
    x = torch.randn(1, 8, 12)
    with pytest.raises(ValueError, match="streams"):
        short_conv_silu(x, torch.randn(12, 1, 4), streams=5)
    with pytest.raises(ValueError, match="channels"):
        short_conv_silu(x, torch.randn(10, 1, 4))
    with pytest.raises(ValueError, match="B = 1"):
        short_conv_silu(torch.randn(2, 8, 12), torch.randn(12, 1, 4), cu_seqlens=torch.tensor([0, 8]))


@pytest.mark.gpu
def test_gpu_large_bf16(bwd):
    _check(1, 4096, 3, 1024, 4, torch.bfloat16, cu=[0, 1000, 1001, 3000, 4096], sliced=True)
    # k3-small's layout: q|k|v leading a 4,232-wide fused projection (rows 16-byte aligned, VT = 8)
    _check(1, 4096, 3, 1024, 4, torch.bfloat16, cu=[0, 1000, 1001, 3000, 4096], sliced=True, pad=1160, at=0)
