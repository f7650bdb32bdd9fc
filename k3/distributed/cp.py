"""Context parallel over the `cp` group (spec §11): each packed row is split into `cp` contiguous
segments of equal length, one per rank; documents may cross segment edges.

* KDA: every rank computes the affine transform (S_ext, M) of its LAST local document piece
  (k3.ops.kda.cp.kda_segment_transform), the transforms are all-gathered (fixed size H*K*(K+V)),
  and rank r folds its predecessors' in order, S <- M_j S + S_ext_j, restarting from S_ext_j where
  a document starts inside rank j's segment and from 0 where one starts exactly at r's first
  token. That state enters r's first local document. Backward is the mirrored scan, which
  autograd derives through the differentiable all-gather (gradients summed over ranks).
* Short conv: the previous rank's last W-1 pre-conv q|k|v inputs (a halo, zeroed before the
  document start) become the conv history of the first local document.
* MLA: the latent (kv_lora_rank + rope wide, the small per-token KV) is all-gathered over the
  row; local queries attend to it with a causal, same-document mask in row coordinates.

The single-device modules are untouched: `apply_context_parallel` swaps the `forward` of every
KDAttention and GatedMLA instance for the versions here.
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
import torch.nn as nn

from k3.model.cache import SeqLayout
from k3.model.common import linear_residual, rms_norm
from k3.model.kda import KDAttention, causal_conv_silu
from k3.model.mla import GatedMLA, _sdpa
from k3.ops.kda import kda, kda_gate, l2norm
from k3.ops.kda.cp import kda_segment_transform


class _AllGather(torch.autograd.Function):
    """[*] -> [R, *] over `group`; backward sums the gradient over ranks and keeps this rank's slice."""

    @staticmethod
    def forward(ctx, x, group):  # noqa: ANN001 - autograd signature
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001
        g = g.contiguous()
        dist.all_reduce(g, group=ctx.group)
        return g[dist.get_rank(ctx.group)], None


def all_gather(x: torch.Tensor, group) -> torch.Tensor:
    return _AllGather.apply(x, group)


def segment_flags(row_cu: list[int], seg_len: int, R: int) -> tuple[list[bool], list[bool]]:
    """(continues, starts_doc) per rank for a row of R segments with document boundaries row_cu."""
    bounds = set(row_cu)
    edges = [j * seg_len for j in range(R + 1)]
    starts = [e in bounds for e in edges[:-1]]
    cont = [not starts[j] and not any(edges[j] < b < edges[j + 1] for b in bounds) for j in range(R)]
    return cont, starts


def fold_predecessors(S_ext: torch.Tensor, M: torch.Tensor, rank: int, continues: list[bool],
                      starts_doc: list[bool]) -> torch.Tensor:
    """Prefix scan of segment transforms: S_ext [R, H, K, V] and M [R, H, K, K] of every rank's
    last local document piece -> the state [H, K, V] entering `rank`'s first token.

    continues[j]: rank j's whole segment continues a document begun earlier (compose with M_j);
    otherwise a document starts inside it (restart from S_ext_j). starts_doc[rank]: a document
    starts at rank's first token (state 0)."""
    S = torch.zeros_like(S_ext[0])
    for j in range(rank):
        S = (M[j] @ S if continues[j] else 0 * S) + S_ext[j]
    return S * 0 if starts_doc[rank] else S


class CPContext:
    """Where this rank's segment sits in its row; set once per batch by `Parallel.local_batch`."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group, self.R, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.row_cu: torch.Tensor | None = None

    def set(self, row_cu: torch.Tensor, seg_start: int, seg_len: int) -> None:
        """row_cu: [m+1] boundaries of the whole row (cp * seg_len tokens)."""
        if int(row_cu[-1]) != seg_len * self.R:
            raise ValueError(f"row_cu ends at {int(row_cu[-1])}, expected {seg_len * self.R}")
        self.row_cu, self.seg_start, self.seg_len = row_cu.to(torch.long), seg_start, seg_len
        self.continues, self.starts_doc = segment_flags(self.row_cu.tolist(), seg_len, self.R)
        self.doc_start = int(self.row_cu[self.row_cu <= seg_start].max())
        pos = torch.arange(seg_len * self.R, device=row_cu.device)
        self.doc_id = torch.searchsorted(self.row_cu, pos, right=True) - 1

    def halo(self, last: torch.Tensor) -> torch.Tensor:
        """last: this rank's last W-1 pre-conv inputs [W-1, C] -> the previous rank's, with rows
        before the current document's start zeroed (zeros on rank 0 / at a document start)."""
        got = all_gather(last, self.group)
        anchor = got.sum() * 0  # keeps the backward collective on every rank
        if self.rank == 0:
            return torch.zeros_like(last) + anchor
        w = last.shape[0]
        first = self.seg_start - w  # row position of halo row 0
        keep = (torch.arange(w, device=last.device) + first >= self.doc_start).to(last.dtype)
        return got[self.rank - 1] * keep[:, None] + anchor

    def initial_state(self, S_ext: torch.Tensor, M: torch.Tensor) -> torch.Tensor:
        """This rank's (S_ext [H, K, V], M [H, K, K]) of its last local document -> the state
        [H, K, V] entering its first local document (prefix scan over the predecessors)."""
        GS, GM = all_gather(S_ext, self.group), all_gather(M, self.group)
        anchor = (GS.sum() + GM.sum()) * 0  # keeps the backward collectives on every rank
        return fold_predecessors(GS, GM, self.rank, self.continues, self.starts_doc) + anchor

    def attention_mask(self) -> torch.Tensor:
        """[seg_len, R*seg_len] bool: query (row position seg_start + i) sees key j iff j <= its
        position and both lie in the same document."""
        q = torch.arange(self.seg_start, self.seg_start + self.seg_len, device=self.doc_id.device)
        k = torch.arange(self.doc_id.numel(), device=self.doc_id.device)
        return (k[None, :] <= q[:, None]) & (self.doc_id[k][None, :] == self.doc_id[q][:, None])


