"""Chain acceptance of speculative drafts (exact: greedy = the target's argmax chain, sampling = the
target's distribution), and drafts that are still on the device (`DraftIds`)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from k3.serve.sampling import SamplingParams, sample_from, target_probs


@dataclass
class DraftIds:
    """A request's greedy drafts still on the device: the first `n` ids of row `row` of `ids` [B, k] long
    (a proposer's output, valid until its next call). The verify step copies them into its input on
    the device and reads them back together with its own argmaxes (one host read per step)."""

    ids: torch.Tensor
    row: int
    n: int

    def __len__(self) -> int:
        return self.n

    def host(self) -> list[int]:
        """The ids as a list (a device read)."""
        return self.ids[self.row, : self.n].tolist()


def accept_draft(logits: torch.Tensor, draft: Sequence[int], params: SamplingParams,
                 rng: random.Random, q: torch.Tensor | None = None) -> tuple[list[int], int]:
    """Chain acceptance for one request. logits: [k + 1, V] float32 (vocab-limited) where row j is
    the target's prediction after the draft's first j tokens; draft: k token ids. q: [k, V] float32,
    the distributions the drafts were drawn from (a learned draft, `k3.serve.draft_spec`), or None for
    a deterministic proposer (a point mass). Returns (tokens to emit: the accepted drafts then one
    target token, number of drafts accepted).

    Greedy: accept while the draft equals the argmax; the emitted token after is the argmax.
    Sampling (p = `target_probs`, the distribution `sample_batch` draws from): draft x is accepted
    with probability min(1, p(x) / q(x)); on rejection the token is drawn from normalise(max(0, p - q))
    (for a point mass: p with x zeroed); after k acceptances a bonus token is drawn from p
    (Leviathan et al. 2023), so every emitted token is distributed as p. Uniforms come from the
    request's rng (one per acceptance test, one per drawn token), so seeded runs repeat.
    """
    k = len(draft)
    if logits.shape[0] != k + 1:
        raise ValueError(f"logits must have len(draft) + 1 = {k + 1} rows, got {logits.shape[0]}")
    if q is not None and q.shape[0] != k:
        raise ValueError(f"q must have len(draft) = {k} rows, got {q.shape[0]}")
    if params.greedy:
        return accept_greedy(logits.argmax(-1).tolist(), draft)
    p = target_probs(logits, [params] * (k + 1))
    rows, cols = torch.arange(k, device=p.device), torch.tensor(list(draft), device=p.device)
    p_draft = p[rows, cols].tolist()
    q_draft = [1.0] * k if q is None else q.to(p.device)[rows, cols].tolist()
    for j in range(k):
        if rng.random() * q_draft[j] < p_draft[j]:  # u < p / q without dividing by a tiny q
            continue
        if q is None:
            residual = p[j].clone()
            residual[draft[j]] = 0.0
        else:
            residual = (p[j] - q[j].to(p.device)).clamp_(min=0.0)
            if not float(residual.sum()) > 0.0:  # only by rounding (p == q would have accepted): draw from p
                residual = p[j]
        return list(draft[:j]) + [sample_from(residual, rng.random())], j
    return list(draft) + [sample_from(p[k], rng.random())], k


def accept_greedy(best: Sequence[int], draft: Sequence[int]) -> tuple[list[int], int]:
    """Greedy chain acceptance: best[j] = the target's argmax after the draft's first j tokens (at least
    len(draft) + 1 entries). Returns (the accepted drafts then the target's own token, drafts accepted)."""
    k = len(draft)
    if len(best) < k + 1:
        raise ValueError(f"best must have len(draft) + 1 = {k + 1} entries, got {len(best)}")
    n = 0
    while n < k and draft[n] == best[n]:
        n += 1
    return list(draft[:n]) + [best[n]], n


