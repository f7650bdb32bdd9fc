"""Per-request logits adjustments for the batched sampler: presence / frequency penalties,
`logit_bias`, `min_tokens` and grammar masks (structured outputs, `k3.serve.structured`).

`make_adjust` looks at the rows of one sampling call and returns None when no row needs a change,
so a batch of plain requests samples from the model's logits untouched (no copy, no mask). Only
the rows that ask for something are modified; the changes are applied to a copy of the logits
after the forward (outside any CUDA graph).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch


def needs_adjust(req: Any) -> bool:
    """req: a scheduler Request (duck-typed: `.params`, `.constraint`)."""
    return req.params.adjusts_logits or req.constraint is not None


def make_adjust(reqs: Sequence[Any], eos_id: int | None) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """reqs: the requests of the rows of one sampling call, in row order (`.params`, `.out_ids`,
    `.constraint` with `allowed(vocab) -> bool [vocab] | None`). Returns logits [N, V] float32 ->
    adjusted copy, or None when no row changes. Grammar masks of all constrained rows are computed
    together (`batch_bias` of the constraint type) and added to the logits at once."""
    rows = [(i, r) for i, r in enumerate(reqs) if needs_adjust(r)]
    if not rows:
        return None

    def adjust(logits: torch.Tensor) -> torch.Tensor:
        logits = logits.clone()
        vocab = logits.shape[-1]
        grammar = []  # (row, request): constrained rows without other adjustments, masked together
        for i, r in rows:
            if r.params.adjusts_logits:  # rare: penalties / bias / min_tokens, row by row
                allowed = r.constraint.allowed(vocab) if r.constraint is not None else None
                logits[i] = adjust_row(logits[i], r, eos_id, allowed)
            else:
                grammar.append((i, r))
        if grammar:
            cons = [r.constraint for _, r in grammar]
            which, bias = type(cons[0]).batch_bias(cons, vocab, logits.device)
            if which and len(which) == logits.shape[0]:
                logits += bias
            elif which:
                idx = torch.tensor([grammar[k][0] for k in which], device=logits.device)
                logits.index_add_(0, idx, bias)
        return logits

    return adjust


def adjust_row(row: torch.Tensor, req: Any, eos_id: int | None, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """One row: logits [V] float32 -> adjusted [V] (penalties, bias, min_tokens, then the grammar mask
    `allowed` bool [V]). The grammar mask wins: when the other changes leave no allowed token, only the
    mask is applied."""
    p, vocab = req.params, row.shape[-1]
    out = row.clone()
    if (p.presence_penalty or p.frequency_penalty) and req.out_ids:
        counts = torch.bincount(torch.tensor(req.out_ids, device=row.device), minlength=vocab)[:vocab].float()
        out -= p.presence_penalty * (counts > 0).float() + p.frequency_penalty * counts
    if p.logit_bias:
        ids = [t for t in p.logit_bias if 0 <= t < vocab]
        if ids:
            out[torch.tensor(ids, device=row.device)] += torch.tensor(
                [p.logit_bias[t] for t in ids], device=row.device)
    if p.min_tokens and len(req.out_ids) < p.min_tokens:
        stops = [t for t in p.stop_token_ids if 0 <= t < vocab]
        if eos_id is not None and not p.ignore_eos and eos_id < vocab:
            stops.append(eos_id)
        if stops:
            out[torch.tensor(stops, device=row.device)] = float("-inf")
    if allowed is not None:
        allowed = allowed.to(row.device)
        masked = out.masked_fill(~allowed, float("-inf"))
        if not torch.isfinite(masked).any():
            masked = row.masked_fill(~allowed, float("-inf"))
        out = masked
    return out
