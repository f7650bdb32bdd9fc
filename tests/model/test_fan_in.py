"""fan_in_linears: one tensor read by several GEMMs and other consumers, its gradient summed inside the
input-gradient GEMMs (k3.model.common), against autograd's own sums."""

import pytest
import torch
import torch.nn.functional as F

from k3.model.common import fan_in_linears


def _grads(x, ws, fused: bool, gos):
    x = x.detach().requires_grad_()
    ws = [w.detach().requires_grad_() for w in ws]
    if fused:
        xr, *ys = fan_in_linears(x, ws)
    else:
        xr, ys = x, [F.linear(x, w) for w in ws]
    out = sum((y * g).sum() for y, g in zip(ys, gos[1:]))
    out = out + (torch.tanh(xr) * gos[0]).sum()  # another consumer of x itself
    out.backward()
    return [y.detach() for y in ys], x.grad, [w.grad for w in ws]


@pytest.mark.parametrize("n", [1, 2, 3])
def test_fan_in_matches_autograd_fp32(n):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 24, generator=g, dtype=torch.float64)
    ws = [torch.randn(8 * (i + 1), 24, generator=g, dtype=torch.float64) for i in range(n)]
    gos = [torch.randn(37, 24, generator=g, dtype=torch.float64)] + [torch.randn(37, w.shape[0], generator=g,
                                                                                 dtype=torch.float64) for w in ws]
    ya, dxa, dwa = _grads(x, ws, False, gos)
    yb, dxb, dwb = _grads(x, ws, True, gos)
    for a, b in zip(ya + [dxa] + dwa, yb + [dxb] + dwb):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)


def test_fan_in_bf16_under_autocast_rounds_once():
    """bf16 under autocast (fp32 weights cast as autocast casts them): outputs are the bf16 GEMMs' bits; dx is
    the running sum rounded once per GEMM, within bf16 rounding of autograd's pairwise adds."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 32, generator=g).to(torch.bfloat16)
    ws = [torch.randn(16, 32, generator=g) * 0.2, torch.randn(48, 32, generator=g) * 0.2]
    gos = [torch.randn(64, 32, generator=g).to(torch.bfloat16)] + [torch.randn(64, w.shape[0], generator=g)
                                                                   .to(torch.bfloat16) for w in ws]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ya, dxa, dwa = _grads(x, ws, False, gos)
        yb, dxb, dwb = _grads(x, ws, True, gos)
    for a, b in zip(ya, yb):
        assert torch.equal(a, b)
    torch.testing.assert_close(dxb.float(), dxa.float(), rtol=2 ** -7, atol=2 ** -7 * dxa.abs().max().item())
    for a, b in zip(dwa, dwb):
        assert b.dtype == torch.float32 and torch.equal(a, b)


def test_fan_in_declines_without_grad_or_off_dtype():
    x, w = torch.randn(4, 8), torch.randn(3, 8)
    with torch.no_grad():
        assert fan_in_linears(x, [w]) is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert fan_in_linears(x, [w]) is None  # fp32 x under bf16 autocast: the plain path casts it
    assert fan_in_linears(x.unsqueeze(0), [w]) is None


def test_fan_in_same_loss_and_grads_as_autograd_adds(monkeypatch):
    """k3-tiny (LatentMoE and MLA layers) with the fan-in turned off (the layers' plain path: autograd's
    adds) and on: same loss, gradients within fp32 summation order."""
    import k3.model.mla as mla_mod
    import k3.model.moe as moe_mod
    from k3.config import k3_tiny
    from k3.model.causal_lm import K3ForCausalLM

    model = K3ForCausalLM(k3_tiny()).init_weights(seed=0).train()
    ids = torch.randint(0, 4096, (1, 33))

    def run(flag: str):
        for mod in (mla_mod, moe_mod):
            monkeypatch.setattr(mod, "fan_in_linears", fan_in_linears if flag == "1" else lambda x, ws: None)
        model.zero_grad(set_to_none=True)
        loss = model(ids[:, :-1], labels=ids[:, 1:]).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    (la, ga), (lb, gb) = run("0"), run("1")
    assert torch.equal(la, lb) and ga.keys() == gb.keys()
    for n in ga:
        torch.testing.assert_close(gb[n], ga[n], rtol=1e-4, atol=1e-6, msg=n)


def test_fan_in_never_writes_into_a_shared_gradient():
    """x' added to another leaf: the add's backward hands one gradient tensor to both; the fan-in must not
    sum into it in place (c.grad would change). A fresh gradient (exp's backward) is used in place."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(16, 8, generator=g, requires_grad=True)
    w = torch.randn(4, 8, generator=g, requires_grad=True)
    c = torch.randn(16, 8, generator=g, requires_grad=True)
    xr, y = fan_in_linears(x, [w])
    ((xr + c).sum() + (y * y).sum()).backward()
    assert torch.equal(c.grad, torch.ones_like(c))
    torch.testing.assert_close(x.grad, 1 + 2 * (x @ w.t()) @ w)
    x.grad = w.grad = None
    xr, y = fan_in_linears(x, [w])
    (xr.exp().sum() + (y * y).sum()).backward()
    torch.testing.assert_close(x.grad, x.exp() + 2 * (x @ w.t()) @ w)


def test_unshared_detects_sharing():
    from k3.model.common import _unshared

    t = torch.randn(6, 4)
    assert _unshared(t)
    v = t.view(24)
    assert not _unshared(t) and not _unshared(v)
    del v
    assert _unshared(t)
    assert not _unshared(torch.randn(4, 6).t())
