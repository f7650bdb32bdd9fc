"""Quantile Balancing (QB): recompute each MoE router's selection bias from the last batch.

Notation for one MoE layer: E experts, top-k routing, m tokens observed during the step (all
micro-batches and all ranks), sigmoid scores s[t, e] (fp32) and the selection-only bias b[e]
(``e_score_correction_bias``) that was used to route those tokens.

* biased score    z[t, e] = s[t, e] + b[e];  z_(k)[t], z_(k+1)[t] its k-th and (k+1)-th largest
* threshold       c[t, e] = z_(k+1)[t] if token t picked e (the best expert it did not pick),
                            z_(k)[t]   otherwise           (the weakest expert it did pick)
* biased margin   u[t, e] = z[t, e] - c[t, e]    (u > 0 exactly for the k picked experts)
* With every other bias fixed, token t picks e under a bias b'[e]  <=>  u[t, e] + b'[e] - b[e] > 0.
  QB chooses b' so that exactly m*k/E tokens pass for every expert:

      b_new[e] = b[e] - Q_{1-k/E}( u[:, e] )

  (J. Su, kexue.fm/archives/11619; K3 report Eq. 14). The report's cutoff is z_(k+1) for every
  expert; for an expert the token did not pick that is the threshold to become the (k+1)-th, not
  to be picked, and the expert that *is* the (k+1)-th gets u = 0 exactly: an atom of ~m/E zeros
  per expert (a quarter of the k/E target at E=32, k=4) on which the quantile of an underloaded
  expert lands, so its bias does not move. The two-sided threshold removes that stall (docs/optim.md).

``rate`` (alpha) damps the step: b_new = b - alpha * Q. ``estimator="exact"`` keeps the margins
and takes the order statistic u_(ceil r); ``"histogram"`` (the default) bins them.
Quantile Q_p from a histogram: with cumulative counts C over bins in ascending order and the
rank r = p*m, take the first bin j with C[j] >= r and interpolate linearly inside it,
Q = lo_j + width_j * (r - C[j-1]) / count_j. The order statistic u_(ceil r) lies in the same
bin, so |Q - u_(ceil r)| <= width_j. Values outside [lo, hi] fall in under/overflow bins and
the estimate is clamped to lo/hi: one step moves a bias by at most max(|lo|, |hi|).

Histograms are integer counts, so per-rank histograms are combined exactly by one sum
all-reduce (``all_reduce`` hook) -- scores are never gathered. Observing every token the same
number of times (e.g. an activation-checkpoint recompute) scales all counts alike and leaves
the quantiles and load ratios unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["QuantileBalancer", "balance_stats", "biased_margins", "check_observation", "exact_bias_update",
           "layer_biases"]

_SPACINGS = ("linear", "asinh")
_ESTIMATORS = ("histogram", "exact")


def biased_margins(scores: Tensor, bias: Tensor, top_k: int) -> tuple[Tensor, Tensor]:
    """u = z - c per token/expert (two-sided threshold, module docstring) and the top-k picks.

    scores: [m, E] fp32 sigmoid scores; bias: [E]. Returns (u [m, E] fp32, picks [m, k] int64);
    picks are ``torch.topk`` of the biased scores, the router's own selection rule.
    """
    biased = scores.float() + bias.float()
    values, indices = biased.topk(top_k + 1, dim=-1)
    picks = indices[:, :top_k]
    picked = torch.zeros_like(biased, dtype=torch.bool).scatter_(1, picks, True)
    threshold = torch.where(picked, values[:, top_k : top_k + 1], values[:, top_k - 1 : top_k])
    return biased - threshold, picks


def _order_statistic(u: Tensor, num_experts: int, top_k: int) -> Tensor:
    """u_(ceil r) per expert, r = m*(1 - k/E): u [m, E] -> [E]."""
    m = u.shape[0]
    rank = max(math.ceil(m * (num_experts - top_k) / num_experts), 1)
    return u.sort(dim=0).values[rank - 1]


def exact_bias_update(scores: Tensor, bias: Tensor, top_k: int) -> Tensor:
    """Reference QB update with an exact order statistic (one process, no histogram).

    Returns b_new [E] fp32 = b - u_(ceil r), u_(i) the i-th smallest biased margin of each expert
    and r = m*(1 - k/E).
    """
    u, _ = biased_margins(scores, bias, top_k)
    return bias.float() - _order_statistic(u, u.shape[1], top_k)


def balance_stats(loads: Tensor, tokens: Tensor, top_k: int) -> tuple[Tensor, Tensor]:
    """Per-layer (max/mean, coefficient of variation) of expert loads.

    loads: [L, E] tokens routed to each expert; tokens: [L] tokens observed. Returns two float64
    [L] CPU tensors, NaN where a layer saw no tokens. mean = tokens*k/E; CV = std/mean with the
    population std over the E experts; a perfectly balanced layer gives (1, 0).
    """
    loads, tokens = loads.double(), tokens.double()
    mean = (tokens * top_k / loads.shape[-1]).clamp(min=1e-12)
    ratio = loads.amax(-1) / mean
    cv = (loads - mean.unsqueeze(-1)).square().mean(-1).sqrt() / mean
    nan = torch.full_like(ratio, float("nan"))
    return torch.where(tokens > 0, ratio, nan).cpu(), torch.where(tokens > 0, cv, nan).cpu()


def layer_biases(biases: Mapping[int, Tensor] | Sequence[Tensor | None], num_layers: int,
                 num_experts: int) -> dict[int, Tensor]:
    """{layer index: bias [E]} from a mapping or a per-layer list (None = no MoE layer), each checked to
    be a layer in [0, num_layers) with shape (num_experts,): the `biases` argument of a balancer's step."""
    items = biases.items() if isinstance(biases, Mapping) else enumerate(biases)
    targets = {int(i): b for i, b in items if b is not None}
    for i, b in targets.items():
        if not 0 <= i < num_layers or tuple(b.shape) != (num_experts,):
            raise ValueError(f"biases[{i}]: expected a layer in [0, {num_layers}) with shape ({num_experts},)")
    return targets


