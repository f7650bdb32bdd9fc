"""MLA's key / value expansion without a cache (k3_model.md section 5.2), the spec in plain torch.

The up-projection's output kv = kv_b_proj(c) holds, per head h, [k_nope_h | v_h]; the rope part of the
key (k_pe, one per token, shared by all heads) is appended to each head's k_nope:

    k[t, h] = [kv[t, h, :nope] | k_pe[t]]        ([nope + rope])
    v[t, h] = kv[t, h, nope:]                    ([v])
"""

from __future__ import annotations

import torch


def mla_kv_reference(kv: torch.Tensor, k_pe: torch.Tensor, num_heads: int, nope: int,
                     v_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kv [..., H * (nope + v_dim)], k_pe [..., rope] -> (k [..., H, nope + rope], v [..., H, v_dim])."""
    kv = kv.unflatten(-1, (num_heads, nope + v_dim))
    k_nope, v = kv.split([nope, v_dim], dim=-1)
    k = torch.cat([k_nope, k_pe.unsqueeze(-2).expand(*k_pe.shape[:-1], num_heads, k_pe.shape[-1])], dim=-1)
    return k, v
