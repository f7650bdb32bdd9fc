"""Continuous-batching scheduler: admission, chunked prefill under separate token budgets for long
and short requests, batched decode, memory (pages, slots, checkpoints) and preemption.

Every request is a growing token list `tokens` of which the first `num_computed` are in the cache.
More than one pending token = prefill (run in chunks), exactly one = decode. A prefill chunk stops
at the next planned checkpoint position so the KDA state there can be saved (the model exports the
state only at the end of a forward). Memory comes from one block pool; when it runs out the
scheduler first evicts prefix-cache checkpoints (LRU), then preempts the newest request (its state
is donated to the prefix cache, so readmission usually resumes where it stopped).
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from k3.serve.cache_manager import BlockPool, CacheLayout, OutOfBlocks
from k3.serve.prefix_cache import CheckpointPlan, PrefixCache, PrefixHasher
from k3.serve.sampling import Detokenizer, SamplingParams


@dataclass
class SchedulerConfig:
    """Scheduling knobs (see EngineConfig for their meaning)."""

    max_running: int = 64
    max_long_running: int = 32
    long_prompt_threshold: int = 4096
    short_prefill_budget: int = 2048
    long_prefill_budget: int = 2048
    unit_size: int = 512
    checkpoint_every_units: int = 8
    checkpoint_boundary_id: int | None = None
    max_checkpoints_per_request: int = 8
    checkpoint_min_gap: int = 16


@dataclass(eq=False)
class Request:
    """One generation request and its cache state."""

    request_id: str
    tokens: list[int]
    params: SamplingParams
    arrival: float
    rng: random.Random
    detok: Detokenizer
    long: bool
    max_sampled: int
    extra_checkpoints: tuple[int, ...] = ()
    prompt_len: int = 0
    status: str = "waiting"  # waiting | running | finished
    paused: bool = False
    num_computed: int = 0
    pages: list[int] = field(default_factory=list)
    shared_pages: int = 0  # pages[:shared_pages] came from a checkpoint and are never written in place
    slot: list[int] | None = None
    plan: CheckpointPlan = field(default_factory=CheckpointPlan)
    cached_tokens: int | None = None  # prompt tokens served from the prefix cache (first admission)
    admit_seq: int = 0
    out_ids: list[int] = field(default_factory=list)
    out_logprobs: list[tuple[float | None, list | None]] = field(default_factory=list)
    emitted: int = 0
    stop_id_hit: bool = False
    finish_reason: str | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    error: str | None = None
    hasher: PrefixHasher | None = None
    media: Any = None  # k3.serve.media.RequestMedia: encoded media rows and their prompt positions
    constraint: Any = None  # k3.serve.structured.GrammarConstraint: masks what may be sampled next
    forks: list["Request"] = field(default_factory=list)  # n > 1: siblings that fork at the first sample

    def __post_init__(self) -> None:
        self.prompt_len = self.prompt_len or len(self.tokens)

    @property
    def pending(self) -> int:
        return len(self.tokens) - self.num_computed


@dataclass
class StepPlan:
    decode: list[Request] = field(default_factory=list)
    prefill: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool, prefix: PrefixCache | None) -> None:
        self.cfg, self.pool, self.prefix = config, pool, prefix
        self.layout: CacheLayout = pool.layout
        self.waiting_short: deque[Request] = deque()
        self.waiting_long: deque[Request] = deque()
        self.running: list[Request] = []  # admission order (includes paused requests)
        self._admit_counter = 0
        self.num_preemptions = 0

    # ---- queues -----------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.waiting_short) + len(self.waiting_long)

    def add(self, req: Request, front: bool = False) -> None:
        req.status = "waiting"
        q = self.waiting_long if req.long else self.waiting_short
        q.appendleft(req) if front else q.append(req)

    def remove(self, req: Request) -> None:
        """Take a request out of every queue and free its memory (no donation)."""
        for q in (self.waiting_short, self.waiting_long):
            if req in q:
                q.remove(req)
        if req in self.running:
            self.release(req, donate=False)

    # ---- memory -----------------------------------------------------------------------------------
    def _alloc(self, n: int, *, pages: bool = False) -> list[int]:
        while self.pool.num_free < n:
            if self.prefix is None or not self.prefix.evict_one():
                raise OutOfBlocks(f"need {n} blocks, {self.pool.num_free} free, nothing evictable")
        return self.pool.alloc_pages(n) if pages else self.pool.alloc(n)

    def _ensure_pages(self, req: Request, upto: int) -> None:
        """Make req.pages cover positions [0, upto) and make the page written next private."""
        first = req.num_computed // self.layout.page_size
        if first < req.shared_pages:
            old = req.pages[first]
            if self.pool.refcount[old] > 1:  # copy-on-write: someone else may read past our position
                new = self._alloc(1)[0]
                self.pool.copy_blocks([old], [new])
                self.pool.decref([old])
                req.pages[first] = new
            req.shared_pages = first
        need = self.layout.pages_for(upto) - len(req.pages)
        if need > 0:
            req.pages.extend(self._alloc(need, pages=True))

    def reserve(self, req: Request, upto: int) -> bool:
        """Opportunistically extend req.pages to cover positions [0, upto) (speculative drafts) from
        free blocks only: never evicts a checkpoint or preempts. False (nothing taken) if short."""
        first = req.num_computed // self.layout.page_size
        cow = first < req.shared_pages and self.pool.refcount[req.pages[first]] > 1
        if self.layout.pages_for(upto) - len(req.pages) + cow > self.pool.num_free:
            return False
        self._ensure_pages(req, upto)
        return True

    def release(self, req: Request, *, donate: bool) -> None:
        """Free a running request's slot and pages; with donate, its state becomes a checkpoint."""
        if req in self.running:
            self.running.remove(req)
        if req.slot is None:
            return
        pos = req.num_computed
        keep = self.layout.pages_for(pos)
        pages, extra = req.pages[:keep], req.pages[keep:]
        self.pool.decref(extra)
        taken = False
        if donate and self.prefix is not None and pos > 0:
            h = req.hasher
            taken = self.prefix.insert(h.key(pos), h.anchor(pos // h.unit), pos, req.slot, pages)
        if not taken:
            self.pool.decref(req.slot)
            self.pool.decref(pages)
        req.slot, req.pages, req.shared_pages, req.num_computed = None, [], 0, 0

    def save_checkpoint(self, req: Request) -> bool:
        """Copy the request's current KDA state into a new checkpoint at num_computed (never preempts)."""
        if self.prefix is None or req.slot is None:
            return False
        pos, h = req.num_computed, req.hasher
        key = h.key(pos)
        if key in self.prefix:
            self.prefix.touch(key)
            return False
        try:
            blocks = self._alloc(self.layout.slot_blocks)
        except OutOfBlocks:
            return False
        self.pool.copy_blocks(req.slot, blocks)
        pages = req.pages[: self.layout.pages_for(pos)]
        self.pool.incref(pages)
        return self.prefix.insert(key, h.anchor(pos // h.unit), pos, blocks, pages)

    def fork(self, parent: Request, child: Request) -> bool:
        """Give `child` a copy of `parent`'s cache state (its prompt computed once): a copied KDA slot
        and the parent's pages shared copy-on-write. Never evicts running work: False (nothing
        taken) when the running set is full or no block is free even after evicting checkpoints."""
        if len(self.running) >= self.cfg.max_running or parent.slot is None:
            return False
        try:
            slot = self._alloc(self.layout.slot_blocks)
        except OutOfBlocks:
            return False
        self.pool.copy_blocks(parent.slot, slot)
        child.pages = list(parent.pages[: self.layout.pages_for(parent.num_computed)])
        self.pool.incref(child.pages)
        child.slot, child.num_computed, child.shared_pages = slot, parent.num_computed, len(child.pages)
        # the page both write next (if partly filled) is shared now: each copies it before writing
        parent.shared_pages = max(parent.shared_pages, len(child.pages))
        child.cached_tokens = parent.cached_tokens
        self._admit_counter += 1
        child.admit_seq = self._admit_counter
        child.status = "running"
        self.running.append(child)
        return True

    def preempt(self, req: Request) -> None:
        """Stop a running request and requeue it at the front; its state is donated to the cache."""
        self.release(req, donate=True)
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.add(req, front=True)

    def _victim(self) -> Request | None:
        """Paused requests first, then the most recently admitted one."""
        if not self.running:
            return None
        paused = [r for r in self.running if r.paused]
        pool = paused or self.running
        return max(pool, key=lambda r: r.admit_seq)

    # ---- admission ----------------------------------------------------------------------------------
    def _admit(self, req: Request) -> bool:
        hit = None
        if self.prefix is not None:
            hit = self.prefix.lookup(req.hasher, len(req.tokens) - 1)
        if hit is not None:
            hit.pins += 1
        try:
            slot = self._alloc(self.layout.slot_blocks)
        except OutOfBlocks:
            return False
        finally:
            if hit is not None:
                hit.pins -= 1
        start = 0
        if hit is not None:
            self.pool.copy_blocks(hit.slot, slot)
            req.pages = list(hit.pages[: self.layout.pages_for(hit.pos)])
            self.pool.incref(req.pages)
            start = hit.pos
        else:
            self.pool.zero(slot)  # fresh state: zero recurrent state and conv tail
            req.pages = []
        req.slot, req.num_computed, req.shared_pages = slot, start, len(req.pages)
        c = self.cfg
        # long / short by the tokens left to compute: an agent's 50K-token context with a cached prefix
        # is a short prefill, and must neither count against max_long_running nor use the long budget
        req.long = len(req.tokens) - start > c.long_prompt_threshold
        extra = req.extra_checkpoints if self.prefix is not None else ()
        req.plan = CheckpointPlan.build(
            req.tokens, start, boundary_id=c.checkpoint_boundary_id if self.prefix is not None else None,
            unit=c.unit_size, every_units=c.checkpoint_every_units if self.prefix is not None else 0,
            max_count=c.max_checkpoints_per_request if self.prefix is not None else 0,
            min_gap=c.checkpoint_min_gap, extra=extra,
        )
        self._admit_counter += 1
        req.admit_seq = self._admit_counter
        req.status = "running"
        self.running.append(req)
        return True

    # ---- one step -----------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """Decode every running request that has one pending token; then prefill chunks: running
        requests within their class budget (oldest first), newly admitted requests (short ones first;
        a request is admitted only together with pages for its first chunk), then whatever budget
        either class left goes to running requests that got no chunk yet, and what is still left
        extends the chunks planned (`_top_up`)."""
        plan = StepPlan()
        self._schedule_decode(plan)
        budget = {False: self.cfg.short_prefill_budget, True: self.cfg.long_prefill_budget}
        running = sorted((r for r in self.running if not r.paused and r.pending >= 2),
                         key=lambda r: (r.long, r.admit_seq))
        done: set[int] = set()
        if (self._prefill_pass(plan, running, budget, done, pooled=False) and self._admit_pass(plan, budget)
                and self._prefill_pass(plan, running, budget, done, pooled=True)):
            self._top_up(plan, budget)
        if plan.empty:
            self._unblock(plan)
        return plan

    def _take(self, budget: dict[bool, int], req: Request, n: int) -> None:
        own = min(n, budget[req.long])
        budget[req.long] -= own
        budget[not req.long] -= n - own

    def _prefill_pass(self, plan: StepPlan, reqs: list[Request], budget: dict[bool, int], done: set[int], *,
                      pooled: bool) -> bool:
        """Schedule one chunk for each of `reqs` not in `done`, from its class budget (or, pooled, from
        both); False when memory ran out (stop scheduling prefill)."""
        for req in reqs:
            if id(req) in done:
                continue
            n = self._chunk(req, budget[False] + budget[True] if pooled else budget[req.long])
            if n <= 0:
                continue
            try:
                self._ensure_pages(req, req.num_computed + n)
            except OutOfBlocks:
                return False
            plan.prefill.append((req, n))
            done.add(id(req))
            self._take(budget, req, n)
        return True

    def _top_up(self, plan: StepPlan, budget: dict[bool, int]) -> None:
        """Extend this step's chunks (in plan order) with whatever budget both classes left: a chunk
        cut short by its class budget would otherwise cost another forward for its remainder (e.g.
        the last of 8 agent turns admitted together)."""
        for i, (req, n) in enumerate(plan.prefill):
            left = budget[False] + budget[True]
            if left <= 0:
                return
            m = self._chunk(req, n + left)
            if m <= n:
                continue
            if self.layout.pages_for(req.num_computed + m) - len(req.pages) > self.pool.num_free:
                return  # an optional extension never evicts prefix checkpoints
            self._ensure_pages(req, req.num_computed + m)
            plan.prefill[i] = (req, m)
            self._take(budget, req, m - n)

    def _admit_pass(self, plan: StepPlan, budget: dict[bool, int]) -> bool:
        """Admit waiting requests (short queue first) with a first chunk from their class budget, or
        from the leftovers of both; False when memory ran out."""
        c = self.cfg
        for q, is_long in ((self.waiting_short, False), (self.waiting_long, True)):
            for req in list(q):
                if len(self.running) >= c.max_running or budget[False] + budget[True] <= 0:
                    return True
                if (is_long and sum(r.long for r in self.running) >= c.max_long_running
                        and not self._short_after_hit(req)):
                    break
                if req.paused or self._defer(req):
                    continue  # paused: waits until resumed; deferred: its prefix is being computed
                if not self._admit(req):
                    return False
                if req.pending == 1:  # resumed right before its last token: it decodes next step
                    q.remove(req)
                    self._record_hit(req)
                    continue
                own = budget[req.long]
                n = self._chunk(req, own if own > 0 else budget[False] + budget[True])
                try:
                    self._ensure_pages(req, req.num_computed + n)
                except OutOfBlocks:
                    self.release(req, donate=False)  # roll back; it keeps its place in the queue
                    req.status = "waiting"
                    return False
                q.remove(req)
                plan.prefill.append((req, n))
                self._take(budget, req, n)
                self._record_hit(req)
        return True

    def _short_after_hit(self, req: Request) -> bool:
        """A long prompt whose prefix is cached may leave at most `long_prompt_threshold` tokens to compute."""
        if self.prefix is None:
            return False
        hit = self.prefix.lookup(req.hasher, len(req.tokens) - 1)
        return hit is not None and len(req.tokens) - hit.pos <= self.cfg.long_prompt_threshold

    def _defer(self, req: Request) -> bool:
        """True when a running request is about to checkpoint a longer prefix of `req` than the cache
        holds now: admitting `req` later reuses that work instead of computing the prefix twice."""
        if self.prefix is None:
            return False
        limit = len(req.tokens) - 1
        future = [q for r in self.running if r.pending >= 2 and not r.paused for q in r.plan.positions
                  if r.num_computed < q <= limit and q <= len(r.tokens)]
        if not future:
            return False
        hit = self.prefix.lookup(req.hasher, limit)
        have = hit.pos if hit is not None else 0
        for r in self.running:
            if r.paused:
                continue
            for q in r.plan.positions:
                if q in future and q > have and r.num_computed < q and r.hasher.key(q) == req.hasher.key(q):
                    return True
        return False

    def _record_hit(self, req: Request) -> None:
        """Prompt tokens served from the cache are counted at the first admission only."""
        if req.cached_tokens is None:
            req.cached_tokens = req.num_computed
            if self.prefix is not None:
                self.prefix.record_query(req.prompt_len, req.num_computed)

    def _unblock(self, plan: StepPlan) -> None:
        """Nothing could be scheduled: preempt to make room (paused requests first, then the newest)."""
        active = [r for r in self.running if not r.paused]
        paused = [r for r in self.running if r.paused]
        if paused and (active or any(not r.paused for q in (self.waiting_short, self.waiting_long) for r in q)):
            victim = max(paused, key=lambda r: r.admit_seq)
        elif len(active) > 1:
            victim = max(active, key=lambda r: r.admit_seq)
        else:
            return
        self.preempt(victim)
        plan.preempted.append(victim)

    def _schedule_decode(self, plan: StepPlan) -> None:
        for req in list(self.running):
            if req.paused or req.status != "running" or req.pending != 1:
                continue
            while req.status == "running":
                try:
                    self._ensure_pages(req, req.num_computed + 1)
                    plan.decode.append(req)
                    break
                except OutOfBlocks:
                    victim = self._victim()
                    if victim is None:
                        break
                    self.preempt(victim)
                    plan.preempted.append(victim)

    def _chunk(self, req: Request, avail: int) -> int:
        n = min(req.pending, avail)
        nxt = req.plan.next_after(req.num_computed)
        if nxt is not None and nxt < req.num_computed + n:
            n = nxt - req.num_computed
        return n
