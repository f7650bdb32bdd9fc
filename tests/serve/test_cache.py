"""Unit tests of the block pool, the paged HybridCache adapter, prefix hashing and checkpoint plans."""

from __future__ import annotations

import random

import pytest
import torch

from k3.model.cache import HybridCache
from k3.serve.cache_manager import BlockPool, CacheLayout, OutOfBlocks, PagedBatchCache
from k3.serve.prefix_cache import CheckpointPlan, PrefixCache, PrefixHasher


@pytest.fixture
def layout(model) -> CacheLayout:
    return CacheLayout.from_config(model.config.text_config, page_size=4, dtype=torch.float32)


def test_layout_geometry(layout, model):
    tc = model.config.text_config
    assert layout.mla_layers == tuple(i for i in range(tc.num_hidden_layers) if tc.is_mla(i))
    assert layout.block_bytes == len(layout.mla_layers) * 4 * (tc.kv_lora_rank + tc.qk_rope_head_dim) * 4
    assert layout.slot_blocks * layout.block_bytes >= layout.slot_bytes > 0
    assert layout.pages_for(0) == 0 and layout.pages_for(4) == 1 and layout.pages_for(5) == 2


def test_pool_alloc_refcount_and_zero_block(layout):
    pool = BlockPool(layout, 6)
    assert pool.usable == 5 and pool.num_free == 5
    a = pool.alloc(3)
    assert 0 not in a and pool.num_free == 2
    with pytest.raises(OutOfBlocks):
        pool.alloc(3)
    assert pool.num_free == 2  # a failed alloc takes nothing
    pool.incref(a[:1])
    pool.decref(a)
    assert pool.num_free == 4 and pool.refcount[a[0]] == 1
    pool.decref(a[:1])
    assert pool.num_free == 5
    with pytest.raises(RuntimeError):
        pool.decref(a[:1])
    pool.decref([0])  # the shared zero block is never freed
    assert pool.refcount[0] > 0 and pool.storage[0].abs().sum() == 0


def test_slot_round_trip_over_scattered_blocks(layout):
    pool = BlockPool(layout, 3 * layout.slot_blocks + 4)
    pool.alloc(1)  # make the slots non-contiguous
    slots = [pool.alloc(layout.slot_blocks) for _ in range(2)]
    slots[1].reverse()
    H, K = layout.kda_heads, layout.kda_head_dim
    states = {l: torch.randn(2, H, K, K) for l in layout.kda_layers}
    tails = {l: torch.randn(2, *layout.tail_shape) for l in layout.kda_layers}
    pool.write_slots(slots, states, tails)
    s2, t2 = pool.read_slots(slots[::-1])
    for l in layout.kda_layers:
        assert torch.equal(s2[l], states[l].flip(0)) and torch.equal(t2[l], tails[l].flip(0))
    dst = pool.alloc(layout.slot_blocks)
    pool.copy_blocks(slots[0], dst)
    s3, _ = pool.read_slots([dst])
    assert all(torch.equal(s3[l][0], states[l][0]) for l in layout.kda_layers)


@torch.inference_mode()
def test_paged_cache_matches_hybrid_cache(model):
    """Packed prefill of ragged chunks then a decode step: the paged adapter gives the logits of the
    model's own dense HybridCache (same math, different memory layout)."""
    layout = CacheLayout.from_config(model.config.text_config, page_size=4, dtype=torch.float32)
    pool = BlockPool(layout, 3 * layout.slot_blocks + 16)
    g = torch.Generator().manual_seed(0)
    lens = [7, 2, 12]
    seqs = [torch.randint(0, 400, (n + 1,), generator=g).tolist() for n in lens]
    slots = [pool.alloc(layout.slot_blocks) for _ in lens]
    for s in slots:
        pool.zero(s)
    tables = [pool.alloc_pages(layout.pages_for(n + 1)) for n in lens]
    model.set_kda_backend("reference")
    dense = HybridCache(model.config.text_config, len(lens), capacity=4)
    ids = torch.tensor([t for s, n in zip(seqs, lens) for t in s[:n]])[None]
    cu = torch.tensor([0] + lens).cumsum(0)
    dense.absorb_mla = False
    h_d, _ = model.model(ids, cu_seqlens=cu, cache=dense)
    for absorb in (True, False):  # the absorbed pass is not committed: both start from zero state
        paged = PagedBatchCache(pool, tables, slots, [0] * 3, lens, absorb_mla=absorb)
        h_p, _ = model.model(ids, cu_seqlens=cu, cache=paged)
        torch.testing.assert_close(h_p, h_d, rtol=1e-5, atol=1e-5)
    paged.commit()
    step = torch.tensor([[s[n]] for s, n in zip(seqs, lens)])
    paged = PagedBatchCache(pool, tables, slots, lens, [1] * 3, absorb_mla=True)
    dense.absorb_mla = True
    h_p, _ = model.model(step, cache=paged)
    h_d, _ = model.model(step, cache=dense)
    torch.testing.assert_close(model.lm_head(h_p), model.lm_head(h_d), rtol=1e-4, atol=1e-4)


