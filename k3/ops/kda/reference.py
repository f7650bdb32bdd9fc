"""KDA (Kimi Delta Attention) per-token recurrence: the specification every fast path is tested against.

Per head, with state S in R^{K x V} (fp32 or fp64):
    S' = Diag(exp(g_t)) S_{t-1}
    u_t = beta_t * (v_t - S'^T k_t)
    S_t = S' + k_t u_t^T
    o_t = S_t^T (scale * q_t)
q and k arrive already L2-normalised; g is the natural-log decay per key channel.
"""

from __future__ import annotations

import torch


def kda_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token KDA.

    Args:
        q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H, K] log-decay (<= 0); beta: [B, T, H].
        initial_state: [N, H, K, V] where N = B, or the number of sequences when `cu_seqlens` is given.
        cu_seqlens: [N + 1] int cumulative lengths of packed sequences (requires B == 1).
        dtype: accumulation dtype (float32 or float64).
    Returns:
        o: [B, T, H, V] in v's dtype; final state [N, H, K, V] in `dtype` (or None).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    if cu_seqlens is None:
        bounds = [(b, 0, T) for b in range(B)]
    else:
        if B != 1:
            raise ValueError(f"cu_seqlens requires batch size 1, got B={B}")
        cs = cu_seqlens.tolist()
        bounds = [(0, cs[i], cs[i + 1]) for i in range(len(cs) - 1)]
    qf, kf, vf, gf, bf = (x.to(dtype) for x in (q, k, v, g, beta))
    o = torch.zeros(B, T, H, V, dtype=dtype, device=q.device)
    finals = []
    for n, (b, start, end) in enumerate(bounds):
        if initial_state is not None:
            S = initial_state[n].to(dtype)
        else:
            S = torch.zeros(H, K, V, dtype=dtype, device=q.device)
        for t in range(start, end):
            S = S * gf[b, t].exp()[..., None]
            kt = kf[b, t]
            u = bf[b, t][:, None] * (vf[b, t] - torch.einsum("hk,hkv->hv", kt, S))
            S = S + kt[..., None] * u[:, None, :]
            o[b, t] = torch.einsum("hk,hkv->hv", qf[b, t] * scale, S)
        finals.append(S)
    final = torch.stack(finals) if output_final_state else None
    return o.to(v.dtype), final
