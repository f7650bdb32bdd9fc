"""KDA context-parallel segment transforms (spec §11): chaining segments == one pass."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3.ops.kda import kda_reference
from k3.ops.kda.chunk_torch import chunk_kda_torch
from k3.ops.kda.cp import (apply_transform, chain_transforms, compose, kda_segment_transform,
                           segment_initial_states)

F64 = torch.float64


def make_inputs(B, T, H, K, V, *, dtype=F64, g_low=-5.0, N=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=F64), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=F64), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen, dtype=F64)
    g = g_low * torch.rand(B, T, H, K, generator=gen, dtype=F64)
    beta = torch.rand(B, T, H, generator=gen, dtype=F64)
    s0 = torch.randn(N or B, H, K, V, generator=gen, dtype=F64)
    return [x.to(dtype) for x in (q, k, v, g, beta)], s0


def one_pass(q, k, v, g, beta, s0):
    return chunk_kda_torch(q, k, v, g, beta, initial_state=s0, output_final_state=True)


def split_pass(q, k, v, g, beta, s0, cuts):
    """Each segment's transform from zero state, prefix-scanned into initial states, then each
    segment run from its own initial state: what ranks of a context-parallel group do."""
    segs = list(zip(cuts, cuts[1:]))
    transforms = [kda_segment_transform(k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b]) for a, b in segs]
    states = segment_initial_states(transforms, s0)
    outs = [chunk_kda_torch(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b],
                            initial_state=s, output_final_state=True) for (a, b), s in zip(segs, states)]
    return torch.cat([o for o, _ in outs], 1), outs[-1][1], transforms, states


def with_grads(fn, tensors, s0, *extra):
    leaves = [x.detach().clone().requires_grad_() for x in (*tensors, s0)]
    o, s = fn(*leaves, *extra)[:2]
    gen = torch.Generator().manual_seed(5)
    loss = (o.to(F64) * torch.randn(o.shape, generator=gen, dtype=F64)).sum()
    loss = loss + (s.to(F64) * torch.randn(s.shape, generator=gen, dtype=F64)).sum()
    loss.backward()
    return [o.detach(), s.detach()] + [x.grad for x in leaves]


NAMES = ("o", "final_state", "grad_q", "grad_k", "grad_v", "grad_g", "grad_beta", "grad_initial_state")


def assert_all_close(got, want, atol):
    for x, y, name in zip(got, want, NAMES):
        assert torch.isfinite(x).all(), name
        scale = max(1.0, y.abs().max().item())
        err = (x.to(F64) - y.to(F64)).abs().max().item() / scale
        assert err <= atol, f"{name}: error {err:.2e} > {atol:.0e}"


@pytest.mark.parametrize("cuts", [[0, 37, 101, 102, 165, 300], [0, 64, 128, 300], [0, 299, 300]])
def test_chained_segments_equal_one_pass_fp64(cuts):
    tensors, s0 = make_inputs(2, 300, 2, 8, 6, seed=len(cuts))
    want = with_grads(one_pass, tensors, s0)
    got = with_grads(split_pass, tensors, s0, cuts)
    assert_all_close(got, want, atol=1e-11)


def test_transform_matches_reference_affine_map():
    """For any S_in, the reference's final state equals M S_in + S_ext, per packed sequence
    (including an empty one, whose transform is the identity)."""
    cu = torch.tensor([0, 45, 45, 130])
    (q, k, v, g, beta), _ = make_inputs(1, 130, 2, 8, 5, seed=9)
    S_ext, M = kda_segment_transform(k, v, g, beta, cu_seqlens=cu)
    assert S_ext.shape == (3, 2, 8, 5) and M.shape == (3, 2, 8, 8) and M.dtype == F64
    torch.testing.assert_close(M[1], torch.eye(8, dtype=F64).expand(2, 8, 8), atol=0, rtol=0)
    for seed in range(2):
        S_in = torch.randn(3, 2, 8, 5, generator=torch.Generator().manual_seed(seed), dtype=F64)
        _, s_ref = kda_reference(q, k, v, g, beta, initial_state=S_in, output_final_state=True,
                                 cu_seqlens=cu, dtype=F64)
        torch.testing.assert_close(apply_transform((S_ext, M), S_in), s_ref, atol=1e-12, rtol=0)


def test_varlen_transform_equals_per_sequence():
    cu = [0, 1, 70, 200]
    (q, k, v, g, beta), _ = make_inputs(1, 200, 2, 8, 8, seed=4)
    S_ext, M = kda_segment_transform(k, v, g, beta, cu_seqlens=torch.tensor(cu, dtype=torch.int32))
    for n, (a, b) in enumerate(zip(cu, cu[1:])):
        Sn, Mn = kda_segment_transform(k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b])
        torch.testing.assert_close(S_ext[n:n + 1], Sn, atol=1e-13, rtol=0)
        torch.testing.assert_close(M[n:n + 1], Mn, atol=1e-13, rtol=0)


def _random_transform(seed, N=2, H=2, K=6, V=4):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(N, H, K, V, generator=gen, dtype=F64), torch.randn(N, H, K, K, generator=gen, dtype=F64) / 2


def test_composition_is_associative():
    a, b, c = (_random_transform(s) for s in range(3))
    left, right = compose(compose(a, b), c), compose(a, compose(b, c))
    for x, y in zip(left, right):
        torch.testing.assert_close(x, y, atol=1e-13, rtol=0)
    S = torch.randn(2, 2, 6, 4, dtype=F64)
    torch.testing.assert_close(apply_transform(left, S),
                               apply_transform(c, apply_transform(b, apply_transform(a, S))))


def test_prefix_scan_matches_whole_segment_transform():
    """chain_transforms over segments == the transform of their concatenation, and the scan's
    S_ext entries are the zero-start initial states of the following segments."""
    (q, k, v, g, beta), _ = make_inputs(2, 250, 2, 8, 6, seed=2)
    cuts = [0, 20, 120, 121, 250]
    parts = [kda_segment_transform(k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b]) for a, b in zip(cuts, cuts[1:])]
    prefix = chain_transforms(parts)
    whole = kda_segment_transform(k, v, g, beta)
    for x, y in zip(prefix[-1], whole):
        torch.testing.assert_close(x, y, atol=1e-12, rtol=0)
    states = segment_initial_states(parts)
    for r in range(1, len(parts)):
        torch.testing.assert_close(states[r], prefix[r - 1][0], atol=1e-12, rtol=0)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 3e-5), (F64, 1e-11)])
def test_gate_pinned_at_lower_bound_long_spans(dtype, atol):
    """g == -5 over 4 segments of 1024 tokens: M underflows towards 0 (true value ~e^-5120),
    which must stay finite; chaining still equals one pass, also in gradients. M is fp32."""
    (q, k, v, g, beta), s0 = make_inputs(1, 4096, 1, 16, 16, dtype=dtype, seed=8)
    g = torch.full_like(g, -5.0)
    tensors = (q, k, v, g, beta)
    cuts = [0, 1024, 2048, 3072, 4096]
    S_ext, M = kda_segment_transform(k[:, :1024], v[:, :1024], g[:, :1024], beta[:, :1024])
    assert M.dtype == (F64 if dtype == F64 else torch.float32)
    assert torch.isfinite(M).all() and torch.isfinite(S_ext).all()
    want = with_grads(one_pass, tensors, s0.to(M.dtype))
    got = with_grads(split_pass, tensors, s0.to(M.dtype), cuts)
    assert_all_close(got, want, atol=atol)


def test_bf16_inputs_give_fp32_transforms():
    (q, k, v, g, beta), _ = make_inputs(1, 100, 2, 8, 8, dtype=torch.bfloat16, seed=3)
    S_ext, M = kda_segment_transform(k, v, g, beta)
    assert S_ext.dtype == M.dtype == torch.float32
    S_ref, M_ref = kda_segment_transform(*(x.to(F64) for x in (k, v, g, beta)))
    torch.testing.assert_close(S_ext, S_ref.float(), atol=2e-5, rtol=0)
    torch.testing.assert_close(M, M_ref.float(), atol=2e-5, rtol=0)


def test_segment_initial_states_validation():
    t = _random_transform(0)
    with pytest.raises(ValueError, match="transforms"):
        segment_initial_states([])
    with pytest.raises(ValueError, match="initial_state"):
        segment_initial_states([t], torch.zeros(1, 2, 6, 4))


def test_segment_transform_validation():
    (q, k, v, g, beta), _ = make_inputs(2, 10, 1, 4, 4)
    with pytest.raises(ValueError, match="beta"):
        kda_segment_transform(k, v, g, beta[..., None])
    with pytest.raises(ValueError, match="cu_seqlens"):
        kda_segment_transform(k, v, g, beta, cu_seqlens=torch.tensor([0, 10]))
