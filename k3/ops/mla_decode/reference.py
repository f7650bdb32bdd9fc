"""Plain float32 reference of weight-absorbed MLA decode attention over a paged latent cache.

This is the attention core of `GatedMLA._absorbed` (k3/model/mla.py) for one query token per row,
with the latents read through a page table instead of a dense gathered tensor:

    c_s, k_s   = cache[table[b, s // page], s % page, :r], cache[..., r:]   for s < lens[b]
    score_h,s  = (q_lat_h . c_s + q_pe_h . k_s) * scale                      (fp32)
    out_h      = sum_s softmax_s(score_h) c_s                                (fp32, [H, r])

The caller absorbs W_uk into q (q_lat = q_nope W_uk) and applies W_uv to `out` afterwards. A row
with lens[b] == 0 (a padding row) attends over nothing and gets zeros.
"""

from __future__ import annotations

import torch

__all__ = ["mla_decode_reference"]


def mla_decode_reference(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, page_tables: torch.Tensor,
                         lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q_lat: [N, H, r] (any float dtype; absorbed no-position query); q_pe: [N, H, rope];
    cache: [num_blocks, page_size, r + rope] latent pages ([latent | k_pe] per token, the pool's layout);
    page_tables: [N, P] int block ids; lens: [N] int valid tokens per row (<= P * page_size).
    Returns [N, H, r] float32. Reads values on the host: a reference, not a fast path."""
    n, h, r = q_lat.shape
    page = cache.shape[1]
    out = torch.zeros(n, h, r, dtype=torch.float32, device=q_lat.device)
    for b in range(n):
        length = int(lens[b])
        if length <= 0:
            continue
        pos = torch.arange(length, device=cache.device)
        blocks = page_tables[b].to(cache.device).long()[pos // page]
        rows = cache[blocks, pos % page].float()  # [S, r + rope]
        c, k_pe = rows[:, :r], rows[:, r:]
        scores = (q_lat[b].float() @ c.T + q_pe[b].float() @ k_pe.T) * scale  # [H, S]
        out[b] = torch.softmax(scores, dim=-1) @ c
    return out
