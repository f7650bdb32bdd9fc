"""Per-Head Muon's stacked (launch-light) path equals the per-parameter path, and its launch count
does not grow with the number of parameters."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from k3.optim.muon import BlockSpec, PerHeadMuon, _resolve_ns_dtype

LR, WD = 0.02, 0.1


class _PerParam(PerHeadMuon):
    """The per-parameter path (what sharded parameters take), for comparison."""

    def _use_stacks(self, p):  # noqa: ANN001
        return False


def _setup(cls, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    shapes = [((32, 24), BlockSpec.rows(8)), ((24, 32), BlockSpec.cols(8)), ((3, 8, 24), BlockSpec.experts()),
              ((8, 24), BlockSpec.whole()), ((24, 16), BlockSpec.cols(8)), ((16, 24), BlockSpec.rows(8))]
    params = [torch.nn.Parameter((torch.randn(*s, generator=g) * 0.1).to(dtype)) for s, _ in shapes]
    vec = torch.nn.Parameter(torch.randn(24, generator=g).to(dtype))
    groups = [dict(kind="muon", params=params[:4], block_specs=[sp for _, sp in shapes[:4]]),
              dict(kind="muon", params=params[4:], block_specs=[sp for _, sp in shapes[4:]], lr=LR / 3,
                   weight_decay=0.0, nesterov=False),
              dict(kind="adamw", params=[vec], lr=1e-3)]
    return params + [vec], cls(groups, lr=LR, weight_decay=WD, ns_dtype="float32")


def _grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g).to(p.dtype) for p in params]


def test_stacked_equals_per_parameter_path():
    a, opt_a = _setup(PerHeadMuon)
    b, opt_b = _setup(_PerParam)
    for step in range(4):
        grads = _grads(a, step)
        for i, (pa, pb, g) in enumerate(zip(a, b, grads)):
            # parameter 3 has no gradient in step 1: the bucket layout changes and changes back
            pa.grad = pb.grad = None if (step == 1 and i == 3) else g.clone()
        opt_a.step()
        opt_b.step()
        for pa, pb in zip(a, b):
            torch.testing.assert_close(pa.detach(), pb.detach(), rtol=1e-5, atol=1e-7)
    for pa, pb in zip(a, b):
        torch.testing.assert_close(opt_a.state[pa].get("momentum_buffer"), opt_b.state[pb].get("momentum_buffer"),
                                   rtol=1e-6, atol=1e-7)
    stack = opt_a._buckets[0].mom
    assert opt_a.state[a[0]]["momentum_buffer"].untyped_storage().data_ptr() == stack.untyped_storage().data_ptr()
    assert opt_a.state[a[1]]["momentum_buffer"].shape == a[1].shape  # 'cols': parameter-shaped view


def test_stacked_bf16_params():
    a, opt_a = _setup(PerHeadMuon, torch.bfloat16)
    b, opt_b = _setup(_PerParam, torch.bfloat16)
    for step in range(2):
        for pa, pb, g in zip(a, b, _grads(a, step)):
            pa.grad, pb.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
    for pa, pb in zip(a, b):
        assert pa.dtype == torch.bfloat16
        # fp32 rounding-order differences ('cols' blocks are orthogonalised transposed) may flip a bf16
        # rounding: allow 3 bf16 ulps (2^-8 relative each; ~1e-3 absolute at these magnitudes)
        torch.testing.assert_close(pa.detach().float(), pb.detach().float(), rtol=3 * 2**-8, atol=1e-3)


def test_loaded_state_is_adopted_by_the_stacks():
    a, opt_a = _setup(PerHeadMuon)
    for step in range(2):
        for p, g in zip(a, _grads(a, step)):
            p.grad = g
        opt_a.step()
    b, opt_b = _setup(PerHeadMuon)
    with torch.no_grad():
        for pa, pb in zip(a, b):
            pb.copy_(pa)
    opt_b.load_state_dict(opt_a.state_dict())
    for p_list, opt in ((a, opt_a), (b, opt_b)):
        for p, g in zip(p_list, _grads(a, 5)):
            p.grad = g
        opt.step()
    for pa, pb in zip(a, b):
        torch.testing.assert_close(pb.detach(), pa.detach(), rtol=0, atol=0)


def _launches(num_params: int) -> int:
    params = [torch.nn.Parameter(torch.randn(16, 24)) for _ in range(num_params)]
    vecs = [torch.nn.Parameter(torch.randn(24)) for _ in range(num_params)]
    opt = PerHeadMuon([dict(kind="muon", params=params, block_specs=[BlockSpec.rows(8)] * num_params),
                       dict(kind="adamw", params=vecs)], lr=LR, ns_dtype="float32")
    for p in params + vecs:
        p.grad = torch.randn_like(p)
    opt.step()  # builds the stacks
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        opt.step()
    return sum(1 for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None)


def test_launches_do_not_grow_with_parameter_count():
    # One bucket and one AdamW group: a fixed number of (multi-tensor) operators, however many params.
    assert _launches(24) == _launches(3)


def test_ns_dtype_auto_is_bf16_on_cuda_only():
    assert _resolve_ns_dtype("auto", torch.device("cpu")) == torch.float32
    assert _resolve_ns_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert _resolve_ns_dtype("float32", torch.device("cuda")) == torch.float32
