"""Fused linear + cross-entropy (k3.ops.cross_entropy) against the float64 spec and the model's torch path.

Without CUDA the kernel runs under TRITON_INTERPRET=1 on small shapes (CI), with a small vocabulary block
(the module constant triton_ce.TILE, set by the tests) so rows span several blocks and end in a partial one; on a GPU the same tests plus a
k3-small-sized case marked `gpu`.
"""

import math
import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from k3.ops.cross_entropy import linear_cross_entropy  # noqa: E402
from k3.ops.cross_entropy.reference import cross_entropy_reference, linear_cross_entropy_reference  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BF16_ULP = 2.0 ** -8  # bf16 spacing relative to a value in [1, 2)


def _inputs(N, d, V, dtype, seed=0, ignore_every=5):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, d, generator=g).to(DEV, dtype)
    w = (torch.randn(V, d, generator=g) / math.sqrt(d) * 2).to(DEV, dtype)
    labels = torch.randint(0, V, (N,), generator=g)
    if ignore_every:
        labels[::ignore_every] = -100
    return h, w, labels.to(DEV)


def _run(fn, h, w, labels):
    """(loss, grad h, grad w) of fn(h, w, labels) with fresh leaves."""
    h, w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = fn(h, w, labels)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def _rel(got, want):
    """max |got - want| / max |want| in float64."""
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-300)).item()


@pytest.mark.parametrize("N,d,V,chunk,bv", [
    (37, 16, 50, 8, 16),     # N not a multiple of the chunk, V not a multiple of the block
    (16, 8, 64, 16, 64),     # one chunk, one block
    (16, 8, 64, 100, 32),    # chunk larger than N
    (5, 12, 300, 2, 128),    # several chunks of two rows, a partial last block
])
def test_fp32_against_float64(N, d, V, chunk, bv, monkeypatch):
    """Loss, dh and dW within fp32 rounding of the float64 spec (autograd through it)."""
    monkeypatch.setattr("k3.ops.cross_entropy.triton_ce.TILE", (bv, 8))
    h, w, labels = _inputs(N, d, V, torch.float32)
    loss, gh, gw = _run(lambda h, w, y: linear_cross_entropy(h, w, y, chunk_rows=chunk), h, w, labels)
    ref, rh, rw = _run(linear_cross_entropy_reference, h.double(), w.double(), labels)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert gh.dtype == torch.float32 and gw.dtype == torch.float32
    assert abs(loss.item() - ref.item()) <= 1e-6 * abs(ref.item())
    assert _rel(gh, rh) <= 1e-5 and _rel(gw, rw) <= 1e-5


@pytest.mark.parametrize("chunk", [16, 4096])
def test_bf16_against_float64_and_the_torch_path(chunk, monkeypatch):
    """bf16 h and W: the logits are rounded to bf16 (as the model's bf16 lm_head output), so against the
    float64 spec on the same inputs the loss is within 2e-3 relative and the gradients within 3e-2 of
    their largest entry. Against the model's torch path (bf16 GEMM, fp32 cross-entropy, autograd) the
    loss and dh agree to one bf16 rounding (identical bf16 gradient of the logits); dW is each chunk's
    bf16 GEMM summed in fp32, then rounded to bf16: within 4 bf16 ulps of its largest entry."""
    monkeypatch.setattr("k3.ops.cross_entropy.triton_ce.TILE", (32, 8))
    h, w, labels = _inputs(45, 32, 100, torch.bfloat16, seed=1, ignore_every=7)
    loss, gh, gw = _run(lambda h, w, y: linear_cross_entropy(h, w, y, chunk_rows=chunk), h, w, labels)
    ref, rh, rw = _run(linear_cross_entropy_reference, h.double(), w.double(), labels)
    assert gh.dtype == torch.bfloat16 and gw.dtype == torch.bfloat16
    assert abs(loss.item() - ref.item()) <= 2e-3 * abs(ref.item())
    assert _rel(gh, rh) <= 3e-2 and _rel(gw, rw) <= 3e-2
    tl, th, tw = _run(lambda h, w, y: F.cross_entropy((h @ w.t()).float(), y, ignore_index=-100), h, w, labels)
    assert abs(loss.item() - tl.item()) <= 1e-6 * abs(tl.item())
    assert _rel(gh, th) <= BF16_ULP and _rel(gw, tw) <= 4 * BF16_ULP


def test_fp32_weight_under_autocast():
    """Autocast (bf16) with an fp32 master weight and fp32 h: the GEMMs run in bf16 as nn.Linear's would,
    the gradients come back in the inputs' dtypes (fp32), dW summed in fp32 over the chunks: within
    4 bf16 ulps of the autocast torch path's, which rounds dW to bf16 once."""
    h, w, labels = _inputs(40, 32, 70, torch.float32, seed=2)
    with torch.autocast(DEV, dtype=torch.bfloat16):
        loss, gh, gw = _run(lambda h, w, y: linear_cross_entropy(h, w, y, chunk_rows=16), h, w, labels)
        tl, th, tw = _run(lambda h, w, y: F.cross_entropy(F.linear(h, w).float(), y), h, w, labels)
    assert gh.dtype == torch.float32 and gw.dtype == torch.float32
    assert abs(loss.item() - tl.item()) <= 1e-6 * abs(tl.item())
    assert _rel(gh, th) <= BF16_ULP and _rel(gw, tw) <= 4 * BF16_ULP


