"""Prefix cache for the hybrid KDA + MLA model (the K3 design).

Token prefixes are identified by *chained* hashes over fixed units (`unit_size` tokens, 512 by
default): h_0 = root, h_k = H(h_{k-1}, tokens of unit k). A KDA state is only valid at the exact
position it was taken, so the cache stores **checkpoints**: (position p, the KDA state of every
KDA layer after tokens[:p], the MLA pages covering tokens[:p]). A checkpoint is keyed by
H(h_{p // unit}, tokens[p // unit * unit : p]) and indexed under its anchor h_{p // unit}, so a
lookup hashes the prompt once and walks the anchors from the deepest down.

* MLA pages are shared by reference (refcounted blocks); the KDA state is copied into a private
  running slot on a hit (copy-on-write: the checkpoint itself is never written).
* A hit is always a point where both caches match: every checkpoint holds its own pages, and its
  KDA state covers all KDA layers (eviction removes all of it at once, never part).
* LRU eviction removes checkpoints only; live requests hold their own references to their pages
  and their own slot, so eviction can never change what a running request reads.
"""

from __future__ import annotations

import bisect
import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from k3.serve.cache_manager import BlockPool

ROOT = b"k3-prefix-root"


def _h(*parts: bytes) -> bytes:
    d = hashlib.blake2b(digest_size=16)
    for p in parts:
        d.update(p)
    return d.digest()


def _tok_bytes(tokens: list[int]) -> bytes:
    return np.asarray(tokens, dtype=np.int64).tobytes()


class PrefixHasher:
    """Chained unit hashes of a growing token list (tokens may only be appended)."""

    def __init__(self, tokens: list[int], unit: int) -> None:
        if unit < 1:
            raise ValueError(f"unit_size must be >= 1, got {unit}")
        self.tokens, self.unit = tokens, unit
        self._chain = [ROOT]

    def anchor(self, k: int) -> bytes:
        """h_k, the hash of tokens[: k * unit] (needs k * unit <= len(tokens))."""
        while len(self._chain) <= k:
            j = len(self._chain)
            if j * self.unit > len(self.tokens):
                raise ValueError(f"cannot hash unit {j}: only {len(self.tokens)} tokens")
            self._chain.append(_h(self._chain[-1], self.span_bytes((j - 1) * self.unit, j * self.unit)))
        return self._chain[k]

    def key(self, pos: int) -> bytes:
        """The checkpoint key of tokens[:pos]."""
        k = pos // self.unit
        return _h(self.anchor(k), self.span_bytes(k * self.unit, pos), pos.to_bytes(8, "little"))

    def span_bytes(self, lo: int, hi: int) -> bytes:
        """What identifies tokens[lo:hi] (subclasses add non-token content, e.g. image digests)."""
        return _tok_bytes(self.tokens[lo:hi])


@dataclass
class Checkpoint:
    """A reusable point: KDA state `slot` (blocks) after tokens[:pos] and the MLA `pages` of tokens[:pos]."""

    key: bytes
    anchor: bytes
    pos: int
    slot: list[int]
    pages: list[int]
    pins: int = 0


@dataclass
class PrefixCacheStats:
    queries: int = 0
    hits: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    saved: int = 0
    evicted: int = 0