def test_prefix_hasher_is_chained():
    a = list(range(40))
    b = list(range(40))
    b[5] = 999
    ha, hb, hc = PrefixHasher(a, 8), PrefixHasher(b, 8), PrefixHasher(list(a[:20]), 8)
    assert ha.anchor(0) == hb.anchor(0)
    assert all(ha.anchor(k) != hb.anchor(k) for k in range(1, 6))  # a change poisons every later unit
    assert ha.anchor(2) == hc.anchor(2) and ha.key(19) == hc.key(19)
    assert ha.key(19) != ha.key(18)
    with pytest.raises(ValueError):
        hc.anchor(3)


def test_prefix_cache_lookup_lru_and_pins(layout):
    pool = BlockPool(layout, 40)
    cache = PrefixCache(pool, unit=8)
    toks = list(range(100, 140))
    h = PrefixHasher(toks, 8)
    for pos in (5, 16, 21):
        slot, pages = pool.alloc(1), pool.alloc(2)
        assert cache.insert(h.key(pos), h.anchor(pos // 8), pos, slot, pages)
    assert not cache.insert(h.key(21), h.anchor(2), 21, [], [])  # duplicates are refused
    q = PrefixHasher(toks[:30] + [1, 2, 3], 8)
    assert cache.lookup(q, 32).pos == 21
    assert cache.lookup(q, 20).pos == 16
    assert cache.lookup(PrefixHasher(toks[:18] + [7] * 10, 8), 27).pos == 16
    assert cache.lookup(PrefixHasher([9] + toks[1:], 8), 39) is None
    # LRU: 16 was used last, 21 before it; pinned entries are skipped
    cache._lru[h.key(5)].pins = 1
    assert cache.evict_one() and h.key(21) not in cache
    assert cache.evict_one() and h.key(16) not in cache
    assert not cache.evict_one() and len(cache) == 1
    cache._lru[h.key(5)].pins = 0
    cache.clear()
    assert pool.num_free == pool.usable


def test_checkpoint_plan_positions():
    eos = 99
    toks = [1] * 10 + [eos] + [2] * 5 + [eos] + [3] * 20 + [eos] + [4] * 3
    plan = CheckpointPlan.build(toks, 0, boundary_id=eos, unit=4, every_units=2, max_count=10, min_gap=3)
    # the last position 40, message ends 11, 17 (38 is within min_gap of 40), interval points 8..32
    assert plan.positions == [8, 11, 17, 24, 32, 40]
    assert CheckpointPlan.build(toks, 17, boundary_id=eos, unit=4, every_units=0, max_count=10,
                                min_gap=3).positions == [40]
    assert CheckpointPlan.build(toks, 0, boundary_id=eos, unit=4, every_units=0, max_count=2,
                                min_gap=0).positions == [38, 40]
    assert CheckpointPlan.build(toks, 0, boundary_id=None, unit=4, every_units=0, max_count=0,
                                min_gap=0).positions == []
    assert plan.next_after(11) == 17 and plan.next_after(40) is None


def test_checkpoint_plan_skips_message_ends_right_after_the_resume_point():
    """An agent's next turn resumes at the previous answer's last token; the message end 2 tokens later
    would cost a prefill forward of its own for a 2-token chunk: within min_gap of start, it is skipped."""
    eos = 99
    toks = [1] * 20 + [eos] + [2] * 30 + [eos] + [3] * 8  # message ends 21 and 52, last position 59
    assert CheckpointPlan.build(toks, 19, boundary_id=eos, unit=4, every_units=0, max_count=10,
                                min_gap=4).positions == [52, 59]  # 21 (2 after start) skipped
    assert CheckpointPlan.build(toks, 17, boundary_id=eos, unit=4, every_units=0, max_count=10,
                                min_gap=4).positions == [21, 52, 59]  # 4 after start: kept
    # interval points (every 8) near start go as well: 24 is 5 after 19; explicit positions stay
    assert CheckpointPlan.build(toks, 19, boundary_id=eos, unit=4, every_units=2, max_count=10,
                                min_gap=6).positions == [32, 40, 52, 59]
    assert CheckpointPlan.build(toks, 19, boundary_id=eos, unit=4, every_units=0, max_count=10, min_gap=6,
                                extra=(21,)).positions == [21, 52, 59]


def test_random_tables_write_where_expected(layout):
    """PagedBatchCache writes token t of sequence i to page t // P, row t % P of its table."""
    pool = BlockPool(layout, 3 * layout.slot_blocks + 16)
    rng = random.Random(0)
    past, new = [3, 0, 9], [4, 6, 1]
    tables = [pool.alloc_pages(layout.pages_for(p + n)) for p, n in zip(past, new)]
    slots = [pool.alloc(layout.slot_blocks) for _ in past]
    c = PagedBatchCache(pool, tables, slots, past, new, absorb_mla=True)
    D = layout.latent_dim
    lat = torch.tensor([[[rng.random() for _ in range(D)] for _ in range(max(new))] for _ in past])
    layer = layout.mla_layers[0]
    out = c.mla_append(layer, lat, None)
    for i, (p, n) in enumerate(zip(past, new)):
        for j in range(n):
            t = p + j
            assert torch.equal(pool.pages[tables[i][t // 4], 0, t % 4], lat[i, j])
            assert torch.equal(out[i, t], lat[i, j])
