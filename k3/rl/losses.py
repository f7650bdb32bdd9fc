"""RL losses: group-normalised advantages and the truncated-importance-sampling policy gradient with
staleness masking (spec k3_posttraining.md §2; equations and choices in docs/rl.md).

Notation: a batch of B response rows, T token positions each. μ is the behaviour policy (the
engine's log-probs recorded when each token was sampled, with the weight version v_t that produced
it), π_θ the policy being trained, s_t = v_now − v_t the token's staleness.

    ρ_t = exp(log π_θ(y_t) − log μ(y_t))
    w_t = sg(min(ρ_t, C))                                      truncated IS weight
    m_t = 1[1/C' <= ρ_t <= C'] · 1[s_t <= S_max] · response_mask_t
    L   = −(1/N) Σ_rows Σ_t m_t · w_t · Â_row · log π_θ(y_t)      N = Σ response_mask (all response tokens)
        + β · (1/N) Σ_t response_mask_t · k3_t                   optional KL to a reference policy

k3_t is Schulman's "k3" estimator of KL(π_θ || π_ref) from samples of π_θ:
k3_t = exp(log π_ref − log π_θ) − (log π_ref − log π_θ) − 1 (>= 0, unbiased when the samples are
on-policy; its gradient flows through log π_θ).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PGConfig:
    """clip_c: C, the truncation of the importance weight (> 1). mask_c: C', tokens with ρ outside
    [1/C', C'] are masked (>= clip_c; inf = never). max_staleness: S_max, tokens older than this many
    weight versions are masked. kl_coef: β of the KL-to-reference term (0 = off). adv_eps: ε of the
    group normalisation."""

    clip_c: float = 2.0
    mask_c: float = 8.0
    max_staleness: int = 4
    kl_coef: float = 0.0
    adv_eps: float = 1e-6

    def validate(self) -> "PGConfig":
        if not self.clip_c > 1:
            raise ValueError(f"clip_c must be > 1, got {self.clip_c}")
        if not self.mask_c >= self.clip_c:
            raise ValueError(f"mask_c must be >= clip_c ({self.clip_c}), got {self.mask_c}")
        if not isinstance(self.max_staleness, int) or self.max_staleness < 0:
            raise ValueError(f"max_staleness must be an integer >= 0, got {self.max_staleness!r}")
        if self.kl_coef < 0 or self.adv_eps <= 0:
            raise ValueError("kl_coef must be >= 0 and adv_eps > 0")
        return self


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """rewards [num_groups, G] -> Â [num_groups, G] = (r − mean_G r) / (std_G r + ε).

    std is the population standard deviation over the group (divide by G): a group whose samples all
    got the same reward has Â = 0 (it carries no learning signal). G = 1 gives zeros."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [num_groups, G], got shape {tuple(rewards.shape)}")
    r = rewards.double()
    mean = r.mean(dim=1, keepdim=True)
    std = r.std(dim=1, unbiased=False, keepdim=True)
    return ((r - mean) / (std + eps)).to(rewards.dtype)


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator per token: exp(d) − d − 1 with d = ref_logp − logp (same shapes)."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def pg_loss(logp: torch.Tensor, behaviour_logp: torch.Tensor, advantages: torch.Tensor,
            response_mask: torch.Tensor, staleness: torch.Tensor, cfg: PGConfig,
            ref_logp: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The truncated-IS policy-gradient loss above.

    logp [B, T] fp32: log π_θ of the response tokens (differentiable). behaviour_logp [B, T]: log μ.
    advantages [B]: Â per row (the same for every token of the row), or [B, T] per token (packed rows
    holding several attempts carry each attempt's Â on its tokens). response_mask [B, T] bool: the
    model's own tokens (prompt, tool results and padding are False). staleness [B, T] int: s_t.
    ref_logp [B, T] or None: log π_ref (needed when cfg.kl_coef > 0).
    Returns (scalar loss, metrics): clip_frac (tokens whose weight was truncated at C), mask_frac
    (tokens masked by the ratio or staleness bound), stale_masked_frac, mean_ratio, mean/max
    staleness, kl (mean k3 when a reference is given) — all over response tokens."""
    if not (logp.shape == behaviour_logp.shape == response_mask.shape == staleness.shape):
        raise ValueError("logp, behaviour_logp, response_mask and staleness must have the same [B, T] shape")
    if advantages.shape == logp.shape[:1]:
        advantages = advantages[:, None]
    elif advantages.shape != logp.shape:
        raise ValueError(f"advantages must be [B] or [B, T] = {list(logp.shape)}, got {list(advantages.shape)}")
    resp = response_mask.bool()
    n = resp.sum().clamp(min=1).to(logp.dtype)
    log_ratio = (logp.detach() - behaviour_logp).masked_fill(~resp, 0.0)
    ratio = torch.exp(log_ratio)
    w = ratio.clamp(max=cfg.clip_c)
    in_band = (ratio >= 1.0 / cfg.mask_c) & (ratio <= cfg.mask_c)
    fresh = staleness <= cfg.max_staleness
    keep = resp & in_band & fresh
    coef = torch.where(keep, w * advantages.to(logp.dtype), torch.zeros_like(w))
    loss = -(coef * logp).sum() / n
    metrics = _metrics(resp, ratio, keep, fresh, staleness, cfg, n)
    if cfg.kl_coef > 0:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 needs ref_logp")
        kl = (kl_k3(logp, ref_logp) * resp).sum() / n
        loss = loss + cfg.kl_coef * kl
        metrics["kl"] = float(kl.detach())
    return loss, metrics


def _metrics(resp: torch.Tensor, ratio: torch.Tensor, keep: torch.Tensor, fresh: torch.Tensor,
             staleness: torch.Tensor, cfg: PGConfig, n: torch.Tensor) -> dict[str, float]:
    nf = float(n)
    stale = staleness[resp].float()
    return {
        "clip_frac": float((resp & (ratio > cfg.clip_c)).sum()) / nf,
        "mask_frac": float((resp & ~keep).sum()) / nf,
        "stale_masked_frac": float((resp & ~fresh).sum()) / nf,
        "mean_ratio": float(ratio[resp].mean()) if resp.any() else 1.0,
        "staleness_mean": float(stale.mean()) if stale.numel() else 0.0,
        "staleness_max": float(stale.max()) if stale.numel() else 0.0,
        "tokens": nf,
    }


__all__ = ["PGConfig", "group_advantages", "kl_k3", "pg_loss"]