def check_observation(layer_idx: int, num_layers: int, scores: Tensor, bias: Tensor, num_experts: int) -> None:
    """The arguments of a balancer's `observe`: a layer index in [0, num_layers), float scores [..., E] and a
    bias [E]; a clear ValueError otherwise."""
    if not 0 <= layer_idx < num_layers:
        raise ValueError(f"layer_idx: must be in [0, {num_layers}), got {layer_idx}")
    E = num_experts
    if scores.shape[-1] != E or not scores.is_floating_point():
        raise ValueError(f"scores: expected a float tensor [..., {E}], got {scores.dtype} {tuple(scores.shape)}")
    if tuple(bias.shape) != (E,):
        raise ValueError(f"bias: expected shape ({E},), got {tuple(bias.shape)}")


class QuantileBalancer:
    """Histogram-based Quantile Balancing for all MoE layers of a model.

    num_layers: layer indices accepted by :meth:`observe` are 0..num_layers-1 (use the model's
    layer index with num_layers = num_hidden_layers, or a compact MoE index).
    num_experts, top_k: E and k of the router (k < E).
    bins: interior bins per expert; range: (lo, hi) or R for (-R, R), the histogram span of the
    biased margin u; spacing: "linear" (uniform in u) or "asinh" (uniform in asinh(u/scale):
    bins ~scale*width near 0, relatively constant far away); scale: the asinh knee.
    estimator: "histogram" (mergeable across ranks) or "exact" (keeps this step's margins and
    takes the order statistic: one process only, memory m*E*4 bytes per layer).
    rate: alpha in b_new = b - alpha*Q, in (0, 1]; 1 is the full QB step.
    device: where the counts live (default: the device of the first observed scores).
    """

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        top_k: int,
        bins: int = 1024,
        range: float | tuple[float, float] = 1.0,  # noqa: A002 - the documented argument name
        spacing: str = "asinh",
        scale: float = 1e-3,
        device: torch.device | str | None = None,
        estimator: str = "histogram",
        rate: float = 1.0,
    ) -> None:
        if num_layers <= 0:
            raise ValueError(f"num_layers: must be positive, got {num_layers}")
        if not 0 < top_k < num_experts:
            raise ValueError(f"top_k: must satisfy 0 < top_k < num_experts={num_experts}, got {top_k}")
        if bins < 1:
            raise ValueError(f"bins: must be >= 1, got {bins}")
        lo, hi = (-float(range), float(range)) if isinstance(range, (int, float)) else map(float, range)
        if not lo < hi:
            raise ValueError(f"range: need lo < hi, got ({lo}, {hi})")
        if spacing not in _SPACINGS:
            raise ValueError(f"spacing: expected one of {_SPACINGS}, got {spacing!r}")
        if scale <= 0:
            raise ValueError(f"scale: must be positive, got {scale}")
        if estimator not in _ESTIMATORS:
            raise ValueError(f"estimator: expected one of {_ESTIMATORS}, got {estimator!r}")
        if not 0 < rate <= 1:
            raise ValueError(f"rate: must be in (0, 1], got {rate}")
        self.estimator, self.rate = estimator, float(rate)
        self._margins: dict[int, list[Tensor]] = {}  # estimator="exact": this step's u per layer
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        self.bins, self.lo, self.hi, self.spacing, self.scale = bins, lo, hi, spacing, scale
        self._g_lo, self._g_hi = self._warp(lo), self._warp(hi)
        self._g_width = (self._g_hi - self._g_lo) / bins
        self._device = torch.device(device) if device is not None else None
        self._buf: Tensor | None = None
        self.steps = 0
        self.last_balance = torch.full((num_layers,), float("nan"), dtype=torch.float64)
        self.last_cv = self.last_balance.clone()

    # ---- bin geometry -------------------------------------------------------------------
    def _warp(self, u: float) -> float:
        return math.asinh(u / self.scale) if self.spacing == "asinh" else u

    def _unwarp(self, g: Tensor) -> Tensor:
        return self.scale * torch.sinh(g) if self.spacing == "asinh" else g

    def bin_edges(self) -> Tensor:
        """Interior bin edges [bins + 1] (float64) in margin units."""
        g = torch.linspace(self._g_lo, self._g_hi, self.bins + 1, dtype=torch.float64)
        return self._unwarp(g)

    def bin_index(self, u: Tensor) -> Tensor:
        """Histogram slot of each margin: 0 = underflow (< lo), 1..bins, bins+1 = overflow (>= hi or NaN)."""
        g = torch.asinh(u.double() / self.scale) if self.spacing == "asinh" else u.double()
        t = torch.floor((g - self._g_lo) / self._g_width)
        t = torch.nan_to_num(t, nan=float(self.bins)).clamp_(-1, self.bins)
        return t.long() + 1

    # ---- accumulation -------------------------------------------------------------------
    def _slots(self) -> int:
        return self.bins + 2

    def _ensure_buffer(self, device: torch.device) -> Tensor:
        if self._buf is None:
            size = self.num_layers * (self.num_experts * (self._slots() + 1) + 1)
            self._buf = torch.zeros(size, dtype=torch.int64, device=self._device or device)
        return self._buf

    def _views(self, buf: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(counts [L, E, bins+2], loads [L, E], tokens [L]) views of one flat int64 buffer."""
        L, E, S = self.num_layers, self.num_experts, self._slots()
        counts = buf[: L * E * S].view(L, E, S)
        loads = buf[L * E * S : L * E * (S + 1)].view(L, E)
        tokens = buf[L * E * (S + 1) :]
        return counts, loads, tokens

    @torch.compiler.disable  # a compiled model calls it eagerly (the histogram update stays one eager region)
    @torch.no_grad()
    def observe(self, layer_idx: int, scores: Tensor, bias: Tensor) -> None:
        """Add one routed batch of a layer to this step's histograms.

        scores: [m, E] router sigmoid scores (fp32; any leading dims are flattened);
        bias: [E] the selection bias these tokens were routed with.
        """
        check_observation(layer_idx, self.num_layers, scores, bias, self.num_experts)
        E = self.num_experts
        scores = scores.detach().reshape(-1, E)
        buf = self._ensure_buffer(scores.device)
        counts, loads, tokens = self._views(buf)
        u, picks = biased_margins(scores.to(buf.device), bias.detach().to(buf.device), self.top_k)
        flat = self.bin_index(u) + torch.arange(E, device=buf.device) * self._slots()
        # index_add_, not bincount: on CUDA bincount reads the largest index back to the host, a stall of
        # the GPU queue in every MoE layer of every forward (integer adds: deterministic all the same)
        if self.estimator == "exact":
            self._margins.setdefault(layer_idx, []).append(u)
        else:
            counts[layer_idx].view(-1).index_add_(0, flat.flatten(), torch.ones_like(flat).flatten())
        loads[layer_idx].index_add_(0, picks.flatten(), torch.ones_like(picks).flatten())
        tokens[layer_idx] += scores.shape[0]

    # ---- the update ---------------------------------------------------------------------
    def quantiles(self, counts: Tensor, tokens: Tensor) -> Tensor:
        """Q_{1-k/E} of the biased margin per expert from histograms.

        counts: [..., E, bins+2] int64; tokens: [...] the number of margins per expert.
        Returns [..., E] float64 in margin units (clamped to [lo, hi]).
        """
        cum = counts.cumsum(-1).double()
        # m*(E-k) is an exact integer, so r is exact whenever E divides it.
        rank = (tokens * (self.num_experts - self.top_k)).double().div(self.num_experts).unsqueeze(-1)
        j = (cum < rank.unsqueeze(-1)).sum(-1).clamp_(max=self._slots() - 1)  # [..., E]
        prev = torch.where(j > 0, cum.gather(-1, (j - 1).clamp(min=0).unsqueeze(-1)).squeeze(-1), 0.0)
        inside = counts.gather(-1, j.unsqueeze(-1)).squeeze(-1).double().clamp(min=1)
        frac = ((rank - prev) / inside).clamp_(0, 1)
        g = self._g_lo + ((j - 1).double() + frac) * self._g_width
        value = self._unwarp(g)
        value = torch.where(j == 0, torch.full_like(value, self.lo), value)
        return torch.where(j == self._slots() - 1, torch.full_like(value, self.hi), value)

    @torch.no_grad()
    def step(
        self,
        biases: Mapping[int, Tensor] | Sequence[Tensor | None],
        all_reduce: Callable[[Tensor], None] | None = None,
    ) -> dict[int, Tensor]:
        """Turn this step's histograms into new biases, written in place; reset the histograms.

        biases: {layer_idx: bias buffer [E]} or a list indexed by layer (None = no MoE layer);
        they must be the biases the observed tokens were routed with. all_reduce: in-place sum
        over data-parallel ranks of one flat int64 tensor (e.g.
        ``lambda t: torch.distributed.all_reduce(t)``); every rank must call step() with the same
        balancer configuration. Layers with no observed tokens keep their bias.
        Returns {layer_idx: new bias}; load_balance() then reports the observed batch.
        """
        targets = layer_biases(biases, self.num_layers, self.num_experts)
        if self._buf is None:
            device = next(iter(targets.values())).device if targets else torch.device("cpu")
            self._ensure_buffer(device)
        if all_reduce is not None:
            if self.estimator == "exact":
                raise ValueError("estimator='exact' needs every score in one process; use 'histogram' across ranks")
            all_reduce(self._buf)
        counts, loads, tokens = self._views(self._buf)
        q = self.quantiles(counts, tokens) if self.estimator == "histogram" else None
        self._record_balance(loads, tokens)
        observed = tokens.cpu()  # one device sync for all layers
        out = {}
        for i, b in targets.items():
            if int(observed[i]) > 0:
                qi = q[i] if q is not None else _order_statistic(torch.cat(self._margins[i]), self.num_experts, self.top_k)
                b.sub_((self.rate * qi.double()).to(device=b.device, dtype=b.dtype))
            out[i] = b
        self._buf.zero_()
        self._margins.clear()
        self.steps += 1
        return out

    def _record_balance(self, loads: Tensor, tokens: Tensor) -> None:
        self.last_balance, self.last_cv = balance_stats(loads, tokens, self.top_k)

    def load_balance(self) -> dict[int, float]:
        """Max load / mean load per observed layer of the last step()'s batch (1.0 = perfect)."""
        return {i: float(v) for i, v in enumerate(self.last_balance.tolist()) if not math.isnan(v)}

    def load_cv(self) -> dict[int, float]:
        """Coefficient of variation (std/mean) of the expert loads per observed layer of the last step()."""
        return {i: float(v) for i, v in enumerate(self.last_cv.tolist()) if not math.isnan(v)}

    # ---- checkpointing ------------------------------------------------------------------
    def _config(self) -> dict[str, Any]:
        return dict(num_layers=self.num_layers, num_experts=self.num_experts, top_k=self.top_k,
                    bins=self.bins, lo=self.lo, hi=self.hi, spacing=self.spacing, scale=self.scale,
                    estimator=self.estimator, rate=self.rate)

    def state_dict(self) -> dict[str, Any]:
        """Config, step count, last balance and any histograms accumulated so far (on CPU).
        (estimator="exact": the margins of a step in progress are not saved; save between steps.)"""
        return dict(config=self._config(), steps=self.steps, last_balance=self.last_balance.clone(),
                    last_cv=self.last_cv.clone(), buffer=None if self._buf is None else self._buf.cpu().clone())

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a state_dict() taken from a balancer with the same configuration."""
        saved = dict(estimator="histogram", rate=1.0) | dict(state["config"])  # older states lack these keys
        if saved != self._config():
            raise ValueError(f"state['config']: {saved} does not match {self._config()}")
        self.steps = int(state["steps"])
        self.last_balance = state["last_balance"].clone().to(torch.float64)
        self.last_cv = state.get("last_cv", torch.full_like(self.last_balance, float("nan"))).clone()
        buf = state["buffer"]
        if buf is None:
            self._buf = None
        else:
            device = self._device or (self._buf.device if self._buf is not None else torch.device("cpu"))
            self._buf = buf.to(device=device, dtype=torch.int64).clone()
