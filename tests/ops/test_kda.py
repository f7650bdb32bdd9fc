"""KDA: chunked PyTorch backend vs the per-token reference, dispatcher, fused prologue, gate."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3.ops.kda import kda, kda_gate, kda_reference
from k3.ops.kda.chunk_torch import chunk_kda_torch

F64 = torch.float64


def make_inputs(B, T, H, K, V, *, dtype=F64, g_low=-5.0, N=None, seed=0):
    """q, k (L2-normalised), v, g in (g_low, 0), beta in (0, 1), initial state [N, H, K, V]."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=F64), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=F64), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen, dtype=F64)
    g = g_low * torch.rand(B, T, H, K, generator=gen, dtype=F64)
    beta = torch.rand(B, T, H, generator=gen, dtype=F64)
    s0 = torch.randn(N or B, H, K, V, generator=gen, dtype=F64)
    return [x.to(dtype) for x in (q, k, v, g, beta)] + [s0]


def run_with_grads(fn, inputs, **kw):
    """Outputs, final state and gradients of (q, k, v, g, beta, initial_state) under a fixed
    random linear loss on both outputs."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    o, s = fn(*leaves[:5], initial_state=leaves[5], output_final_state=True, **kw)
    gen = torch.Generator().manual_seed(123)
    wo = torch.randn(o.shape, generator=gen, dtype=F64)
    ws = torch.randn(s.shape, generator=gen, dtype=F64)
    ((o.to(F64) * wo).sum() + (s.to(F64) * ws).sum()).backward()
    return o.detach(), s.detach(), [x.grad for x in leaves]


def reference(*args, **kw):
    return kda_reference(*args, dtype=F64, **kw)


def assert_close_all(a, b, atol, rtol=0.0, names=("o", "final_state")):
    """Compare (o, state, grads) triples; tolerances are relative to each tensor's scale."""
    (oa, sa, ga), (ob, sb, gb) = a, b
    pairs = [(oa, ob, "o"), (sa, sb, "final_state")]
    pairs += [(x, y, f"grad_{n}") for x, y, n in zip(ga, gb, ("q", "k", "v", "g", "beta", "initial_state"))]
    for x, y, name in pairs:
        x, y = x.to(F64), y.to(F64)
        scale = max(1.0, y.abs().max().item())
        err = (x - y).abs().max().item() / scale
        assert err <= atol, f"{name}: max error {err:.3e} (relative to scale {scale:.2f}) > {atol:.1e}"
        assert torch.isfinite(x).all(), name


# ---------------------------------------------------------------- reference vs chunked (fp64)

@pytest.mark.parametrize("T", [1, 63, 64, 65, 200])
def test_chunked_matches_reference_fp64(T):
    inputs = make_inputs(2, T, 2, 8, 6, seed=T)
    ref = run_with_grads(reference, inputs)
    assert_close_all(run_with_grads(chunk_kda_torch, inputs), ref, atol=1e-11)


@pytest.mark.parametrize("chunk_size", [32, 64, 128])
def test_chunk_size_does_not_change_results(chunk_size):
    inputs = make_inputs(2, 97, 2, 8, 6, seed=1)
    ref = run_with_grads(reference, inputs)
    assert_close_all(run_with_grads(chunk_kda_torch, inputs, chunk_size=chunk_size), ref, atol=1e-11)


@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("g_low", [0.0, -0.01, -60.0, -300.0])
def test_extreme_gates_fp64(g_low, chunk_size):
    """g = 0 (no decay), very slow decay, and gates far below K3's -5 bound (which switch the
    diagonal blocks to the exact per-channel path): still equal to the reference."""
    inputs = make_inputs(1, 80, 2, 8, 5, g_low=g_low, seed=3)
    ref = run_with_grads(reference, inputs)
    assert_close_all(run_with_grads(chunk_kda_torch, inputs, chunk_size=chunk_size), ref, atol=1e-11)


