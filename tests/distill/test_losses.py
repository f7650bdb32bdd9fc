import math

import pytest
import torch

from k3.distill.losses import opd_loss
from k3.rl.losses import PGConfig

CFG = PGConfig(clip_c=2.0, mask_c=8.0, max_staleness=4)


def _inputs():
    # two sequences packed in one row: seq 0 = positions 0..2 (responses at 1, 2), seq 1 = 3..5 (response at 5)
    lp = torch.tensor([[0.0, -1.0, -2.0, 0.0, -0.5, -0.3]], dtype=torch.float64, requires_grad=True)
    tl = torch.tensor([[0.0, -0.5, -2.5, 0.0, -9.0, -1.3]], dtype=torch.float64)
    mask = torch.tensor([[False, True, True, False, False, True]])
    seq = torch.tensor([[0, 0, 0, 1, 1, 1]])
    stale = torch.zeros(1, 6, dtype=torch.long)
    return lp, tl, mask, seq, stale


def test_loss_and_gradient_match_hand_computation_on_policy():
    lp, tl, mask, seq, stale = _inputs()
    loss, m = opd_loss(lp, tl, lp.detach().clone(), mask, stale, seq, CFG)
    # L = -(1/2) [ (1/2)((-0.5+1)(-1) + (-2.5+2)(-2)) + (1/1)((-1.3+0.3)(-0.3)) ]
    hand = -0.5 * (0.5 * (0.5 * -1.0 + -0.5 * -2.0) + (-1.0 * -0.3))
    assert float(loss.detach()) == pytest.approx(hand, abs=1e-12)
    loss.backward()
    # dL/dlp_t = -(1/B)(1/|y_i|) sg(tl_t - lp_t)
    want = torch.tensor([[0.0, -0.5 * 0.5 * 0.5, -0.5 * 0.5 * -0.5, 0.0, 0.0, -0.5 * 1.0 * -1.0]], dtype=torch.float64)
    assert torch.allclose(lp.grad, want, atol=1e-12)
    # reverse KL estimate: mean of d_t = lp - tl over response tokens
    assert m["reverse_kl"] == pytest.approx((-0.5 + 0.5 + 1.0) / 3)
    assert m["seq_kl"] == pytest.approx(((-0.5 + 0.5) + 1.0) / 2)


def test_truncated_is_weights_and_masks():
    lp, tl, mask, seq, stale = _inputs()
    mu = lp.detach().clone()
    mu[0, 1] = -1.0 - math.log(3.0)   # ρ = 3 -> w = C = 2
    mu[0, 2] = -2.0 + math.log(10.0)  # ρ = 0.1 -> outside [1/8, 8]: masked
    stale[0, 5] = 5                   # older than S_max = 4: masked
    loss, m = opd_loss(lp, tl, mu, mask, stale, seq, CFG)
    hand = -0.5 * (0.5 * (2.0 * 0.5 * -1.0))
    assert float(loss.detach()) == pytest.approx(hand, abs=1e-12)
    loss.backward()
    assert torch.allclose(lp.grad, torch.tensor([[0.0, -0.5 * 0.5 * 2.0 * 0.5, 0, 0, 0, 0]], dtype=torch.float64))
    assert m["mask_frac"] == pytest.approx(2 / 3) and m["clip_frac"] == pytest.approx(1 / 3)


def test_gradient_through_softmax_is_the_reverse_kl_score_function():
    """Student logits z [T, V]; L's gradient = -(1/|y|) Σ_t sg(lT - lθ)_t (onehot(y_t) - softmax(z_t))."""
    torch.manual_seed(0)
    z = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    zt = torch.randn(4, 5, dtype=torch.float64)
    y = torch.tensor([1, 3, 0, 4])
    lp = torch.log_softmax(z, -1)[torch.arange(4), y][None]
    tl = torch.log_softmax(zt, -1)[torch.arange(4), y][None]
    mask = torch.ones(1, 4, dtype=torch.bool)
    loss, _ = opd_loss(lp, tl, lp.detach(), mask, torch.zeros(1, 4, dtype=torch.long),
                       torch.zeros(1, 4, dtype=torch.long), CFG)
    loss.backward()
    c = (tl - lp.detach())[0] / 4
    want = -c[:, None] * (torch.nn.functional.one_hot(y, 5) - torch.softmax(z.detach(), -1))
    assert torch.allclose(z.grad, want, atol=1e-12)


def test_equal_student_and_teacher_give_zero_loss_and_gradient():
    lp, _, mask, seq, stale = _inputs()
    loss, m = opd_loss(lp, lp.detach().clone(), lp.detach().clone(), mask, stale, seq, CFG)
    loss.backward()
    assert float(loss.detach()) == 0.0 and torch.count_nonzero(lp.grad) == 0 and m["reverse_kl"] == 0.0


def test_shape_errors_and_empty_rows():
    lp, tl, mask, seq, stale = _inputs()
    with pytest.raises(ValueError, match="shape"):
        opd_loss(lp, tl[:, :3], lp.detach(), mask, stale, seq, CFG)
    loss, m = opd_loss(lp, tl, lp.detach(), torch.zeros_like(mask), stale, seq, CFG)
    assert float(loss.detach()) == 0.0 and m["sequences"] == 0.0
