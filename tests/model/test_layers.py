"""The facts that are easy to get wrong, one test each."""

import contextlib
import warnings

import pytest
import torch

from k3.config import k3_tiny, kimi_k3
from k3.kernel_config import KernelConfig
from k3.model.cache import SeqLayout
from k3.model.common import rms_norm, situ_glu
from k3.model.compile import set_kernel_config
from k3.model.kda import causal_conv_silu
from k3.model.mla import MLA_NORM_EPS, GatedMLA
from k3.model.moe import LatentMoE, RoutedExperts, Router


def test_official_layout_last_two_layers_are_mla():
    tc = kimi_k3().text_config
    assert tc.is_mla(91) and tc.is_mla(92) and not tc.is_mla(90)
    assert len(tc.mla_layers) == 24 and sum(not tc.is_mla(i) for i in range(93)) == 69
    assert not tc.is_moe(0) and all(tc.is_moe(i) for i in range(1, 93))


def test_rms_norm_normalises_in_fp32_then_casts():
    x = torch.randn(4, 64, dtype=torch.bfloat16) * 30
    w = torch.randn(64, dtype=torch.bfloat16)
    xf = x.float()
    want = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    assert torch.equal(rms_norm(x, w, 1e-5), want)


def test_mla_norms_use_eps_1e6_and_k_pe_is_not_normalised():
    cfg = k3_tiny().text_config
    mla = GatedMLA(cfg, 2)
    assert mla.q_a_layernorm.eps == MLA_NORM_EPS == 1e-6 and mla.kv_a_layernorm.eps == 1e-6
    x = torch.randn(1, 5, cfg.hidden_size)
    lat = mla._latent(x)
    raw = mla.kv_a_proj_with_mqa(x)
    torch.testing.assert_close(lat[..., cfg.kv_lora_rank:], raw[..., cfg.kv_lora_rank:], rtol=0, atol=0)
    c = raw[..., : cfg.kv_lora_rank]
    torch.testing.assert_close(lat[..., : cfg.kv_lora_rank], rms_norm(c, mla.kv_a_layernorm.weight, 1e-6))


def test_situ_limits():
    a = torch.randn(1000) * 0.01
    b = torch.randn(1000) * 0.01
    torch.testing.assert_close(situ_glu(a, b, 4.0, 25.0), a * torch.sigmoid(a) * b, rtol=1e-3, atol=1e-9)
    big = situ_glu(torch.full((3,), 1e4), torch.full((3,), 1e4), 4.0, 25.0)
    assert (big.abs() <= 100).all() and (big > 99).all()  # tanh saturates to 1 in fp32


def test_router_bias_only_selects():
    cfg = k3_tiny().text_config
    r = Router(cfg)
    torch.nn.init.normal_(r.weight, std=0.5)
    x = torch.randn(16, cfg.hidden_size)
    r.e_score_correction_bias[:4] = 100.0  # forces experts 0..3 to be chosen for every token
    idx, w, scores = r(x)
    assert (idx.sort(-1).values == torch.arange(4)).all()
    s = torch.sigmoid(x @ r.weight.t())
    torch.testing.assert_close(w, s[:, :4].gather(-1, idx) / s[:, :4].sum(-1, keepdim=True) * cfg.routed_scaling_factor)
    torch.testing.assert_close(w.sum(-1), torch.ones(16))


def _experts_loop(ex: RoutedExperts, z, idx, w):
    out = torch.zeros(z.shape[0], ex.w2.shape[1], dtype=torch.float32)
    for t in range(z.shape[0]):
        for j in range(idx.shape[1]):
            e = idx[t, j]
            h = situ_glu(z[t] @ ex.w1[e].t(), z[t] @ ex.w3[e].t(), ex.beta, ex.beta_lin)
            out[t] += w[t, j] * (h @ ex.w2[e].t()).float()
    return out


def test_routed_experts_match_per_token_loop():
    cfg = k3_tiny().text_config
    ex = RoutedExperts(cfg)
    for p in ex.parameters():
        torch.nn.init.normal_(p, std=0.1)
    z = torch.randn(13, cfg.routed_expert_hidden_size)
    idx = torch.stack([torch.randperm(cfg.num_experts)[: cfg.num_experts_per_token] for _ in range(13)])
    w = torch.rand(13, cfg.num_experts_per_token)
    torch.testing.assert_close(ex(z, idx, w), _experts_loop(ex, z, idx, w), atol=1e-5, rtol=1e-5)