class PrefixCache:
    """Checkpoints indexed by anchor hash, evicted least-recently-used first."""

    def __init__(self, pool: BlockPool, unit: int) -> None:
        self.pool, self.unit = pool, unit
        self._lru: OrderedDict[bytes, Checkpoint] = OrderedDict()
        self._by_anchor: dict[bytes, dict[bytes, Checkpoint]] = {}
        self.stats = PrefixCacheStats()

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, key: bytes) -> bool:
        return key in self._lru

    def lookup(self, hasher: PrefixHasher, max_pos: int) -> Checkpoint | None:
        """The deepest checkpoint matching tokens[:p] with p <= max_pos (marked most recently used)."""
        for k in range(max_pos // self.unit, -1, -1):
            group = self._by_anchor.get(hasher.anchor(k))
            if not group:
                continue
            for c in sorted(group.values(), key=lambda c: -c.pos):
                if c.pos <= max_pos and hasher.key(c.pos) == c.key:
                    self._lru.move_to_end(c.key)
                    return c
        return None

    def record_query(self, prompt_tokens: int, hit_tokens: int) -> None:
        s = self.stats
        s.queries += 1
        s.query_tokens += prompt_tokens
        s.hits += hit_tokens > 0
        s.hit_tokens += hit_tokens

    def insert(self, key: bytes, anchor: bytes, pos: int, slot: list[int], pages: list[int]) -> bool:
        """Take ownership of one reference to `slot` and `pages`. False (nothing taken) if `key` exists."""
        if key in self._lru:
            self._lru.move_to_end(key)
            return False
        c = Checkpoint(key, anchor, pos, slot, pages)
        self._lru[key] = c
        self._by_anchor.setdefault(anchor, {})[key] = c
        self.stats.saved += 1
        return True

    def touch(self, key: bytes) -> None:
        self._lru.move_to_end(key)

    def evict_one(self) -> bool:
        """Drop the least recently used unpinned checkpoint; False when none can go."""
        for key, c in self._lru.items():
            if c.pins == 0:
                self._remove(c)
                self.stats.evicted += 1
                return True
        return False

    def clear(self) -> None:
        for c in list(self._lru.values()):
            if c.pins == 0:
                self._remove(c)

    def _remove(self, c: Checkpoint) -> None:
        del self._lru[c.key]
        group = self._by_anchor[c.anchor]
        del group[c.key]
        if not group:
            del self._by_anchor[c.anchor]
        self.pool.decref(c.slot)
        self.pool.decref(c.pages)

    def blocks_held(self) -> int:
        return sum(len(c.slot) for c in self._lru.values())


@dataclass
class CheckpointPlan:
    """Positions (sorted, increasing) where a request's prefill stops to save a KDA checkpoint."""

    positions: list[int] = field(default_factory=list)

    @staticmethod
    def build(tokens: list[int], start: int, *, boundary_id: int | None, unit: int, every_units: int,
              max_count: int, min_gap: int, extra: tuple[int, ...] = ()) -> "CheckpointPlan":
        """Candidates in (start, len(tokens) - 1]: the last prompt position (always: an identical or
        extended prompt resumes there and recomputes one token), every message end (the position
        after each `boundary_id`) and `extra` unless within `min_gap` of the last position (which
        supersedes them), then every `every_units` units unless within `min_gap` of a kept position.
        Message ends and interval points within `min_gap` after `start` are skipped too: the state
        at `start` (the prefix hit, or nothing) is that close, and each planned position costs a
        prefill forward of its own (an agent's next turn starts with the 1-2 tokens that close the
        previous answer: no separate forward for them). Of these the last `max_count` are kept
        (max_count 0 = none)."""
        end = len(tokens) - 1
        if end <= start:
            return CheckpointPlan([])
        bounds = {end} | {p for p in extra if start < p <= end}
        if boundary_id is not None:
            arr = np.asarray(tokens[start:end], dtype=np.int64)
            bounds.update(int(i) + start + 1 for i in np.nonzero(arr == boundary_id)[0] if int(i) + 1 >= min_gap)
        kept = sorted({end} | {p for p in bounds if end - p >= min_gap})
        if every_units > 0:
            step = every_units * unit
            near = sorted(kept + [start])
            for p in range((start // step + 1) * step, end, step):
                i = bisect.bisect_left(near, p)
                gaps = [abs(near[j] - p) for j in (i - 1, i) if 0 <= j < len(near)]
                if not gaps or min(gaps) >= min_gap:
                    kept.append(p)
        kept.sort()
        if max_count and len(kept) > max_count:
            kept = kept[-max_count:]
        return CheckpointPlan(kept if max_count else [])

    def next_after(self, pos: int) -> int | None:
        for p in self.positions:
            if p > pos:
                return p
        return None