def test_all_rows_ignored_is_nan_like_f_cross_entropy():
    """No label counts: the loss is 0 / 0 = nan (as F.cross_entropy with ignore_index), the gradients zero."""
    h, w, labels = _inputs(6, 8, 20, torch.float32)
    labels = torch.full_like(labels, -100)
    loss, gh, gw = _run(lambda h, w, y: linear_cross_entropy(h, w, y, chunk_rows=4), h, w, labels)
    assert math.isnan(loss.item()) and math.isnan(F.cross_entropy(h @ w.t(), labels, ignore_index=-100).item())
    assert math.isnan(cross_entropy_reference(h @ w.t(), labels).item())
    assert not gh.any() and not gw.any()


def test_no_rows():
    h, w, labels = _inputs(0, 8, 20, torch.float32)
    loss, gh, gw = _run(linear_cross_entropy, h, w, labels)
    assert math.isnan(loss.item()) and gh.shape == (0, 8) and not gw.any()


def test_backward_scales_by_the_incoming_gradient():
    """(3 loss).backward() gives 3x the gradients (computed in the forward, scaled in the backward)."""
    h, w, labels = _inputs(20, 8, 30, torch.float32)
    _, gh, gw = _run(lambda h, w, y: linear_cross_entropy(h, w, y, chunk_rows=8), h, w, labels)
    _, gh3, gw3 = _run(lambda h, w, y: 3 * linear_cross_entropy(h, w, y, chunk_rows=8), h, w, labels)
    torch.testing.assert_close(gh3, 3 * gh, rtol=1e-6, atol=0.0)
    torch.testing.assert_close(gw3, 3 * gw, rtol=1e-6, atol=0.0)


def test_only_the_needed_gradients():
    """h or W alone requiring grad, or neither (no_grad): the same loss; only those gradients."""
    h, w, labels = _inputs(20, 8, 30, torch.float32, seed=3)
    loss, gh, gw = _run(lambda h, w, y: linear_cross_entropy(h, w, y, chunk_rows=8), h, w, labels)
    hh = h.clone().requires_grad_()
    a = linear_cross_entropy(hh, w, labels, chunk_rows=8)
    a.backward()
    ww = w.clone().requires_grad_()
    b = linear_cross_entropy(h, ww, labels, chunk_rows=8)
    b.backward()
    with torch.no_grad():
        c = linear_cross_entropy(h, w, labels, chunk_rows=8)
    assert c.grad_fn is None and torch.equal(a.detach(), loss) and torch.equal(b.detach(), loss)
    assert torch.equal(c, loss) and torch.equal(hh.grad, gh) and torch.equal(ww.grad, gw)


def test_out_of_range_label_gives_nan():
    """Labels are not range-checked on the host (a sync); the kernel marks the loss nan instead."""
    h, w, labels = _inputs(8, 8, 20, torch.float32)
    for bad in (20, -3):
        labels[2] = bad
        assert math.isnan(linear_cross_entropy(h, w, labels).item())


def test_int32_labels():
    h, w, labels = _inputs(12, 8, 20, torch.float32)
    assert torch.equal(linear_cross_entropy(h, w, labels.int()), linear_cross_entropy(h, w, labels))


def test_bad_inputs_raise():
    h, w, labels = _inputs(8, 8, 20, torch.float32)
    cases = [((h[None], w, labels), "expected h"), ((h, w[:, :4], labels), "shapes do not match"),
             ((h, w, labels[:5]), "shapes do not match"), ((h, w[:0], labels), "shapes do not match"),
             ((h.double(), w.double(), labels), "bf16, fp16 or fp32"), ((h, w, labels.float()), "int32 or int64"),
             ((h.bfloat16(), w, labels), "one dtype outside autocast")]
    for args, msg in cases:
        with pytest.raises(ValueError, match=msg):
            linear_cross_entropy(*args)
    for chunk in (0, 2.0, True):
        with pytest.raises(ValueError, match="chunk_rows"):
            linear_cross_entropy(h, w, labels, chunk_rows=chunk)


def _tiny_model():
    from k3.config import k3_tiny
    from k3.model.causal_lm import K3ForCausalLM

    torch.manual_seed(0)
    return K3ForCausalLM(k3_tiny()).init_weights(seed=0).train().to(DEV)