CU_CASES = [[0, 1, 1, 64, 129, 200], [0, 200], [0, 1], [0, 0, 65, 65]]


@pytest.mark.parametrize("cu", CU_CASES, ids=lambda c: "-".join(map(str, c)))
def test_varlen_matches_reference_fp64(cu):
    cu_seqlens = torch.tensor(cu, dtype=torch.int32)
    inputs = make_inputs(1, cu[-1], 2, 4, 10, N=len(cu) - 1, seed=len(cu))
    ref = run_with_grads(reference, inputs, cu_seqlens=cu_seqlens)
    assert_close_all(run_with_grads(chunk_kda_torch, inputs, cu_seqlens=cu_seqlens), ref, atol=1e-11)


def test_varlen_equals_each_sequence_alone():
    cu = [0, 17, 17, 100, 230]
    q, k, v, g, beta, s0 = make_inputs(1, cu[-1], 2, 8, 8, N=4, seed=7)
    o, s = chunk_kda_torch(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                           cu_seqlens=torch.tensor(cu))
    for n, (a, b) in enumerate(zip(cu, cu[1:])):
        on, sn = chunk_kda_torch(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b],
                                 initial_state=s0[n:n + 1], output_final_state=True)
        torch.testing.assert_close(o[:, a:b], on, atol=1e-12, rtol=0)
        torch.testing.assert_close(s[n:n + 1], sn, atol=1e-12, rtol=0)


def test_no_initial_state_and_no_final_state():
    q, k, v, g, beta, _ = make_inputs(3, 70, 2, 8, 4, seed=5)
    o, s = chunk_kda_torch(q, k, v, g, beta)
    assert s is None
    o_ref, _ = reference(q, k, v, g, beta)
    torch.testing.assert_close(o, o_ref, atol=1e-12, rtol=0)


def test_custom_scale():
    q, k, v, g, beta, s0 = make_inputs(1, 40, 1, 8, 8, seed=6)
    o, _ = chunk_kda_torch(q, k, v, g, beta, scale=0.7, initial_state=s0)
    o_ref, _ = reference(q, k, v, g, beta, scale=0.7, initial_state=s0)
    torch.testing.assert_close(o, o_ref, atol=1e-12, rtol=0)


# ---------------------------------------------------------------- lower precision vs fp64 reference

# Tolerances are max |error| / max(1, max |reference|) per tensor. Measured: fp32 <= 7e-6,
# bf16 <= 3e-3. bf16 rounding of the inputs is excluded by feeding the reference the same
# rounded values; what remains is fp32 compute plus bf16 rounding of o and the gradients.
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 3e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("cu", [None, [0, 50, 51, 190]])
def test_low_precision_vs_fp64_reference(dtype, atol, cu):
    cu_seqlens = None if cu is None else torch.tensor(cu)
    B, T = (2, 190) if cu is None else (1, 190)
    inputs = make_inputs(B, T, 2, 16, 16, dtype=dtype, N=None if cu is None else 3, seed=11)
    inputs[5] = inputs[5].float()  # states are fp32 whatever the input dtype
    o, s, grads = run_with_grads(chunk_kda_torch, inputs, cu_seqlens=cu_seqlens)
    assert o.dtype == dtype and s.dtype == torch.float32
    assert all(gr.dtype == x.dtype for gr, x in zip(grads, inputs))
    ref = run_with_grads(reference, [x.to(F64) for x in inputs], cu_seqlens=cu_seqlens)
    assert_close_all((o, s, grads), ref, atol=atol)


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_steep_gates_fp32(chunk_size):
    """Gates below K3's bound (down to -20) take the exact diagonal path in fp32 too."""
    inputs = make_inputs(1, 100, 2, 8, 8, dtype=torch.float32, g_low=-20.0, seed=12)
    inputs[5] = inputs[5].float()
    ref = run_with_grads(reference, [x.to(F64) for x in inputs])
    assert_close_all(run_with_grads(chunk_kda_torch, inputs, chunk_size=chunk_size), ref, atol=3e-5)


