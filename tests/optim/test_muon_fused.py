"""Per-Head Muon's fused Triton step (k3.optim.muon_kernels) against its torch path (PerHeadMuon(fused=False)).

Without CUDA the kernels run under TRITON_INTERPRET=1 on small shapes (CI), where torch's CPU lerp and add
are the same single-rounding fmas as the kernels': momentum and Nesterov updates are compared bit for bit;
on a GPU the same tests, with one-ulp slack for them.
"""

import io
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from k3.optim import muon_kernels  # noqa: E402
from k3.optim.muon import BlockSpec, PerHeadMuon  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
EXACT = DEV == "cpu"
LR, WD = 0.02, 0.1
BF16_ULP = 2.0**-8  # relative spacing of bf16 values


def _assert_tight(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Bit-identical on CPU; within an fp32 ulp on CUDA (no promise there that torch's kernels contract
    into the same fmas)."""
    if EXACT:
        assert torch.equal(actual, expected)
    else:
        torch.testing.assert_close(actual, expected, rtol=2.0**-22, atol=1e-30)


# ---- prep kernel ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape,block", [((3, 7, 13), 32), ((2, 16, 24), 64), ((5, 1, 3), 2), ((1, 40, 9), 4096)])
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("mu", [0.95, 0.3])
def test_prep_matches_torch(shape, block, nesterov, mu):
    """Momentum and (Nesterov) update as torch's lerp, the update rounded to bf16 as .to(bf16), the block norms
    as vector_norm of the rounded block; sizes that leave ragged last programs (91 = 2*32 + 27 elements, ...)
    and mu = 0.3 for the other branch of torch's lerp."""
    g = torch.Generator().manual_seed(1)
    grad = torch.randn(shape, generator=g).to(DEV)
    mom = (torch.randn(shape, generator=g) * 0.3).to(DEV)
    mom_ref = mom.clone().lerp_(grad, 1 - mu)
    upd_ref = grad.clone().lerp_(mom_ref, mu) if nesterov else mom_ref
    u, sumsq = muon_kernels.muon_prep(grad, mom, mu, nesterov, torch.bfloat16, block=block)
    _assert_tight(mom, mom_ref)
    assert u.dtype == torch.bfloat16 and u.shape == shape
    if EXACT:
        assert torch.equal(u, upd_ref.to(torch.bfloat16))
    else:  # a one-ulp fp32 difference may flip a bf16 rounding
        torch.testing.assert_close(u.float(), upd_ref.to(torch.bfloat16).float(), rtol=BF16_ULP, atol=0)
    torch.testing.assert_close(sumsq, u.float().square().sum(dim=(1, 2)), rtol=1e-6, atol=0)
    # the norm Newton-Schulz divides by: as vector_norm of the rounded block (summation order aside)
    norm, norm_ref = sumsq.sqrt().to(torch.bfloat16), torch.linalg.vector_norm(u, dim=(1, 2))
    if EXACT:
        assert torch.equal(norm, norm_ref)
    else:
        torch.testing.assert_close(norm.float(), norm_ref.float(), rtol=2.0**-7, atol=0)


def test_prep_fp16_and_zero_blocks():
    """fp16 output; an all-zero block has norm 0 (masked lanes add nothing)."""
    grad = torch.randn(3, 5, 6, device=DEV)
    grad[1] = 0
    mom = torch.zeros_like(grad)
    u, sumsq = muon_kernels.muon_prep(grad, mom, 0.9, True, torch.float16, block=8)
    ref = grad.lerp(mom.new_zeros(()).expand_as(grad).lerp(grad, 0.1), 0.9)
    torch.testing.assert_close(u, ref.half(), rtol=2.0**-10, atol=1e-7)
    assert sumsq[1] == 0 and (sumsq[[0, 2]] > 0).all()


def test_prep_bad_inputs_raise():
    x = torch.randn(2, 3, 4, device=DEV)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        muon_kernels.muon_prep(x, x.clone(), 0.9, True, torch.float32)
    with pytest.raises(ValueError, match="fp32"):
        muon_kernels.muon_prep(x.bfloat16(), x.bfloat16(), 0.9, True, torch.bfloat16)
    with pytest.raises(ValueError, match="contiguous"):
        muon_kernels.muon_prep(x.transpose(1, 2), x.transpose(1, 2).clone(), 0.9, True, torch.bfloat16)
    with pytest.raises(ValueError, match="power of two"):
        muon_kernels.muon_prep(x, x.clone(), 0.9, True, torch.bfloat16, block=6)


# ---- update kernel ----------------------------------------------------------------------------------------
def _reference_update(p: torch.Tensor, o: torch.Tensor, decay: float, alpha: float) -> torch.Tensor:
    """The torch path's p.mul_(decay); p.add_(o, alpha) in fp32 arithmetic (torch on CUDA; on CPU torch rounds
    alpha to bf16 for a bf16 p): fp32 decay and alpha, the decayed bf16 value rounded, then one fma (float64
    holds alpha * o exactly)."""
    d, a = torch.tensor(decay), torch.tensor(alpha)
    t = p.float() * d
    if p.dtype != torch.float32:
        t = t.to(p.dtype).float()
    return (t.double() + a.double() * o.double()).float().to(p.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flat_update_matches_reference(dtype):
    """Several parameters in one launch: ragged sizes, one that is a misaligned view into a larger buffer
    (no vector hint); each reads its own range of the stack and writes nothing outside its elements."""
    g = torch.Generator().manual_seed(2)
    buf = torch.randn(200, generator=g).to(DEV, dtype)
    params = [torch.randn(7, 13, generator=g).to(DEV, dtype), buf[3:3 + 91].view(7, 13),
              torch.randn(2, 8, 24, generator=g).to(DEV, dtype), torch.randn(1, 5, generator=g).to(DEV, dtype)]
    sizes = [p.numel() for p in params]
    starts = [0, 91 + 5, 91 + 5 + 91, 91 + 5 + 91 + 384]  # gaps between ranges
    stack = torch.randn(sum(sizes) + 5 + 3, generator=g).to(DEV, torch.bfloat16)
    before = [p.clone() for p in params]
    buf_before = buf.clone()
    plan = muon_kernels.plan_flat_update(params, starts, block=32)
    assert plan.vec == 1 and plan.table.shape[0] == sum(-(-n // 32) for n in sizes)
    decay, alpha = 1 - LR * WD, -LR * 0.2 * 24**0.5
    muon_kernels.apply_flat_update(plan, stack, decay, alpha)
    for p, b, s in zip(params, before, starts):
        ref = _reference_update(b, stack[s:s + b.numel()].view_as(b), decay, alpha)
        if dtype == torch.float32:
            _assert_tight(p, b.clone().mul_(decay).add_(stack[s:s + b.numel()].view_as(b).float(), alpha=alpha))
        # float64 then fp32 then bf16 may round a tie differently from the kernel's fp32 fma: one ulp
        torch.testing.assert_close(p.float(), ref.float(), rtol=BF16_ULP if dtype != torch.float32 else 2.0**-23,
                                   atol=0)
    assert torch.equal(buf[:3], buf_before[:3]) and torch.equal(buf[94:], buf_before[94:])  # around the view


def test_flat_update_vector_hint_and_bad_inputs():
    params = [torch.zeros(16, 32, device=DEV), torch.zeros(8, 32, device=DEV)]
    plan = muon_kernels.plan_flat_update(params, [0, 512], block=64)
    assert plan.vec == 16  # every offset and count a multiple of 16 elements
    with pytest.raises(ValueError, match="one dtype"):
        muon_kernels.plan_flat_update([params[0], params[1].bfloat16()], [0, 512])
    with pytest.raises(ValueError, match="contiguous"):
        muon_kernels.plan_flat_update([params[0].t()], [0])
    with pytest.raises(ValueError, match="starts"):
        muon_kernels.plan_flat_update(params, [0])
    with pytest.raises(ValueError, match="contiguous"):
        muon_kernels.apply_flat_update(plan, torch.zeros(64, 12, device=DEV).t(), 1.0, 0.1)


# ---- whole optimizer step -----------------------------------------------------------------------------------
def _model(dtype_b: torch.dtype = torch.bfloat16):
    """Muon params in several buckets ([8, 24] shared by rows / cols / experts / whole members of two groups),
    fp32 and bf16, weight decay on (group 0) and off (group 1, lr / 3), no Nesterov (group 2), plus AdamW."""
    g = torch.Generator().manual_seed(0)
    shapes = [((32, 24), BlockSpec.rows(8), torch.float32), ((24, 32), BlockSpec.cols(8), dtype_b),
              ((3, 8, 24), BlockSpec.experts(), torch.float32), ((8, 24), BlockSpec.whole(), dtype_b),
              ((16, 40), BlockSpec.rows(8), torch.float32), ((24, 40), BlockSpec.cols(8), torch.float32),
              ((16, 24), BlockSpec.rows(8), dtype_b), ((24, 16), BlockSpec.cols(8), torch.float32),
              ((2, 16, 24), BlockSpec.experts(), torch.float32), ((12, 20), BlockSpec.whole(), dtype_b)]
    params = [torch.nn.Parameter((torch.randn(*s, generator=g) * 0.1).to(DEV, dt)) for s, _, dt in shapes]
    vec = torch.nn.Parameter(torch.randn(24, generator=g).to(DEV))
    groups = [dict(kind="muon", params=params[:6], block_specs=[sp for _, sp, _ in shapes[:6]]),
              dict(kind="muon", params=params[6:9], block_specs=[sp for _, sp, _ in shapes[6:9]], lr=LR / 3,
                   weight_decay=0.0),
              dict(kind="muon", params=params[9:], block_specs=[sp for _, sp, _ in shapes[9:]], nesterov=False),
              dict(kind="adamw", params=[vec], lr=1e-3)]
    return params + [vec], PerHeadMuon(groups, lr=LR, weight_decay=WD, ns_dtype="bfloat16")


def _grads(params, step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g).to(DEV, p.dtype) for p in params]


def _step(opt: PerHeadMuon, params, grads, monkeypatch, fused: bool) -> None:
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt.fused = fused
    opt.step()


def _spy(monkeypatch) -> dict[str, int]:
    calls = {"prep": 0, "update": 0}
    prep, update = muon_kernels.muon_prep, muon_kernels.apply_flat_update

    def spy_prep(*args, **kw):
        calls["prep"] += 1
        return prep(*args, **kw)

    def spy_update(*args, **kw):
        calls["update"] += 1
        return update(*args, **kw)

    monkeypatch.setattr(muon_kernels, "muon_prep", spy_prep)
    monkeypatch.setattr(muon_kernels, "apply_flat_update", spy_update)
    return calls


def test_step_matches_torch_path(monkeypatch):
    """3 steps fused vs PerHeadMuon(fused=False), small programs (several per block and per parameter): momentum
    identical (one fp32 ulp on CUDA); parameters within bf16-level rounding of the update (on CPU fp32 ones
    come out identical; bf16 ones differ where torch's CPU bf16 add rounds alpha to bf16)."""
    monkeypatch.setattr(muon_kernels, "PREP_BLOCK", 64)
    monkeypatch.setattr(muon_kernels, "UPDATE_BLOCK", 128)
    calls = _spy(monkeypatch)
    a, opt_a = _model()
    b, opt_b = _model()
    for step in range(3):
        grads = _grads(a, step)
        _step(opt_a, a, grads, monkeypatch, fused=True)
        _step(opt_b, b, grads, monkeypatch, fused=False)
    buckets = len(opt_a._buckets)
    assert buckets == 4 and calls["prep"] == 3 * buckets
    assert len({id(g) for _, g, _ in opt_a._buckets[0].members}) == 2  # [8, 24]: both groups' lr in one bucket
    assert calls["update"] == 3 * sum(len(b.fused_plan()[0]) for b in opt_a._buckets)
    for pa, pb in zip(a, b):
        assert pa.dtype == pb.dtype
        # a step moves an element by at most lr * 0.2 * sqrt(40) * ~1: bf16 rounding of that, plus (bf16
        # parameters) two ulps over the 3 steps -- an ulp is up to 2^-7 relative
        torch.testing.assert_close(pa.float(), pb.float(), rtol=2 * 2.0**-7 if pa.dtype != torch.float32 else 0,
                                   atol=LR * 1.3 * BF16_ULP)
        if EXACT and pa.dtype == torch.float32:
            assert torch.equal(pa, pb)
        if "momentum_buffer" in opt_a.state[pa]:
            _assert_tight(opt_a.state[pa]["momentum_buffer"], opt_b.state[pb]["momentum_buffer"])
            assert opt_a.state[pa]["momentum_buffer"].shape == pa.shape


def test_state_dict_roundtrip(monkeypatch):
    """Save after 2 fused steps, load into a fresh optimizer (weights_only), continue: identical."""
    a, opt_a = _model()
    for step in range(2):
        for p, g in zip(a, _grads(a, step)):
            p.grad = g
        opt_a.step()
    buf = io.BytesIO()
    torch.save(opt_a.state_dict(), buf)
    buf.seek(0)
    b, opt_b = _model()
    with torch.no_grad():
        for pa, pb in zip(a, b):
            pb.copy_(pa)
    opt_b.load_state_dict(torch.load(buf, weights_only=True))
    for params, opt in ((a, opt_a), (b, opt_b)):
        for p, g in zip(params, _grads(a, 5)):
            p.grad = g
        opt.step()
    for pa, pb in zip(a, b):
        assert torch.equal(pa, pb)
        for key, value in opt_a.state[pa].items():
            assert torch.equal(opt_b.state[pb][key], value)


def test_storage_change_rebuilds_the_update_plan(monkeypatch):
    """The update tables hold addresses: a parameter given new storage is updated there, not at the old one."""
    a, opt_a = _model(torch.float32)
    b, opt_b = _model(torch.float32)
    for params, opt in ((a, opt_a), (b, opt_b)):
        for p, g in zip(params, _grads(a, 0)):
            p.grad = g
        opt.step()
    old = a[0].data
    a[0].data = old.clone()
    stale = old.clone()
    for params, opt in ((a, opt_a), (b, opt_b)):
        for p, g in zip(params, _grads(a, 1)):
            p.grad = g
        opt.step()
    assert torch.equal(old, stale)  # the old storage untouched
    for pa, pb in zip(a, b):
        assert torch.equal(pa, pb)


def test_switch_off_and_fp32_ns_take_the_torch_path(monkeypatch):
    """fused=False, and an fp32 Newton-Schulz, never reach the kernels."""
    def boom(*args, **kw):
        raise AssertionError("kernel called")

    monkeypatch.setattr(muon_kernels, "muon_prep", boom)
    monkeypatch.setattr(muon_kernels, "apply_flat_update", boom)
    a, opt = _model()
    opt.fused = False
    for p, g in zip(a, _grads(a, 0)):
        p.grad = g
    opt.step()
    opt.fused = True
    for group in opt.param_groups:
        group["ns_dtype"] = "float32"
    opt.step()
