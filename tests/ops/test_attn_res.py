"""Block-AttnRes aggregation Triton kernels against the spec's loops (float64) and the model's maths.

Without CUDA the kernels run under TRITON_INTERPRET=1 on small shapes (CI); on a GPU the same tests plus
a large bf16 case marked `gpu`.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from k3.ops.attn_res import MAX_CANDIDATES, attn_res_mix  # noqa: E402
from k3.ops.attn_res.reference import attn_res_reference  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# (output, gradient) tolerance relative to the largest reference magnitude
TOL = {torch.float32: (2e-6, 5e-6), torch.bfloat16: (2 ** -7, 2 ** -6)}


def _case(n, shape, dtypes, seed=0, sharp=0.3):
    g = torch.Generator().manual_seed(seed)
    cands = [(torch.randn(shape, generator=g) * (1 + i)).to(DEV, dtypes[i % len(dtypes)]) for i in range(n)]
    w_norm = (torch.rand(shape[-1], generator=g) + 0.5).to(DEV)
    w_proj = (torch.randn(1, shape[-1], generator=g) * sharp).to(DEV)
    return cands, w_norm, w_proj


def _compare(cands, w_norm, w_proj, tol, eps=1e-5, w_atol=0.0):
    """Output and every gradient vs float64; w_atol: an absolute floor for the w_norm / w_proj gradients
    (nearly one-hot weights make them sums of cancelling terms, ~1e-10 in float64)."""
    leaves = [t.detach().requires_grad_() for t in (*cands, w_norm, w_proj)]
    out = attn_res_mix(leaves[:-2], leaves[-2], leaves[-1], eps)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref = attn_res_reference(ref_leaves[:-2], ref_leaves[-2], ref_leaves[-1], eps)
    go = torch.randn(ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).to(DEV)
    out.backward(go.to(out.dtype))
    ref.backward(go)
    assert out.dtype == cands[-1].dtype and out.shape == cands[-1].shape
    ftol, gtol = tol
    assert (out.double() - ref).abs().max() <= ftol * ref.abs().max()
    for k, (leaf, r) in enumerate(zip(leaves, ref_leaves)):
        assert leaf.grad.dtype == leaf.dtype and leaf.grad.shape == leaf.shape
        floor = w_atol if k >= len(cands) else 0.0
        assert (leaf.grad.double() - r.grad).abs().max() <= gtol * r.grad.abs().max() + floor


@pytest.mark.parametrize("n", [2, 3, 5, MAX_CANDIDATES])
@pytest.mark.parametrize("shape", [(13, 96), (2, 7, 300)])  # rows not a multiple of the block, d of the chunk
def test_fp32_against_float64(n, shape):
    _compare(*_case(n, shape, [torch.float32]), TOL[torch.float32])


def test_bf16_and_mixed_dtypes():
    """bf16 streams, and an fp32 first candidate beside bf16 ones (`K3Model.fp32_embeddings`)."""
    _compare(*_case(4, (33, 128), [torch.bfloat16]), TOL[torch.bfloat16])
    _compare(*_case(3, (9, 64), [torch.float32, torch.bfloat16, torch.bfloat16]), TOL[torch.bfloat16])


def test_sharp_softmax_and_zero_rows():
    """Large logits (nearly one-hot weights) and an all-zero candidate row (RMS from eps alone)."""
    cands, w_norm, w_proj = _case(3, (10, 64), [torch.float32], sharp=30.0)
    cands[1][4] = 0.0
    _compare(cands, w_norm, w_proj, (1e-5, 5e-5), w_atol=1e-6)


def test_matches_the_model_mix():
    """Same values as the model's eager AttnRes region (k3.model.fused) in fp32."""
    from k3.model.fused import EAGER

    cands, w_norm, w_proj = _case(4, (3, 5, 64), [torch.float32])
    torch.testing.assert_close(attn_res_mix(cands, w_norm, w_proj, 1e-5),
                               EAGER.attn_res(cands, w_norm, w_proj, 1e-5), rtol=2e-6, atol=2e-6)


def test_bad_input():
    cands, w_norm, w_proj = _case(3, (4, 32), [torch.float32])
    with pytest.raises(ValueError, match="candidates"):
        attn_res_mix(cands[:1], w_norm, w_proj, 1e-5)
    with pytest.raises(ValueError, match="candidates"):
        attn_res_mix(cands * 4, w_norm, w_proj, 1e-5)
    with pytest.raises(ValueError, match="one shape"):
        attn_res_mix([cands[0], cands[1][:2]], w_norm, w_proj, 1e-5)
    with pytest.raises(ValueError, match="32 elements"):
        attn_res_mix(cands, w_norm[:5], w_proj, 1e-5)
    with pytest.raises(ValueError, match="fp32"):
        attn_res_mix([c.double() for c in cands], w_norm, w_proj, 1e-5)
    with pytest.raises(ValueError, match="carry"):
        attn_res_mix(cands, w_norm, w_proj, 1e-5, carry=len(cands) + 1)


