"""The serving engine: drivable from Python (submit, step, stream, pause/resume, abort).

    engine = Engine(model, tokenizer, EngineConfig(memory_budget_bytes=2 << 30))
    rid = engine.add_request(prompt_ids, SamplingParams(temperature=0, max_tokens=64))
    while engine.has_unfinished():
        for out in engine.step():       # RequestOutput per request that produced tokens or finished
            ...

Each step runs at most one packed prefill forward (chunks of several requests, within the long and
short token budgets) and one batched decode forward ([N, 1] rows). `generate()` is the blocking
convenience wrapper. The HTTP server drives the same object from a background thread
(`k3.serve.async_engine`).
"""

from __future__ import annotations

import importlib.util
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import torch

from k3.ops import to_device_async
from k3.serve.cache_manager import BlockPool, CacheLayout, PagedBatchCache
from k3.serve.logits import make_adjust
from k3.serve.media import MediaPrefixHasher, check_media_pad, encode_request_media, prefill_embeds, vision_config_of
from k3.serve.metrics import EngineMetrics
from k3.serve.model_runner import DecodeRunner, graphs_supported
from k3.serve.prefix_cache import PrefixCache, PrefixHasher
from k3.serve.sampling import Detokenizer, NullDetokenizer, SamplingParams, make_rng, sample_batch
from k3.serve.scheduler import Request, Scheduler, SchedulerConfig
from k3.serve.spec_policy import SpecPolicy, resolve_max_batch
from k3.serve.speculative import make_speculator


@dataclass
class EngineConfig:
    """memory_budget_bytes: the one budget for MLA pages, KDA slots and prefix-cache checkpoints.
    page_size: tokens per MLA page (= bytes of one pool block). unit_size: prefix hash unit (tokens).
    checkpoint_every_units: also checkpoint every N units of a long prompt (0 = off).
    checkpoint_at_message_ends: checkpoint after every `<|end_of_msg|>` of the prompt (turn boundaries).
    max_running: concurrent requests (each holds one KDA slot); max_long_running: of them, long ones.
    long_prompt_threshold: prompts longer than this use the long prefill budget.
    short/long_prefill_budget: prefill tokens per step for each class (leftovers are shared).
    max_model_len: context limit (default: the config's max_position_embeddings).
    cuda_graphs: replay decode steps as CUDA graphs (CUDA, bf16 weights; `k3.serve.model_runner`);
    cuda_graph_max_len: contexts up to this many tokens decode in graphs, longer ones eagerly.
    static_decode: run the graphs' static-shape decode path eagerly where graphs are not used (tests).
    paged_mla_decode: decode MLA attention by the paged Triton kernel (`k3.ops.mla_decode`), which
    reads each row's pages in place; None = on CUDA. False = gather the pages and attend densely.
    speculative_ngram: draft length k of prompt-lookup speculative decoding (0 = off); drafts come
    from the longest earlier match of the context's last speculative_min_match..max_match tokens
    (`k3.serve.speculative`; exact for greedy and sampled requests).
    speculative_draft_tokens: draft length k of learned-draft (EAGLE-3) speculation when the engine is
    given a draft model (`Engine(..., draft=)`, `k3.serve.draft_spec`); exact likewise.
    speculative_draft_window: draft KV positions kept per request (a ring: the draft attends to about
    the last this many positions; only the acceptance rate depends on it).
    speculative_max_batch: speculate only in steps with at most this many decoding requests (0 = no
    limit): beyond it a verify step costs more than the tokens it saves. None = the measured default of
    the engine's device type (`k3.serve.spec_policy.DEFAULT_SPEC_MAX_BATCH`; docs/draft.md). Steps above
    it decode plainly and feed the draft nothing.
    """

    memory_budget_bytes: int = 1 << 30
    page_size: int = 128
    unit_size: int = 512
    enable_prefix_cache: bool = True
    checkpoint_every_units: int = 8
    checkpoint_at_message_ends: bool = True
    max_checkpoints_per_request: int = 8
    checkpoint_min_gap: int = 16
    max_running: int = 64
    max_long_running: int | None = None
    long_prompt_threshold: int = 4096
    short_prefill_budget: int = 2048
    long_prefill_budget: int = 2048
    max_model_len: int | None = None
    max_waiting: int = 4096
    kda_backend: str | None = None
    flush_denormal: bool = True
    cuda_graphs: bool = True
    cuda_graph_max_len: int = 16384
    static_decode: bool = False
    paged_mla_decode: bool | None = None
    speculative_ngram: int = 0
    speculative_min_match: int = 2
    speculative_max_match: int = 4
    speculative_draft_tokens: int = 4
    speculative_draft_window: int = 1024
    speculative_max_batch: int | None = None

    def validate(self) -> "EngineConfig":
        for name in ("memory_budget_bytes", "page_size", "unit_size", "max_running", "short_prefill_budget",
                     "long_prefill_budget", "max_waiting", "long_prompt_threshold", "cuda_graph_max_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"EngineConfig.{name} must be a positive integer, got {v!r}")
        optional = ("speculative_max_batch",) if self.speculative_max_batch is not None else ()
        for name in ("checkpoint_every_units", "max_checkpoints_per_request", "checkpoint_min_gap",
                     "speculative_ngram", *optional):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"EngineConfig.{name} must be an integer >= 0, got {v!r}")
        for name in ("speculative_min_match", "speculative_max_match", "speculative_draft_tokens",
                     "speculative_draft_window"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"EngineConfig.{name} must be a positive integer, got {v!r}")
        if self.speculative_max_match < self.speculative_min_match:
            raise ValueError(f"EngineConfig.speculative_max_match ({self.speculative_max_match}) must be >= "
                             f"speculative_min_match ({self.speculative_min_match})")
        return self


