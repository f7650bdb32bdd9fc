"""Learned-draft (EAGLE-3) proposals for the engine's verify path (`k3.serve.speculative`).

The engine captures the target's hidden states at the draft's three layers in every forward that
produces final positions (prefill chunks, decode steps, the accepted part of each verify run) and hands
them to `DraftProposer.observe`. Per request the proposer keeps

* the features of positions the draft has not consumed yet (`pending`, [n, 3H] rows), and
* the draft layer's own KV cache (plain tensors [S, heads, head_dim]; one entry per consumed position).

`propose` then, for all drafted requests at once (right-padded batches):
1. feeds the pending (feature_i, token_{i+1}) pairs through the draft and commits their keys/values:
   the output at the newest position predicts the first draft token d1;
2. runs k - 1 more single-entry steps on its own guesses ((draft hidden, d_j) -> d_{j+1}) against the
   committed cache plus the speculative entries of this call, which are dropped afterwards: the next
   verify run supplies the real features of every accepted position, so the draft never rolls back.

Greedy requests draft the argmax (verification: exact match). Sampled requests draw d_j from
q_j = `target_probs(draft logits, params)` (the request's temperature/top-k/top-p applied to the draft)
with the request's rng and return q, so `accept_draft` applies min(1, p/q) and the residual
max(0, p - q): the output distribution is the target's, whatever the draft's quality.

Positions the draft has no features for (a prefix-cache hit, a decode step that ran in a CUDA graph,
recomputation after preemption) are skipped or start the request's draft context afresh: only the
acceptance rate can suffer, never the output.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence

from k3.model.draft import EagleDraft, check_compatible
from k3.serve.sampling import limit_vocab, sample_from, target_probs


@dataclass
class DraftSeq:
    """One request's draft context: KV of consumed positions, features not consumed yet."""

    k: torch.Tensor | None = None  # [S, heads, head_dim]
    v: torch.Tensor | None = None
    pending: list[torch.Tensor] = field(default_factory=list)  # [n, 3H] rows, contiguous positions
    pending_start: int = 0  # position of pending's first row
    next_pos: int = 0  # position after the last observed one

    @property
    def num_pending(self) -> int:
        return sum(x.shape[0] for x in self.pending)