def test_expert_weight_transform_is_the_single_hook():
    cfg = k3_tiny().text_config
    moe = LatentMoE(cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(7, cfg.hidden_size)
    base = moe(x)
    moe.experts.weight_transform = lambda t: torch.zeros_like(t)
    zeroed = moe(x)
    moe.experts.weight_transform = None
    assert not torch.allclose(base, zeroed)
    shared = moe.shared_experts(x)
    up = moe.routed_expert_up_proj(moe.routed_expert_norm(torch.zeros(7, cfg.routed_expert_hidden_size)))
    torch.testing.assert_close(zeroed, up + shared)


def test_short_conv_packed_equals_separate_and_tail_continues():
    C, W = 6, 4
    w = torch.randn(C, 1, W)
    a, b = torch.randn(1, 5, C), torch.randn(1, 2, C)
    lay = SeqLayout.build(1, 7, torch.tensor([0, 5, 7]), None, torch.device("cpu"))
    packed, tails = causal_conv_silu(torch.cat([a, b], 1), w, lay, None)
    ya, ta = causal_conv_silu(a, w, SeqLayout.build(1, 5, None, None, torch.device("cpu")), None)
    yb, tb = causal_conv_silu(b, w, SeqLayout.build(1, 2, None, None, torch.device("cpu")), None)
    torch.testing.assert_close(packed, torch.cat([ya, yb], 1))
    torch.testing.assert_close(tails, torch.cat([ta, tb]))
    # Tap W-1 multiplies the current token: check one output by hand.
    x = torch.cat([torch.zeros(1, W - 1, C), a], 1)[0]
    want = torch.nn.functional.silu((x[3:7] * w[:, 0, :].t()).sum(0))
    torch.testing.assert_close(ya[0, 3], want)
    # Continuing from the tail == running on the concatenation.
    lay2 = SeqLayout.build(1, 3, None, None, torch.device("cpu"))
    y2, _ = causal_conv_silu(b[:, :1].repeat(1, 3, 1), w, lay2, ta)
    full, _ = causal_conv_silu(torch.cat([a, b[:, :1].repeat(1, 3, 1)], 1), w,
                               SeqLayout.build(1, 8, None, None, torch.device("cpu")), None)
    torch.testing.assert_close(y2, full[:, 5:])


def test_fp32_tensors_stay_fp32_under_to_dtype():
    from k3.model.causal_lm import K3ForCausalLM

    m = K3ForCausalLM(k3_tiny()).init_weights(0).to_dtype(torch.bfloat16)
    sd = m.state_dict()
    fp32 = sorted({n.split(".", 3)[-1] for n, t in sd.items() if t.dtype == torch.float32})
    assert fp32 == ["block_sparse_moe.gate.e_score_correction_bias", "self_attn.A_log", "self_attn.dt_bias",
                    "self_attn.k_conv1d.weight", "self_attn.o_norm.weight", "self_attn.q_conv1d.weight",
                    "self_attn.v_conv1d.weight"]
    assert sd["lm_head.weight"].dtype == torch.bfloat16
    ids = torch.randint(0, 4096, (1, 9))
    assert torch.isfinite(m(ids).logits).all()


def test_kda_gate_init_in_bounds():
    from k3.model.kda import KDAttention
    from k3.ops.kda import kda_gate

    cfg = k3_tiny().text_config
    layer = KDAttention(cfg, 0)
    layer.reset_kda_parameters()
    g = kda_gate(torch.zeros(cfg.kda_num_heads, cfg.kda_head_dim), layer.A_log, layer.dt_bias, -5.0)
    assert (g < 0).all() and (g > -1.0 - 1e-4).all() and g.max() > -2e-3


def test_mla_prefill_rows_equal_the_masked_padded_attention():
    """Prefill against a latent cache, row by row with a lower-right causal bias, == one masked SDPA
    over all rows padded to the longest context (the formulation it replaces), fp32 and bf16."""
    from k3.model.mla import _sdpa

    torch.manual_seed(0)
    cfg = k3_tiny().text_config
    mla = GatedMLA(cfg, layer_idx=3)
    for p in mla.parameters():
        torch.nn.init.normal_(p, std=0.2)
    past, new = torch.tensor([5, 0, 13, 2]), torch.tensor([3, 4, 1, 0])  # incl. an empty and a fresh row
    N, Tq, H = 4, int(new.max()), mla.num_heads
    layout = SeqLayout(N, torch.cat([torch.zeros(1, dtype=torch.long), new.cumsum(0)]), new, past)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        m = mla.to(dtype)
        q = torch.randn(N, Tq, H, mla.nope + mla.rope, dtype=dtype)
        buf = torch.randn(N, 20, cfg.kv_lora_rank + mla.rope, dtype=dtype)
        got = m._prefill_rows(q, buf, layout)
        S = int((past + new).max())
        qpos = past[:, None] + torch.arange(Tq)[None, :]
        mask = torch.arange(S)[None, None, :] <= qpos[:, :, None]
        k, v = m._expand(buf[:, :S])
        want = _sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask[:, None], causal=False,
                     scale=m.scale).transpose(1, 2)
        for i in range(N):  # only each row's real tokens are defined
            torch.testing.assert_close(got[i, : new[i]].float(), want[i, : new[i]].float(), atol=tol, rtol=tol)
        assert not got[1:2].isnan().any() and (got[3] == 0).all()


