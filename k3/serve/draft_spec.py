"""Learned-draft (EAGLE-3) proposals for the engine's verify path (`k3.serve.speculative`).

The engine captures the target's hidden states at the draft's three layers in every forward that
produces final positions (prefill chunks, decode steps, the accepted part of each verify run) and hands
them to `DraftProposer.observe`. Per request the proposer keeps the features of positions the draft has
not consumed yet (`pending`) and a row of the static draft KV cache (`DraftKV`).

`propose` then, for all drafted requests at once:
1. feeds the pending (feature_i, token_{i+1}) entries through the draft and writes their keys/values
   into the request's cache row: the output at the newest entry predicts the first draft token d1;
2. runs k - 1 more single-entry steps on its own guesses ((draft hidden, d_j) -> d_{j+1}) against the
   cache row plus the speculative entries of this call, which are never stored: the next verify run
   supplies the real features of every accepted position, so the draft itself never rolls back.

Every shape in (1)-(2) is fixed by the row bucket b (the last <= k + 1 pending entries, k steps): when
the engine decodes in CUDA graphs and every drafted request is greedy, the whole chain (feed, k steps,
argmax) is one captured graph per bucket, read back once (`.tolist()` of [b, k] ids). Sampled requests
run the same code eagerly: d_j ~ q_j = `target_probs(draft logits, params)` (the request's temperature /
top-k / top-p applied to the draft) with the request's rng, returned with q, so `accept_draft` applies
min(1, p/q) and the residual max(0, p - q): the output distribution is the target's whatever the draft.

Positions the draft has no features for (a prefix-cache hit, recomputation after preemption, steps the
engine's batch-size policy ran without speculation: `k3.serve.spec_policy`) are skipped or start the
request's draft context afresh; the cache keeps a window of the last `window`
positions (a ring; the draft attends to about that many). Only the acceptance rate can suffer from
either, never the output.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from k3.model.draft import EagleDraft, attend, check_compatible
from k3.serve.acceptance import DraftIds
from k3.serve.model_runner import bucket_sizes, capture_graph
from k3.serve.sampling import limit_vocab, sample_from, target_probs


@dataclass
class DraftSeq:
    """One request's draft context: its cache row and the features not consumed yet."""

    row: int
    pending: list[torch.Tensor] = field(default_factory=list)  # [n, 3H] rows, contiguous positions
    pending_start: int = 0  # position of pending's first row
    next_pos: int = 0  # position after the last observed one

    @property
    def num_pending(self) -> int:
        return self.next_pos - self.pending_start if self.pending else 0