class DraftProposer:
    """A `k3.serve.speculative.Proposer` backed by an `EagleDraft` attached to `target`.

    num_draft: drafts per request and step (k); vocab_limit: ids the tokenizer can produce (the
    target's logits are limited the same way)."""

    def __init__(self, draft: EagleDraft, target: Any, num_draft: int, vocab_limit: int) -> None:
        if not isinstance(num_draft, int) or isinstance(num_draft, bool) or num_draft < 1:
            raise ValueError(f"the number of draft tokens must be a positive integer, got {num_draft!r}")
        check_compatible(draft.config, target.config)
        if draft.shared is None:
            draft.attach(target)
        self.draft, self.k, self.vocab_limit = draft.eval(), num_draft, vocab_limit
        self.capture_layers = list(draft.config.target_layers)
        self.seqs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Request -> DraftSeq

    # ---- features ---------------------------------------------------------------------------------------
    def observe(self, req: Any, start: int, aux: torch.Tensor) -> None:
        """Record the target states of req's positions start..start + n - 1 (aux [n, 3H])."""
        if aux.shape[0] == 0:
            return
        s = self.seqs.get(req)
        if s is None or start < s.next_pos:  # new, or recomputed from earlier on (preemption): start afresh
            s = self.seqs[req] = DraftSeq(pending_start=start, next_pos=start)
        if start > s.next_pos:  # positions without states in between: the draft skips them
            s.pending, s.pending_start = [], start
        if not s.pending:
            s.pending_start = start
        s.pending.append(aux.detach())
        s.next_pos = start + aux.shape[0]

    # ---- drafting ---------------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, cands: list[tuple[Any, int]]) -> list[tuple[list[int], torch.Tensor | None]]:
        """(request, most drafts) -> (drafts, q [n, V] for sampled requests else None); a request whose
        newest position has no state yet gets no drafts (it decodes plainly and is observed there)."""
        out: list[tuple[list[int], torch.Tensor | None]] = [([], None)] * len(cands)
        rows = [i for i, (r, _) in enumerate(cands) if self._ready(r)]
        if not rows:
            return out
        reqs = [cands[i][0] for i in rows]
        limits = [min(self.k, cands[i][1]) for i in rows]
        h = self._feed(reqs)
        keys, values, valid = self._padded_cache(reqs)
        toks: list[list[int]] = [[] for _ in rows]
        qs: list[list[torch.Tensor]] = [[] for _ in rows]
        for j in range(max(limits)):
            logits = limit_vocab(self.draft.logits(h).float(), self.vocab_limit)
            step = self.sample_drafts(logits, reqs, toks, qs)
            if j + 1 == max(limits):
                break
            hid, k, v = self.draft(step[:, None], h[:, None], keys, values, valid)
            keys, values = torch.cat([keys, k], 1), torch.cat([values, v], 1)
            valid = torch.cat([valid, valid.new_ones(len(reqs), 1)], 1)
            h = hid[:, 0]
        for n, (i, lim) in enumerate(zip(rows, limits)):
            q = torch.stack(qs[n][:lim]) if qs[n] else None
            out[i] = (toks[n][:lim], q)
        return out

    def _ready(self, r: Any) -> bool:
        """The request's features reach its newest computed position (the draft has a prediction point)."""
        s = self.seqs.get(r)
        return s is not None and bool(s.pending) and s.next_pos == r.num_computed and len(r.tokens) > r.num_computed

    def _feed(self, reqs: list[Any]) -> torch.Tensor:
        """Consume every request's pending (feature_i, token_{i+1}) pairs in one right-padded draft forward,
        commit their keys/values; returns the draft hidden at each request's newest entry [B, H]."""
        seqs = [self.seqs[r] for r in reqs]
        aux = [torch.cat(s.pending) for s in seqs]
        ids = [torch.tensor(r.tokens[s.pending_start + 1: s.pending_start + 1 + a.shape[0]], device=a.device)
               for r, s, a in zip(reqs, seqs, aux)]
        n = [a.shape[0] for a in aux]
        feats = self.draft.fuse(pad_sequence(aux, batch_first=True))
        keys, values, valid = self._padded_cache(reqs)
        hid, k, v = self.draft(pad_sequence(ids, batch_first=True), feats, keys, values, valid)
        for b, s in enumerate(seqs):
            s.k = k[b, : n[b]] if s.k is None else torch.cat([s.k, k[b, : n[b]]])
            s.v = v[b, : n[b]] if s.v is None else torch.cat([s.v, v[b, : n[b]]])
            s.pending, s.pending_start = [], s.next_pos
        return hid[torch.arange(len(reqs), device=hid.device), torch.tensor(n, device=hid.device) - 1]

    def _padded_cache(self, reqs: list[Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The requests' committed draft caches right-padded: keys, values [B, S, heads, head_dim] and
        valid [B, S] bool (S may be 0)."""
        c = self.draft.config
        w = self.draft.fc.weight
        empty = w.new_zeros(0, c.num_heads, c.head_dim)
        ks = [self.seqs[r].k if self.seqs[r].k is not None else empty for r in reqs]
        vs = [self.seqs[r].v if self.seqs[r].v is not None else empty for r in reqs]
        lens = torch.tensor([x.shape[0] for x in ks], device=w.device)
        S = int(lens.max()) if len(ks) else 0
        if S == 0:
            z = w.new_zeros(len(reqs), 0, c.num_heads, c.head_dim)
            return z, z, torch.zeros(len(reqs), 0, dtype=torch.bool, device=w.device)
        valid = torch.arange(S, device=w.device)[None] < lens[:, None]
        return pad_sequence(ks, batch_first=True), pad_sequence(vs, batch_first=True), valid

    @staticmethod
    def sample_drafts(logits: torch.Tensor, reqs: list[Any], toks: list[list[int]], qs: list[list[torch.Tensor]]
                ) -> torch.Tensor:
        """One draft token per row (argmax for greedy requests, a draw from q with the request's rng
        otherwise; q appended to qs) -> ids [B]."""
        picks = logits.argmax(-1).tolist()
        for b, r in enumerate(reqs):
            if not r.params.greedy:
                q = target_probs(logits[b: b + 1], [r.params])[0]
                picks[b] = sample_from(q, r.rng.random())
                qs[b].append(q)
            toks[b].append(picks[b])
        return torch.tensor(picks, device=logits.device)
