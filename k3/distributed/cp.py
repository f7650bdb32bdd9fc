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

The layers run their own forward; `CPContext` is the `k3.model.segment.SegmentHooks` they ask for
that history (`apply_context_parallel` sets it on every KDAttention and GatedMLA).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from k3.model.cache import SeqLayout
from k3.model.kda import KDAttention
from k3.model.mla import GatedMLA
from k3.ops.kda import kda_gate, l2norm
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

    # -- k3.model.segment.SegmentHooks ------------------------------------------------------------
    def conv_history(self, qkv: torch.Tensor, width: int, layout: SeqLayout) -> torch.Tensor:
        """qkv [1, T, C] pre-conv inputs -> [N, W-1, C]: the halo for the first local document, zeros
        for the others (they start on this rank)."""
        _check_packed(layout)
        T = qkv.shape[1]
        if T < width - 1:
            raise ValueError(f"context-parallel segments need >= {width - 1} tokens, got {T}")
        halo = self.halo(qkv[0, T - (width - 1):])
        return torch.cat([halo[None], halo.new_zeros(layout.num_seqs - 1, width - 1, halo.shape[-1])])

    def kda_initial_state(self, layer: KDAttention, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor,
                          b: torch.Tensor, layout: SeqLayout) -> torch.Tensor:
        """[N, H, K, V]: the folded predecessors' state for the first local document, zeros after."""
        _check_packed(layout)
        cu = layout.cu_seqlens_cpu if layout.cu_seqlens_cpu is not None else layout.cu_seqlens.cpu()
        s = int(cu[-2])  # start of the last local document piece
        g = kda_gate(f[:, s:], layer.A_log, layer.dt_bias, layer.lower_bound)
        S_ext, M = kda_segment_transform(l2norm(k[:, s:]), v[:, s:], g, torch.sigmoid(b[:, s:]))
        init = self.initial_state(S_ext[0], M[0])
        return torch.cat([init[None], init.new_zeros(layout.num_seqs - 1, *init.shape)])

    def mla_kv_source(self, latent: torch.Tensor, layout: SeqLayout) -> tuple[torch.Tensor, torch.Tensor]:
        """latent [1, T, D] -> (the whole row's latents [1, R*T, D], `attention_mask()`)."""
        _check_packed(layout)
        return all_gather(latent[0], self.group).flatten(0, 1)[None], self.attention_mask()


def _check_packed(layout: SeqLayout) -> None:
    if layout.cu_seqlens is None:
        raise ValueError("context parallel needs packed input with cu_seqlens")


def apply_context_parallel(model: nn.Module, group: dist.ProcessGroup) -> CPContext:
    """Set one shared `CPContext` as the segment hooks of every KDA and MLA mixer; returns it (its
    `set` must be called with each batch's row layout before the forward)."""
    ctx = CPContext(group)
    for m in model.modules():
        if isinstance(m, (KDAttention, GatedMLA)):
            m.segment_hooks = ctx
    return ctx
