"""Expert parallel over the `ep` group, with MoonEP-style exact balance (spec §12).

`EPExperts` replaces a LatentMoE's `RoutedExperts` from outside: rank r of R keeps experts
[r*E/R, (r+1)*E/R) ("home" rank of expert e: e // (E/R)). Token-expert pairs travel in the latent
width L (after the latent down-projection) with `all_to_all_single`:

* plain (balanced=False): every pair goes to its expert's home; buffers are padded to the static
  worst case S*K rows per destination (S tokens per rank, K = top-k), i.e. S*K*R per rank.
* MoonEP (balanced=True): from the step's global per-expert counts (one all-gather of an [E]
  vector) every rank computes the same plan in which each rank processes exactly S*K pairs:
  homes keep their experts' pairs up to S*K, the overflow is spread over ranks with spare room,
  which then hold redundant copies. The copies' weights are fetched from their home ranks with an
  all_to_all before compute; autograd returns their gradients to the home rank in backward.
  Dispatch/combine buffers hold exactly S*K rows per rank (the split sizes vary, the totals do not).

Results equal the dense `RoutedExperts.forward` up to fp32 reduction order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from k3.distributed.fsdp import EP_LOCAL
from k3.model.common import glu_act
from k3.model.moe import LatentMoE, RoutedExperts


class _AllToAll(torch.autograd.Function):
    """all_to_all_single along dim 0 with explicit split sizes; backward sends gradients back."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):  # noqa: ANN001 - autograd signature
        ctx.meta = (out_splits, in_splits, group)
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001
        out_splits, in_splits, group = ctx.meta
        gi = g.new_empty((sum(in_splits),) + tuple(g.shape[1:]))
        dist.all_to_all_single(gi, g.contiguous(), in_splits, out_splits, group=group)
        return gi, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    return _AllToAll.apply(x, out_splits, in_splits, group)


def plan_balanced(counts: torch.Tensor, num_ranks: int) -> list[list[tuple[int, int]]]:
    """MoonEP-style plan: counts [E] pairs per expert (global, summing to R * C) -> for every rank
    the (expert, pairs) slots it processes, in order, summing to exactly C. Homes come first
    (expert e's home is e // (E / R)); overflow fills ranks with spare room in rank order, so a
    rank's redundant experts are the ones whose overflow it takes. Deterministic (same on all ranks)."""
    E = counts.numel()
    total = int(counts.sum())
    if E % num_ranks or total % num_ranks:
        raise ValueError(f"counts: {E} experts / {total} pairs must divide over {num_ranks} ranks")
    cap, per = total // num_ranks, E // num_ranks
    c = counts.tolist()
    slots: list[list[tuple[int, int]]] = [[] for _ in range(num_ranks)]
    room = [cap] * num_ranks
    overflow: list[tuple[int, int]] = []
    for e in range(E):
        h = e // per
        keep = min(c[e], room[h])
        if keep:
            slots[h].append((e, keep))
            room[h] -= keep
        if c[e] > keep:
            overflow.append((e, c[e] - keep))
    r = 0
    for e, n in overflow:
        while n:
            while room[r] == 0:
                r += 1
            take = min(n, room[r])
            slots[r].append((e, take))
            room[r] -= take
            n -= take
    return slots


