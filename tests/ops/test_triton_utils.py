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


def test_env_int_knobs(monkeypatch):
    """Integer kernel knobs (tiles, warps, pipeline depths): unset -> the default; a non-integer, a value
    below 1 or (for tiles) not a power of two raises, naming the variable."""
    from k3.ops.backend import env_int, env_tile

    monkeypatch.delenv("K3_TEST_KNOB", raising=False)
    assert env_int("K3_TEST_KNOB", 7) == 7
    monkeypatch.setenv("K3_TEST_KNOB", "3")
    assert env_int("K3_TEST_KNOB", 7) == 3
    with pytest.raises(ValueError, match="K3_TEST_KNOB must be a positive power of two, got 3"):
        env_int("K3_TEST_KNOB", 4, pow2=True)
    for bad, msg in (("x2", "must be an integer"), ("0", "must be a positive integer"), ("-4", "must be a positive integer")):
        monkeypatch.setenv("K3_TEST_KNOB", bad)
        with pytest.raises(ValueError, match=f"K3_TEST_KNOB {msg}"):
            env_int("K3_TEST_KNOB", 4)
    monkeypatch.setenv("K3_TEST_BM", "6")
    with pytest.raises(ValueError, match="K3_TEST_BM must be a positive power of two"):
        env_tile("K3_TEST", ("BM", "BD"), (2, 1024))
    monkeypatch.setenv("K3_KDA_STAGES", "two")
    from k3.ops.kda.chunk import _stages

    with pytest.raises(ValueError, match="K3_KDA_STAGES must be an integer"):
        _stages()


def test_env_int_opt_knobs(monkeypatch):
    """Optional integer knobs (KDA value blocks, register caps): unset or empty -> None; else env_int's strict
    parse; the KDA value-block choice honours and checks it."""
    from k3.ops.backend import env_int_opt
    from k3.ops.kda.chunk import _state_bv

    monkeypatch.delenv("K3_TEST_KNOB", raising=False)
    assert env_int_opt("K3_TEST_KNOB") is None
    monkeypatch.setenv("K3_TEST_KNOB", "")
    assert env_int_opt("K3_TEST_KNOB") is None
    monkeypatch.setenv("K3_TEST_KNOB", "168")
    assert env_int_opt("K3_TEST_KNOB") == 168
    with pytest.raises(ValueError, match="K3_TEST_KNOB must be a positive power of two, got 168"):
        env_int_opt("K3_TEST_KNOB", pow2=True)
    monkeypatch.setenv("K3_KDA_BV", "32")
    assert _state_bv(128, 1) == 32 and _state_bv(16, 1) == 16
    monkeypatch.setenv("K3_KDA_BV", "48")
    with pytest.raises(ValueError, match="K3_KDA_BV must be a positive power of two"):
        _state_bv(128, 1)
