"""The balancing baselines (sign update, none), the trainer's method choice and the balance telemetry."""

from __future__ import annotations

import json

import pytest
import torch

from k3.config import ConfigError
from k3.optim.balance_baselines import BALANCING_METHODS, SignBalancer, make_balancer
from k3.optim.quantile_balance import QuantileBalancer
from k3.train.config import TrainConfig
from k3.train.metrics import balance_record, plot_balance

E, K = 8, 2


def _skewed(m: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.sigmoid(torch.randn(m, E, generator=g) + torch.linspace(-1, 1, E))


def test_sign_update_moves_by_rate_against_the_load():
    scores, bias = _skewed(800), torch.zeros(E)
    sb = SignBalancer(2, E, K, rate=0.01)
    sb.observe(1, scores[:300], bias)
    sb.observe(1, scores[300:], bias)
    sb.step({1: bias})
    loads = torch.bincount(scores.topk(K, -1).indices.flatten(), minlength=E).double()
    expected = 0.01 * torch.sign(loads.mean() - loads)
    torch.testing.assert_close(bias, expected.float(), rtol=0, atol=0)
    assert sb.load_balance()[1] == pytest.approx(float(loads.max() / loads.mean()))
    assert sb.load_cv()[1] == pytest.approx(float(loads.std(unbiased=False) / loads.mean()))
    assert set(sb.load_balance()) == {1}


def test_sign_update_balances_slowly_and_none_only_monitors():
    bias_sign, bias_none = torch.zeros(E), torch.zeros(E)
    sign, none = make_balancer("sign", 1, E, K, rate=0.02), make_balancer("none", 1, E, K)
    for step in range(60):
        scores = _skewed(1024, seed=step)
        sign.observe(0, scores, bias_sign)
        sign.step([bias_sign])
        none.observe(0, scores, bias_none)
        none.step([bias_none])
    assert torch.equal(bias_none, torch.zeros(E)) and none.load_balance()[0] > 1.5
    assert sign.load_balance()[0] < 1.25


def test_sign_state_roundtrip_and_ranks_sum():
    scores, bias = _skewed(512), torch.zeros(E)
    a, b, union = SignBalancer(1, E, K), SignBalancer(1, E, K), SignBalancer(1, E, K)
    a.observe(0, scores[:200], bias)
    b.observe(0, scores[200:], bias)
    union.observe(0, scores, bias)
    assert torch.equal(a._buf + b._buf, union._buf)
    restored = SignBalancer(1, E, K)
    restored.load_state_dict(a.state_dict())
    assert torch.equal(restored._buf, a._buf)
    with pytest.raises(ValueError, match="config"):
        SignBalancer(1, E, K, rate=0.5).load_state_dict(a.state_dict())


def test_make_balancer_and_config_choices():
    assert BALANCING_METHODS == ("quantile", "quantile_exact", "sign", "none")
    q = make_balancer("quantile", 3, E, K, bins=64)
    assert isinstance(q, QuantileBalancer) and q.estimator == "histogram" and q.bins == 64 and q.rate == 1.0
    assert make_balancer("quantile_exact", 3, E, K, rate=0.5).estimator == "exact"
    assert make_balancer("sign", 3, E, K).rate == 1e-3 and make_balancer("none", 3, E, K).rate == 0.0
    with pytest.raises(ValueError, match="balancing"):
        make_balancer("aux_loss", 3, E, K)
    assert TrainConfig().balancing == "quantile"
    TrainConfig(balancing="sign", bias_update_rate=0.01).validate()
    with pytest.raises(ConfigError, match="balancing"):
        TrainConfig(balancing="aux").validate()
    with pytest.raises(ConfigError, match="bias_update_rate"):
        TrainConfig(balancing="quantile", bias_update_rate=2.0).validate()
    # an older state (no estimator/rate in its config) still loads into the default balancer
    old = QuantileBalancer(2, E, K).state_dict()
    del old["config"]["estimator"], old["config"]["rate"], old["last_cv"]
    QuantileBalancer(2, E, K).load_state_dict(old)


def test_balance_record_and_plot(tmp_path):
    assert balance_record({}, {}) == {}
    rec = balance_record({1: 1.5, 3: 1.1}, {1: 0.2, 3: 0.1})
    assert rec["max_load_ratio"] == 1.5 and rec["load_cv"] == pytest.approx(0.15)
    assert rec["layer_max_load"] == {"1": 1.5, "3": 1.1} and rec["layer_load_cv"] == {"1": 0.2, "3": 0.1}
    path = tmp_path / "metrics.jsonl"
    with open(path, "w") as f:
        for step in range(4):
            f.write(json.dumps({"step": step, "loss": 5.0} | rec) + "\n")
    png = tmp_path / "balance.png"
    assert plot_balance(str(path), str(png)) and png.stat().st_size > 0