class EPExperts(nn.Module):
    """Drop-in for RoutedExperts holding E/R experts: forward(z [N, L], idx [N, k], w [N, k]) ->
    [N, L] fp32. Every rank of `group` must call it with the same N (static shapes)."""

    def __init__(self, dense: RoutedExperts, group: dist.ProcessGroup, balanced: bool = True) -> None:
        super().__init__()
        R, r = dist.get_world_size(group), dist.get_rank(group)
        E = dense.w1.shape[0]
        if E % R:
            raise ValueError(f"num_experts={E} must be divisible by ep={R}")
        self.group, self.R, self.rank, self.E, self.per = group, R, r, E, E // R
        self.balanced = balanced
        sl = slice(r * self.per, (r + 1) * self.per)
        for n in ("w1", "w3", "w2"):
            p = nn.Parameter(getattr(dense, n).detach()[sl].clone())
            setattr(p, EP_LOCAL, True)
            setattr(self, n, p)
        self.act, self.beta, self.beta_lin = dense.act, dense.beta, dense.beta_lin
        # QAT's hooks (k3.quant.qat), as on RoutedExperts: weights -> weights, and the expert-GEMM inputs
        # (the latent tokens, before the dispatch: row-local, so it commutes with it; the GLU output)
        self.weight_transform = dense.weight_transform
        self.input_transform = dense.input_transform
        self.last_load: dict[str, float] = {}

    def weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        f = self.weight_transform
        return (self.w1, self.w3, self.w2) if f is None else (f(self.w1), f(self.w3), f(self.w2))

    def _transform_input(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.input_transform is None else self.input_transform(x)

    # ---- routing plan ------------------------------------------------------------------------------
    def _destinations(self, flat: torch.Tensor, counts_all: torch.Tensor, slots) -> torch.Tensor:
        """Destination rank of each of this rank's pairs (flat expert ids [P]) under `slots`."""
        dest = torch.empty_like(flat)
        before = counts_all[: self.rank].sum(0)  # pairs of each expert on lower source ranks
        by_expert: dict[int, list[tuple[int, int]]] = {}
        for rank, items in enumerate(slots):
            for e, n in items:
                by_expert.setdefault(e, []).append((rank, n))
        order = torch.argsort(flat, stable=True)
        sorted_e = flat[order]
        starts = torch.searchsorted(sorted_e, torch.arange(self.E, device=flat.device))
        for e in torch.unique(flat).tolist():
            mine = order[starts[e]: starts[e] + int(counts_all[self.rank, e])]
            pos = int(before[e]) + torch.arange(mine.numel(), device=flat.device)
            ranks = torch.tensor([rk for rk, _ in by_expert[e]], device=flat.device)
            bounds = torch.cumsum(torch.tensor([n for _, n in by_expert[e]], device=flat.device), 0)
            dest[mine] = ranks[torch.searchsorted(bounds, pos, right=True)]
        return dest

    def _fetch(self, slots) -> tuple[dict[int, tuple[torch.Tensor, ...]], torch.Tensor | None]:
        """Weights of every expert this rank computes (its own plus fetched redundant copies), and
        a zero-valued anchor that ties the fetch into the dispatch's autograd graph."""
        w1, w3, w2 = self.weights()
        own = {self.rank * self.per + i: (w1[i], w3[i], w2[i]) for i in range(self.per)}
        if not self.balanced:
            return own, None
        need = [sorted({e for e, _ in items if e // self.per != rk}) for rk, items in enumerate(slots)]
        send = [[e for e in need[d] if e // self.per == self.rank] for d in range(self.R)]
        recv = [[e for e in need[self.rank] if e // self.per == h] for h in range(self.R)]
        if not any(need):  # the plan is global: every rank skips the exchange together
            return own, None
        flat = torch.cat([w1.flatten(1), w3.flatten(1), w2.flatten(1)], 1)  # [E/R, P]
        idx = torch.tensor([e - self.rank * self.per for d in send for e in d], dtype=torch.long, device=flat.device)
        got = all_to_all(flat[idx], [len(x) for x in recv], [len(x) for x in send], self.group)
        n1, n2 = w1[0].numel(), w2[0].numel()
        for row, e in enumerate(e for h in recv for e in h):
            a, b, c = got[row].split([n1, n1, n2])
            own[e] = (a.view_as(w1[0]), b.view_as(w3[0]), c.view_as(w2[0]))
        # Backward collectives must run in the same order on every rank, and even on a rank that
        # received no copy (so that it still returns gradients home): the anchor makes the
        # fetch's backward run right after the dispatch's, everywhere.
        return own, got.sum() * 0

    # ---- forward ---------------------------------------------------------------------------------------
    def forward(self, z: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        N, k = idx.shape
        P = N * k
        flat = idx.reshape(-1)
        local_counts = torch.bincount(flat, minlength=self.E)
        gathered = [torch.empty_like(local_counts) for _ in range(self.R)]
        dist.all_gather(gathered, local_counts, group=self.group)
        counts_all = torch.stack(gathered)  # [R, E]
        totals = counts_all.sum(0)
        home_load = totals.view(self.R, self.per).sum(1).float()
        self.last_load = {"max_over_mean_plain": float(home_load.max() / home_load.mean())}
        if self.balanced:
            slots = plan_balanced(totals.cpu(), self.R)
            dest = self._destinations(flat, counts_all, slots)
            self.last_load["max_over_mean_balanced"] = 1.0
        else:
            slots = [[(e, int(totals[e])) for e in range(rk * self.per, (rk + 1) * self.per)] for rk in range(self.R)]
            dest = torch.div(flat, self.per, rounding_mode="floor")
        weights, anchor = self._fetch(slots)
        order = torch.argsort(dest, stable=True)  # my pairs grouped by destination
        send_counts = torch.bincount(dest, minlength=self.R)
        token = order // k
        x_send, e_send = self._transform_input(z)[token], flat[order]
        if anchor is not None:
            x_send = x_send + anchor.to(x_send.dtype)
        if self.balanced:
            all_send = [torch.empty_like(send_counts) for _ in range(self.R)]
            dist.all_gather(all_send, send_counts, group=self.group)
            in_splits = send_counts.tolist()
            out_splits = [int(t[self.rank]) for t in all_send]
        else:  # static padding: S*K rows for every destination
            pad = torch.repeat_interleave(torch.arange(self.R, device=z.device) * P, send_counts)
            slot = pad + torch.arange(P, device=z.device) - torch.repeat_interleave(
                torch.cumsum(send_counts, 0) - send_counts, send_counts)
            x_pad = z.new_zeros(self.R * P, z.shape[1]).index_copy(0, slot, x_send)
            e_pad = torch.full((self.R * P,), -1, dtype=flat.dtype, device=z.device).index_copy(0, slot, e_send)
            x_send, e_send = x_pad, e_pad
            in_splits = out_splits = [P] * self.R
        x_recv = all_to_all(x_send, out_splits, in_splits, self.group)
        e_recv = all_to_all(e_send, out_splits, in_splits, self.group)
        y_recv = self._compute(x_recv, e_recv, weights)
        y_back = all_to_all(y_recv, in_splits, out_splits, self.group)
        if not self.balanced:
            y_back = y_back[slot]
        contrib = y_back.float() * w.reshape(-1)[order, None]
        return torch.zeros(N, y_back.shape[1], dtype=torch.float32, device=z.device).index_add_(0, token, contrib)

    def _compute(self, x: torch.Tensor, e: torch.Tensor, weights) -> torch.Tensor:
        """Expert outputs for received rows x [M, L] with expert ids e [M] (-1 = padding row)."""
        y = x.new_zeros(x.shape[0], self.w2.shape[1])
        order = torch.argsort(e, stable=True)
        ids, counts = torch.unique_consecutive(e[order], return_counts=True)
        start = 0
        for ex, c in zip(ids.tolist(), counts.tolist()):
            rows = order[start: start + c]
            start += c
            if ex < 0:
                continue
            w1, w3, w2 = weights[ex]
            xe = x[rows]
            h = glu_act(xe @ w1.t(), xe @ w3.t(), self.act, self.beta, self.beta_lin)
            y = y.index_copy(0, rows, self._transform_input(h) @ w2.t())
        return y


def apply_expert_parallel(model: nn.Module, group: dist.ProcessGroup, balanced: bool = True) -> list[EPExperts]:
    """Swap every LatentMoE's RoutedExperts for an EPExperts over `group`; returns them."""
    out = []
    for m in list(model.modules()):
        if isinstance(m, LatentMoE) and isinstance(m.experts, RoutedExperts):
            m.experts = EPExperts(m.experts, group, balanced)
            out.append(m.experts)
    return out