@pytest.mark.parametrize("dtype,shape", [(torch.float32, (2, 7, 300)), (torch.bfloat16, (5, 200))])
def test_column_blocks_narrower_than_d(monkeypatch, dtype, shape):
    """Programs of 64 columns (TILE set narrower than d): the row statistics span several column blocks."""
    monkeypatch.setattr("k3.ops.attn_res.triton_attn_res.TILE", (2, 64, 4))
    _compare(*_case(3, shape, [dtype], seed=5), TOL[dtype])


def _chain(mix, bank, prefixes, weights, carry, carry_prefix=False):
    """Mixes in a row over a growing bank, as the model runs them: bank + [prefix_j] for each j, the
    bank (with `carry_prefix` also the prefix) passed on through the mixes' pass-through views when
    `carry`; each prefix is also used after its mix, as the model's residual add uses it; loss = sum of
    the outputs and of those uses."""
    total = 0.0
    for j, (p, (wn, wp)) in enumerate(zip(prefixes, weights)):
        if carry:
            out, views = mix(bank + [p], wn, wp, 1e-5, carry=len(bank) + carry_prefix)
            bank, p = (views[:-1], views[-1]) if carry_prefix else (views, p)
        else:
            out = mix(bank + [p], wn, wp, 1e-5)
        total = total + (out.double() * (j + 1)).sum() + (p.double() * (0.5 - j)).sum()
        if j == 1:
            bank = bank + [p]  # a block boundary: the prefix joins the bank mid-chain
    return total


@pytest.mark.parametrize("carry_prefix", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_carried_bank_gradients_sum_in_the_kernel(dtype, carry_prefix):
    """A chain of mixes whose bank travels through pass-through views gives every bank entry, prefix
    and weight the gradient of the reference chain (each entry used by every later mix, autograd
    summing), and the views hold the bank's values."""
    g = torch.Generator().manual_seed(3)
    shape = (11, 40)
    bank = [torch.randn(shape, generator=g).to(DEV, dtype) for _ in range(2)]
    prefixes = [torch.randn(shape, generator=g).to(DEV, dtype) for _ in range(4)]
    weights = [((torch.rand(40, generator=g) + 0.5).to(DEV), (torch.randn(1, 40, generator=g) * 0.3).to(DEV))
               for _ in range(4)]
    leaves = [t.detach().requires_grad_() for t in bank + prefixes + [w for pair in weights for w in pair]]
    refs = [t.detach().double().requires_grad_() for t in leaves]

    def split(ts):
        return ts[:2], ts[2:6], list(zip(ts[6::2], ts[7::2]))

    b, p, w = split(leaves)
    _chain(attn_res_mix, b, p, w, carry=True, carry_prefix=carry_prefix).backward()
    b, p, w = split(refs)
    _chain(lambda c, wn, wp, eps: attn_res_reference(c, wn, wp, eps), b, p, w, carry=False).backward()
    tol = TOL[dtype][1] * (4 if dtype == torch.bfloat16 else 1)
    for leaf, ref in zip(leaves, refs):
        assert leaf.grad is not None and leaf.grad.dtype == leaf.dtype
        assert (leaf.grad.double() - ref.grad).abs().max() <= tol * ref.grad.abs().max()
    out, views = attn_res_mix(bank + prefixes[:1], *weights[0], 1e-5, carry=2 + carry_prefix)
    assert len(views) == 2 + carry_prefix and all(torch.equal(v, b) for v, b in zip(views, bank + prefixes[:1]))


def test_model_bank_chain_matches_the_torch_regions(monkeypatch):
    """A k3-tiny forward/backward with the Triton AttnRes path (bank passed through the mixes), with and
    without activation checkpointing, gives the loss and gradients of the torch regions (fp32, interpreter
    on the CPU)."""
    from k3.config import get_preset
    from k3.kernel_config import KernelConfig
    from k3.model.causal_lm import K3ForCausalLM
    from k3.model.compile import set_kernel_config

    torch.manual_seed(0)
    cfg = get_preset("k3-tiny")
    model = K3ForCausalLM(cfg).init_weights(seed=0).to(DEV)
    for p in model.parameters():  # non-zero res_proj: the mixes' softmax is not uniform
        if p.dim() == 2 and p.shape[0] == 1:
            p.data.normal_(0, 0.5)
    ids = torch.randint(0, cfg.text_config.vocab_size, (1, 24), device=DEV)
    grads = {}
    model.train()
    for choice, ckpt in (("triton", False), ("torch", False), ("triton", True)):
        set_kernel_config(model, KernelConfig(attn_res=choice))
        model.model.gradient_checkpointing = ckpt  # the carried views also cross checkpointed layers
        model.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        grads[choice, ckpt] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                               if p.grad is not None})
    lb, gb = grads["torch", False]
    for key in (k for k in grads if k[0] == "triton"):
        la, ga = grads[key]
        torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-5)
        assert ga.keys() == gb.keys()
        for n in ga:
            torch.testing.assert_close(ga[n], gb[n], rtol=1e-4, atol=1e-5 * max(1.0, gb[n].abs().max().item()),
                                       msg=f"{key} {n}")


@pytest.mark.gpu
def test_gpu_large_bf16():
    """k3-small's widest mix at 64K tokens: 4 candidates [65536, 1024] bf16."""
    _compare(*_case(4, (65536, 1024), [torch.bfloat16], seed=2), TOL[torch.bfloat16])
