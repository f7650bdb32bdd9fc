"""The fused training regions (k3/model/fused.py) against the plain reference maths: outputs and
gradients, fp32 and bf16, strided inputs, odd shapes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3.config import k3_tiny
from k3.kernel_config import KernelConfig
from k3.model.cache import SeqLayout
from k3.model.common import attn_res_mix, rms_norm, situ_glu
from k3.model.fused import EAGER, Kernels, dispatch, linear_multi, sort_slots
from k3.model.kda import causal_conv_silu, conv_silu_streams

# (forward atol/rtol, gradient atol/rtol) per input dtype. fp32: rounding order only. bf16: the
# hand-derived backward keeps gradients in fp32 where autograd rounds intermediates to bf16, so
# gradients differ by a few bf16 ulps of the largest value.
TOL = {torch.float32: dict(atol=2e-6, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
GTOL = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.bfloat16: dict(atol=5e-2, rtol=5e-2)}
# Gradients of broadcast weights are sums over all rows, in a different order in each implementation:
# absolute tolerance = this fraction of the largest entry. bf16: one bf16 rounding step (2^-8) of the
# largest entry (the bf16 reference rounds every row's normalised value; on the H200 a compiled RMSNorm
# weight gradient over 3,003 rows measured 1.8e-3 of the largest entry).
REDUCED = {torch.float32: 1e-3, torch.bfloat16: 2 ** -8}
def _recompute_table() -> Kernels:
    """The compiled-mode SiTU pair (inputs saved, activations recomputed in the backward), run eagerly."""
    from k3.model import fused

    k = Kernels()
    k.situ_fwd = fused.situ_fwd_recompute
    return k


TABLES = [EAGER, _recompute_table()]


def _grads(fn, inputs, go):
    """Output and gradients of fn(*inputs) for the upstream gradient go."""
    leaves = [t.detach().clone().requires_grad_(True) if t is not None and t.is_floating_point() else t for t in inputs]
    out = fn(*leaves)
    out.backward(go)
    return out.detach(), [t.grad if t is not None and t.is_floating_point() else None for t in leaves]


def _check(fast, ref, inputs, dtype, reduced: tuple[int, ...] = ()):
    """fast == ref in output and in every input gradient, for one random upstream gradient. Inputs at
    the positions `reduced` are broadcast weights: their gradients are sums over many rows, compared
    with an absolute tolerance scaled by their largest entry (summation order differs)."""
    with torch.no_grad():
        go = torch.randn_like(ref(*inputs))
    out_r, gr = _grads(ref, inputs, go)
    out_f, gf = _grads(fast, inputs, go)
    assert out_f.dtype == out_r.dtype
    torch.testing.assert_close(out_f, out_r, **TOL[dtype])
    for i, (a, b) in enumerate(zip(gf, gr)):
        if b is not None:
            assert a is not None and a.dtype == b.dtype
            tol = dict(GTOL[dtype])
            if i in reduced:
                tol["atol"] = max(tol["atol"], REDUCED[dtype] * b.abs().max().item())
            torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("kern", TABLES, ids=["save", "recompute"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_situ_glu_matches_reference(kern, dtype):
    ab = torch.randn(37, 2 * 19) * 6  # a (gate) and up as strided halves of one projection
    ab[0] = 1e4  # saturated tanh
    a, b = ab.to(dtype).split(19, dim=-1)
    _check(lambda a, b: kern.glu(a, b, "situ", 4.0, 25.0), lambda a, b: situ_glu(a, b, 4.0, 25.0), [a, b], dtype)


@pytest.mark.parametrize("kern", TABLES, ids=["save", "recompute"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", ["situ", "silu"])
def test_glu_packed_matches_reference(kern, dtype, act):
    """gate|up packed in one tensor (a GEMM's output): same values and one gradient tensor [..., 2I]."""
    ab = (torch.randn(3, 37, 2 * 19) * 6).to(dtype)

    def ref(ab):
        a, b = ab.chunk(2, dim=-1)
        return situ_glu(a, b, 4.0, 25.0) if act == "situ" else (F.silu(a.float()) * b.float()).to(dtype)

    _check(lambda ab: kern.glu_packed(ab, act, 4.0, 25.0), ref, [ab], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_glu_packed_triton_switch(monkeypatch, dtype):
    """kernels.situ="triton": the Triton SiTU kernels (k3.ops.situ; the interpreter without CUDA) behind the
    same call, same values and gradient layout; an unknown choice is an error."""
    kern = EAGER.with_config(KernelConfig(situ="triton"))
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    ab = (torch.randn(3, 37, 2 * 19) * 6).to(dev, dtype)
    out = kern.glu_packed(ab.requires_grad_(), "situ", 4.0, 25.0)
    assert "SiTUGLU" in type(out.grad_fn.next_functions[0][0]).__name__  # under the reshape to [..., I]
    ab = ab.detach()
    _check(lambda ab: kern.glu_packed(ab, "situ", 4.0, 25.0),
           lambda ab: situ_glu(*ab.chunk(2, dim=-1), 4.0, 25.0), [ab], dtype)
    with pytest.raises(ValueError, match="kernels.situ='cuda'"):
        KernelConfig(situ="cuda")


@pytest.mark.parametrize("dtype,wdtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                          (torch.bfloat16, torch.bfloat16)])
def test_rms_norm_matches_reference(dtype, wdtype):
    x = (torch.randn(3, 7, 48) * 5).to(dtype)
    w = (torch.rand(48) + 0.5).to(wdtype)
    _check(lambda x, w: EAGER.rms_norm(x, w, 1e-5), lambda x, w: rms_norm(x, w, 1e-5), [x, w], dtype)
    assert torch.equal(EAGER.rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5))  # the forward is the same arithmetic


def test_rms_norm_without_weight():
    x = torch.randn(5, 33)
    _check(lambda x: EAGER.rms_norm(x, None, 1e-6), lambda x: rms_norm(x, None, 1e-6), [x], torch.float32)


@pytest.mark.parametrize("dtype,out_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                             (torch.bfloat16, torch.float32)])
def test_gated_norm_matches_reference(dtype, out_dtype):
    o = torch.randn(2, 9, 3, 32).to(dtype)
    g = (torch.randn(2, 9, 96) * 3).to(dtype)[..., :96].reshape(2, 9, 3, 32)
    w = torch.rand(32) + 0.5

    def ref(o, w, g):
        return (rms_norm(o.float(), w, 1e-5) * torch.sigmoid(g.float())).to(out_dtype)

    _check(lambda o, w, g: EAGER.gated_rms_norm(o, w, g, 1e-5, out_dtype), ref, [o, w, g], dtype)


@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attn_res_mix_matches_reference(n, dtype):
    d = 40
    cands = [(torch.randn(2, 6, d) * s).to(torch.float32 if i == 0 else dtype)  # bank entries may be fp32
             for i, s in enumerate([1.0, 3.0, 0.2, 7.0, 1.5][:n])]
    wn, wp = torch.rand(d) + 0.5, torch.randn(1, d)

    def fast(wn, wp, *c):
        return EAGER.attn_res(list(c), wn, wp, 1e-5)

    def ref(wn, wp, *c):
        return attn_res_mix(list(c), wn, wp, 1e-5)

    _check(fast, ref, [wn, wp, *cands], dtype)


def test_attn_res_triton_switch(monkeypatch):
    """kernels.attn_res="triton": the Triton AttnRes kernels (k3.ops.attn_res) behind the same call."""
    kern = EAGER.with_config(KernelConfig(attn_res="triton"))
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cands = [(torch.randn(2, 6, 40) * s).to(dev) for s in (1.0, 3.0, 0.2)]
    wn, wp = (torch.rand(40) + 0.5).to(dev), torch.randn(1, 40).to(dev)
    out = kern.attn_res([c.requires_grad_() for c in cands], wn, wp, 1e-5)
    assert type(out.grad_fn).__name__.startswith("AttnResMix")

    def ref(wn, wp, *c):
        return attn_res_mix(list(c), wn, wp, 1e-5)

    _check(lambda wn, wp, *c: kern.attn_res(list(c), wn, wp, 1e-5), ref,
           [wn, wp, *[c.detach() for c in cands]], torch.float32, reduced=(0, 1))


def test_model_with_the_triton_regions_matches_default(monkeypatch):
    """k3-tiny loss and every parameter gradient with kernels situ, attn_res and moe_combine = "triton" (the
    Triton kernels; the interpreter without CUDA) equal the torch regions' in fp32."""
    from k3.model.causal_lm import K3ForCausalLM
    from k3.model.compile import set_kernel_config

    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(0)
    model = K3ForCausalLM(k3_tiny()).init_weights(seed=0).train()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("res_proj.weight"):
                p.normal_(0, 0.1)
    ids = torch.randint(0, 4096, (1, 40))
    cu = torch.tensor([0, 17, 39], dtype=torch.int32)

    def run():
        model.zero_grad(set_to_none=True)
        loss = model(ids[:, :-1], labels=ids[:, 1:], cu_seqlens=cu).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    set_kernel_config(model, KernelConfig(situ="torch", attn_res="torch", moe_combine="torch"))
    loss0, g0 = run()
    set_kernel_config(model, KernelConfig(situ="triton", attn_res="triton", moe_combine="triton"))
    loss1, g1 = run()
    torch.testing.assert_close(loss1, loss0, rtol=1e-5, atol=1e-6)
    assert g1.keys() == g0.keys()
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-3, atol=1e-3 * g0[n].abs().max().item() + 1e-7, msg=n)


def _combine_ref(y, w, idx):
    """The straightforward formulation: per-slot fp32 contributions scattered with index_add."""
    N, k = idx.shape
    order = torch.argsort(idx.reshape(-1), stable=True)
    contrib = y.float() * w.reshape(-1).index_select(0, order)[:, None]
    return torch.zeros(N, y.shape[1]).index_add_(0, order // k, contrib).to(y.dtype)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dispatch_and_combine_match_index_add(dtype, compiled):
    kern = Kernels(compiled=True, backend="aot_eager") if compiled else EAGER
    N, k, E, L = 11, 3, 5, 24
    idx = torch.stack([torch.randperm(E)[:k] for _ in range(N)])
    order, inv = sort_slots(idx)
    assert torch.equal(order, torch.argsort(idx.reshape(-1), stable=True))
    assert torch.equal(order[inv], torch.arange(N * k))
    z = torch.randn(N, L).to(dtype)
    _check(lambda z: kern.dispatch(z, order, inv, k), lambda z: z.index_select(0, order // k), [z], dtype)
    _check(lambda z: dispatch(z, order, inv, k), lambda z: z.index_select(0, order // k), [z], dtype)
    y = torch.randn(N * k, L).to(dtype)
    w = torch.rand(N, k)
    _check(lambda y, w: kern.combine(y, w, order, inv), lambda y, w: _combine_ref(y, w, idx), [y, w], dtype)


def test_combine_with_no_tokens():
    idx = torch.zeros(0, 2, dtype=torch.long)
    order, inv = sort_slots(idx)
    out = EAGER.combine(torch.zeros(0, 8), torch.zeros(0, 2), order, inv)
    assert out.shape == (0, 8) and out.dtype == torch.float32


def _layout(cu: list[int] | None, B: int = 1, T: int | None = None) -> SeqLayout:
    if cu is None:
        return SeqLayout.build(B, T, None, None, torch.device("cpu"))
    return SeqLayout.build(1, cu[-1], torch.tensor(cu), None, torch.device("cpu"))


@pytest.mark.parametrize("cu", [[0, 1, 2, 4, 9, 17], [0, 17], [0, 5, 7, 17]])
def test_conv_streams_matches_tap_sum_packed(cu):
    C, W = 12, 4  # 3 streams of 4 channels; documents of length 1 and 2 are shorter than W-1
    x = torch.randn(1, cu[-1], 2 * C)[..., :C]  # a strided slice, as from the fused projection
    w = torch.randn(C, 1, W)
    lay = _layout(cu)

    def fast(x, w):
        return torch.cat(conv_silu_streams(x, w, lay, 3), dim=-1)

    def ref(x, w):
        return causal_conv_silu(x, w, lay, None)[0]

    _check(fast, ref, [x, w], torch.float32)


def test_conv_streams_rows_bf16():
    C, W = 6, 4
    x = torch.randn(3, 10, C).to(torch.bfloat16)
    w = torch.randn(C, 1, W)
    lay = _layout(None, 3, 10)
    got = conv_silu_streams(x, w, lay, 2)
    assert len(got) == 2 and all(t.shape == (3, 10, 3) and t.is_contiguous() and t.dtype == torch.bfloat16
                                 for t in got)
    _check(lambda x, w: torch.cat(conv_silu_streams(x, w, lay, 2), dim=-1),
           lambda x, w: causal_conv_silu(x, w, lay, None)[0], [x, w], torch.bfloat16)


def test_linear_multi_training_equals_serving():
    x = torch.randn(2, 5, 16)
    groups = [[torch.randn(4, 16), torch.randn(3, 16)], [torch.randn(6, 16)]]
    train = linear_multi(x, groups)
    with torch.no_grad():
        serve = linear_multi(x, groups)
    for a, b, g in zip(train, serve, groups):
        torch.testing.assert_close(a, b)
        torch.testing.assert_close(a, x @ torch.cat(g).t())


def test_router_select_bias_only_selects():
    from k3.model.fused import router_select

    x, wt = torch.randn(9, 16), torch.randn(6, 16)
    bias = torch.zeros(6)
    bias[[1, 4]] = 50.0
    idx, w, s = router_select(x, wt, bias, 2, True, 2.5)
    assert (idx.sort(-1).values == torch.tensor([1, 4])).all()
    torch.testing.assert_close(w.sum(-1), torch.full((9,), 2.5))
    torch.testing.assert_close(s, torch.sigmoid(x @ wt.t()))


def test_mla_equal_length_documents_equal_rows():
    from k3.model.mla import GatedMLA

    cfg = k3_tiny().text_config
    torch.manual_seed(0)
    mla = GatedMLA(cfg, 2)
    x = torch.randn(3, 8, cfg.hidden_size)
    rows = mla(x, _layout(None, 3, 8))
    packed = mla(x.reshape(1, 24, -1), _layout([0, 8, 16, 24]))
    torch.testing.assert_close(packed.reshape(3, 8, -1), rows, atol=1e-6, rtol=1e-5)


def test_router_and_attn_res_stay_fp32_under_autocast():
    """The spec keeps router logits and AttnRes logits in fp32; autocast would run their matmuls in bf16."""
    from k3.model.fused import router_select

    x, wt = torch.randn(64, 256), torch.randn(16, 256) * 0.2
    cands = [torch.randn(64, 256) for _ in range(3)]
    wn, wp = torch.rand(256) + 0.5, torch.randn(1, 256) * 3
    want_r = router_select(x, wt, torch.zeros(16), 4, True, 1.0)
    want_m = attn_res_mix(cands, wn, wp, 1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got_r = router_select(x, wt, torch.zeros(16), 4, True, 1.0)
        got_m = EAGER.attn_res(cands, wn, wp, 1e-5)
    assert got_r[2].dtype == torch.float32 and got_m.dtype == torch.float32
    torch.testing.assert_close(got_r[2], want_r[2], **TOL[torch.float32])
    torch.testing.assert_close(got_m, want_m, **TOL[torch.float32])


def test_cross_entropy_kernel():
    from k3.model.fused import cross_entropy

    logits = torch.randn(2, 7, 50).to(torch.bfloat16)
    labels = torch.randint(0, 50, (2, 7))
    labels[0, 3] = -100
    want = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)
    assert torch.equal(cross_entropy(logits, labels), want)
    assert torch.equal(EAGER.cross_entropy(logits, labels), want)


@pytest.mark.gpu
def test_cuda_grouped_experts_match_the_loop():
    """The CUDA bf16 expert path (grouped GEMMs, gate and up in one GEMM while training) against the
    CPU fp32 loop, outputs and weight gradients."""
    from k3.model.moe import RoutedExperts

    cfg = k3_tiny().text_config
    torch.manual_seed(0)
    ex = RoutedExperts(cfg)
    for p in ex.parameters():
        torch.nn.init.normal_(p, std=0.05)
    N, k, L = 300, cfg.num_experts_per_token, cfg.routed_expert_hidden_size
    z = torch.randn(N, L)
    idx = torch.stack([torch.randperm(cfg.num_experts)[:k] for _ in range(N)])
    w = torch.rand(N, k)
    go = torch.randn(N, L)
    ref = ex(z, idx, w)
    ref.backward(go)
    ref_grads = [p.grad.clone() for p in ex.parameters()]
    ex.zero_grad()
    ex.cuda()
    got = ex(z.cuda().bfloat16(), idx.cuda(), w.cuda())
    assert got.dtype == torch.bfloat16  # the combine sums in fp32 and returns the experts' dtype
    got.backward(go.cuda().bfloat16())
    torch.testing.assert_close(got.float().cpu(), ref, atol=3e-2, rtol=3e-2)
    for p, g in zip(ex.parameters(), ref_grads):
        torch.testing.assert_close(p.grad.cpu(), g, atol=3e-2 * g.abs().max().item(), rtol=5e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_cuda_regions_bf16(compiled):
    torch.manual_seed(0)
    kern = Kernels(compiled=True) if compiled else EAGER
    dev = "cuda"
    ab = (torch.randn(4099, 2 * 96, device=dev) * 4).bfloat16()
    a, b = ab.split(96, dim=-1)
    x = (torch.randn(3, 1001, 256, device=dev) * 3).bfloat16()
    wn = torch.rand(256, device=dev) + 0.5
    cands = [torch.randn(3, 1001, 256, device=dev)] + [torch.randn(3, 1001, 256, device=dev).bfloat16()
                                                      for _ in range(2)]
    wp = torch.randn(1, 256, device=dev)
    # Forward under autocast, backward outside it, as in training (`loss.backward()` after the autocast block).
    _check(_autocast(lambda a, b: kern.glu(a, b, "situ", 4.0, 25.0)), _autocast(lambda a, b: situ_glu(a, b, 4.0, 25.0)),
           [a, b], torch.bfloat16)
    _check(_autocast(lambda ab: kern.glu_packed(ab, "situ", 4.0, 25.0)),
           _autocast(lambda ab: situ_glu(*ab.chunk(2, dim=-1), 4.0, 25.0)), [ab], torch.bfloat16)
    _check(_autocast(lambda x, w: kern.rms_norm(x, w, 1e-5)), _autocast(lambda x, w: rms_norm(x, w, 1e-5)), [x, wn],
           torch.bfloat16, reduced=(1,))
    _check(_autocast(lambda wn, wp, *c: kern.attn_res(list(c), wn, wp, 1e-5)),
           _autocast(lambda wn, wp, *c: attn_res_mix(list(c), wn, wp, 1e-5)), [wn, wp, *cands], torch.bfloat16,
           reduced=(0, 1))


def _autocast(fn):
    """fn run under CUDA bf16 autocast."""
    def run(*args):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return fn(*args)
    return run


def test_triton_regions_are_the_cuda_training_default(monkeypatch):
    """Every region's default "auto": the Triton kernels for CUDA tensors under autograd (timed faster on an
    H200), the torch regions on CPU and in inference; "torch" / "triton" force either side."""
    from types import SimpleNamespace

    from k3.ops.backend import use_triton

    cuda, cpu = SimpleNamespace(is_cuda=True), SimpleNamespace(is_cuda=False)
    assert set(KernelConfig().to_dict().values()) == {"auto"}
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert use_triton("auto", cuda) and not use_triton("auto", cpu)
    with torch.no_grad():
        assert not use_triton("auto", cuda)
    assert not use_triton("torch", cuda)
    assert use_triton("triton", cuda) and not use_triton("triton", cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert use_triton("triton", cpu)
    with pytest.raises(ValueError, match="'auto', 'triton' or 'torch'"):
        use_triton("inductor", cuda)


def test_kernel_config_parsing():
    """KernelConfig.from_dict: missing regions keep "auto"; unknown regions and values are clear errors."""
    assert KernelConfig.from_dict({"situ": "torch"}) == KernelConfig(situ="torch")
    assert KernelConfig.from_dict(None) == KernelConfig()
    with pytest.raises(ValueError, match="unknown regions"):
        KernelConfig.from_dict({"sitx": "torch"})
    with pytest.raises(ValueError, match="kernels.ce='fast'|unknown regions"):
        KernelConfig.from_dict({"ce": "fast"})
    with pytest.raises(ValueError, match="must be one of"):
        KernelConfig.from_dict({"moe_route": "inductor"})
