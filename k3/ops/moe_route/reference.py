"""MoE routing bookkeeping, the spec.

Top-k selection: the k experts of each token with the largest choice values (sigmoid score + the
selection-only bias), in descending order of value; equal values keep the smaller expert id first
(a stable descending sort), -0.0 equals +0.0 and NaN counts as larger than +inf (torch's order):

    idx[n] = stable_sort(choice[n] (+ bias), descending)[:k]          [N, E] fp32 -> [N, k] int64

Slot sort: the N*k (token, choice) slots in expert order, stably (slots of one expert keep their
flat order n*k + j, i.e. token order, since a token picks each expert at most once):

    order  = argsort(idx.reshape(-1), stable)     [N*k] int64, the slot at each sorted position
    inv    = order^-1                             [N*k] int64, the sorted position of each slot
    counts = bincount(idx.reshape(-1), E)         [E] int64
"""

from __future__ import annotations

import torch


def topk_route_reference(choice: torch.Tensor, k: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """choice [N, E] (fp32, or a narrower float widened to fp32), bias [E] or None -> ids [N, k] int64."""
    c = choice.float() if bias is None else choice.float() + bias.float()
    return torch.sort(c, dim=-1, descending=True, stable=True).indices[:, :k]


def sort_slots_reference(idx: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """idx [N, k] integer expert ids in [0, num_experts) -> (order, inv, counts), all int64."""
    flat = idx.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    return order, inv, torch.bincount(flat, minlength=num_experts)
