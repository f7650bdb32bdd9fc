"""KDA context parallelism building blocks: affine segment transforms (spec §11).

Per head a contiguous segment maps its entering state to its leaving state affinely,
S_out = M S_in + S_ext, with M = A_last ... A_first (A_t = (I - beta_t k_t k_t^T) Diag(exp g_t))
and S_ext the state reached from S_in = 0. A transform is the pair (S_ext [N, H, K, V],
M [N, H, K, K]); composition is associative, so a sequence split across ranks is stitched by
a prefix scan over per-rank transforms (fixed size H*K*(K+V), independent of segment length):
each rank folds its predecessors' transforms into its initial state, then runs its own chunks.

All functions are differentiable (autograd carries gradients back through M and S_ext).
Packed documents: a segment's transform is per sequence of its `cu_seqlens`; stitching
documents across ranks (resetting at document starts) is the caller's job.
"""

from __future__ import annotations

import torch

from k3.ops.kda.chunk_torch import ChunkLayout, chunk_parts, compute_dtype, validate

Transform = tuple[torch.Tensor, torch.Tensor]  # (S_ext [N, H, K, V], M [N, H, K, K])


def compose(first: Transform, second: Transform) -> Transform:
    """The transform of running `first`'s segment and then `second`'s:
    (S2, M2) o (S1, M1) = (M2 S1 + S2, M2 M1)."""
    S1, M1 = first
    S2, M2 = second
    return torch.matmul(M2, S1) + S2, torch.matmul(M2, M1)


def apply_transform(t: Transform, state: torch.Tensor) -> torch.Tensor:
    """M @ state + S_ext; state [N, H, K, V]."""
    S_ext, M = t
    return torch.matmul(M, state.to(M.dtype)) + S_ext


def chain_transforms(transforms: list[Transform]) -> list[Transform]:
    """Inclusive prefix scan: element r is the transform of segments 0..r run in order."""
    out: list[Transform] = []
    for t in transforms:
        out.append(t if not out else compose(out[-1], t))
    return out


def segment_initial_states(transforms: list[Transform],
                           initial_state: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The state entering each segment, given every segment's transform in order.

    Segment 0 starts from `initial_state` (zeros when None); segment r from
    M_{r-1} (... (M_0 S_0 + S_ext_0) ...) + S_ext_{r-1}. Returns R tensors [N, H, K, V] in the
    transforms' dtype. The state after the last segment is apply_transform(transforms[-1], out[-1]).
    """
    if not transforms:
        raise ValueError("transforms must hold at least one segment's (S_ext, M)")
    S_ext0 = transforms[0][0]
    S = torch.zeros_like(S_ext0) if initial_state is None else initial_state.to(S_ext0.dtype)
    if S.shape != S_ext0.shape:
        raise ValueError(f"initial_state must be {list(S_ext0.shape)}; got {list(S.shape)}")
    states = [S]
    for t in transforms[:-1]:
        states.append(apply_transform(t, states[-1]))
    return states


def _fold_chunks(M: torch.Tensor, E: torch.Tensor) -> Transform:
    """Compose per-chunk transforms along dim 1 by a pairwise tree (log2 steps, batched).

    M: [N, n, H, K, K]; E: [N, n, H, K, V] in chunk order. Returns (S_ext, M) [N, H, ...].
    """
    while M.shape[1] > 1:
        if M.shape[1] % 2:
            eye = torch.eye(M.shape[-1], dtype=M.dtype, device=M.device).expand_as(M[:, :1])
            M = torch.cat((M, eye), 1)
            E = torch.cat((E, torch.zeros_like(E[:, :1])), 1)
        E, M = compose((E[:, 0::2], M[:, 0::2]), (E[:, 1::2], M[:, 1::2]))
    return E[:, 0], M[:, 0]


def kda_segment_transform(
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    *,
    chunk_size: int = 16,
) -> Transform:
    """Affine transform of a segment: S_out = M S_in + S_ext, per sequence and head.

    Args:
        k: [B, T, H, K] (L2-normalised); v: [B, T, H, V]; g: [B, T, H, K] log-decay <= 0;
        beta: [B, T, H]; cu_seqlens: [N + 1] packed sequences (B == 1), else N = B.
        chunk_size: chunk length of the internal WY/UT form (a multiple of 16).
    Returns:
        S_ext [N, H, K, V] and M [N, H, K, K], float32 (float64 for float64 k). An empty
        sequence has the identity transform.
    """
    N = validate(None, k, v, g, beta, None, cu_seqlens, chunk_size)
    B, T, H, K = k.shape
    V = v.shape[-1]
    dt = compute_dtype(k)
    eye = torch.eye(K, dtype=dt, device=k.device).expand(H, K, K)
    lay = ChunkLayout.build(B, T, cu_seqlens, chunk_size, k.device)
    if lay.max_chunks == 0:
        return torch.zeros(N, H, K, V, dtype=dt, device=k.device), eye.expand(N, H, K, K).clone()
    kc, vc, gc, bc = (lay.to_chunks(x, dt) for x in (k, v, g, beta))
    M, E = chunk_parts(kc, vc, gc.cumsum(-2), bc)[:2]
    return _fold_chunks(lay.to_grid(M, eye), lay.to_grid(E, E.new_zeros(H, K, V)))
