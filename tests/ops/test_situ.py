"""SiTU-GLU Triton kernels against the spec's torch maths (float64 and the model's fp32 -> bf16).

Without CUDA the kernels run under TRITON_INTERPRET=1 on small shapes (CI); on a GPU the same tests
plus a large bf16 case marked `gpu` (the hardware exponential and reciprocal are approximations: the
fp32 tolerances below hold for them).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from k3.ops.situ import situ_glu  # noqa: E402
from k3.ops.situ.reference import situ_glu_reference  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BETA, BETA_LIN = 4.0, 25.0
# fp32 outputs: a few fp32 ulps of the float64 value; gradients: of their largest magnitude
RTOL_FP32, GTOL_FP32 = 2e-6, 2e-6


def _pair(ab: torch.Tensor):
    """(kernel output, gradient) and the float64 reference's, for a random output gradient."""
    ab = ab.detach().requires_grad_()
    h = situ_glu(ab, BETA, BETA_LIN)
    ref_in = ab.detach().double().requires_grad_()
    ref = situ_glu_reference(*ref_in.chunk(2, dim=-1), BETA, BETA_LIN)
    go = torch.randn(ref.shape, dtype=torch.float64, device=ab.device, generator=None)
    h.backward(go.to(h.dtype))
    ref.backward(go)
    return h, ab.grad, ref, ref_in.grad


def _inputs(shape, dtype, scale=3.0, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(DEV, dtype)


@pytest.mark.parametrize("shape", [(37, 600), (2, 5, 64), (16, 1024), (1, 2)])
def test_fp32_against_float64(shape):
    torch.manual_seed(0)
    h, g, ref, gref = _pair(_inputs(shape, torch.float32))
    assert h.shape == (*shape[:-1], shape[-1] // 2) and g.shape == shape
    err = (h.double() - ref).abs()
    assert (err <= RTOL_FP32 * ref.abs() + 1e-30).all() or err.max() <= 1e-6 * ref.abs().max()
    assert (g.double() - gref).abs().max() <= GTOL_FP32 * gref.abs().max()


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # exp2 -> inf is the saturated branch
def test_extreme_values_and_both_tanh_branches():
    """Zeros, tiny, branch-edge (|x| = 0.625 beta) and saturated arguments: finite and accurate."""
    vals = torch.tensor([0.0, -0.0, 1e-30, -1e-8, 1e-3, 2.4999, 2.5, 2.5001, -2.5, 15.6, 15.7, 40.0, -40.0,
                         88.0, -88.0, 1e4, -1e4, 3e38, -3e38])
    a, b = torch.meshgrid(vals, vals * 6.25, indexing="ij")  # b / 25 crosses 0.625 at 15.625
    ab = torch.cat([a.reshape(-1, 1), b.reshape(-1, 1)], dim=1).to(DEV)
    torch.manual_seed(0)
    h, g, ref, gref = _pair(ab)
    assert torch.isfinite(h).all() and torch.isfinite(g).all()
    assert (h.double() - ref).abs().max() <= RTOL_FP32 * ref.abs().max()
    assert ((g.double() - gref).abs() <= GTOL_FP32 * gref.abs().max() + 1e-6 * gref.abs()).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_outputs_match_the_model_maths(dtype):
    """The fp32 maths cast once: equal to the torch path except within a few fp32 ulps of a rounding
    boundary (at most one unit in the last place, and rarely)."""
    ab = _inputs((64, 2 * 320), dtype)
    h = situ_glu(ab, BETA, BETA_LIN)
    ref = situ_glu_reference(*ab.chunk(2, dim=-1), BETA, BETA_LIN)
    assert h.dtype == dtype
    diff = (h.float() - ref.float()).abs()
    ulp = torch.finfo(dtype).eps * ref.float().abs().clamp_min(torch.finfo(dtype).tiny)
    assert (diff <= ulp).all()
    assert (diff > 0).float().mean() < 5e-3  # a truncating cast would differ in about half of them


def test_strided_rows_and_packed_gradient_layout():
    """ab as a column slice of a wider GEMM output (strided rows); the gradient comes back [M, 2I]."""
    full = _inputs((33, 2 * 96 + 10), torch.float32)
    ab = full[:, 4: 4 + 2 * 96]
    assert not ab.is_contiguous()
    torch.manual_seed(0)
    h, g, ref, gref = _pair(ab)
    assert (h.double() - ref).abs().max() <= 1e-6 * ref.abs().max()
    assert (g.double() - gref).abs().max() <= GTOL_FP32 * gref.abs().max()


def test_matches_the_model_glu():
    """Same values as the model's eager SiTU-GLU (k3.model.fused) in fp32, to fp32 accuracy."""
    from k3.model.fused import EAGER

    ab = _inputs((20, 2 * 48), torch.float32)
    model = EAGER.glu_packed(ab, "situ", BETA, BETA_LIN)
    torch.testing.assert_close(situ_glu(ab, BETA, BETA_LIN), model, rtol=4e-6, atol=1e-6)


def test_bad_input():
    x = torch.zeros(4, 6, device=DEV)
    with pytest.raises(ValueError, match=r"\[\.\.\., 2I\]"):
        situ_glu(torch.zeros(4, 5, device=DEV), BETA, BETA_LIN)
    with pytest.raises(ValueError, match="float64"):
        situ_glu(x.double(), BETA, BETA_LIN)
    with pytest.raises(ValueError, match="positive"):
        situ_glu(x, 0.0, BETA_LIN)


@pytest.mark.gpu
def test_gpu_large_bf16():
    """k3-small's routed experts at 8K tokens x top-8: [65536, 1024] bf16."""
    ab = _inputs((65536, 1024), torch.bfloat16, seed=1)
    torch.manual_seed(0)
    h, g, ref, gref = _pair(ab)
    ref16 = situ_glu_reference(*ab.chunk(2, dim=-1), BETA, BETA_LIN)
    ulp = torch.finfo(torch.bfloat16).eps * ref16.float().abs().clamp_min(1e-30)
    assert ((h.float() - ref16.float()).abs() <= ulp).all()
    assert (h.double() - ref).abs().max() <= 2 ** -8 * ref.abs().max()
    assert (g.double() - gref).abs().max() <= 2 ** -7 * gref.abs().max()
