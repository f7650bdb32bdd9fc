"""The one-pass Gluon KDA forward (k3/ops/kda/gluon_fwd.py) against the float64 token recurrence.

CPU (CI): the selection contract only — KernelConfig.kda_fwd values, "auto" / "triton" run the Triton
kernels under the interpreter, "gluon" raises where it cannot run.  GPU (`-m gpu`, an sm_90 device with
Triton 3.6): outputs and final states on awkward shapes (T not a multiple of 64, varlen with an empty
sequence, in-kernel gate, K 64 / V 32, fp16), bf16 / fp16 tolerances as tests/ops/test_kda_triton.py,
and never worse than 1.5x the Triton forward's error on the same inputs.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from k3.kernel_config import KDA_FWD_CHOICES, KernelConfig  # noqa: E402
from k3.ops.kda import kda_gate, l2norm  # noqa: E402
from k3.ops.kda.chunk import chunk_kda  # noqa: E402
from k3.ops.kda.reference import kda_reference  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
F64 = torch.float64
TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}  # relative Frobenius error vs float64 (test_kda_triton)
STATE_TOL = {torch.bfloat16: 1e-2, torch.float16: 5e-3}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all(), "non-finite values"
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _inputs(T, H, K, V, dtype, *, gate, l2, bsig, N, B=1):
    mk = lambda *s: torch.randn(*s, device=DEV, dtype=dtype)  # noqa: E731
    q, k, v = mk(B, T, H, K), mk(B, T, H, K), mk(B, T, H, V)
    if not l2:
        q, k = l2norm(q.float()).to(dtype), l2norm(k.float()).to(dtype)
    x = dict(q=q, k=k, v=v, h0=torch.randn(N, H, K, V, device=DEV) * 0.1)
    if gate:
        x.update(g=mk(B, T, H, K), A_log=torch.randn(H, device=DEV) * 0.5, dt_bias=torch.randn(H * K, device=DEV) * 0.5)
    else:
        x["g"] = torch.nn.functional.logsigmoid(torch.randn(B, T, H, K, device=DEV)).clamp_min(-5.0).to(dtype)
    x["beta"] = mk(B, T, H) if bsig else torch.rand(B, T, H, device=DEV, dtype=dtype)
    return x


def _run(x, impl, *, l2, bsig, cu=None):
    with torch.no_grad():
        return chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"], output_final_state=True,
                         cu_seqlens=cu, A_log=x.get("A_log"), dt_bias=x.get("dt_bias"), lower_bound=-5.0,
                         use_qk_l2norm_in_kernel=l2, use_beta_sigmoid_in_kernel=bsig, fwd_impl=impl)


def _reference(x, *, l2, bsig, cu=None):
    d = {n: t.to(F64) for n, t in x.items()}
    g = kda_gate(d["g"], d["A_log"], d["dt_bias"], -5.0).to(F64) if "A_log" in x else d["g"]
    q, k = (l2norm(d["q"]), l2norm(d["k"])) if l2 else (d["q"], d["k"])
    beta = torch.sigmoid(d["beta"]) if bsig else d["beta"]
    return kda_reference(q, k, d["v"], g, beta, initial_state=d["h0"], output_final_state=True, cu_seqlens=cu,
                         dtype=F64)


def _check(x, *, l2, bsig, cu=None):
    dt = x["q"].dtype
    ro, rs = _reference(x, l2=l2, bsig=bsig, cu=cu)
    go, gs = _run(x, "gluon", l2=l2, bsig=bsig, cu=cu)
    to, ts = _run(x, "triton", l2=l2, bsig=bsig, cu=cu)
    assert go.dtype == x["v"].dtype and go.shape == x["v"].shape and gs.dtype == torch.float32
    errs = {"o": _rel(go, ro), "state": _rel(gs, rs), "o triton": _rel(to, ro), "state triton": _rel(ts, rs)}
    print(f"{dt} T{x['q'].shape[1]} H{x['q'].shape[2]} K{x['q'].shape[3]} V{x['v'].shape[3]}: "
          + ", ".join(f"{n} {e:.2e}" for n, e in errs.items()))
    assert errs["o"] < TOL[dt] and errs["state"] < STATE_TOL[dt], errs
    assert errs["o"] < 1.5 * errs["o triton"] + 1e-4 and errs["state"] < 1.5 * errs["state triton"] + 1e-5, errs
    ao, as_ = _run(x, "auto", l2=l2, bsig=bsig, cu=cu)  # auto keeps the (faster) Triton forward
    assert torch.equal(ao, to) and torch.equal(as_, ts)


# ---- CPU: the selection contract ------------------------------------------------------------------

def test_kernel_config_kda_fwd_values():
    assert KernelConfig().kda_fwd == "auto" and KDA_FWD_CHOICES == ("auto", "gluon", "triton")
    assert KernelConfig.from_dict({"kda_fwd": "gluon"}).kda_fwd == "gluon"
    with pytest.raises(ValueError, match="kernels.kda_fwd='torch'"):
        KernelConfig(kda_fwd="torch")


def test_fwd_impl_selection_without_gluon():
    """Without an sm_90 Gluon device (here: CPU under the interpreter) "auto" and "triton" give the Triton
    result, "gluon" raises naming the reason, and an unknown value raises."""
    x = _inputs(20, 1, 16, 16, torch.bfloat16, gate=False, l2=True, bsig=False, N=1)
    with pytest.raises(ValueError, match="fwd_impl must be one of"):
        _run(x, "fast", l2=True, bsig=False)
    if DEV == "cpu":  # on a GPU the -m gpu tests below cover the selection
        a, sa = _run(x, "auto", l2=True, bsig=False)
        t, st = _run(x, "triton", l2=True, bsig=False)
        assert torch.equal(a, t) and torch.equal(sa, st)
        with pytest.raises(ValueError, match="fwd_impl='gluon' cannot run"):  # K 16 and no sm_90 anyway
            _run(x, "gluon", l2=True, bsig=False)


def test_gluon_refuses_gradients():
    x = _inputs(20, 1, 16, 16, torch.bfloat16, gate=False, l2=True, bsig=False, N=1)
    q = x["q"].clone().requires_grad_()
    with pytest.raises(ValueError, match="gradients need"):
        chunk_kda(q, x["k"], x["v"], x["g"], x["beta"], lower_bound=-5.0, fwd_impl="gluon")


# ---- GPU: numerics against float64 ----------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_gluon_bf16_fixed_length():
    # B2 T333: five full chunks and a partial one per sequence; pre-gated g, L2 in kernel; 8 programs
    x = _inputs(333, 4, 128, 128, torch.bfloat16, gate=False, l2=True, bsig=False, N=2, B=2)
    _check(x, l2=True, bsig=False)


@pytest.mark.gpu
def test_gpu_gluon_bf16_varlen_gate():
    # packed documents with an empty one and lengths around chunk edges; in-kernel gate, sigmoid beta
    cu = torch.tensor([0, 100, 100, 164, 421, 1000], device=DEV, dtype=torch.int32)
    x = _inputs(1000, 3, 128, 64, torch.bfloat16, gate=True, l2=True, bsig=True, N=5)
    _check(x, l2=True, bsig=True, cu=cu)


@pytest.mark.gpu
def test_gpu_gluon_fp16_small_heads():
    # K 64, V 32, pre-normalised q / k (no L2 in kernel), fp16
    cu = torch.tensor([0, 63, 65, 300], device=DEV, dtype=torch.int32)
    x = _inputs(300, 2, 64, 32, torch.float16, gate=False, l2=False, bsig=False, N=3)
    _check(x, l2=False, bsig=False, cu=cu)


@pytest.mark.gpu
def test_gpu_gluon_pinned_bound():
    # the decay at the bound over whole chunks (G spans 320 nats per chunk): the factorised products
    x = _inputs(256, 2, 128, 128, torch.bfloat16, gate=False, l2=True, bsig=False, N=1)
    x["g"].fill_(-5.0)
    _check(x, l2=True, bsig=False)


@pytest.mark.gpu
def test_gpu_gluon_few_heads_value_blocks():
    # N * H = 2: two value blocks of 64 per (sequence, head)
    x = _inputs(200, 1, 128, 128, torch.bfloat16, gate=False, l2=True, bsig=False, N=2, B=2)
    _check(x, l2=True, bsig=False)