def _check(layout: SeqLayout, cache) -> None:
    if cache is not None:
        raise ValueError("context parallel is for training forwards: cache must be None")
    if layout.cu_seqlens is None:
        raise ValueError("context parallel needs packed input with cu_seqlens")


def kda_cp_forward(self: KDAttention, x: torch.Tensor, layout: SeqLayout, cache=None,
                   residual: torch.Tensor | None = None) -> torch.Tensor:
    """KDAttention.forward on this rank's segment of the row (see module docstring)."""
    _check(layout, cache)
    ctx: CPContext = self._k3_cp
    B, T, _ = x.shape
    H, K = self.num_heads, self.head_dim
    qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
    conv_w = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight], dim=0)
    W = conv_w.shape[-1]
    if T < W - 1:
        raise ValueError(f"context-parallel segments need >= {W - 1} tokens, got {T}")
    halo = ctx.halo(qkv[0, T - (W - 1):])
    N = layout.num_seqs
    tail = torch.cat([halo[None], halo.new_zeros(N - 1, W - 1, halo.shape[-1])])
    qkv, _ = causal_conv_silu(qkv, conv_w, layout, tail)
    q, k, v = (t.reshape(B, T, H, K) for t in qkv.split(H * K, dim=-1))
    f = self.f_b_proj(self.f_a_proj(x)).reshape(B, T, H, K)
    b = self.b_proj(x).float()
    cu_host = layout.cu_seqlens_cpu if layout.cu_seqlens_cpu is not None else layout.cu_seqlens.cpu()
    s = int(cu_host[-2])  # start of the last local document piece
    S_ext, M = kda_segment_transform(l2norm(k[:, s:]), v[:, s:], kda_gate(f[:, s:], self.A_log, self.dt_bias,
                                     self.lower_bound), torch.sigmoid(b[:, s:]))
    init = ctx.initial_state(S_ext[0], M[0])
    initial = torch.cat([init[None], init.new_zeros(N - 1, *init.shape)])
    o, _ = kda(q, k, v, f, b, initial_state=initial, cu_seqlens=layout.cu_seqlens, cu_seqlens_cpu=cu_host,
               A_log=self.A_log, dt_bias=self.dt_bias, lower_bound=self.lower_bound,
               use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, backend=self.kda_backend)
    gate = torch.sigmoid(self.g_proj(x).float()).reshape(B, T, H, K)
    o = (rms_norm(o.float(), self.o_norm.weight, self.eps) * gate).to(x.dtype)
    return linear_residual(o.reshape(B, T, H * K), self.o_proj.weight, residual)


def mla_cp_forward(self: GatedMLA, x: torch.Tensor, layout: SeqLayout, cache=None,
                   residual: torch.Tensor | None = None) -> torch.Tensor:
    """GatedMLA.forward with keys/values from the all-gathered latent of the whole row."""
    _check(layout, cache)
    ctx: CPContext = self._k3_cp
    q, lat = self._q(x), self._latent(x)
    full = all_gather(lat[0], ctx.group).flatten(0, 1)[None]  # [1, R*T, D]
    k, v = self._expand(full)
    o = _sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), ctx.attention_mask(), causal=False,
              scale=self.scale)
    return self._out(x, o.transpose(1, 2), residual)


def apply_context_parallel(model: nn.Module, group: dist.ProcessGroup) -> CPContext:
    """Install the context-parallel forwards on every KDA and MLA mixer; returns the shared context
    (its `set` must be called with each batch's row layout before the forward)."""
    ctx = CPContext(group)
    for m in model.modules():
        if isinstance(m, (KDAttention, GatedMLA)):
            m._k3_cp = ctx
            fn = kda_cp_forward if isinstance(m, KDAttention) else mla_cp_forward
            m.forward = types.MethodType(fn, m)
    return ctx
