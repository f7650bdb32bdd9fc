"""Fused KDA decode: one token, or a short span (T <= 16) for speculative verification.

Serving layout: the recurrent states live in a pool `state_pool` [num_slots, H, K, V] fp32 and each
sequence b of the batch owns slot `state_indices[b]` (negative = padding row: skipped, output 0).
The kernel reads the slot, runs the token recurrence of reference.py over the T positions with the
state in registers, and (optionally) writes the state after the last position back in place and /
or the state after every position to `intermediate` [B, T, H, K, V] fp32, from which the engine
commits the state of the last accepted draft position with `commit_states`.

Prologue fusion as in chunk_kda: in-kernel gate (bounded K3 form, or the Kimi-Linear softplus form
when lower_bound is None), q/k L2 norm, beta sigmoid.  No bound is needed here (no factorisation).
The launch makes no host synchronisation and allocates only its outputs, so it can be captured in a
CUDA graph.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from k3.ops.backend import triton_runs_on

__all__ = ["fused_recurrent_kda", "commit_states"]

MAX_SPAN = 16


@triton.jit
def _kda_recurrent(
    q, k, v, g, beta, A_log, dt_bias, pool, idx, o, inter,
    scale, lower_bound, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
    GATE: tl.constexpr, L2: tl.constexpr, BSIG: tl.constexpr,
    WRITE: tl.constexpr, INTER: tl.constexpr,
):
    i_bh = tl.program_id(0)
    i_v = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    slot = tl.load(idx + i_b).to(tl.int64)
    valid = slot >= 0
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    p_kv = o_k[:, None] * V + o_v[None, :]
    p_s = (tl.maximum(slot, 0) * H + i_h) * (K * V) + p_kv
    m_s = (tl.zeros([K, BV], dtype=tl.int64) + slot) >= 0
    S = tl.load(pool + p_s, mask=m_s, other=0.0).to(tl.float32)
    if GATE > 0:
        a = tl.exp(tl.load(A_log + i_h).to(tl.float32))
        bias = tl.load(dt_bias + i_h * K + o_k).to(tl.float32)
    for t in range(T):
        base = (i_b * T + t).to(tl.int64) * H + i_h
        b_q = tl.load(q + base * K + o_k).to(tl.float32)
        b_k = tl.load(k + base * K + o_k).to(tl.float32)
        b_g = tl.load(g + base * K + o_k).to(tl.float32)
        b_v = tl.load(v + base * V + o_v).to(tl.float32)
        b_b = tl.load(beta + base).to(tl.float32)
        if GATE == 1:
            b_g = lower_bound * tl.sigmoid(a * (b_g + bias))
        elif GATE == 2:
            x = b_g + bias
            b_g = -a * tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
        if L2:
            b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q, axis=0) + 1e-6)
            b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, axis=0) + 1e-6)
        if BSIG:
            b_b = tl.sigmoid(b_b)
        S = S * tl.exp(b_g)[:, None]
        u = b_b * (b_v - tl.sum(S * b_k[:, None], axis=0))
        S = S + b_k[:, None] * u[None, :]
        b_o = tl.sum(S * b_q[:, None], axis=0) * scale
        tl.store(o + base * V + o_v, tl.where(valid, b_o, 0.0).to(o.dtype.element_ty))
        if INTER:
            tl.store(inter + base * (K * V) + p_kv, S)
    if WRITE:
        tl.store(pool + p_s, S, mask=m_s)


@triton.jit
def _kda_commit(pool, idx, inter, nacc, T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                BV: tl.constexpr):
    i_bh = tl.program_id(0)
    i_v = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    slot = tl.load(idx + i_b).to(tl.int64)
    n = tl.minimum(tl.load(nacc + i_b), T)
    p_kv = tl.arange(0, K)[:, None] * V + i_v * BV + tl.arange(0, BV)[None, :]
    zero = tl.zeros([K, BV], dtype=tl.int64)
    ok = ((zero + slot) >= 0) & ((zero + n) > 0)
    src = ((i_b * T + tl.maximum(n - 1, 0)).to(tl.int64) * H + i_h) * (K * V) + p_kv
    dst = (tl.maximum(slot, 0) * H + i_h) * (K * V) + p_kv
    S = tl.load(inter + src, mask=ok, other=0.0)
    tl.store(pool + dst, S, mask=ok)


def _check(q, k, v, g, beta, state_pool, state_indices, A_log, dt_bias, lower_bound):
    if q.dim() != 4 or k.shape != q.shape or g.shape != q.shape:
        raise ValueError(f"q, k, g must be [B, T, H, K]; got {list(q.shape)}, {list(k.shape)}, {list(g.shape)}")
    B, T, H, K = q.shape
    if not 1 <= T <= MAX_SPAN:
        raise ValueError(f"decode span T must be in [1, {MAX_SPAN}], got {T}")
    if v.dim() != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"v must be [B={B}, T={T}, H={H}, V]; got {list(v.shape)}")
    V = v.shape[-1]
    for name, d in (("K", K), ("V", V)):
        if d < 16 or d > 128 or d & (d - 1):
            raise ValueError(f"head dim {name}={d} must be a power of two in [16, 128]")
    if beta.shape != (B, T, H):
        raise ValueError(f"beta must be [B, T, H] = {[B, T, H]}; got {list(beta.shape)}")
    if state_pool.dim() != 4 or state_pool.shape[1:] != (H, K, V) or state_pool.dtype != torch.float32:
        raise ValueError(f"state_pool must be fp32 [num_slots, {H}, {K}, {V}]; "
                         f"got {state_pool.dtype} {list(state_pool.shape)}")
    if not state_pool.is_contiguous():
        raise ValueError("state_pool must be contiguous (it is updated in place)")
    if state_indices.shape != (B,) or state_indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"state_indices must be int32/int64 [B={B}]; "
                         f"got {state_indices.dtype} {list(state_indices.shape)}")
    if A_log is not None:
        if dt_bias is None or A_log.shape != (H,) or dt_bias.numel() != H * K:
            raise ValueError(f"the in-kernel gate needs A_log [{H}] and dt_bias [{H * K}]")
        if lower_bound is not None and not -5.0 <= float(lower_bound) < 0.0:
            raise ValueError(f"lower_bound must be in [-5, 0), got {lower_bound}")
    elif dt_bias is not None or lower_bound is not None:
        raise ValueError("dt_bias / lower_bound are only meaningful with A_log (in-kernel gate)")
    if q.device.type == "cpu" and not triton_runs_on(q):
        raise ValueError("triton KDA decode on CPU tensors needs TRITON_INTERPRET=1")


DEC_BV: int | None = None  # value block of the decode kernel; None: `_bv`'s rule (tests set one)
DEC_WARPS = 4


def _bv(V: int, programs: int) -> int:
    """Value-block width: 64, narrower while that leaves fewer than 4 programs per SM (wider blocks move
    the state closer to the copy bandwidth, docs/kda_kernels.md); DEC_BV, when set, overrides."""
    if DEC_BV is not None:
        return min(V, DEC_BV)
    bv = min(V, 64)
    while bv > 16 and programs * (V // bv) < 528:
        bv //= 2
    return bv


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    state_indices: torch.Tensor,
    *,
    scale: float | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    write_state: bool = True,
    return_intermediate_states: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Decode step(s) of KDA against a slot pool (inference only, no autograd).

    Args:
        q, k, g: [B, T, H, K] (T <= 16); v: [B, T, H, V]; beta: [B, T, H]; conventions as chunk_kda
            (g is the raw gate input when A_log is given; lower_bound None -> softplus gate).
        state_pool: [num_slots, H, K, V] fp32, read at `state_indices` and, if `write_state`,
            overwritten in place with the state after position T - 1.
        state_indices: [B] int32/int64 slot per sequence; < 0 marks a padding row.
        return_intermediate_states: also return the state after every position.
    Returns:
        o [B, T, H, V] in v's dtype (0 on padding rows); intermediate [B, T, H, K, V] fp32 or None.
    """
    _check(q, k, v, g, beta, state_pool, state_indices, A_log, dt_bias, lower_bound)
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else float(scale)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    o = torch.empty(B, T, H, V, device=q.device, dtype=v.dtype)
    inter = torch.empty(B, T, H, K, V, device=q.device, dtype=torch.float32) if return_intermediate_states else None
    gate = 0 if A_log is None else (1 if lower_bound is not None else 2)
    BV = _bv(V, B * H)
    dummy = state_pool
    _kda_recurrent[(B * H, V // BV)](
        q, k, v, g, beta, A_log if gate else dummy, dt_bias.contiguous() if gate else dummy,
        state_pool, state_indices, o, inter if inter is not None else dummy,
        scale, float(lower_bound or 0.0), T,
        H=H, K=K, V=V, BV=BV, GATE=gate, L2=bool(use_qk_l2norm_in_kernel),
        BSIG=bool(use_beta_sigmoid_in_kernel), WRITE=bool(write_state), INTER=inter is not None,
        num_warps=DEC_WARPS,
    )
    return o, inter


def commit_states(state_pool: torch.Tensor, state_indices: torch.Tensor, intermediate: torch.Tensor,
                  num_accepted: torch.Tensor) -> None:
    """After verification: state_pool[state_indices[b]] = intermediate[b, num_accepted[b] - 1].

    Rows with a negative slot or num_accepted[b] == 0 are left untouched.
    Args:
        state_pool: [num_slots, H, K, V] fp32; intermediate: [B, T, H, K, V] fp32;
        state_indices, num_accepted: [B] int.
    """
    B, T, H, K, V = intermediate.shape
    if state_pool.shape[1:] != (H, K, V) or state_indices.shape != (B,) or num_accepted.shape != (B,):
        raise ValueError("commit_states: shapes of state_pool / state_indices / num_accepted do not match intermediate")
    BV = _bv(V, B * H)
    _kda_commit[(B * H, V // BV)](state_pool, state_indices, intermediate.contiguous(), num_accepted, T,
                                  H=H, K=K, V=V, BV=BV, num_warps=4)
