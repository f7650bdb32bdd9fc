"""Block-AttnRes aggregation Triton kernels against the spec's loops (float64) and the model's maths.

Without CUDA the kernels run under TRITON_INTERPRET=1 on small shapes (CI); on a GPU the same tests plus
a large bf16 case marked `gpu`.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from k3.ops.attn_res import MAX_CANDIDATES, attn_res_mix  # noqa: E402
from k3.ops.attn_res.reference import attn_res_reference  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# (output, gradient) tolerance relative to the largest reference magnitude
TOL = {torch.float32: (2e-6, 5e-6), torch.bfloat16: (2 ** -7, 2 ** -6)}


def _case(n, shape, dtypes, seed=0, sharp=0.3):
    g = torch.Generator().manual_seed(seed)
    cands = [(torch.randn(shape, generator=g) * (1 + i)).to(DEV, dtypes[i % len(dtypes)]) for i in range(n)]
    w_norm = (torch.rand(shape[-1], generator=g) + 0.5).to(DEV)
    w_proj = (torch.randn(1, shape[-1], generator=g) * sharp).to(DEV)
    return cands, w_norm, w_proj


def _compare(cands, w_norm, w_proj, tol, eps=1e-5, w_atol=0.0):
    """Output and every gradient vs float64; w_atol: an absolute floor for the w_norm / w_proj gradients
    (nearly one-hot weights make them sums of cancelling terms, ~1e-10 in float64)."""
    leaves = [t.detach().requires_grad_() for t in (*cands, w_norm, w_proj)]
    out = attn_res_mix(leaves[:-2], leaves[-2], leaves[-1], eps)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref = attn_res_reference(ref_leaves[:-2], ref_leaves[-2], ref_leaves[-1], eps)
    go = torch.randn(ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).to(DEV)
    out.backward(go.to(out.dtype))
    ref.backward(go)
    assert out.dtype == cands[-1].dtype and out.shape == cands[-1].shape
    ftol, gtol = tol
    assert (out.double() - ref).abs().max() <= ftol * ref.abs().max()
    for k, (leaf, r) in enumerate(zip(leaves, ref_leaves)):
        assert leaf.grad.dtype == leaf.dtype and leaf.grad.shape == leaf.shape
        floor = w_atol if k >= len(cands) else 0.0
        assert (leaf.grad.double() - r.grad).abs().max() <= gtol * r.grad.abs().max() + floor


@pytest.mark.parametrize("n", [2, 3, 5, MAX_CANDIDATES])
@pytest.mark.parametrize("shape", [(13, 96), (2, 7, 300)])  # rows not a multiple of the block, d of the chunk
def test_fp32_against_float64(n, shape):
    _compare(*_case(n, shape, [torch.float32]), TOL[torch.float32])


def test_bf16_and_mixed_dtypes():
    """bf16 streams, and an fp32 first candidate beside bf16 ones (`K3Model.fp32_embeddings`)."""
    _compare(*_case(4, (33, 128), [torch.bfloat16]), TOL[torch.bfloat16])
    _compare(*_case(3, (9, 64), [torch.float32, torch.bfloat16, torch.bfloat16]), TOL[torch.bfloat16])


def test_sharp_softmax_and_zero_rows():
    """Large logits (nearly one-hot weights) and an all-zero candidate row (RMS from eps alone)."""
    cands, w_norm, w_proj = _case(3, (10, 64), [torch.float32], sharp=30.0)
    cands[1][4] = 0.0
    _compare(cands, w_norm, w_proj, (1e-5, 5e-5), w_atol=1e-6)


def test_matches_the_model_mix():
    """Same values as the model's eager AttnRes region (k3.model.fused) in fp32."""
    from k3.model.fused import EAGER

    cands, w_norm, w_proj = _case(4, (3, 5, 64), [torch.float32])
    torch.testing.assert_close(attn_res_mix(cands, w_norm, w_proj, 1e-5),
                               EAGER.attn_res(cands, w_norm, w_proj, 1e-5), rtol=2e-6, atol=2e-6)


def test_bad_input():
    cands, w_norm, w_proj = _case(3, (4, 32), [torch.float32])
    with pytest.raises(ValueError, match="candidates"):
        attn_res_mix(cands[:1], w_norm, w_proj, 1e-5)
    with pytest.raises(ValueError, match="candidates"):
        attn_res_mix(cands * 4, w_norm, w_proj, 1e-5)
    with pytest.raises(ValueError, match="one shape"):
        attn_res_mix([cands[0], cands[1][:2]], w_norm, w_proj, 1e-5)
    with pytest.raises(ValueError, match="32 elements"):
        attn_res_mix(cands, w_norm[:5], w_proj, 1e-5)
    with pytest.raises(ValueError, match="fp32"):
        attn_res_mix([c.double() for c in cands], w_norm, w_proj, 1e-5)


@pytest.mark.gpu
def test_gpu_large_bf16():
    """k3-small's widest mix at 64K tokens: 4 candidates [65536, 1024] bf16."""
    _compare(*_case(4, (65536, 1024), [torch.bfloat16], seed=2), TOL[torch.bfloat16])