def test_seq_layout_keeps_host_offsets():
    """SeqLayout holds cu_seqlens on the input's device and on the host; shape decisions (longest
    document, total) come from the host copy, and host tensors pass through to_device_async as is."""
    from k3.ops import to_device_async

    cu = torch.tensor([0, 3, 3, 10], dtype=torch.int32)
    lay = SeqLayout.build(1, 10, cu, None, torch.device("cpu"))
    assert lay.cu_seqlens_cpu.dtype == torch.int64 and lay.cu_seqlens_cpu.tolist() == [0, 3, 3, 10]
    assert lay.cu_seqlens.tolist() == [0, 3, 3, 10] and lay.new_lens.tolist() == [3, 0, 7]
    assert lay.max_new() == 7 and lay.total_new() == 10 and lay.num_seqs == 3
    rows = SeqLayout.build(2, 5, None, None, torch.device("cpu"))
    assert rows.cu_seqlens_cpu is None and rows.max_new() == 5 and rows.total_new() == 10
    t = torch.arange(4)
    assert to_device_async(t, "cpu") is t


def _fake_varlen(causal_kw: str):
    """A CPU stand-in with torch's varlen_attn contract (one head size for q, k, v, as flash attention
    takes; int32 offsets; the longest document as max length): per-document causal SDPA."""

    def fn(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, **kw):
        assert kw == ({"window_size": (-1, 0)} if causal_kw == "window_size" else {"is_causal": True})
        assert q.shape[-1] == k.shape[-1] == v.shape[-1] and cu_q.dtype == torch.int32 and cu_q is cu_k
        lens = (cu_q[1:] - cu_q[:-1]).tolist()
        assert max_q == max_k == max(lens)
        outs = [torch.nn.functional.scaled_dot_product_attention(
            *(t[a:b].transpose(0, 1) for t in (q, k, v)), is_causal=True, scale=scale).transpose(0, 1)
            for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist())]
        return torch.cat(outs)

    return fn


@pytest.mark.parametrize("causal_kw", ["window_size", "is_causal"])
def test_mla_varlen_path_equals_the_padded_path(monkeypatch, causal_kw):
    """Documents of unequal lengths go to flash varlen attention on the GPU (value zero-padded to the q/k
    head size, output sliced back); against a stand-in with varlen_attn's contract the layer's output and
    gradients equal the re-padded SDPA path's (both torch spellings of causality)."""
    import k3.model.mla as mla_mod

    torch.manual_seed(0)
    cfg = k3_tiny().text_config
    mla = GatedMLA(cfg, layer_idx=3)
    for p in mla.parameters():
        torch.nn.init.normal_(p, std=0.2)
    cu = torch.tensor([0, 5, 6, 19, 27], dtype=torch.int32)
    layout = SeqLayout.build(1, 27, cu, None, torch.device("cpu"))
    x = torch.randn(1, 27, cfg.hidden_size)

    def run():
        mla.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        out = mla(xi, layout)
        out.backward(torch.ones_like(out))
        return out.detach(), xi.grad, {n: p.grad.clone() for n, p in mla.named_parameters()}

    want = run()
    monkeypatch.setattr(mla_mod, "_VARLEN_ATTN", _fake_varlen(causal_kw))
    monkeypatch.setattr(mla_mod, "_VARLEN_CAUSAL", {"window_size": (-1, 0)} if causal_kw == "window_size"
                        else {"is_causal": True})
    monkeypatch.setattr(mla_mod, "_use_varlen", lambda q: True)
    got = run()
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-5)
    for n in want[2]:
        torch.testing.assert_close(got[2][n], want[2][n], rtol=1e-4, atol=1e-5, msg=n)


