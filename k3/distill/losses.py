"""On-policy distillation loss (spec k3_posttraining.md §5; choices in docs/distill.md).

The student π_θ samples y ~ μ (the engine); the routed teacher π_T scores the same tokens. Per
response token t of sequence i (|y_i| response tokens):

    d_t = log π_θ(y_t | s_t) − log π_T(y_t | s_t)          per-token reverse-KL estimate (k1)
    L   = −(1/B) Σ_i (1/|y_i|) Σ_t m_t · w_t · sg(log π_T − log π_θ)_t · log π_θ(y_t | s_t)

w_t = sg(min(ρ_t, C)) with ρ_t = π_θ/μ, and m_t masks tokens whose ρ_t leaves [1/C', C'] or whose
staleness exceeds S_max — exactly the truncated IS of the RL loss (`k3.rl.losses.PGConfig` holds
C, C', S_max); w_t = 1 when μ = π_θ. B counts the sequences with at least one response token.

Why this estimator: E_y~π_θ[Σ_t d_t] = KL(π_θ || π_T) over whole responses; its score-function
gradient with the per-token "reward" −d_t and no reward-to-go (discount 0, as in Thinking
Machines' on-policy distillation) is −E[Σ_t (−d_t) ∇ log π_θ(y_t)], which is the gradient of L
above. The loss value is 0 whenever student and teacher agree on every token (d_t = 0), and so is
its gradient.
"""

from __future__ import annotations

import torch

from k3.rl.losses import PGConfig


def is_weights(logp: torch.Tensor, behaviour_logp: torch.Tensor, response_mask: torch.Tensor,
               staleness: torch.Tensor, cfg: PGConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(w [B, T] fp32 detached: min(ρ, C) on kept tokens, 0 elsewhere; keep [B, T] bool).

    ρ = exp(log π_θ − log μ) (detached). keep = response token, ρ in [1/C', C'], staleness <= S_max."""
    resp = response_mask.bool()
    log_ratio = (logp.detach() - behaviour_logp).masked_fill(~resp, 0.0)
    ratio = torch.exp(log_ratio)
    keep = resp & (ratio >= 1.0 / cfg.mask_c) & (ratio <= cfg.mask_c) & (staleness <= cfg.max_staleness)
    w = torch.where(keep, ratio.clamp(max=cfg.clip_c), torch.zeros_like(ratio))
    return w, keep


def opd_loss(logp: torch.Tensor, teacher_logp: torch.Tensor, behaviour_logp: torch.Tensor,
             response_mask: torch.Tensor, staleness: torch.Tensor, seq_ids: torch.Tensor,
             cfg: PGConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss L above.

    logp [B, T] fp32: log π_θ of each token (differentiable). teacher_logp [B, T]: log π_T of the
    same tokens (no gradient needed). behaviour_logp [B, T]: log μ. response_mask [B, T] bool: the
    student's sampled tokens. staleness [B, T] int. seq_ids [B, T] long: which sequence each token
    belongs to (packed rows hold several; values in [0, S)); the 1/|y_i| normalisation is per sequence.
    Returns (scalar loss, metrics): reverse_kl (mean d_t over response tokens, unweighted),
    seq_kl (mean over sequences of Σ_t d_t), mask_frac, clip_frac, sequences."""
    if not (logp.shape == teacher_logp.shape == behaviour_logp.shape == response_mask.shape
            == staleness.shape == seq_ids.shape):
        raise ValueError("logp, teacher_logp, behaviour_logp, response_mask, staleness and seq_ids must share "
                         f"one [B, T] shape, got {[tuple(t.shape) for t in (logp, teacher_logp, behaviour_logp)]}")
    resp = response_mask.bool()
    w, keep = is_weights(logp, behaviour_logp, resp, staleness, cfg)
    adv = (teacher_logp.to(logp.dtype) - logp.detach()).masked_fill(~resp, 0.0)  # sg(log π_T − log π_θ)
    n_seq = int(seq_ids.max()) + 1 if seq_ids.numel() else 0
    flat_ids = seq_ids.reshape(-1).long()
    lengths = torch.zeros(n_seq, dtype=logp.dtype, device=logp.device).index_add_(
        0, flat_ids, resp.reshape(-1).to(logp.dtype))
    has = lengths > 0
    b = has.sum().clamp(min=1).to(logp.dtype)
    inv_len = torch.where(has, 1.0 / lengths.clamp(min=1), torch.zeros_like(lengths))[flat_ids].view_as(logp)
    loss = -(w * adv * inv_len * logp.masked_fill(~resp, 0.0)).sum() / b
    d = (-adv).masked_fill(~resp, 0.0)
    seq_sum = torch.zeros(n_seq, dtype=logp.dtype, device=logp.device).index_add_(0, flat_ids, d.reshape(-1))
    ntok = max(int(resp.sum()), 1)
    metrics = {
        "reverse_kl": float(d.sum()) / ntok,
        "seq_kl": float(seq_sum[has].mean()) if bool(has.any()) else 0.0,
        "mask_frac": float((resp & ~keep).sum()) / ntok,
        "clip_frac": float((keep & (w >= cfg.clip_c)).sum()) / ntok,
        "sequences": float(has.sum()),
        "tokens": float(resp.sum()),
    }
    return loss, metrics


__all__ = ["is_weights", "opd_loss"]
