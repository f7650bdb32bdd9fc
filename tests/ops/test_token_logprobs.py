"""Chunked per-token log-probabilities (`linear_token_logprobs`) against the full-logits maths, and the
model's `token_logprobs` built on it."""

import pytest
import torch

from k3.ops.cross_entropy.logprobs import linear_token_logprobs

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _full(h, w, labels, temperature):
    """The unfused maths: all logits, log_softmax, gather; -100 rows give 0."""
    z = (h @ w.t()).float() / temperature
    lp = torch.log_softmax(z, -1).gather(-1, labels.clamp(min=0)[:, None].long())[:, 0]
    return torch.where(labels != -100, lp, 0.0)


def _inputs(N, d, V, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, d, generator=g).to(DEV, dtype)
    w = (torch.randn(V, d, generator=g) * 0.5).to(DEV, dtype)
    labels = torch.randint(0, V, (N,), generator=g).to(DEV)
    labels[::5] = -100
    upstream = torch.randn(N, generator=g).to(DEV)
    return h, w, labels, upstream


@pytest.mark.parametrize("chunk_rows", [8, 37, 1000])  # several chunks ending in a partial one; one chunk
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fp32_against_float64(chunk_rows, temperature):
    h, w, labels, up = _inputs(37, 16, 50, torch.float32)
    leaves = [t.clone().requires_grad_() for t in (h, w)]
    lp = linear_token_logprobs(*leaves, labels, temperature=temperature, chunk_rows=chunk_rows)
    (lp * up).sum().backward()
    refs = [t.double().requires_grad_() for t in (h, w)]
    ref = _full(refs[0], refs[1], labels, temperature).double()
    (ref * up.double()).sum().backward()
    assert lp.dtype == torch.float32 and lp.shape == (37,)
    assert (lp[labels == -100] == 0).all()
    torch.testing.assert_close(lp.double(), ref, rtol=1e-5, atol=1e-5)
    for leaf, r in zip(leaves, refs):
        assert leaf.grad.dtype == torch.float32
        torch.testing.assert_close(leaf.grad.double(), r.grad, rtol=1e-4, atol=1e-5 * r.grad.abs().max().item())


def test_bf16_matches_the_unfused_path():
    """bf16 h and W: the same bf16 GEMM and fp32 softmax as the full-logits path; gradients within bf16
    rounding of theirs."""
    h, w, labels, up = _inputs(29, 32, 64, torch.bfloat16, seed=1)
    a = [t.clone().requires_grad_() for t in (h, w)]
    b = [t.clone().requires_grad_() for t in (h, w)]
    lp = linear_token_logprobs(*a, labels, temperature=0.9, chunk_rows=10)
    ref = _full(*b, labels, 0.9)
    torch.testing.assert_close(lp, ref, rtol=1e-5, atol=1e-5)
    (lp * up).sum().backward()
    (ref * up).sum().backward()
    for x, y in zip(a, b):
        assert x.grad.dtype == torch.bfloat16
        torch.testing.assert_close(x.grad.float(), y.grad.float(), rtol=0, atol=2 ** -7 * y.grad.float().abs().max().item())


def test_autocast_fp32_weight_gets_fp32_gradient():
    """Under autocast the GEMMs run in its dtype (as nn.Linear would) and an fp32 master weight gets an
    fp32 gradient."""
    h, w, labels, up = _inputs(20, 16, 40, torch.float32, seed=2)
    w = w.requires_grad_()
    with torch.autocast(DEV, dtype=torch.bfloat16):
        lp = linear_token_logprobs(h, w, labels, chunk_rows=7)
        ref = _full(h.bfloat16(), w.bfloat16(), labels, 1.0)
    torch.testing.assert_close(lp, ref, rtol=1e-5, atol=1e-5)
    (lp * up).sum().backward()
    assert w.grad.dtype == torch.float32 and torch.isfinite(w.grad).all()


def test_no_grad_and_bad_input():
    h, w, labels, _ = _inputs(6, 8, 10, torch.float32)
    with torch.no_grad():
        assert linear_token_logprobs(h, w, labels).shape == (6,)
    with pytest.raises(ValueError, match="temperature"):
        linear_token_logprobs(h, w, labels, temperature=0.0)
    with pytest.raises(ValueError, match="shapes"):
        linear_token_logprobs(h, w[:, :4], labels)
    with pytest.raises(ValueError, match="chunk_rows"):
        linear_token_logprobs(h, w, labels, chunk_rows=0)


def test_model_token_logprobs_matches_full_logits():
    """k3-tiny: `token_logprobs` (chunked) equals log_softmax of `forward`'s logits, packed documents'
    first tokens 0, and its gradients (an RL-style weighted sum) equal those through the full logits."""
    from k3.config import get_preset
    from k3.model.causal_lm import K3ForCausalLM

    cfg = get_preset("k3-tiny")
    model = K3ForCausalLM(cfg).init_weights(seed=0).to(DEV)
    ids = torch.randint(0, cfg.text_config.vocab_size, (1, 23), device=DEV)
    cu = torch.tensor([0, 9, 23], dtype=torch.int32, device=DEV)
    adv = torch.randn(1, 23, device=DEV)

    lp = model.token_logprobs(ids, cu_seqlens=cu, temperature=0.8)
    (lp * adv).sum().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()

    logits = model(ids, cu_seqlens=cu).logits.float() / 0.8
    want = torch.zeros_like(lp)
    want[:, 1:] = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    want[0, cu[:-1].long()] = 0.0
    (want * adv).sum().backward()
    torch.testing.assert_close(lp, want, rtol=1e-5, atol=1e-5)
    assert lp[0, 9] == 0 and lp[0, 0] == 0
    for n, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(got[n], p.grad, rtol=1e-4, atol=1e-6 * max(1.0, p.grad.abs().max().item()), msg=n)