def test_mla_varlen_failure_falls_back_to_the_padded_path(monkeypatch):
    """A torch build whose flash varlen kernel refuses the case: a RuntimeWarning and the exact padded path."""
    import k3.model.mla as mla_mod

    torch.manual_seed(0)
    cfg = k3_tiny().text_config
    mla = GatedMLA(cfg, layer_idx=3)
    layout = SeqLayout.build(1, 27, torch.tensor([0, 5, 6, 19, 27], dtype=torch.int32), None, torch.device("cpu"))
    x = torch.randn(1, 27, cfg.hidden_size)
    want = mla(x, layout)

    def refuse(*args, **kwargs):
        raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.\nmore")

    monkeypatch.setattr(mla_mod, "_VARLEN_ATTN", refuse)
    monkeypatch.setattr(mla_mod, "_use_varlen", lambda q: True)
    with pytest.warns(RuntimeWarning, match="flash varlen attention is unavailable here"):
        got = mla(x, layout)
    torch.testing.assert_close(got, want)


@pytest.mark.gpu
def test_mla_varlen_flash_matches_padded_on_gpu(monkeypatch):
    """The real flash varlen kernel (bf16, CUDA) against the re-padded SDPA path: output and gradients."""
    import k3.model.mla as mla_mod

    torch.manual_seed(0)
    cfg = k3_tiny().text_config
    mla = GatedMLA(cfg, layer_idx=3).cuda()
    cu = torch.tensor([0, 700, 701, 2048, 3011, 4096], dtype=torch.int32)
    layout = SeqLayout.build(1, 4096, cu, None, torch.device("cuda"))  # host offsets, as the trainer passes
    x = torch.randn(1, 4096, cfg.hidden_size, device="cuda")
    results = []
    for varlen in (True, False):
        monkeypatch.setattr(mla_mod, "_use_varlen", (lambda q: True) if varlen else (lambda q: False))
        mla.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the padded fallback would make this comparison vacuous
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = mla(xi, layout)
        out.float().square().mean().backward()
        results.append((out.float(), xi.grad, mla.kv_b_proj.weight.grad))
    for a, b in zip(*results):
        assert ((a - b).abs().max() / b.abs().max()).item() < 2e-2


def test_linear_residual_sums_in_the_gemm():
    """residual + x W^T in one addmm (same dtype), the plain add otherwise; gradients to all three."""
    from k3.model.common import linear_residual

    torch.manual_seed(0)
    x, w, r = (torch.randn(2, 5, 8, requires_grad=True), torch.randn(6, 8, requires_grad=True),
               torch.randn(2, 5, 6, requires_grad=True))
    y = linear_residual(x, w, r)
    want = r + x @ w.t()
    torch.testing.assert_close(y, want)
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, (x, w, r), g)
    for a, b in zip(got, torch.autograd.grad(want, (x, w, r), g)):
        torch.testing.assert_close(a, b)
    assert torch.equal(linear_residual(x, w, None), torch.nn.functional.linear(x, w))
    r64 = r.detach().double()  # another dtype keeps the promoting add
    assert linear_residual(x, w, r64).dtype == torch.float64


def _expert_loss(w13, w2, x):
    """A stand-in micro-batch: every expert's packed gate/up and down weights used once, bf16 compute."""
    h = torch.einsum("nl,eil->eni", x, w13)  # [E, N, 2I]
    return torch.einsum("eni,eli->enl", h[..., : w2.shape[-1]], w2).float().square().mean()


