"""Speculative decoding v1: prompt-lookup (n-gram) drafts, chain verification, lossless acceptance.

A decoding request whose recent tokens repeat something earlier in its context (code edits, quoted
documents, tool results read back) gets up to k draft tokens from `NgramProposer`. The target model
then runs once over [last, d1..dk] (a prefill-like forward on the existing context with logits at
every position) and `accept_draft` keeps the longest prefix of the drafts the target agrees with,
plus one token the target picks itself (the correction at the first rejection, or a bonus token
after k acceptances): up to k + 1 tokens for one forward.

Rolling back the hybrid cache (spec section 7):
* MLA latents: the verify forward writes latents at every draft position; attention reads only the
  first `num_computed` rows of a request's pages (`PagedBatchCache` past + new lengths), so rows of
  rejected drafts are dead and are overwritten when real tokens reach those positions. Pages
  allocated for them stay with the request until it is released.
* KDA recurrent state + conv tail: overwritten in place by every token, so the verifying rows'
  slots are snapshotted before the forward, and every KDA layer records its inputs of the verify
  forward (pre-conv q|k|v, k, v, gate input, beta; `PagedBatchCache.kda_inputs`). When fewer than
  k + 1 tokens are kept (a rejection, or a stop / max_tokens inside the run), the slot is rebuilt from
  the snapshot by replaying only the recurrence and the conv tail over the kept tokens' recorded
  inputs (`KDAttention.replay`), which are exact because nothing before a position depends on what
  follows it: the slot holds the state after exactly the kept prefix (spec section 7.2, "replay").
  The cost is the recurrence over <= k + 1 tokens per KDA layer, not a second model forward.
* Prefix-cache checkpoints are taken only from that rolled-back state (a finishing request donates
  its slot after the rollback), so no checkpoint ever lies inside a rejected draft.

Acceptance is exact: greedy rows reproduce plain greedy decoding token for token; sampled rows draw
from the same target distribution p as `sample_batch` (temperature, top-k, top-p), because a
deterministic proposer is a point mass q: the draft x is accepted with probability p(x), and on
rejection the token is drawn from p with x removed, renormalised (Leviathan et al. 2023).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from k3.serve.acceptance import DraftIds, accept_draft, accept_greedy
from k3.serve.cache_manager import PagedBatchCache
from k3.serve.logits import needs_adjust
from k3.serve.sampling import limit_vocab, token_logprobs

if TYPE_CHECKING:
    from k3.serve.scheduler import Request


class VerifyHost(Protocol):
    """What the verify path uses of its engine (`k3.serve.engine.Engine` provides it): the model, the
    paged cache and its scheduler, metrics, and the two request-level operations below."""

    model: Any  # K3ForCausalLM: .model(ids, cu_seqlens=, cache=) -> (hidden, _), .lm_head
    pool: Any  # BlockPool: read_slots / write_slots of KDA state, .device
    scheduler: Any  # Scheduler: reserve(request, num_tokens) -> bool
    metrics: Any  # EngineMetrics: spec_* counters, prompt_tokens_computed
    layout: Any  # cache layout: .kda_layers
    prefix: Any  # prefix cache or None
    paged_mla: bool
    vocab_limit: int
    device: torch.device
    max_model_len: int

    def append_token(self, req: Request, tok: int, lp: float | None, top: list | None) -> str | None:
        """Record one sampled token -> the finish reason it causes (None: go on); does not finish."""
        ...

    def finish_request(self, req: Request, reason: str, *, donate: bool = True, error: str | None = None) -> None:
        """Finish `req` with `reason`, releasing its pages (donating its state when `donate`)."""
        ...


class NgramProposer:
    """Prompt-lookup drafts: the longest suffix of the tokens (min_match..max_match tokens long) that
    occurred earlier in them, and the up-to-max_draft tokens that followed its most recent earlier
    occurrence."""

    def __init__(self, max_draft: int, min_match: int, max_match: int) -> None:
        for name, v in (("max_draft", max_draft), ("min_match", min_match), ("max_match", max_match)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"NgramProposer {name} must be a positive integer, got {v!r}")
        if max_match < min_match:
            raise ValueError(f"NgramProposer max_match ({max_match}) must be >= min_match ({min_match})")
        self.max_draft, self.min_match, self.max_match = max_draft, min_match, max_match

    def propose(self, tokens: Sequence[int] | np.ndarray, limit: int | None = None) -> list[int]:
        """Draft tokens to follow `tokens` (ids, or an int64 array of them; at most min(max_draft,
        limit) drafts); [] when nothing matches."""
        limit = self.max_draft if limit is None else min(limit, self.max_draft)
        n = len(tokens)
        if limit < 1 or n < self.min_match + 1:
            return []
        arr = np.asarray(tokens, dtype=np.int64)
        ends = np.flatnonzero(arr[:-1] == arr[-1])  # where an earlier occurrence of the suffix could end
        if ends.size == 0:
            return []
        length = np.ones(ends.size, dtype=np.int64)  # matched suffix length at each candidate end
        alive = np.ones(ends.size, dtype=bool)
        for t in range(1, min(self.max_match, n - 1)):
            alive &= ends >= t
            alive[alive] = arr[ends[alive] - t] == arr[n - 1 - t]
            length += alive
            if not alive.any():
                break
        best = int(length.max())
        if best < self.min_match:
            return []
        end = int(ends[length == best].max())  # the most recent occurrence of the longest suffix
        return arr[end + 1: end + 1 + limit].tolist()


class TokenArray:
    """An int64 numpy copy of a growing token list, extended by the new tokens only (the proposer
    would otherwise convert a long context's whole list every step)."""

    def __init__(self) -> None:
        self.buf = np.empty(0, dtype=np.int64)
        self.n = 0

    def sync(self, tokens: Sequence[int]) -> np.ndarray:
        """tokens must extend what the previous call saw (a request's tokens are only appended)."""
        m = len(tokens)
        if m > self.buf.size:
            grown = np.empty(max(m, 2 * self.buf.size), dtype=np.int64)
            grown[: self.n] = self.buf[: self.n]
            self.buf = grown
        if m > self.n:
            self.buf[self.n: m] = tokens[self.n: m]
        self.n = m
        return self.buf[:m]


class Proposer(Protocol):
    """Where drafts come from. capture_layers: target layers whose hidden states the proposer reads
    (`K3Model.forward(hidden_state_layers=...)`; [] = none), handed to `observe` for every computed
    position the engine knows to be final (prefill chunks, decode steps, accepted verify rows)."""

    capture_layers: list[int]

    def propose(self, cands: list[tuple[Request, int]]) -> list[tuple[list[int] | DraftIds, torch.Tensor | None]]:
        """(request, most drafts allowed) -> (draft ids (a list, or `DraftIds` still on the device: greedy
        only), their distributions [n, V] or None = point mass)."""
        ...

    def observe(self, req: Request, start: int, aux: torch.Tensor) -> None:
        """aux [n, len(capture_layers) * H]: the captured states of req's positions start..start+n-1."""
        ...


class NgramSource:
    """Prompt-lookup drafts (`NgramProposer`) as a `Proposer`: deterministic, no captured states."""

    capture_layers: list[int] = []

    def __init__(self, num_draft: int, min_match: int, max_match: int) -> None:
        self.proposer = NgramProposer(num_draft, min_match, max_match)
        self._arrays: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Request -> TokenArray

    def propose(self, cands: list[tuple[Request, int]]) -> list[tuple[list[int], torch.Tensor | None]]:
        return [(self.proposer.propose(self._tokens(r), room), None) for r, room in cands]

    def observe(self, req: Request, start: int, aux: torch.Tensor) -> None:
        pass

    def _tokens(self, r: Request) -> np.ndarray:
        arr = self._arrays.get(r)
        if arr is None:
            arr = self._arrays[r] = TokenArray()
        return arr.sync(r.tokens)


# (Request, drafts: host ids or `DraftIds` on the device, their distributions or None)
Drafted = tuple[Any, "list[int] | DraftIds", "torch.Tensor | None"]


class SpeculativeDecoder:
    """The engine's verify path: drafts for decoding requests (from a `Proposer`), one packed verify
    forward, acceptance, emission (stops and max_tokens honoured inside a run) and the rollback of the
    KDA slots."""

    def __init__(self, engine: VerifyHost, source: Proposer) -> None:
        self.engine, self.source = engine, source
        self.capture_layers = list(source.capture_layers)

    @property
    def proposer(self) -> Any:
        """The n-gram path's `NgramProposer` (replaceable by any object with its `propose(tokens, limit)`,
        e.g. a test oracle), or the learned draft's `DraftProposer`."""
        return self.source.proposer if isinstance(self.source, NgramSource) else self.source

    @proposer.setter
    def proposer(self, value: Any) -> None:
        if isinstance(self.source, NgramSource):
            self.source.proposer = value
        else:
            self.source = value

    def split(self, decode: list[Request]) -> tuple[list[Request], list[Drafted]]:
        """Decode requests -> (those for a plain decode step, (request, drafts, q) for verification).

        A draft never reaches past what the request may still emit (its bonus token included) nor past
        the context limit, and takes pages only from free blocks (no eviction, no preemption)."""
        eng = self.engine
        plain, cands = [], []
        for r in decode:
            room = min(r.max_sampled - len(r.out_ids) - 1, eng.max_model_len - len(r.tokens))
            if r.slot is None or r.pending != 1 or needs_adjust(r) or room < 1:  # adjusted logits: no drafts
                plain.append(r)
            else:
                cands.append((r, room))
        drafted = []
        start = time.perf_counter()
        proposals = self.source.propose(cands) if cands else []
        eng.metrics.spec_propose_seconds += time.perf_counter() - start
        for (r, _), (d, q) in zip(cands, proposals):
            if d and eng.scheduler.reserve(r, r.num_computed + 1 + len(d)):
                drafted.append((r, d, q))
            else:
                plain.append(r)
        return plain, drafted

    def observe_forward(self, batch: list[tuple[Request, int]], hidden: dict[int, torch.Tensor]) -> None:
        """Hand the proposer the captured states of a plain forward: batch (request, new tokens) before
        num_computed advanced; hidden {layer: [1, total, H] packed or [N, 1, H]}."""
        aux = self.features(hidden)
        aux = aux.reshape(-1, aux.shape[-1])
        off = 0
        for r, n in batch:
            self.source.observe(r, r.num_computed, aux[off: off + n])
            off += n

    def observe_rows(self, batch: list[tuple[Request, int]], aux: torch.Tensor) -> None:
        """`observe_forward` for a static step: aux [N, T, F] (the runner's output, a view valid until its
        next step: copied here once), row i's first n_i positions (batch (request, n_i), num_computed not
        yet advanced)."""
        aux = aux.clone()
        for i, (r, n) in enumerate(batch):
            self.source.observe(r, r.num_computed, aux[i, :n])

    def features(self, hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        """The captured layers concatenated: [..., len(capture_layers) * H]."""
        return torch.cat([hidden[i] for i in self.capture_layers], -1)

    def run(self, drafted: list[Drafted]) -> list[Request]:
        """Verify, accept and emit for every (request, drafts, q); returns the requests touched. The verify
        forward runs in the engine's static runner (a CUDA graph on GPU) when it has one and a bucket fits,
        else eagerly (`_run_eager`)."""
        runner = getattr(self.engine, "runner", None)
        if runner is not None and runner.max_new > max(len(d) for _, d, _ in drafted):
            done = self._run_static(drafted, runner)
            if done is not None:
                return done
        return self._run_eager(drafted)

    def _run_static(self, drafted: list[Drafted], runner: Any) -> list[Request] | None:
        """The verify step through `runner` (`k3.serve.model_runner.DecodeRunner.run` + `commit_verify`):
        the same static kernels as a decode step, the per-token KDA states recorded by the forward (the
        rollback selects one, nothing is recomputed). Drafts still on the device (`DraftIds`) go into the
        step's input there; they and the greedy rows' argmaxes come back in one host read. None when no
        bucket fits (nothing was run)."""
        eng, m = self.engine, self.engine.metrics
        start = time.perf_counter()
        reqs = [r for r, _, _ in drafted]
        dev = device_drafts(drafted)
        try:
            out = runner.run([[r.tokens[r.num_computed]] + ([0] * len(d) if dev is not None else d)
                              for r, d, _ in drafted], [r.num_computed for r in reqs],
                             [r.slot for r in reqs], [r.pages for r in reqs], draft_ids=dev)
        except Exception as e:  # a failed forward fails its requests, never the engine
            for r in reqs:
                eng.finish_request(r, "error", donate=False, error=f"{type(e).__name__}: {e}")
            return reqs
        if out is None:
            return None
        raw, aux = out[0], (out[1].clone() if out[1] is not None else None)
        best = raw[..., : eng.vocab_limit].argmax(-1)  # [n, t]: the greedy rows' verdicts (bf16 argmax is exact)
        k = 0 if dev is None else dev.shape[1]
        read = (best if dev is None else torch.cat([dev, best], 1)).tolist()  # the one host read of the step
        kept_all: list[int] = []
        finished: list[tuple[Request, str]] = []
        for i, (r, d, q) in enumerate(drafted):
            d = read[i][: len(d)] if dev is not None else d
            need_rows = not r.params.greedy or r.params.logprobs is not None
            rows = limit_vocab(raw[i, : len(d) + 1], eng.vocab_limit) if need_rows else None
            toks, accepted = accept_greedy(read[i][k:], d) if r.params.greedy else accept_draft(rows, d, r.params,
                                                                                                r.rng, q)
            m.spec_draft_tokens += len(d)
            m.spec_accepted_tokens += accepted
            kept, reason = self._emit(r, rows, toks)
            if aux is not None and reason is None:
                self.source.observe(r, r.num_computed, aux[i, :kept])
            kept_all.append(kept)
            if reason is not None:
                finished.append((r, reason))
        runner.commit_verify(kept_all)  # the state after the kept tokens, before a finishing request donates it
        m.spec_rerun_forwards += any(k < len(d) + 1 for k, (_, d, _) in zip(kept_all, drafted))
        for r, n in zip(reqs, kept_all):
            self._advance(r, n)
        m.spec_verify_forwards += 1
        m.spec_verify_rows += len(drafted)
        for r, reason in finished:
            if r.status != "finished":
                eng.finish_request(r, reason)
        m.spec_verify_seconds += time.perf_counter() - start
        return reqs

    def _run_eager(self, drafted: list[Drafted]) -> list[Request]:
        """The verify step as one packed eager forward, rolled back by replaying the KDA recurrence."""
        eng, m = self.engine, self.engine.metrics
        start = time.perf_counter()
        dev = device_drafts(drafted)
        if dev is not None:
            ids = dev.tolist()
            drafted = [(r, ids[i][: len(d)], q) for i, (r, d, q) in enumerate(drafted)]
        reqs = [r for r, _, _ in drafted]
        try:
            snapshot = eng.pool.read_slots([r.slot for r in reqs]) if eng.layout.kda_layers else None
            record: dict[int, tuple] = {}  # KDA layer -> its inputs in this forward, for the rollback's replay
            logits, aux = self._forward([(r, [r.tokens[r.num_computed]] + d) for r, d, _ in drafted],
                                        capture=bool(self.capture_layers), record=record)
        except Exception as e:  # a failed forward fails its requests, never the engine
            for r in reqs:
                eng.finish_request(r, "error", donate=False, error=f"{type(e).__name__}: {e}")
            return reqs
        logits = limit_vocab(logits, eng.vocab_limit)
        redo: list[tuple[int, int]] = []  # (row, tokens to keep computed)
        finished: list[tuple[Request, str]] = []
        off = 0
        for i, (r, d, q) in enumerate(drafted):
            rows = logits[off: off + len(d) + 1]
            toks, accepted = accept_draft(rows, d, r.params, r.rng, q)
            m.spec_draft_tokens += len(d)
            m.spec_accepted_tokens += accepted
            kept, reason = self._emit(r, rows, toks)
            if aux is not None and reason is None:  # states of the kept positions (computed on accepted tokens)
                self.source.observe(r, r.num_computed, aux[off: off + kept])
            off += len(d) + 1
            if reason is not None:
                finished.append((r, reason))
            # the state must be the one after [last, kept - 1 emitted tokens]; a request that finishes
            # needs it only to donate it to the prefix cache
            if kept < len(d) + 1 and (reason is None or eng.prefix is not None):
                redo.append((i, kept))
            else:
                self._advance(r, kept)
        m.spec_verify_forwards += 1
        m.spec_verify_rows += len(drafted)
        if redo:
            self._rollback(drafted, snapshot, redo, record)
        for r, reason in finished:
            if r.status != "finished":
                eng.finish_request(r, reason)
        m.spec_verify_seconds += time.perf_counter() - start
        return reqs

    def _emit(self, r: Request, rows: torch.Tensor | None, toks: list[int]) -> tuple[int, str | None]:
        """Append the accepted tokens one by one until the request finishes -> (tokens kept, reason)."""
        n = len(toks)
        if r.params.logprobs is None:  # (building the id tensor alone would cost a host->device copy)
            lps, tops = [None] * n, [None] * n
        else:
            lps, tops = token_logprobs(rows[:n], torch.tensor(toks, device=rows.device), [r.params] * n)
        for j, t in enumerate(toks):
            reason = self.engine.append_token(r, t, lps[j], tops[j])
            if reason is not None:
                return j + 1, reason
        return n, None

    def _advance(self, r: Request, n: int) -> None:
        # prompt tokens computed here: only the prompt's last one, on the first decode after prefill
        self.engine.metrics.prompt_tokens_computed += max(0, min(r.num_computed + n, r.prompt_len) - r.num_computed)
        r.num_computed += n

    def _rollback(self, drafted: list[Drafted],
                  snapshot: tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]] | None,
                  redo: list[tuple[int, int]], record: dict[int, tuple]) -> None:
        """Set the KDA slots of the `redo` rows (row, kept tokens) to the state after their kept tokens:
        from the pre-verify snapshot (`BlockPool.read_slots` of all verify rows, {layer: [N, H, K, V]
        fp32}, {layer: [N, W-1, C]}) and the inputs each KDA layer recorded in the verify forward, only
        the recurrence and the conv tail are replayed (`KDAttention.replay`): the kept positions' inputs
        are those of the verify forward, since nothing before a position depends on what follows it."""
        eng = self.engine
        reqs = [drafted[i][0] for i, _ in redo]
        ns = [n for _, n in redo]
        if snapshot is not None:
            starts = [0]
            for _, d, _ in drafted:
                starts.append(starts[-1] + len(d) + 1)
            rows = [starts[i] for i, _ in redo]
            idx = torch.tensor([i for i, _ in redo], device=eng.pool.device)
            states, tails = snapshot
            new_states, new_tails = {}, {}
            for layer, inputs in record.items():
                padded = tuple(_rows(x[0], rows, ns) for x in inputs)
                attn = eng.model.model.layers[layer].self_attn
                new_states[layer], new_tails[layer] = attn.replay(states[layer][idx], tails[layer][idx], padded, ns)
            eng.pool.write_slots([r.slot for r in reqs], new_states, new_tails)
        eng.metrics.spec_rerun_forwards += 1
        for r, n in zip(reqs, ns):
            self._advance(r, n)

    def _forward(self, rows: list[tuple[Request, list[int]]], *, logits: bool = True, capture: bool = False,
                 record: dict[int, tuple] | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Run each request's `ids` from position num_computed (packed rows, weight-absorbed MLA as in
        decode) and commit the KDA state; returns (logits [sum of lengths, vocab] at every position or
        None, the captured states [sum of lengths, 3H] when `capture` else None). num_computed is left
        alone (the caller advances it by what it keeps). record: filled with each KDA layer's inputs
        (`KDAttention.forward` with a cache's `kda_inputs`)."""
        eng = self.engine
        reqs = [r for r, _ in rows]
        ns = [len(ids) for _, ids in rows]
        cache = PagedBatchCache(eng.pool, [r.pages for r in reqs], [r.slot for r in reqs],
                                [r.num_computed for r in reqs], ns, absorb_mla=True, paged_mla=eng.paged_mla)
        cache.kda_inputs = record
        ids = torch.tensor([t for _, seq in rows for t in seq], device=eng.device)[None]
        cu = torch.tensor([0] + ns).cumsum(0)  # host offsets: the layers never read them back
        h, hidden = eng.model.model(ids, cu_seqlens=cu, cache=cache,
                                    hidden_state_layers=self.capture_layers if capture else None)
        cache.commit()
        aux = self.features(hidden)[0] if capture else None
        return (eng.model.lm_head(h[0]) if logits else None), aux


def device_drafts(drafted: list[Drafted]) -> torch.Tensor | None:
    """The drafts of the verify rows as one device tensor [N, k] when every row's are `DraftIds` (a greedy
    learned-draft batch), else None (host lists). Row order follows `drafted` (a subset of the proposer's
    rows: those that got pages)."""
    ds = [d for _, d, _ in drafted]
    if not ds or not all(isinstance(d, DraftIds) for d in ds):
        if any(isinstance(d, DraftIds) for d in ds):
            raise ValueError("a verify batch mixes device drafts (DraftIds) with host lists")
        return None
    src = ds[0].ids
    rows = [d.row for d in ds]
    if any(d.ids is not src for d in ds):
        raise ValueError("device drafts of one verify batch must come from one proposal")
    if rows == list(range(len(rows))):
        return src[: len(rows)]
    return src.index_select(0, torch.tensor(rows, dtype=torch.long).to(src.device, non_blocking=True))


def _rows(x: torch.Tensor, starts: list[int], ns: list[int]) -> torch.Tensor:
    """Packed [total, ...] -> [len(starts), max(ns), ...]: row i = x[starts[i]: starts[i] + ns[i]], zero padded."""
    out = x.new_zeros((len(starts), max(ns), *x.shape[1:]))
    for i, (s, n) in enumerate(zip(starts, ns)):
        out[i, :n] = x[s: s + n]
    return out


def make_speculator(engine: VerifyHost, ngram: int, min_match: int, max_match: int, draft: Any = None,
                    draft_tokens: int = 4, draft_window: int = 1024, max_rows: int = 64) -> SpeculativeDecoder | None:
    """The engine's verify path: learned-draft speculation when `draft` (an `EagleDraft`) is given
    (`draft_tokens` drafts per step, a KV window of `draft_window` positions, up to `max_rows` requests
    drafted together; CUDA graphs when the engine's runner uses them), n-gram speculation when
    ngram > 0, else None."""
    if draft is not None and ngram:
        raise ValueError("use either a learned draft or n-gram speculation (speculative_ngram), not both")
    if draft is not None:
        from k3.serve.draft_spec import DraftProposer  # k3.model.draft is loaded only when a draft is used

        runner = getattr(engine, "runner", None)
        graphs = runner is not None and runner.use_graphs
        proposer = DraftProposer(draft, engine.model, draft_tokens, engine.vocab_limit,
                                 max_rows=max_rows, window=draft_window, graphs=graphs,
                                 mempool=runner.mempool if graphs else None)
        return SpeculativeDecoder(engine, proposer)
    if ngram:
        return SpeculativeDecoder(engine, NgramSource(ngram, min_match, max_match))
    return None
