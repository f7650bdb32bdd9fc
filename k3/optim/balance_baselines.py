"""Baselines for MoE router balancing, with the same interface as QuantileBalancer.

* :class:`SignBalancer` -- the auxiliary-loss-free update of DeepSeek-V3 (arXiv:2412.19437, §2.1.2):
  after each step, b[e] += gamma * sign(mean load - load[e]); gamma = 0 only monitors the loads
  (no balancing).
* :func:`make_balancer` -- the trainer's choice by name: "quantile" (histogram QB, the default),
  "quantile_exact" (QB with the exact order statistic), "sign", "none".

All balancers share: observe(layer_idx, scores [m, E], bias [E]) during the forward,
step(biases, all_reduce) after the optimizer step, load_balance() / load_cv() of the last step,
state_dict() / load_state_dict().
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from k3.optim.quantile_balance import QuantileBalancer, balance_stats, check_observation, layer_biases

__all__ = ["BALANCING_METHODS", "SignBalancer", "make_balancer"]

BALANCING_METHODS = ("quantile", "quantile_exact", "sign", "none")


class SignBalancer:
    """Fixed-step sign update of the selection bias, counted from the routed loads of each step.

    num_layers, num_experts, top_k: as QuantileBalancer. rate: gamma >= 0 (DeepSeek-V3 uses 1e-3).
    """

    def __init__(self, num_layers: int, num_experts: int, top_k: int, rate: float = 1e-3) -> None:
        if num_layers <= 0:
            raise ValueError(f"num_layers: must be positive, got {num_layers}")
        if not 0 < top_k < num_experts:
            raise ValueError(f"top_k: must satisfy 0 < top_k < num_experts={num_experts}, got {top_k}")
        if not (rate >= 0 and math.isfinite(rate)):
            raise ValueError(f"rate: must be a finite number >= 0, got {rate}")
        self.num_layers, self.num_experts, self.top_k, self.rate = num_layers, num_experts, top_k, float(rate)
        self._buf: Tensor | None = None  # [L, E + 1] int64: loads, then the token count
        self.steps = 0
        self.last_balance = torch.full((num_layers,), float("nan"), dtype=torch.float64)
        self.last_cv = self.last_balance.clone()

    @torch.compiler.disable
    @torch.no_grad()
    def observe(self, layer_idx: int, scores: Tensor, bias: Tensor) -> None:
        """Count one routed batch: scores [..., E] float, bias [E] the bias it was routed with."""
        check_observation(layer_idx, self.num_layers, scores, bias, self.num_experts)
        E = self.num_experts
        scores = scores.detach().reshape(-1, E)
        if self._buf is None:
            self._buf = torch.zeros(self.num_layers, E + 1, dtype=torch.int64, device=scores.device)
        picks = (scores.float() + bias.detach().float().to(scores.device)).topk(self.top_k, dim=-1).indices
        row = self._buf[layer_idx]
        row[:E].index_add_(0, picks.flatten().to(row.device), torch.ones_like(picks.flatten(), device=row.device))
        row[E] += scores.shape[0]

    @torch.no_grad()
    def step(
        self,
        biases: Mapping[int, Tensor] | Sequence[Tensor | None],
        all_reduce: Callable[[Tensor], None] | None = None,
    ) -> dict[int, Tensor]:
        """b[e] += rate * sign(mean - load[e]) in place for observed layers; reset the counts.
        biases / all_reduce / return value: as QuantileBalancer.step."""
        targets = layer_biases(biases, self.num_layers, self.num_experts)
        if self._buf is None:
            device = next(iter(targets.values())).device if targets else torch.device("cpu")
            self._buf = torch.zeros(self.num_layers, self.num_experts + 1, dtype=torch.int64, device=device)
        if all_reduce is not None:
            all_reduce(self._buf)
        loads, tokens = self._buf[:, :-1], self._buf[:, -1]
        self.last_balance, self.last_cv = balance_stats(loads, tokens, self.top_k)
        if self.rate > 0:
            # sign(mean - load) = sign(tokens*k - E*load): exact in integers
            direction = torch.sign(tokens.unsqueeze(-1) * self.top_k - loads * self.num_experts).double()
            observed = tokens.cpu()
            for i, b in targets.items():
                if int(observed[i]) > 0:
                    b.add_((self.rate * direction[i]).to(device=b.device, dtype=b.dtype))
        self._buf.zero_()
        self.steps += 1
        return targets

    def load_balance(self) -> dict[int, float]:
        """Max load / mean load per observed layer of the last step()'s batch (1.0 = perfect)."""
        return {i: float(v) for i, v in enumerate(self.last_balance.tolist()) if not math.isnan(v)}

    def load_cv(self) -> dict[int, float]:
        """Coefficient of variation of the expert loads per observed layer of the last step()."""
        return {i: float(v) for i, v in enumerate(self.last_cv.tolist()) if not math.isnan(v)}

    def _config(self) -> dict[str, Any]:
        return dict(method="sign", num_layers=self.num_layers, num_experts=self.num_experts, top_k=self.top_k,
                    rate=self.rate)

    def state_dict(self) -> dict[str, Any]:
        return dict(config=self._config(), steps=self.steps, last_balance=self.last_balance.clone(),
                    last_cv=self.last_cv.clone(), buffer=None if self._buf is None else self._buf.cpu().clone())

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a state_dict() taken from a SignBalancer with the same configuration."""
        if dict(state["config"]) != self._config():
            raise ValueError(f"state['config']: {dict(state['config'])} does not match {self._config()}")
        self.steps = int(state["steps"])
        self.last_balance = state["last_balance"].clone().to(torch.float64)
        self.last_cv = state["last_cv"].clone().to(torch.float64)
        buf = state["buffer"]
        device = self._buf.device if self._buf is not None else torch.device("cpu")
        self._buf = None if buf is None else buf.to(device=device, dtype=torch.int64).clone()


def make_balancer(
    method: str, num_layers: int, num_experts: int, top_k: int, *, bins: int = 256, rate: float | None = None
) -> QuantileBalancer | SignBalancer:
    """The balancer for a method name (BALANCING_METHODS). rate: the QB damping alpha (default 1)
    or the sign step gamma (default 1e-3); ignored by "none"."""
    if method in ("quantile", "quantile_exact"):
        return QuantileBalancer(num_layers, num_experts, top_k, bins=bins, rate=1.0 if rate is None else rate,
                                estimator="exact" if method == "quantile_exact" else "histogram")
    if method == "sign":
        return SignBalancer(num_layers, num_experts, top_k, rate=1e-3 if rate is None else rate)
    if method == "none":
        return SignBalancer(num_layers, num_experts, top_k, rate=0.0)
    raise ValueError(f"balancing method: expected one of {BALANCING_METHODS}, got {method!r}")
