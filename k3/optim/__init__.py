"""Optimisers and router load balancing for k3 training.

* :class:`PerHeadMuon` -- Muon with per-head / per-expert Newton-Schulz plus AdamW, one object.
* :func:`build_param_groups` / :func:`muon_block_spec` / :class:`HeadGeometry` -- which parameter
  goes where and how it is cut into blocks.
* :class:`QuantileBalancer` -- Quantile Balancing of the MoE selection bias.
* :class:`SignBalancer` / :func:`make_balancer` -- the aux-loss-free sign update (and "none") baselines,
  and the trainer's choice of balancer by name.

See docs/optim.md.
"""

from k3.optim.muon import BlockSpec, PerHeadMuon, newton_schulz
from k3.optim.param_groups import HeadGeometry, build_param_groups, layer_mixers, muon_block_spec
from k3.optim.quantile_balance import QuantileBalancer, balance_stats, biased_margins, exact_bias_update
from k3.optim.balance_baselines import BALANCING_METHODS, SignBalancer, make_balancer

__all__ = [
    "BALANCING_METHODS",
    "SignBalancer",
    "balance_stats",
    "make_balancer",
    "BlockSpec",
    "HeadGeometry",
    "PerHeadMuon",
    "QuantileBalancer",
    "biased_margins",
    "build_param_groups",
    "exact_bias_update",
    "layer_mixers",
    "muon_block_spec",
    "newton_schulz",
]