class DraftKV:
    """The draft layer's KV cache on static buffers: keys/values [rows, window, heads, head_dim] and the
    target position each entry holds ([rows, window] long, -1 = empty). Row 0 is padding (never
    assigned); a request's position p lives at index p % window of its row."""

    def __init__(self, draft: EagleDraft, rows: int, window: int) -> None:
        c, w = draft.config, draft.fc.weight
        self.window = window
        self.k = w.new_zeros(rows + 1, window, c.num_heads, c.head_dim)
        self.v = torch.zeros_like(self.k)
        self.pos = torch.full((rows + 1, window), -1, dtype=torch.long, device=w.device)
        self._free = list(range(rows, 0, -1))
        self._owner: dict[int, weakref.ref] = {}

    def alloc(self, req: Any) -> int | None:
        """A cleared row for `req` (reclaiming rows of finished or collected requests), or None."""
        if not self._free:
            for row, ref in list(self._owner.items()):
                r = ref()
                if r is None or r.status == "finished":
                    del self._owner[row]
                    self._free.append(row)
        if not self._free:
            return None
        row = self._free.pop()
        self._owner[row] = weakref.ref(req)
        self.pos[row] = -1
        return row

    def write(self, rows: torch.Tensor, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store entries: rows [B] long, pos [B, T] long (-1 = padding entry, not stored), k/v [B, T, h, d]."""
        real = pos >= 0
        r = torch.where(real, rows[:, None], torch.zeros_like(pos))  # padding entries go to row 0 as empty
        i = torch.where(real, pos % self.window, torch.zeros_like(pos))
        self.k[r, i], self.v[r, i] = k, v
        self.pos[r, i] = torch.where(real, pos, torch.full_like(pos, -1))


class DraftProposer:
    """A `k3.serve.speculative.Proposer` backed by an `EagleDraft` attached to `target`.

    num_draft: drafts per request and step (k); vocab_limit: ids the tokenizer can produce (the
    target's logits are limited the same way); max_rows: the most requests drafted together (the
    engine's max_running); window: draft KV positions kept per request; graphs: capture the greedy
    chain as CUDA graphs (CUDA only) in `mempool` (the engine runner's, shared)."""

    def __init__(self, draft: EagleDraft, target: Any, num_draft: int, vocab_limit: int, *, max_rows: int = 64,
                 window: int = 1024, graphs: bool = False, mempool: Any = None) -> None:
        if not isinstance(num_draft, int) or isinstance(num_draft, bool) or num_draft < 1:
            raise ValueError(f"the number of draft tokens must be a positive integer, got {num_draft!r}")
        if not isinstance(window, int) or window < 2 * (num_draft + 1):
            raise ValueError(f"the draft window must be an integer >= 2 * (k + 1) = {2 * (num_draft + 1)}, got {window!r}")
        check_compatible(draft.config, target.config)
        if draft.shared is None:
            draft.attach(target)
        self.draft, self.k, self.vocab_limit = draft.eval(), num_draft, vocab_limit
        self.capture_layers = list(draft.config.target_layers)
        self.seqs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Request -> DraftSeq
        self.kv = DraftKV(draft, max_rows, window)
        self.buckets = bucket_sizes(max_rows)
        w, feat = draft.fc.weight, draft.fc.in_features
        self.feed_len = num_draft + 1  # entries fed per request and step (more: fed eagerly before)
        # static inputs: features [R, F, 3H]; ids [R, 2F + 2] = [tokens F | positions F | cache row | newest]
        self._aux = w.new_zeros(max_rows, self.feed_len, feat)
        self._ids = torch.zeros(max_rows, 2 * self.feed_len + 2, dtype=torch.long, device=w.device)
        self.use_graphs = graphs and w.is_cuda
        self.graphs: dict[int, tuple[Any, torch.Tensor]] = {}
        self._mempool = mempool
        self.capture_error: Exception | None = None

    # ---- features ---------------------------------------------------------------------------------------
    def observe(self, req: Any, start: int, aux: torch.Tensor) -> None:
        """Record the target states of req's positions start..start + n - 1 (aux [n, 3H])."""
        if aux.shape[0] == 0:
            return
        s = self.seqs.get(req)
        if s is None or start < s.next_pos:  # new, or recomputed from earlier on (preemption): start afresh
            row = self.kv.alloc(req) if s is None else s.row
            if row is None:
                return  # no free cache row: this request decodes without drafts
            if s is not None:
                self.kv.pos[row] = -1
            s = self.seqs[req] = DraftSeq(row, pending_start=start, next_pos=start)
        if start > s.next_pos:  # positions without states in between: the draft skips them
            s.pending, s.pending_start = [], start
        if not s.pending:
            s.pending_start = start
        s.pending.append(aux.detach())
        s.next_pos = start + aux.shape[0]
        if s.num_pending > 2 * self.kv.window:  # not drafted for long (grammar, penalties): keep the newest
            keep = torch.cat(s.pending)[-self.kv.window:]  # window (the ring would overwrite the rest); bounded memory
            s.pending, s.pending_start = [keep], s.next_pos - keep.shape[0]

    # ---- drafting ---------------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, cands: list[tuple[Any, int]]) -> list[tuple[list[int] | DraftIds, torch.Tensor | None]]:
        """(request, most drafts) -> (drafts, q [n, V] for sampled requests else None); a request whose
        newest position has no state yet gets no drafts (it decodes plainly and is observed there). An
        all-greedy batch gets `DraftIds` (on the device, no host read here), otherwise id lists."""
        out: list[tuple[list[int] | DraftIds, torch.Tensor | None]] = [([], None)] * len(cands)
        rows = [i for i, (r, _) in enumerate(cands) if self._ready(r)][: self.buckets[-1]]
        if not rows:
            return out
        reqs = [cands[i][0] for i in rows]
        limits = [min(self.k, cands[i][1]) for i in rows]
        b = next(x for x in self.buckets if x >= len(reqs))
        self._load(reqs, b)
        if all(r.params.greedy for r in reqs):  # the ids stay on the device: the verify step reads them back
            ids = self._greedy(b)
            for n, (i, lim) in enumerate(zip(rows, limits)):
                out[i] = (DraftIds(ids, n, lim), None)
            return out
        toks: list[list[int]] = [[] for _ in reqs]
        qs: list[list[torch.Tensor]] = [[] for _ in reqs]
        self._chain(b, lambda logits: self.sample_drafts(logits, reqs, toks, qs))
        for n, (i, lim) in enumerate(zip(rows, limits)):
            out[i] = (toks[n][:lim], torch.stack(qs[n][:lim]) if qs[n] else None)
        return out

    def _ready(self, r: Any) -> bool:
        """The request's features reach its newest computed position (the draft has a prediction point)."""
        s = self.seqs.get(r)
        return s is not None and bool(s.pending) and s.next_pos == r.num_computed and len(r.tokens) > r.num_computed

    def _load(self, reqs: list[Any], b: int) -> None:
        """Consume the requests' pending entries: all but the last `feed_len` through the draft now (a
        prompt after prefill; eager), the rest into the static inputs of bucket b (rows past the
        requests: padding, all entries empty)."""
        F = self.feed_len
        host = torch.zeros(b, 2 * F + 2, dtype=torch.long, pin_memory=self._ids.is_cuda)
        host[:, F: 2 * F] = -1
        older = []  # (row, start, aux, ids) fed eagerly first, all requests together
        for n, r in enumerate(reqs):
            s = self.seqs[r]
            aux = torch.cat(s.pending) if len(s.pending) > 1 else s.pending[0]
            start, m = s.pending_start, aux.shape[0]
            ids = r.tokens[start + 1: start + 1 + m]
            if m > F:
                older.append((s.row, start, aux[: m - F], ids[: m - F]))
                aux, ids, start, m = aux[m - F:], ids[m - F:], start + m - F, F
            self._aux[n, :m].copy_(aux)
            host[n, :m] = torch.tensor(ids, dtype=torch.long)
            host[n, F: F + m] = torch.arange(start, start + m)
            host[n, 2 * F], host[n, 2 * F + 1] = s.row, m - 1
            s.pending, s.pending_start = [], s.next_pos
        if older:
            self._prefeed(older)
        self._ids[:b].copy_(host, non_blocking=True)  # pinned: no wait for the device to drain

    def _prefeed(self, items: list[tuple[int, int, torch.Tensor, list[int]]]) -> None:
        """Feed each (cache row, first position, features [m, 3H], next tokens [m]) into its row eagerly:
        all requests in one padded batch per chunk of half the window (a request's chunk c holds its
        entries c * window / 2 ..; padding entries have position -1 and are not stored)."""
        step, dev = self.kv.window // 2, items[0][2].device
        rows = torch.tensor([row for row, _, _, _ in items], device=dev)
        longest = max(aux.shape[0] for _, _, aux, _ in items)
        for a in range(0, longest, step):
            n = min(step, longest - a)
            feats = self._aux.new_zeros(len(items), n, self._aux.shape[-1])
            tok = torch.zeros(len(items), n, dtype=torch.long)
            pos = torch.full((len(items), n), -1, dtype=torch.long)
            for i, (_, start, aux, ids) in enumerate(items):
                m = min(n, aux.shape[0] - a)
                if m > 0:
                    feats[i, :m] = aux[a: a + m]
                    tok[i, :m] = torch.tensor(ids[a: a + m])
                    pos[i, :m] = torch.arange(start + a, start + a + m)
            self._feed(rows, tok.to(dev, non_blocking=True), self.draft.fuse(feats), pos.to(dev, non_blocking=True))

    def _feed(self, rows: torch.Tensor, tok: torch.Tensor, feats: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Entries (feature, token) at positions pos [B, T] (-1: padding) of cache rows [B]: store their keys
        and values, attend causally over the row -> the draft's hidden [B, T, H]."""
        q, k, v = self.draft.qkv(tok, feats)
        self.kv.write(rows, pos, k, v)
        kpos = self.kv.pos[rows]  # [B, W]
        mask = ((kpos[:, None, :] >= 0) & (kpos[:, None, :] <= pos[:, :, None])) | (pos < 0)[:, :, None]
        return self.draft.finish(feats, attend(q, self.kv.k[rows], self.kv.v[rows], mask))

    def _chain(self, b: int, pick) -> list[torch.Tensor]:
        """The static draft chain of bucket b: feed the loaded entries, then k steps; pick(logits [b, V]
        float32, vocabulary-limited) -> ids [b] long chooses each step's tokens. Returns the picks."""
        F = self.feed_len
        ids = self._ids[:b]
        rows, last = ids[:, 2 * F], ids[:, 2 * F + 1]
        hid = self._feed(rows, ids[:, :F], self.draft.fuse(self._aux[:b]), ids[:, F: 2 * F])
        h = hid[torch.arange(b, device=hid.device), last]  # [b, H] at each request's newest entry
        keys, values = self.kv.k[rows], self.kv.v[rows]
        valid = self.kv.pos[rows] >= 0
        picks = []
        for j in range(self.k):
            tok = pick(limit_vocab(self.draft.logits(h).float(), self.vocab_limit))
            picks.append(tok)
            if j + 1 == self.k:
                break
            q, k, v = self.draft.qkv(tok[:, None], h[:, None])
            keys, values = torch.cat([keys, k], 1), torch.cat([values, v], 1)
            valid = torch.cat([valid, valid.new_ones(b, 1)], 1)
            h = self.draft.finish(h[:, None], attend(q, keys, values, valid[:, None]))[:, 0]
        return picks

    def _greedy(self, b: int) -> torch.Tensor:
        """The greedy chain of bucket b -> draft ids [b, k] (device), replayed from a CUDA graph when on."""
        run = lambda: torch.stack(self._chain(b, lambda logits: logits.argmax(-1)), 1)  # noqa: E731
        if not self.use_graphs:
            return run()
        if b not in self.graphs:
            try:
                if self._mempool is None:
                    self._mempool = torch.cuda.graph_pool_handle()
                self.graphs[b] = capture_graph(run, self._aux.device, self._mempool)
            except Exception as e:  # draft eagerly rather than fail every step
                self.use_graphs, self.capture_error = False, e
                return run()
        graph, out = self.graphs[b]
        graph.replay()
        return out

    @staticmethod
    def sample_drafts(logits: torch.Tensor, reqs: list[Any], toks: list[list[int]], qs: list[list[torch.Tensor]]
                      ) -> torch.Tensor:
        """One draft token per row (argmax for greedy requests, a draw from q with the request's rng
        otherwise; q appended to qs) -> ids [B] long. logits [B, V], B >= len(reqs): rows past the
        requests are padding (their argmax is kept, unused)."""
        picks = logits.argmax(-1).tolist()
        for b, r in enumerate(reqs):
            if not r.params.greedy:
                q = target_probs(logits[b: b + 1], [r.params])[0]
                picks[b] = sample_from(q, r.rng.random())
                qs[b].append(q)
            toks[b].append(picks[b])
        return torch.tensor(picks, device=logits.device)
