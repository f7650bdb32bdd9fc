"""The spec of the grouped GEMMs over expert-sorted rows, as plain per-expert loops.

`offs` [E] int32: each expert's end row (cumulative counts); expert e owns rows offs[e-1] .. offs[e]-1.
"""

from __future__ import annotations

import torch


def check_offs(offs: torch.Tensor, E: int) -> None:
    """offs must be the [E] int32 cumulative row counts of the experts."""
    if offs.dim() != 1 or offs.shape[0] != E or offs.dtype != torch.int32:
        raise ValueError(f"offs must be [{E}] int32 cumulative row counts, got {list(offs.shape)} {offs.dtype}")


def expert_rows(offs: torch.Tensor) -> list[tuple[int, int]]:
    """[(start, end)] row range of each expert (host values)."""
    ends = offs.tolist()
    return list(zip([0] + ends[:-1], ends))


def gmm_reference(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """a [S, K], b [E, K, N] -> [S, N]: rows of expert e times b[e] (fp32 accumulation, a's dtype out);
    rows past offs[-1] are zero."""
    out = a.new_zeros(a.shape[0], b.shape[2])
    for e, (s, t) in enumerate(expert_rows(offs)):
        if t > s:
            out[s:t] = (a[s:t].float() @ b[e].float()).to(a.dtype)
    return out


def wgrad_reference(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """a [S, M], b [S, N] -> [E, M, N] fp32: per expert a[rows]^T @ b[rows] (zero for an empty expert)."""
    rows = expert_rows(offs)
    out = torch.zeros(len(rows), a.shape[1], b.shape[1], dtype=torch.float32, device=a.device)
    for e, (s, t) in enumerate(rows):
        if t > s:
            out[e] = a[s:t].double().t().mm(b[s:t].double()).float()
    return out