def test_step_expert_weights_share_casts_and_accumulate_exact_grads():
    """Inside step_weights() the experts' bf16 copies are made once per step and each micro-batch's
    backward adds into the fp32 .grad in place: the same bits as autograd's cast + accumulation."""
    from k3.config import k3_tiny
    from k3.model.causal_lm import K3ForCausalLM
    from k3.model.moe import RoutedExperts

    model = K3ForCausalLM(k3_tiny()).init_weights(seed=0)
    ex = next(m for m in model.modules() if isinstance(m, RoutedExperts))
    xs = [torch.randn(5, ex.w1.shape[2]).to(torch.bfloat16) for _ in range(3)]

    def run(shared: bool):
        model.zero_grad(set_to_none=True)
        with model.step_weights() if shared else contextlib.nullcontext():
            seen = []  # the tensors themselves (ids of freed tensors can be reused)
            for x in xs:
                w13, w2, cached = ex._train_weights(ex.w1, ex.w3, ex.w2, torch.bfloat16)
                assert cached == shared
                seen.append(w13)
                assert w13.dtype == torch.bfloat16 and w13.shape[1] == 2 * ex.w1.shape[1]
                _expert_loss(w13, w2, x).backward()
            assert all((t is seen[0]) == shared for t in seen[1:])
        return [p.grad.clone() for p in (ex.w1, ex.w3, ex.w2)]

    plain, shared = run(False), run(True)
    for a, b in zip(plain, shared):
        assert b.dtype == torch.float32 and torch.equal(a, b)
    assert ex.step_cache is None  # reset on exit
    with model.step_weights():
        with pytest.raises(RuntimeError, match="already active"):
            with model.step_weights():
                pass
    ex.weight_transform = lambda w: w * 1.0  # a transform (QAT) keeps autograd's path
    with model.step_weights():
        assert not ex._train_weights(ex.w1, ex.w3, ex.w2, torch.bfloat16)[2]
        assert ex.step_cache == {}


@pytest.mark.gpu
@pytest.mark.parametrize("fp32_wgrad", ["0", "1"])
def test_step_weights_model_grads_identical_on_cuda(fp32_wgrad, monkeypatch):
    """k3-tiny, bf16 autocast, 2 micro-batches: step_weights() gives bit-identical gradients; with the routed
    experts' weight gradients accumulated in fp32 inside their GEMM (the default; "0": that GEMM turned off)
    those differ from autograd's sum of bf16-rounded micro-batch gradients by that rounding only."""
    import k3.model.moe as moe_mod
    from k3.model.causal_lm import K3ForCausalLM

    if fp32_wgrad == "0":  # the GEMM's condition is `cached and triton_runs_on(z)`
        monkeypatch.setattr(moe_mod, "triton_runs_on", lambda x: False)
    model = K3ForCausalLM(k3_tiny()).init_weights(seed=0).cuda().train()
    ids = torch.randint(0, 4096, (2, 65), device="cuda")

    def run(shared: bool):
        model.zero_grad(set_to_none=True)
        with model.step_weights() if shared else contextlib.nullcontext():
            for r in range(2):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(ids[r:r + 1, :-1], labels=ids[r:r + 1, 1:]).loss
                loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    a, b = run(False), run(True)
    assert a.keys() == b.keys()
    experts = [n for n in a if ".experts.w" in n]
    assert experts
    for n in a:
        if fp32_wgrad == "1" and n in experts:
            # two bf16 roundings of each micro-batch's gradient (autograd) against none
            torch.testing.assert_close(b[n], a[n], rtol=0, atol=2 ** -7 * a[n].abs().max().item(), msg=n)
        else:
            assert torch.equal(a[n], b[n]), n


@pytest.mark.parametrize("checkpointing", [False, True])
def test_step_weights_model_grads_identical_cpu(checkpointing):
    """k3-tiny, 3 micro-batches (packed documents), with and without activation checkpointing: inside
    step_weights() the loss and every gradient are bit-identical to autograd's own accumulation."""
    from k3.model.causal_lm import K3ForCausalLM

    torch.manual_seed(0)
    model = K3ForCausalLM(k3_tiny()).init_weights(seed=0).train()
    model.model.gradient_checkpointing = checkpointing
    ids = torch.randint(0, 4096, (3, 41))
    cu = torch.tensor([0, 17, 40], dtype=torch.int32)

    def run(shared: bool):
        model.zero_grad(set_to_none=True)
        losses = []
        with model.step_weights() if shared else contextlib.nullcontext():
            for r in range(3):
                loss = model(ids[r:r + 1, :-1], labels=ids[r:r + 1, 1:], cu_seqlens=cu).loss
                loss.backward()
                losses.append(loss.detach())
        return losses, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    (la, a), (lb, b) = run(False), run(True)
    assert all(torch.equal(x, y) for x, y in zip(la, lb))
    assert a.keys() == b.keys() and any("experts.w1" in n for n in a)
    for n in a:
        assert torch.equal(a[n], b[n]), n