def test_gate_pinned_at_lower_bound_long_sequence():
    """g == -5 everywhere for T = 4096 (fp32): finite outputs, state and gradients, and equal to
    the float64 chunked computation (itself checked against the reference above)."""
    inputs = make_inputs(1, 4096, 1, 16, 16, dtype=torch.float32, seed=13)
    inputs[3] = torch.full_like(inputs[3], -5.0)
    inputs[5] = inputs[5].float()
    got = run_with_grads(chunk_kda_torch, inputs)
    want = run_with_grads(chunk_kda_torch, [x.to(F64) for x in inputs])
    assert_close_all(got, want, atol=2e-5)


# ---------------------------------------------------------------- dispatcher

@pytest.mark.parametrize("backend", ["reference", "torch", "auto"])
def test_dispatcher_backends(backend):
    q, k, v, g, beta, s0 = make_inputs(2, 33, 2, 8, 4, dtype=torch.float32, seed=21)
    o, s = kda(q, k, v, g, beta, initial_state=s0.float(), output_final_state=True, backend=backend)
    o_ref, s_ref = kda_reference(q, k, v, g, beta, initial_state=s0, output_final_state=True, dtype=F64)
    assert o.dtype == torch.float32 and s.dtype == torch.float32
    torch.testing.assert_close(o, o_ref.float(), atol=1e-5, rtol=0)
    torch.testing.assert_close(s, s_ref.float(), atol=1e-5, rtol=0)
    assert kda(q, k, v, g, beta, backend=backend)[1] is None


def _bad_calls():
    q, k, v, g, beta, s0 = make_inputs(2, 8, 2, 4, 3, dtype=torch.float32)
    ok = dict(q=q, k=k, v=v, g=g, beta=beta)
    cu = torch.tensor([0, 3, 8])
    one = {n: x[:1] for n, x in ok.items()}
    return [
        ("k", dict(ok, k=k[..., :3]), {}),
        ("v", dict(ok, v=v[:, :5]), {}),
        ("g", dict(ok, g=g[..., :3]), {}),
        ("beta", dict(ok, beta=beta[..., None]), {}),
        ("initial_state", ok, dict(initial_state=s0[:, :, :3])),
        ("cu_seqlens", ok, dict(cu_seqlens=cu)),  # B > 1
        ("cu_seqlens", one, dict(cu_seqlens=torch.tensor([0, 9]))),
        ("cu_seqlens", one, dict(cu_seqlens=torch.tensor([0.0, 8.0]))),
        ("initial_state", one, dict(cu_seqlens=cu, initial_state=s0[:1])),  # N = 2 sequences
        ("backend", ok, dict(backend="cuda")),
        ("dt_bias", ok, dict(dt_bias=torch.zeros(8))),
    ]


@pytest.mark.parametrize("name,args,kw", _bad_calls(), ids=lambda x: x if isinstance(x, str) else "")
def test_dispatcher_rejects_bad_arguments(name, args, kw):
    with pytest.raises(ValueError, match=name):
        kda(args["q"], args["k"], args["v"], args["g"], args["beta"], **{"backend": "torch", **kw})


@pytest.mark.parametrize("name,args,kw", _bad_calls()[:9], ids=lambda x: x if isinstance(x, str) else "")
def test_chunk_kda_torch_rejects_bad_arguments(name, args, kw):
    with pytest.raises(ValueError, match=name):
        chunk_kda_torch(args["q"], args["k"], args["v"], args["g"], args["beta"], **kw)


@pytest.mark.parametrize("chunk_size", [0, 24, 65, 64.0])
def test_chunk_size_validation(chunk_size):
    q, k, v, g, beta, _ = make_inputs(1, 8, 1, 4, 4)
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_kda_torch(q, k, v, g, beta, chunk_size=chunk_size)


# ---------------------------------------------------------------- fused prologue

