"""Optimisers and router load balancing for k3 training.

* :class:`PerHeadMuon` -- Muon with per-head / per-expert Newton-Schulz plus AdamW, one object.
* :func:`build_param_groups` / :func:`muon_block_spec` / :class:`HeadGeometry` -- which parameter
  goes where and how it is cut into blocks.
* :class:`QuantileBalancer` -- Quantile Balancing of the MoE selection bias.

See docs/optim.md.
"""

from k3.optim.muon import BlockSpec, PerHeadMuon, newton_schulz
from k3.optim.param_groups import HeadGeometry, build_param_groups, layer_mixers, muon_block_spec
from k3.optim.quantile_balance import QuantileBalancer, biased_margins, exact_bias_update

__all__ = [
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