def test_mla_triton_kv_expansion_equals_the_torch_path(monkeypatch):
    """kernels.mla_kv="triton" (the Triton interpreter here): MLA's keys / values from
    the k3.ops.mla_kv kernels give the layer's output and every gradient of the spec's split / expand /
    cat, over packed documents of unequal lengths."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(0)
    cfg = k3_tiny().text_config
    mla = GatedMLA(cfg, layer_idx=3)
    for p in mla.parameters():
        torch.nn.init.normal_(p, std=0.2)
    layout = SeqLayout.build(1, 23, torch.tensor([0, 9, 10, 23], dtype=torch.int32), None, torch.device("cpu"))
    x = torch.randn(1, 23, cfg.hidden_size)

    def run(choice):
        set_kernel_config(mla, KernelConfig(mla_kv=choice))
        mla.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        out = mla(xi, layout)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)))
        return out.detach(), xi.grad, {n: p.grad.clone() for n, p in mla.named_parameters()}

    want, got = run("torch"), run("triton")
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)  # k_pe's head sum: fp32, another order
    for n in want[2]:
        torch.testing.assert_close(got[2][n], want[2][n], rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("kind", ["causal", "packed", "lower_right"])
def test_cpu_attention_flash_path_equals_the_fp32_formula(dtype, atol, kind):
    """The CPU path (PyTorch's flash kernel, v zero-padded to the q/k head size) against the attention
    spelt out in fp64: output and every gradient, for causal rows, a packed block-diagonal mask and the
    lower-right causal mask of a cached prefill."""
    from torch.nn.attention.bias import causal_lower_right

    from k3.model.mla import _sdpa, _sdpa_fp32

    torch.manual_seed(0)
    T, S = (5, 23) if kind == "lower_right" else (23, 23)
    q, k = (torch.randn(2, 3, n, 24, dtype=dtype, requires_grad=True) for n in (T, S))
    v = torch.randn(2, 3, S, 16, dtype=dtype, requires_grad=True)
    seg, pos = (torch.arange(T) >= 9).long(), torch.arange(T)
    packed = (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])
    masks = {"causal": (None, True, None), "packed": (packed, False, None),  # (mask, causal, dense form)
             "lower_right": (causal_lower_right(T, S), False, torch.ones(T, S, dtype=torch.bool).tril(S - T))}
    mask, causal, dense = masks[kind]
    o = _sdpa(q, k, v, mask, causal=causal, scale=0.3)
    assert o.dtype == dtype and o.shape == (2, 3, T, 16)
    g = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v), g)
    ref_in = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = _sdpa_fp32(*ref_in, dense if dense is not None else mask, causal=causal, scale=0.3)
    ref_grads = torch.autograd.grad(ref, ref_in, g.double())
    for got, want in zip((o, *grads), (ref, *ref_grads)):
        torch.testing.assert_close(got.double(), want, atol=atol, rtol=atol)


def test_routed_experts_cpu_gemms_stay_fp32_under_autocast():
    """CPU bf16 autocast (`cpu_bf16` training) leaves the expert GEMMs in the weights' fp32: the same
    output as without autocast for the same input."""
    cfg = k3_tiny().text_config
    ex = RoutedExperts(cfg)
    for p in ex.parameters():
        torch.nn.init.normal_(p, std=0.1)
    z = torch.randn(29, cfg.routed_expert_hidden_size).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(cfg.num_experts)[: cfg.num_experts_per_token] for _ in range(29)])
    w = torch.rand(29, cfg.num_experts_per_token)
    want = ex(z.float(), idx, w)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = ex(z, idx, w)
    torch.testing.assert_close(got.float(), want, atol=0, rtol=0)
