"""MLA key / value expansion kernels (k3.ops.mla_kv) against the spec's split / expand / cat.

Without CUDA the kernels run under TRITON_INTERPRET=1 on small shapes (CI); on a GPU the same tests plus
a k3-small-sized bf16 case marked `gpu`.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from k3.ops.mla_kv import mla_expand_kv, mla_kv_reference  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _run(B, T, H, nope, v_dim, rope, dtype, grads=("k", "v"), strided=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(B, T, H * (nope + v_dim) + (7 if strided else 0), generator=g).to(DEV, dtype)
    kv = wide[..., :H * (nope + v_dim)] if strided else wide  # a slice of wider rows, as a fused GEMM's output
    k_pe = torch.randn(B, T, rope, generator=g).to(DEV, dtype)
    gk = torch.randn(B, T, H, nope + rope, generator=g).to(DEV, dtype)
    gv = torch.randn(B, T, H, v_dim, generator=g).to(DEV, dtype)
    if strided:  # gradients laid out [B, H, T, D] underneath, as attention kernels may return them
        gk = gk.transpose(1, 2).contiguous().transpose(1, 2)
        gv = gv.transpose(1, 2).contiguous().transpose(1, 2)
    outs = []
    for fn in (mla_expand_kv, None):
        a, b = kv.detach().clone().requires_grad_(), k_pe.detach().clone().requires_grad_()
        if fn is None:  # the spec, in float64
            k, v = mla_kv_reference(a.double(), b.double(), H, nope, v_dim)
        else:
            k, v = fn(a, b, num_heads=H, nope=nope, v_dim=v_dim)
        loss = 0
        if "k" in grads:
            loss = loss + (k.double() * gk.double()).sum()
        if "v" in grads:
            loss = loss + (v.double() * gv.double()).sum()
        loss.backward()
        outs.append((k, v, a.grad, b.grad))
    return outs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dims", [(2, 37, 3, 16, 8, 8), (1, 50, 2, 12, 20, 6)])  # T not a multiple of the tile; odd widths
def test_expand_matches_spec(dtype, dims):
    B, T, H, nope, v_dim, rope = dims
    (k, v, gkv, gpe), (rk, rv, rgkv, rgpe) = _run(B, T, H, nope, v_dim, rope, dtype, strided=dims[0] == 1)
    assert k.is_contiguous() and k.dtype == dtype and v.dtype == dtype
    assert torch.equal(k.double(), rk) and torch.equal(v.double(), rv)  # pure data movement: exact
    assert torch.equal(gkv.double(), rgkv.to(dtype).double())  # copies of the gradients: exact
    tol = 1e-6 if dtype == torch.float32 else 2 ** -7  # the k_pe gradient is a sum over heads, rounded once
    assert (gpe.double() - rgpe).abs().max() <= tol * rgpe.abs().max()


@pytest.mark.parametrize("grads", [("k",), ("v",)])
def test_unused_output_gradient_is_zero(grads):
    (k, v, gkv, gpe), (_, _, rgkv, rgpe) = _run(2, 21, 2, 8, 8, 4, torch.float32, grads=grads)
    if rgpe is None:  # only v used: the spec's k_pe gets no gradient, the kernel's is zeros
        rgpe = torch.zeros_like(gpe, dtype=torch.float64)
    assert torch.equal(gkv, rgkv) and torch.allclose(gpe.double(), rgpe.double(), rtol=1e-6, atol=1e-6)


def test_bad_shapes_raise():
    kv = torch.zeros(1, 4, 2 * (8 + 8), device=DEV)
    with pytest.raises(ValueError, match="num_heads"):
        mla_expand_kv(kv, torch.zeros(1, 4, 4, device=DEV), num_heads=3, nope=8, v_dim=8)
    with pytest.raises(ValueError, match="k_pe"):
        mla_expand_kv(kv, torch.zeros(1, 5, 4, device=DEV), num_heads=2, nope=8, v_dim=8)
    with pytest.raises(ValueError, match="dtype"):
        mla_expand_kv(kv, torch.zeros(1, 4, 4, device=DEV, dtype=torch.float64), num_heads=2, nope=8, v_dim=8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_k3_small_bf16():
    """k3-small's MLA: 8 heads, nope 128, v 128, rope 64, a 16K-token micro-batch slice, bf16."""
    (k, v, gkv, gpe), (rk, rv, rgkv, rgpe) = _run(2, 8192, 8, 128, 128, 64, torch.bfloat16, strided=True)
    assert torch.equal(k.double(), rk) and torch.equal(gkv.double(), rgkv.to(torch.bfloat16).double())
    assert (gpe.double() - rgpe).abs().max() <= 2 ** -7 * rgpe.abs().max()
