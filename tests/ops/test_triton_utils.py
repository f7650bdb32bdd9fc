"""Shared Triton helpers (k3.ops.triton_utils): the deterministic column sum of fp32 partials.

Without CUDA the kernel runs under TRITON_INTERPRET=1 (CI); on a GPU the same tests plus a large case."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from k3.ops.triton_utils import column_sum  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("shape", [(1, 5), (7, 3), (300, 33), (5000, 17), (129, 1030), (0, 4)])
def test_column_sum_matches_float64_and_is_deterministic(shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(DEV)
    y = column_sum(x)
    ref = x.double().sum(0)
    assert y.shape == (shape[1],) and y.dtype == torch.float32
    # fp32 accumulation: error bounded by ~P ulps of the running magnitude
    assert (y.double() - ref).abs().max() <= 1e-6 * max(1, shape[0]) ** 0.5 * (x.abs().max().item() if x.numel() else 1)
    assert torch.equal(column_sum(x), y)  # fixed summation order: same bits every call


def test_column_sum_rejects_other_inputs():
    with pytest.raises(ValueError, match="fp32"):
        column_sum(torch.zeros(4, 3, dtype=torch.float64, device=DEV))
    with pytest.raises(ValueError, match=r"\[P, D\]"):
        column_sum(torch.zeros(4, device=DEV))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_column_sum_large_gpu():
    """AttnRes's partials at k3-small's micro-batch: one [1024] row per 2-row program."""
    x = torch.randn(32768, 1024, device="cuda")
    torch.testing.assert_close(column_sum(x).double(), x.double().sum(0), rtol=0, atol=1e-3)


def test_state_value_block(monkeypatch):
    """The KDA state scans' value block: 64, narrower only when fewer than 64 programs would run; the
    module constant STATE_BV (tests) overrides it."""
    from k3.ops.kda import chunk

    assert chunk._state_bv(128, 64) == 64 and chunk._state_bv(128, 1) == 16 and chunk._state_bv(16, 1) == 16
    monkeypatch.setattr(chunk, "STATE_BV", 32)
    assert chunk._state_bv(128, 1) == 32 and chunk._state_bv(16, 1) == 16