@dataclass
class RequestOutput:
    """What one step produced for one request.

    new_token_ids / new_text / new_logprobs: released since the last output (stop ids are in the
    ids, never in the text). new_logprobs: per new token (logprob, [(id, logprob)] top) or None.
    finish_reason: None while running; "stop" | "length" | "abort" | "error".
    stop_str: on the final output, the stop string that ended the request (None for a stop id).
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[tuple[float | None, list | None]]
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None
    error: str | None = None
    stop_str: str | None = None


@dataclass
class FinalOutput:
    """All of a finished request (what `Engine.generate` returns)."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[tuple[float | None, list | None]] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0


def pick_kda_backend(device: torch.device) -> str:
    """Fastest KDA backend present in this checkout for `device`."""
    have = lambda m: importlib.util.find_spec(m) is not None  # noqa: E731
    if device.type == "cuda" and have("k3.ops.kda.chunk") and have("triton"):
        return "triton"
    if have("k3.ops.kda.chunk_torch"):
        return "torch"
    return "reference"


class Engine:
    def __init__(self, model: Any, tokenizer: Any = None, config: EngineConfig | None = None, *,
                 eos_id: int | None = None, draft: Any = None) -> None:
        """draft: an `EagleDraft` (`k3.model.draft.load_draft(dir, model)`) for learned speculative
        decoding with `config.speculative_draft_tokens` drafts per step; None = off."""
        self.config = cfg = (config or EngineConfig()).validate()
        self.model, self.tokenizer = model.eval(), tokenizer
        tc = model.config.text_config
        p = model.lm_head.weight
        self.device, self.dtype = p.device, p.dtype
        if cfg.flush_denormal and self.device.type == "cpu":
            torch.set_flush_denormal(True)  # KDA decays produce denormals, ~10x slower on CPU
        model.set_kda_backend(cfg.kda_backend or pick_kda_backend(self.device))
        self.max_model_len = cfg.max_model_len or tc.max_position_embeddings
        self.eos_id = eos_id if eos_id is not None else (tokenizer.eos_id if tokenizer is not None else None)
        self.vocab_limit = min(tc.vocab_size, tokenizer.vocab_size) if tokenizer is not None else tc.vocab_size
        self.vision = vision_config_of(model)  # None: text-only (requests with media are refused)
        self.media_pad_id = check_media_pad(model, tokenizer) if self.vision is not None else None
        self.layout = CacheLayout.from_config(tc, cfg.page_size, self.dtype)
        self.pool = BlockPool(self.layout, BlockPool.blocks_for_budget(self.layout, cfg.memory_budget_bytes),
                              self.device)
        if self.pool.usable < self.layout.slot_blocks + 1:
            raise ValueError(f"memory_budget_bytes={cfg.memory_budget_bytes} holds {self.pool.usable} blocks; one "
                             f"request needs at least {self.layout.slot_blocks + 1}")
        self.prefix = PrefixCache(self.pool, cfg.unit_size) if cfg.enable_prefix_cache else None
        sc = SchedulerConfig(
            max_running=cfg.max_running, max_long_running=cfg.max_long_running or max(1, cfg.max_running // 2),
            long_prompt_threshold=cfg.long_prompt_threshold, short_prefill_budget=cfg.short_prefill_budget,
            long_prefill_budget=cfg.long_prefill_budget, unit_size=cfg.unit_size,
            checkpoint_every_units=cfg.checkpoint_every_units,
            checkpoint_boundary_id=self.eos_id if cfg.checkpoint_at_message_ends else None,
            max_checkpoints_per_request=cfg.max_checkpoints_per_request, checkpoint_min_gap=cfg.checkpoint_min_gap,
        )
        self.scheduler = Scheduler(sc, self.pool, self.prefix)
        self.requests: dict[str, Request] = {}
        self.metrics = EngineMetrics()
        graphs = cfg.cuda_graphs and graphs_supported(model, self.device)
        self.paged_mla = self.device.type == "cuda" if cfg.paged_mla_decode is None else cfg.paged_mla_decode
        spec_k = cfg.speculative_draft_tokens if draft is not None else cfg.speculative_ngram
        # verify steps ([N, k + 1] tokens) and the draft's features come from the same static runner
        self.runner = DecodeRunner(model, self.pool, max_batch=cfg.max_running,
                                   max_len=min(cfg.cuda_graph_max_len, self.max_model_len),
                                   use_graphs=graphs, paged_mla=self.paged_mla, max_new=spec_k + 1,
                                   capture_layers=draft.config.target_layers if draft is not None else ()
                                   ) if graphs or cfg.static_decode else None
        self.spec = make_speculator(self, cfg.speculative_ngram, cfg.speculative_min_match, cfg.speculative_max_match,
                                    draft, cfg.speculative_draft_tokens, cfg.speculative_draft_window, cfg.max_running)
        self.spec_policy = SpecPolicy(resolve_max_batch(cfg.speculative_max_batch, self.device.type))
        self.speculating = False  # this step's policy decision: draft, verify, and feed the proposer

    # ---- requests ----------------------------------------------------------------------------------
    def max_tokens_limit(self, prompt_len: int) -> int:
        """The most tokens a request with this prompt may generate (context and memory limits)."""
        by_ctx = self.max_model_len - prompt_len
        by_mem = (self.pool.usable - self.layout.slot_blocks) * self.layout.page_size - prompt_len
        return min(by_ctx, by_mem)

    def check_request(self, prompt_len: int, max_tokens: int) -> None:
        """ValueError (mentioning the context limit) when the request can never run."""
        if prompt_len < 1:
            raise ValueError("the prompt must contain at least one token")
        if prompt_len >= self.max_model_len:
            raise ValueError(f"prompt has {prompt_len} tokens; this model's maximum context length is "
                             f"{self.max_model_len} tokens")
        if prompt_len + max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the maximum context "
                             f"length of {self.max_model_len} tokens")
        if max_tokens > self.max_tokens_limit(prompt_len):
            raise ValueError(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) does not fit in the server's "
                             "cache memory; the maximum context length here is "
                             f"{self.max_tokens_limit(0)} tokens")

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams | None = None, *,
                    request_id: str | None = None, checkpoint_positions: Sequence[int] = (),
                    media: Sequence[torch.Tensor] | None = None, fork_ids: Sequence[str] = (),
                    constraint: Callable[[], Any] | None = None) -> str:
        """Queue a request. checkpoint_positions: extra prompt positions worth a KDA checkpoint.
        media: images [3, H, W] / videos [T, 3, H, W] (normalised floats) for the prompt's
        `<|media_pad|>` runs, in order; encoded here, once (see k3.serve.media).
        fork_ids: ids of sibling requests with the same prompt (n > 1): they fork this request's cache
        once its prompt is computed (`Scheduler.fork`; prefilled once) and sample independently (a
        seeded request's k-th sibling uses seed + k); if this request is aborted before the fork, they
        are queued on their own. constraint: a factory of a fresh grammar constraint per request (`k3.serve.structured`)."""
        params = params or SamplingParams()
        ids = [int(t) for t in prompt_ids]
        if any(not 0 <= t < self.vocab_limit for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_limit})")
        self.check_request(len(ids), params.max_tokens)
        rid = request_id or uuid.uuid4().hex
        if rid in self.requests:
            raise ValueError(f"request_id {rid!r} is already in use")
        encoded = None
        if media:
            with torch.inference_mode():
                encoded = encode_request_media(self.model, media, ids, self.media_pad_id, self.device, self.dtype)
        req = Request(
            request_id=rid, tokens=ids, params=params, arrival=time.time(), rng=make_rng(params),
            detok=(Detokenizer(self.tokenizer, params.stop, params.skip_special_tokens)
                   if self.tokenizer is not None else NullDetokenizer()),
            long=len(ids) > self.config.long_prompt_threshold, max_sampled=params.max_tokens,
            extra_checkpoints=tuple(int(p) for p in checkpoint_positions), media=encoded,
        )
        req.hasher = (PrefixHasher(req.tokens, self.config.unit_size) if encoded is None
                      else MediaPrefixHasher(req.tokens, self.config.unit_size, encoded.spans))
        req.constraint = constraint() if constraint is not None else None
        for k, cid in enumerate(fork_ids, 1):
            if cid in self.requests or cid == rid:
                raise ValueError(f"request_id {cid!r} is already in use")
            req.forks.append(self._sibling(req, cid, k, constraint))
        self.requests[rid] = req
        for child in req.forks:
            self.requests[child.request_id] = child
        self.scheduler.add(req)
        self.metrics.requests_added += 1 + len(req.forks)
        return rid

    def _sibling(self, req: Request, rid: str, k: int, constraint: Callable[[], Any] | None) -> Request:
        """The k-th sibling of an n > 1 request: same prompt, own sampler state; status "forking"."""
        p = req.params
        params = p if p.seed is None else replace(p, seed=p.seed + k)
        child = Request(request_id=rid, tokens=list(req.tokens), params=params, arrival=req.arrival,
                        rng=make_rng(params), detok=Detokenizer(self.tokenizer, p.stop, p.skip_special_tokens)
                        if self.tokenizer is not None else NullDetokenizer(),
                        long=req.long, max_sampled=req.max_sampled, media=req.media)
        child.status = "forking"
        child.hasher = (PrefixHasher(child.tokens, self.config.unit_size) if req.media is None
                        else MediaPrefixHasher(child.tokens, self.config.unit_size, req.media.spans))
        child.constraint = constraint() if constraint is not None else None
        return child

    def abort(self, request_id: str) -> bool:
        """Cancel a request and free its cache. False when it is unknown or already finished."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        self.scheduler.remove(req)
        req.status, req.finish_reason = "finished", "abort"
        self.metrics.on_finish(req)
        for child in req.forks:  # siblings not forked yet go on alone (prefilling from the prefix cache)
            if child.status == "forking":
                self.scheduler.add(child)
        req.forks = []
        return True

    def pause(self, request_id: str) -> None:
        """Stop scheduling a request; it keeps its cache (unless memory pressure preempts it)."""
        self._get(request_id).paused = True

    def resume(self, request_id: str, append_ids: Sequence[int] = (), max_tokens: int | None = None) -> None:
        """Continue a paused request, optionally after appending context tokens (e.g. a tool result);
        max_tokens: new budget of tokens to sample from now on."""
        req = self._get(request_id)
        ids = [int(t) for t in append_ids]
        if any(not 0 <= t < self.vocab_limit for t in ids):
            raise ValueError(f"append_ids must be in [0, {self.vocab_limit})")
        extra = max_tokens if max_tokens is not None else req.max_sampled - len(req.out_ids)
        if len(req.tokens) + len(ids) + extra > self.max_model_len:
            raise ValueError(f"resume would exceed the maximum context length of {self.max_model_len} tokens")
        req.tokens.extend(ids)
        if max_tokens is not None:
            req.max_sampled = len(req.out_ids) + max_tokens
        req.paused = False

    def _get(self, request_id: str) -> Request:
        req = self.requests.get(request_id)
        if req is None:
            raise KeyError(f"unknown or finished request {request_id!r}")
        return req

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    # ---- stepping ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        touched: list[Request] = []
        decode = plan.decode
        joining = sum(1 for r, n in plan.prefill if n >= r.pending - 1)  # prompt done: they decode next step
        self.speculating = self.spec is not None and self.spec_policy.speculate(len(decode) + joining)
        if self.spec is not None and decode and not self.speculating:
            self.metrics.spec_policy_plain_steps += 1
        if plan.prefill:
            touched += self._run(plan.prefill, decode=False)
        if decode and self.speculating:
            decode, drafted = self.spec.split(decode)  # requests with drafts verify them, the rest decode
            if drafted:
                touched += self.spec.run(drafted)
        if decode:
            touched += self._run([(r, 1) for r in decode], decode=True)
        self.metrics.steps += 1
        return [o for o in (self._output(r) for r in touched) if o is not None]

    def _run(self, batch: list[tuple[Request, int]], *, decode: bool) -> list[Request]:
        start = time.perf_counter()
        reqs = self._run_batch(batch, decode=decode)
        self.metrics.observe_forward(decode, len(batch), time.perf_counter() - start)
        return reqs

    def _run_batch(self, batch: list[tuple[Request, int]], *, decode: bool) -> list[Request]:
        reqs = [r for r, _ in batch]
        try:
            logits_rows = self._forward(batch, decode=decode)
        except Exception as e:  # a failed forward fails its requests, never the engine
            failed = reqs + [c for r in reqs for c in r.forks if c.status == "forking"]
            for r in failed:
                self.finish_request(r, "error", donate=False, error=f"{type(e).__name__}: {e}")
                r.forks = []
            return failed
        sample_reqs = [r for r in reqs if r.pending == 0]
        for r, n in batch:
            if not decode and self.prefix is not None and r.num_computed in r.plan.positions:
                self.scheduler.save_checkpoint(r)
        rows = [reqs.index(r) for r in sample_reqs]
        for r in list(sample_reqs):
            for child in self._fork(r):
                sample_reqs.append(child)
                rows.append(reqs.index(r))
                reqs.append(child)
        if sample_reqs:
            logits = logits_rows[rows]
            res = sample_batch(logits, [r.params for r in sample_reqs], [r.rng for r in sample_reqs], self.vocab_limit,
                               adjust=make_adjust(sample_reqs, self.eos_id))
            for i, r in enumerate(sample_reqs):
                self._on_token(r, res.token_ids[i], res.logprobs[i], res.top[i])
        return reqs

    def _fork(self, parent: Request) -> list[Request]:
        """Siblings that share `parent`'s just-computed prompt (n > 1): forked ones sample from its logits
        row this step; any that did not fit (memory, running limit) wait and prefill on their own,
        usually from the prefix cache."""
        forked = []
        for child in parent.forks:
            if child.status != "forking":  # aborted meanwhile
                continue
            if self.scheduler.fork(parent, child):
                self.metrics.forked_requests += 1
                forked.append(child)
            else:
                self.scheduler.add(child)
        parent.forks = []
        return forked

    def _forward(self, batch: list[tuple[Request, int]], *, decode: bool) -> torch.Tensor:
        """Run the model on each request's next `n` tokens; returns logits [N, vocab] at each chunk end."""
        reqs = [r for r, _ in batch]
        ns = [n for _, n in batch]
        capture = self.spec.capture_layers if self.speculating else []  # a learned draft reads them
        if decode and self.runner is not None:
            out = self.runner.run([[r.tokens[r.num_computed]] for r in reqs], [r.num_computed for r in reqs],
                                  [r.slot for r in reqs], [r.pages for r in reqs])
            if out is not None:  # else: beyond the runner's buckets, run the dynamic path
                if out[1] is not None and self.speculating:
                    self.spec.observe_rows(batch, out[1])
                self._computed(batch)
                return out[0][:, 0]
        cache = PagedBatchCache(self.pool, [r.pages for r in reqs], [r.slot for r in reqs],
                                [r.num_computed for r in reqs], ns, absorb_mla=decode, paged_mla=self.paged_mla)
        if decode:
            ids = torch.tensor([[r.tokens[r.num_computed]] for r in reqs], device=self.device)
            h, hidden = self.model.model(ids, cache=cache, hidden_state_layers=capture or None)
            last = h[:, -1]
        else:
            flat = [t for r, n in batch for t in r.tokens[r.num_computed: r.num_computed + n]]
            ids = torch.tensor(flat, device=self.device)[None]
            cu = torch.tensor([0] + ns).cumsum(0)  # host offsets: the layers never read them back
            embeds = prefill_embeds(self.model, ids, batch)  # media rows spliced in, or None
            h, hidden = self.model.model(None if embeds is not None else ids, inputs_embeds=embeds, cu_seqlens=cu,
                                         cache=cache, hidden_state_layers=capture or None)
            last = h[0, to_device_async(cu[1:] - 1, self.device)]
        cache.commit()
        if capture:
            self.spec.observe_forward(batch, hidden)
        self._computed(batch)
        return self.model.lm_head(last)

    def _computed(self, batch: list[tuple[Request, int]]) -> None:
        for r, n in batch:
            # prompt tokens computed here (the last one usually runs in a decode batch)
            self.metrics.prompt_tokens_computed += max(0, min(r.num_computed + n, r.prompt_len) - r.num_computed)
            r.num_computed += n

    def _on_token(self, req: Request, tok: int, lp: float | None, top: list | None) -> None:
        reason = self.append_token(req, tok, lp, top)
        if reason is not None:
            self.finish_request(req, reason)

    def append_token(self, req: Request, tok: int, lp: float | None, top: list | None) -> str | None:
        """Record one sampled token; returns the finish reason it causes (the caller finishes the
        request: the verify path first rolls its state back to the accepted position). Part of the
        interface `k3.serve.speculative.VerifyHost` declares."""
        now = time.time()
        if req.constraint is not None:
            req.constraint.accept(tok)
        req.tokens.append(tok)
        req.out_ids.append(tok)
        req.out_logprobs.append((lp, top))
        self.metrics.generated_tokens += 1
        if req.first_token_time is None:
            req.first_token_time = now
            self.metrics.observe_ttft(now - req.arrival)
        p = req.params
        if (not p.ignore_eos and tok == self.eos_id) or tok in p.stop_token_ids:
            req.stop_id_hit = True
            return "stop"
        if req.detok.add(tok):
            return "stop"
        if len(req.out_ids) >= req.max_sampled or len(req.tokens) >= self.max_model_len:
            return "length"
        return None

    def finish_request(self, req: Request, reason: str, *, donate: bool = True, error: str | None = None) -> None:
        """Mark `req` finished with `reason` and release its pages (donating its state to the prefix
        cache when `donate`); part of the interface `k3.serve.speculative.VerifyHost` declares."""
        req.status, req.finish_reason, req.finish_time = "finished", reason, time.time()
        req.error = error
        self.scheduler.release(req, donate=donate)
        self.metrics.on_finish(req)

    def _output(self, req: Request) -> RequestOutput | None:
        final = req.status == "finished"
        ids, text = req.detok.release(final)
        n0 = req.emitted
        n1 = n0 + len(ids) + (1 if final and req.stop_id_hit else 0)
        n1 = min(n1, len(req.out_ids))
        if n1 == n0 and not final:
            return None
        req.emitted = n1
        if final:
            self.requests.pop(req.request_id, None)
        return RequestOutput(
            request_id=req.request_id, new_token_ids=req.out_ids[n0:n1], new_text=text,
            new_logprobs=req.out_logprobs[n0:n1], finished=final, finish_reason=req.finish_reason,
            prompt_tokens=req.prompt_len, cached_tokens=req.cached_tokens or 0, output_tokens=len(req.out_ids),
            arrival_time=req.arrival, first_token_time=req.first_token_time, finish_time=req.finish_time,
            error=req.error, stop_str=req.detok.matched if final and req.finish_reason == "stop" else None,
        )

    # ---- weight updates (RL) ---------------------------------------------------------------------------
    def on_weights_updated(self) -> int:
        """Call after the model's parameters were changed in place (RL weight sync, k3.rl.sync): drops
        the prefix cache's unpinned checkpoints, which hold states computed with the old weights, so no
        later request starts from them. Running and paused requests keep their own caches (a partial
        rollout resumes on the states its earlier tokens produced). Returns the number dropped."""
        if self.prefix is None:
            return 0
        before = len(self.prefix)
        self.prefix.clear()
        return before - len(self.prefix)

    # ---- convenience ---------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 max_steps: int = 1_000_000) -> list[FinalOutput]:
        """Run prompts to completion (together with anything already queued); results in prompt order."""
        plist = list(params) if isinstance(params, (list, tuple)) else [params or SamplingParams()] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        results = {rid: FinalOutput(rid) for rid in ids}
        for _ in range(max_steps):
            if not any(rid in self.requests for rid in ids):
                break
            for out in self.step():
                f = results.get(out.request_id)
                if f is None:
                    continue
                f.token_ids += out.new_token_ids
                f.text += out.new_text
                f.logprobs += out.new_logprobs
                f.prompt_tokens, f.cached_tokens = out.prompt_tokens, out.cached_tokens
                if out.finished:
                    f.finish_reason = out.finish_reason
        else:
            raise RuntimeError(f"generate did not finish within {max_steps} steps")
        return [results[rid] for rid in ids]

    def stats(self) -> dict[str, Any]:
        """Gauges and counters for /metrics and tests."""
        s = self.metrics.snapshot()
        s.update(running=self.num_running, waiting=self.num_waiting, blocks_total=self.pool.usable,
                 blocks_free=self.pool.num_free, preemptions=self.scheduler.num_preemptions)
        if self.prefix is not None:
            ps = self.prefix.stats
            s.update(prefix_checkpoints=len(self.prefix), prefix_queries=ps.queries, prefix_hits=ps.hits,
                     prefix_query_tokens=ps.query_tokens, prefix_hit_tokens=ps.hit_tokens,
                     prefix_saved=ps.saved, prefix_evicted=ps.evicted,
                     prefix_token_hit_rate=ps.hit_tokens / ps.query_tokens if ps.query_tokens else 0.0)
        return s
