"""Quantile Balancing: histogram estimator accuracy, convergence, rank-summability, state."""

from __future__ import annotations

import io

import pytest
import torch

from k3.optim.quantile_balance import QuantileBalancer, biased_margins, exact_bias_update

E, K, D = 16, 2, 32


class SkewedRouter:
    """Sigmoid router over fixed random token features with a strongly skewed per-expert offset."""

    def __init__(self, seed: int = 0, skew: float = 3.0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.features = torch.randn(20_000, D, generator=g)
        self.weight = torch.randn(E, D, generator=g) / D**0.5
        self.offset = torch.linspace(-skew, skew, E)
        self.gen = torch.Generator().manual_seed(seed + 1)

    def batch(self, m: int) -> torch.Tensor:
        idx = torch.randint(0, self.features.shape[0], (m,), generator=self.gen)
        return torch.sigmoid(self.features[idx] @ self.weight.T + self.offset)


def _loads(scores: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    picks = (scores + bias).topk(K, dim=-1).indices
    return torch.bincount(picks.flatten(), minlength=E).double()


def test_biased_margins_positive_exactly_for_picks():
    scores = SkewedRouter().batch(512)
    bias = torch.randn(E) * 0.1
    u, picks = biased_margins(scores, bias, K)
    picked = torch.zeros_like(u, dtype=torch.bool).scatter_(1, picks, True)
    assert torch.equal(u > 0, picked)


@pytest.mark.parametrize("spacing,bins,rng", [("asinh", 1024, 1.0), ("linear", 1024, 1.0), ("linear", 64, (-1.5, 0.75))])
@pytest.mark.parametrize("m", [1000, 4096])
def test_estimator_error_bounded_by_bin_width(spacing, bins, rng, m):
    router = SkewedRouter(seed=m)
    scores = router.batch(m)
    bias = torch.randn(E, generator=torch.Generator().manual_seed(3)) * 0.2
    qb = QuantileBalancer(1, E, K, bins=bins, range=rng, spacing=spacing)
    qb.observe(0, scores, bias)
    new = bias.clone()
    qb.step([new])
    exact = exact_bias_update(scores, bias, K)
    # Width of the bin holding the exact order statistic u_(ceil r) (same bin as the estimate).
    u_exact = bias - exact
    edges = qb.bin_edges()
    j = torch.bucketize(u_exact.double(), edges, right=True).clamp(1, bins)
    width = (edges[j] - edges[j - 1]).float()
    assert ((u_exact >= qb.lo) & (u_exact < qb.hi)).all()
    err = (new - exact).abs()
    assert (err <= width + 1e-6).all(), (err / width).max()


def test_out_of_range_quantile_is_clamped():
    scores = SkewedRouter().batch(2048)
    qb = QuantileBalancer(1, E, K, bins=32, range=0.05, spacing="linear")
    qb.observe(0, scores, torch.zeros(E))
    bias = torch.zeros(E)
    qb.step([bias])
    assert bias.abs().max() <= 0.05 + 1e-7
    exact = exact_bias_update(scores, torch.zeros(E), K)
    assert torch.equal(torch.sign(bias[exact.abs() > 0.05]), torch.sign(exact[exact.abs() > 0.05]))


@pytest.mark.parametrize("spacing", ["asinh", "linear"])
def test_skewed_router_balances_within_a_few_steps(spacing):
    router = SkewedRouter()
    bias = torch.zeros(E)
    qb = QuantileBalancer(1, E, K, spacing=spacing)
    ratios = []
    for _ in range(8):
        scores = router.batch(4096)
        qb.observe(0, scores, bias)
        qb.step({0: bias})  # in place; the next batch is routed with the new bias
        ratios.append(qb.load_balance()[0])
    assert ratios[0] > 3.0  # the router really is skewed
    assert min(ratios[:5]) < 1.2, ratios
    assert max(ratios[4:]) < 1.25, ratios
    held_out = router.batch(8192)
    loads = _loads(held_out, bias)
    assert loads.max() / loads.mean() < 1.2
    # The reported ratio is exactly max/mean of the batch's top-k picks.
    scores = router.batch(1024)
    qb.observe(0, scores, bias)
    qb.step([bias.clone()])
    loads = _loads(scores, bias)
    assert qb.load_balance()[0] == pytest.approx(float(loads.max() / loads.mean()))


def test_histograms_sum_over_fake_ranks():
    router = SkewedRouter()
    bias = torch.randn(E) * 0.05
    shards = [router.batch(700), router.batch(1100)]
    ranks = [QuantileBalancer(3, E, K) for _ in shards]
    for qb, s in zip(ranks, shards):
        qb.observe(2, s[:300], bias)  # several micro-batches accumulate
        qb.observe(2, s[300:], bias)
    union = QuantileBalancer(3, E, K)
    union.observe(2, torch.cat(shards), bias)
    total = ranks[0]._buf + ranks[1]._buf
    assert torch.equal(total, union._buf)

    def fake_all_reduce(t: torch.Tensor) -> None:  # what dist.all_reduce(SUM) does on each rank
        t.copy_(total)

    results = []
    for qb in ranks + [union]:
        b = bias.clone()
        qb.step({2: b}, all_reduce=None if qb is union else fake_all_reduce)
        results.append(b)
    for b in results[:2]:
        torch.testing.assert_close(b, results[2], rtol=0, atol=0)
    assert ranks[0].load_balance() == union.load_balance()


def test_repeated_observation_is_harmless():
    """Observing every token twice (activation-checkpoint recompute) gives the same update."""
    scores = SkewedRouter().batch(1024)
    bias = torch.randn(E) * 0.1
    once, twice = QuantileBalancer(1, E, K), QuantileBalancer(1, E, K)
    once.observe(0, scores, bias)
    twice.observe(0, scores, bias)
    twice.observe(0, scores, bias)
    b1, b2 = bias.clone(), bias.clone()
    once.step([b1])
    twice.step([b2])
    torch.testing.assert_close(b1, b2, rtol=0, atol=1e-7)
    assert once.load_balance() == twice.load_balance()


def test_unobserved_layers_keep_bias_and_histograms_reset():
    qb = QuantileBalancer(4, E, K)
    qb.observe(1, SkewedRouter().batch(256), torch.zeros(E))
    b1, b3 = torch.zeros(E), torch.full((E,), 0.3)
    qb.step([None, b1, None, b3])
    assert not torch.equal(b1, torch.zeros(E))
    assert torch.equal(b3, torch.full((E,), 0.3))
    assert set(qb.load_balance()) == {1}
    assert int(qb._buf.abs().sum()) == 0 and qb.steps == 1


def test_state_dict_roundtrip_mid_step():
    router = SkewedRouter()
    bias_a = torch.zeros(E)
    qb = QuantileBalancer(2, E, K, bins=256, range=0.5)
    qb.observe(1, router.batch(512), bias_a)
    qb.step({1: bias_a})
    s = router.batch(512)
    qb.observe(1, s, bias_a)  # checkpoint taken between observe and step
    blob = io.BytesIO()
    torch.save(qb.state_dict(), blob)
    blob.seek(0)
    qb2 = QuantileBalancer(2, E, K, bins=256, range=0.5)
    qb2.load_state_dict(torch.load(blob, weights_only=True))
    assert qb2.steps == 1 and qb2.load_balance() == qb.load_balance()
    bias_b = bias_a.clone()
    qb.step({1: bias_a})
    qb2.step({1: bias_b})
    torch.testing.assert_close(bias_b, bias_a, rtol=0, atol=0)
    with pytest.raises(ValueError, match="config"):
        QuantileBalancer(2, E, K, bins=128, range=0.5).load_state_dict(qb.state_dict())


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="top_k"):
        QuantileBalancer(1, 4, 4)
    with pytest.raises(ValueError, match="range"):
        QuantileBalancer(1, E, K, range=(1.0, -1.0))
    with pytest.raises(ValueError, match="spacing"):
        QuantileBalancer(1, E, K, spacing="log")
    qb = QuantileBalancer(2, E, K)
    with pytest.raises(ValueError, match="layer_idx"):
        qb.observe(2, torch.rand(4, E), torch.zeros(E))
    with pytest.raises(ValueError, match="scores"):
        qb.observe(0, torch.rand(4, E + 1), torch.zeros(E))
    with pytest.raises(ValueError, match="bias"):
        qb.observe(0, torch.rand(4, E), torch.zeros(E + 1))
    with pytest.raises(ValueError, match="biases"):
        qb.step({5: torch.zeros(E)})
