import math

import pytest
import torch

from k3.rl.losses import PGConfig, group_advantages, kl_k3, pg_loss


def test_group_advantages_hand_values():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5]])
    a = group_advantages(r, eps=0.0 + 1e-12)
    # group 1: mean 0.5, population std 0.5 -> +-1; group 2: all equal -> 0
    assert torch.allclose(a[0], torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-6)
    assert torch.equal(a[1], torch.zeros(4))
    with pytest.raises(ValueError):
        group_advantages(torch.ones(3))


def _batch():
    # two rows, three positions; row 1's last position is padding
    logp = torch.tensor([[-1.0, -0.5, -2.0], [-0.2, -3.0, -1.0]], requires_grad=True)
    mu = torch.tensor([[-1.0, -1.5, -2.0 + math.log(20.0)], [-0.2 - math.log(1.5), -3.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    stale = torch.tensor([[0, 1, 0], [2, 9, 0]])
    adv = torch.tensor([1.0, -2.0])
    return logp, mu, mask, stale, adv


def test_pg_loss_hand_computed_value_and_gradient():
    logp, mu, mask, stale, adv = _batch()
    cfg = PGConfig(clip_c=2.0, mask_c=8.0, max_staleness=4)
    loss, m = pg_loss(logp, mu, adv, mask, stale, cfg)
    # ratios: row0: e^0=1, e^1=2.718 (truncated to 2), 1/20 (outside [1/8, 8]: masked)
    #         row1: 1.5, e^0=1 but staleness 9 > 4 (masked), padding
    # N = 5 response tokens
    w = [[1.0, 2.0, 0.0], [1.5, 0.0, 0.0]]
    expect = -(w[0][0] * 1 * -1.0 + w[0][1] * 1 * -0.5 + w[1][0] * -2 * -0.2) / 5
    assert loss.item() == pytest.approx(expect, rel=1e-6)
    loss.backward()
    grad = torch.tensor([[-1.0 / 5, -2.0 / 5, 0.0], [3.0 / 5, 0.0, 0.0]])
    assert torch.allclose(logp.grad, grad, atol=1e-6)
    assert m["clip_frac"] == pytest.approx(1 / 5)
    assert m["mask_frac"] == pytest.approx(2 / 5)
    assert m["stale_masked_frac"] == pytest.approx(1 / 5)
    assert m["staleness_max"] == 9.0


def test_stale_tokens_are_bounded():
    """Every token's gradient coefficient |dL/dlogp_t| <= C·|Â|/N, and tokens past S_max or outside the
    ratio band contribute exactly zero, whatever the ratio."""
    torch.manual_seed(0)
    B, T = 6, 9
    logp = (torch.randn(B, T) - 1).requires_grad_()
    mu = logp.detach() + 3 * torch.randn(B, T)
    adv = torch.randn(B) * 3
    mask = torch.rand(B, T) > 0.2
    stale = torch.randint(0, 8, (B, T))
    cfg = PGConfig(clip_c=2.0, mask_c=4.0, max_staleness=3)
    loss, _ = pg_loss(logp, mu, adv, mask, stale, cfg)
    loss.backward()
    n = mask.sum()
    bound = cfg.clip_c * adv.abs()[:, None] / n
    assert (logp.grad.abs() <= bound + 1e-7).all()
    ratio = torch.exp(logp.detach() - mu)
    dead = ~mask | (stale > 3) | (ratio > 4) | (ratio < 0.25)
    assert (logp.grad[dead] == 0).all()
    assert (logp.grad[~dead] != 0).all()


def test_on_policy_reduces_to_reinforce():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, m = pg_loss(logp, logp.detach(), torch.tensor([0.5]), torch.ones(1, 2, dtype=torch.bool),
                      torch.zeros(1, 2, dtype=torch.long), PGConfig())
    assert loss.item() == pytest.approx(-0.5 * (-3.0) / 2)
    assert m["clip_frac"] == 0 and m["mask_frac"] == 0 and m["mean_ratio"] == pytest.approx(1.0)


def test_kl_term():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -2.0]])
    cfg = PGConfig(kl_coef=0.1)
    loss, m = pg_loss(logp, logp.detach(), torch.zeros(1), torch.ones(1, 2, dtype=torch.bool),
                      torch.zeros(1, 2, dtype=torch.long), cfg, ref_logp=ref)
    k = math.exp(-0.5) + 0.5 - 1
    assert m["kl"] == pytest.approx(k / 2, rel=1e-6)
    assert loss.item() == pytest.approx(0.1 * k / 2, rel=1e-6)
    assert float(kl_k3(torch.tensor(0.3), torch.tensor(0.3))) == 0.0
    with pytest.raises(ValueError):
        pg_loss(logp, logp.detach(), torch.zeros(1), torch.ones(1, 2, dtype=torch.bool),
                torch.zeros(1, 2, dtype=torch.long), cfg)


def test_config_validation():
    with pytest.raises(ValueError):
        PGConfig(clip_c=1.0).validate()
    with pytest.raises(ValueError):
        PGConfig(clip_c=3.0, mask_c=2.0).validate()


def test_cluster_standard_error():
    from k3.rl.batch import cluster_se
    # two tasks with means 1 and 3: sd of the means sqrt(2), over sqrt(2) clusters = 1
    assert cluster_se([0.0, 2.0, 3.0, 3.0], ["a", "a", "b", "b"]) == pytest.approx(1.0)
    assert cluster_se([1.0, 2.0], ["a", "a"]) != cluster_se([1.0, 2.0], ["a", "a"])  # nan below two clusters