@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("lower_bound", [-5.0, -1.0, None])
def test_fused_prologue_equals_manual(backend, lower_bound):
    """A_log/dt_bias/lower_bound gate, q/k L2 norm and beta sigmoid inside kda() == doing them
    by hand from their formulas (spec §5.2), fp32."""
    gen = torch.Generator().manual_seed(31)
    B, T, H, K, V = 2, 70, 3, 8, 6
    q, k = (3 * torch.randn(B, T, H, K, generator=gen) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen)
    f = 2 * torch.randn(B, T, H, K, generator=gen)
    b_logit = 2 * torch.randn(B, T, H, generator=gen)
    A_log = torch.randn(H, generator=gen)
    dt_bias = torch.randn(H * K, generator=gen)
    o, s = kda(q, k, v, f, b_logit, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
               use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
               output_final_state=True, backend=backend)
    x = A_log.exp()[:, None] * (f + dt_bias.view(H, K))
    g = -F.softplus(f + dt_bias.view(H, K)) * A_log.exp()[:, None] if lower_bound is None \
        else lower_bound * torch.sigmoid(x)
    qn, kn = (t / torch.sqrt((t * t).sum(-1, keepdim=True) + 1e-6) for t in (q, k))
    o_ref, s_ref = kda_reference(qn, kn, v, g, torch.sigmoid(b_logit), output_final_state=True, dtype=F64)
    torch.testing.assert_close(o, o_ref.float(), atol=2e-5, rtol=0)
    torch.testing.assert_close(s, s_ref.float(), atol=2e-5, rtol=0)


# ---------------------------------------------------------------- gate

def test_gate_stays_inside_bounds():
    """What is true in fp32 for g = L * sigmoid(exp(A_log) * (f + dt_bias)):
    - always L <= g <= 0, no NaN, for any finite or infinite f;
    - strictly L < g < 0 while x = exp(A_log) * (f + dt_bias) is in [-88, 16.5]: fp32 sigmoid
      rounds to exactly 1 from x ~ 16.64 and to exactly 0 below x ~ -88.7, so saturated gates
      sit exactly on the bounds (both are harmless for the recurrence: decay e^L or 1)."""
    H, K = 4, 8
    A_log = torch.tensor([-2.0, 0.0, 1.0, 2.5])
    dt_bias = torch.randn(H * K, generator=torch.Generator().manual_seed(0))
    a = A_log.exp()[:, None]
    for L in (-5.0, -1.0, -1e-3):
        x = torch.linspace(-88.0, 16.5, 4001)[:, None, None].expand(-1, H, K)
        f = x / a - dt_bias.view(H, K)
        g = kda_gate(f, A_log, dt_bias, L)
        inside = (g > L) & (g < 0)
        xs = a * (f + dt_bias.view(H, K))  # recomputed x, as the gate sees it
        assert inside[(xs > -88.0) & (xs < 16.5)].all(), L
        huge = torch.tensor([1e4, -1e4, 1e30, -1e30, float("inf"), -float("inf")])
        g = kda_gate(huge[:, None, None].expand(-1, H, K), A_log, dt_bias, L)
        assert g.dtype == torch.float32 and not g.isnan().any()
        assert ((g >= L) & (g <= 0)).all(), L
        assert (g[0::2] == L).all() and (g[1::2] == 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_gate_random_inputs_in_range_and_fp32(dtype):
    gen = torch.Generator().manual_seed(1)
    f = (20 * torch.randn(64, 3, 16, generator=gen)).to(dtype)
    g = kda_gate(f, torch.randn(3, generator=gen), torch.randn(48, generator=gen), -5.0)
    assert g.dtype == torch.float32
    assert ((g >= -5.0) & (g <= 0)).all()


@pytest.mark.parametrize("lower_bound", [0.0, -5.5, 1.0])
def test_gate_rejects_bad_lower_bound(lower_bound):
    with pytest.raises(ValueError, match="lower_bound"):
        kda_gate(torch.zeros(2, 1, 4), torch.zeros(1), torch.zeros(4), lower_bound)