def test_model_loss_only_path_matches_default(monkeypatch):
    """k3-tiny fp32: return_logits=False with kernels.cross_entropy="triton" (the interpreter without CUDA)
    gives the default path's loss and every parameter gradient (fp32 GEMMs, fp32 softmax: rounding-level
    differences); logits is None. "torch" with return_logits=False is the logits path's computation, bit for bit."""
    from k3.kernel_config import KernelConfig
    from k3.model.compile import set_kernel_config

    model = _tiny_model()
    ids = torch.randint(0, model.config.text_config.vocab_size, (1, 40), device=DEV)
    labels = ids[:, 1:].clone()
    labels[0, :5] = -100
    cu = torch.tensor([0, 17, 39], dtype=torch.int32)

    def run(**kw):
        model.zero_grad(set_to_none=True)
        out = model(ids[:, :-1], labels=labels, cu_seqlens=cu, **kw)
        out.loss.backward()
        return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    set_kernel_config(model, KernelConfig(cross_entropy="torch"))
    out0, g0 = run()
    out1, g1 = run(return_logits=False)
    assert out0.logits is not None and out1.logits is None
    assert torch.equal(out0.loss, out1.loss) and all(torch.equal(g0[n], g1[n]) for n in g0)
    set_kernel_config(model, KernelConfig(cross_entropy="triton"))
    out2, g2 = run(return_logits=False)
    assert out2.logits is None and type(out2.loss.grad_fn).__name__.startswith("LinearCrossEntropy")
    torch.testing.assert_close(out2.loss, out0.loss, rtol=1e-6, atol=0.0)
    assert g2.keys() == g0.keys()
    for n in g0:
        torch.testing.assert_close(g2[n], g0[n], rtol=1e-4, atol=1e-5 * g0[n].abs().max().item() + 1e-8, msg=n)
    with pytest.raises(ValueError, match="needs labels"):
        model(ids, return_logits=False)


def test_lm_loss_refuses_what_the_fused_path_cannot_take(monkeypatch):
    """kernels.cross_entropy="triton" with an lm_head bias, or a weight held as a tensor subclass (an
    FSDP-sharded DTensor): a clear error naming the choice, not a wrong loss."""
    from k3.kernel_config import KernelConfig
    from k3.model.fused import EAGER as PLAIN

    EAGER = PLAIN.with_config(KernelConfig(cross_entropy="triton"))
    h, labels = torch.randn(2, 3, 8, device=DEV), torch.zeros(2, 3, dtype=torch.long, device=DEV)
    with pytest.raises(ValueError, match="bias"):
        EAGER.lm_loss(h, torch.nn.Linear(8, 16, bias=True).to(DEV), labels)

    class Sharded(torch.Tensor):
        pass

    head = torch.nn.Linear(8, 16, bias=False).to(DEV)
    head.weight = torch.nn.Parameter(head.weight.detach().as_subclass(Sharded))
    with pytest.raises(ValueError, match="unsharded"):
        EAGER.lm_loss(h, head, labels)


def test_lm_loss_default_falls_back_for_what_the_fused_path_cannot_take(monkeypatch):
    """kernels.cross_entropy="auto" (the fused loss is the default on CUDA training): a biased or sharded
    lm_head takes the module path (lm_head(h) then cross-entropy) instead of raising, so FSDP training
    keeps working."""
    from k3.model import fused
    from k3.model.fused import EAGER

    monkeypatch.setattr(fused, "use_triton", lambda choice, x: choice == "auto")  # as on a CUDA tensor
    h, labels = torch.randn(2, 3, 8, device=DEV), torch.randint(0, 16, (2, 3), device=DEV)
    head = torch.nn.Linear(8, 16, bias=True).to(DEV)
    want = torch.nn.functional.cross_entropy(head(h).float().reshape(-1, 16), labels.reshape(-1))
    torch.testing.assert_close(EAGER.lm_loss(h, head, labels), want)


@pytest.mark.gpu
def test_k3_small_size_on_gpu(monkeypatch):
    """65,536 tokens x hidden 1,024 x vocab 32,768, bf16 h and W (fp32 master weight under autocast, as in
    training): against the eager torch path (bf16 lm_head GEMM, fp32 cross-entropy) and the compiled
    one (Kernels.cross_entropy with Inductor), loss to 1e-5 relative, dh to one bf16 ulp of its largest
    entry, dW (8 chunks summed in fp32 vs one rounded GEMM) to 4."""
    from k3.model.fused import Kernels

    N, d, V = 65536, 1024, 32768
    h, w, labels = _inputs(N, d, V, torch.bfloat16, seed=4, ignore_every=9)
    w = w.float()
    compiled = Kernels(compiled=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss, gh, gw = _run(linear_cross_entropy, h, w, labels)
        for ce in (lambda x, y: F.cross_entropy(x.float(), y), compiled.cross_entropy):
            tl, th, tw = _run(lambda h, w, y, ce=ce: ce(F.linear(h, w), y), h, w, labels)
            assert abs(loss.item() - tl.item()) <= 1e-5 * abs(tl.item())
            assert _rel(gh, th) <= BF16_ULP and _rel(gw, tw) <= 4 * BF16_ULP
    assert gh.dtype == torch.bfloat16 and gw.dtype == torch.float32
