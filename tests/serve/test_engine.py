"""Engine acceptance tests on k3-tiny (random weights, CPU): batching, prefix-cache hits, eviction
under memory pressure, cancellation, pause/resume."""

from __future__ import annotations

import random

import pytest

from k3.model.generate import generate as dense_generate
from k3.serve.engine import Engine, EngineConfig
from k3.serve.sampling import SamplingParams
from tests.serve.conftest import random_prompt

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _cold(make_engine, prompts, params=GREEDY):
    """Each prompt alone in a fresh engine without prefix cache and with one big prefill chunk."""
    outs = []
    for p in prompts:
        eng = make_engine(enable_prefix_cache=False, short_prefill_budget=4096, long_prefill_budget=4096,
                          page_size=64)
        outs.append(eng.generate([p], params)[0].token_ids)
    return outs


def _conversation(rng, tok, turns: int, turn_len: int) -> list[int]:
    """Token ids shaped like a rendered conversation: messages that each end with <|end_of_msg|>."""
    ids: list[int] = []
    for _ in range(turns):
        ids += random_prompt(rng, turn_len, tok.base_size) + [tok.eos_id]
    return ids


def _no_leak(eng) -> None:
    """Every block is either free or held by a prefix-cache checkpoint; clearing the cache frees all."""
    assert not eng.scheduler.running and eng.num_waiting == 0
    if eng.prefix is not None:
        eng.prefix.clear()
    assert eng.pool.num_free == eng.pool.usable
    assert all(c == 0 for c in eng.pool.refcount[1:])


def test_batched_greedy_equals_one_at_a_time(make_engine, tokenizer, model):
    rng = random.Random(1)
    prompts = [random_prompt(rng, n, tokenizer.base_size) for n in (3, 17, 40, 64, 9)]
    # small budgets and a low long threshold: chunked prefill of both classes, pages crossed mid-chunk
    eng = make_engine(short_prefill_budget=12, long_prefill_budget=20, long_prompt_threshold=30)
    batched = eng.generate(prompts, GREEDY)
    assert [o.finish_reason for o in batched] == ["length"] * len(prompts)
    assert [o.token_ids for o in batched] == _cold(make_engine, prompts)
    _no_leak(eng)


def test_engine_matches_the_dense_cache_generation_loop(model, tokenizer):
    """Against `k3.model.generate` (HybridCache, one prefill): an independent implementation. Without a
    tokenizer the engine samples from the model's whole vocabulary, as the dense loop does."""
    rng = random.Random(7)
    prompts = [random_prompt(rng, n, tokenizer.base_size) for n in (5, 23, 38)]
    eng = Engine(model, None, EngineConfig(memory_budget_bytes=16 << 20, page_size=8, unit_size=8,
                                           short_prefill_budget=16, long_prefill_budget=16))
    outs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=6))
    ref = dense_generate(model, prompts, SamplingParams(temperature=0, max_tokens=6))
    assert [o.token_ids for o in outs] == ref
    assert all(o.text == "" for o in outs)


def test_prefix_hit_output_identical_to_cold(make_engine, tokenizer):
    rng = random.Random(2)
    system = _conversation(rng, tokenizer, 1, 30)
    turn1 = system + _conversation(rng, tokenizer, 1, 11) + random_prompt(rng, 3, tokenizer.base_size)
    eng = make_engine()
    out1 = eng.generate([turn1], GREEDY)[0]
    assert out1.cached_tokens == 0
    # next turn: the previous prompt + its output + a tool result; a sibling shares only the system prompt
    turn2 = turn1 + out1.token_ids + _conversation(rng, tokenizer, 1, 13) + random_prompt(rng, 3, tokenizer.base_size)
    sibling = system + random_prompt(rng, 20, tokenizer.base_size)
    same = list(turn1)
    outs = eng.generate([turn2, sibling, same], GREEDY)
    cached = [o.cached_tokens for o in outs]
    assert cached[0] == len(turn1) + len(out1.token_ids) - 1  # the finished request's donated state
    assert cached[1] == len(system)  # the message-end checkpoint
    assert cached[2] == len(turn1) - 1  # the prompt-end checkpoint (one token is recomputed)
    assert [o.token_ids for o in outs] == _cold(make_engine, [turn2, sibling, same])
    assert outs[2].token_ids == out1.token_ids
    s = eng.stats()
    assert s["prefix_hits"] == 3 and s["prefix_queries"] == 4
    assert s["prefix_hit_tokens"] == sum(cached)
    _no_leak(eng)


def test_agent_turn_resumes_with_one_prefill_chunk(make_engine, tokenizer):
    """Turn 2 = turn 1's prompt + answer + closing <|end_of_msg|> + a tool message + a generation
    prompt: it resumes at turn 1's final state and prefills the new messages in ONE forward (the
    message end 2 tokens after the resume point gets no chunk of its own), with cold-run output."""
    rng = random.Random(11)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    eng = make_engine(checkpoint_min_gap=4, short_prefill_budget=64, long_prefill_budget=64)
    first = _conversation(rng, tokenizer, 2, 12)
    answer = eng.generate([first], params)[0].token_ids
    second = first + answer + [tokenizer.eos_id] + random_prompt(rng, 20, tokenizer.base_size) + [tokenizer.eos_id, 5]
    chunks = []
    schedule = eng.scheduler.schedule

    def spy():
        plan = schedule()
        chunks.extend(n for _, n in plan.prefill)
        return plan

    eng.scheduler.schedule = spy
    out = eng.generate([second], params)[0]
    assert out.cached_tokens == len(first) + len(answer) - 1
    assert chunks == [len(second) - 1 - out.cached_tokens]  # one chunk up to the last prompt position
    assert out.token_ids == _cold(make_engine, [second], params)[0]


def test_concurrent_requests_wait_for_a_prefix_being_computed(make_engine, tokenizer):
    """Requests arriving together with one system prompt: the first computes it, the others are admitted
    once its checkpoint exists (instead of all computing the same prefix at once)."""
    rng = random.Random(8)
    system = _conversation(rng, tokenizer, 1, 50)
    prompts = [system + _conversation(rng, tokenizer, 1, 5 + k) + [1, 2] for k in range(3)]
    eng = make_engine(short_prefill_budget=16, long_prefill_budget=16)
    outs = eng.generate(prompts, GREEDY)
    assert [o.cached_tokens for o in outs] == [0, len(system), len(system)]
    assert eng.stats()["prompt_tokens_computed"] == sum(len(p) for p in prompts) - 2 * len(system)
    assert [o.token_ids for o in outs] == _cold(make_engine, prompts)


def test_copy_on_write_from_a_shared_mid_page_checkpoint(make_engine, tokenizer):
    rng = random.Random(3)
    base = random_prompt(rng, 21, tokenizer.base_size)  # prompt-end checkpoint at 20: mid-page (page 8)
    eng = make_engine(page_size=8)
    eng.generate([base], GREEDY)
    branches = [base + random_prompt(rng, k, tokenizer.base_size) for k in (5, 9, 2)]
    outs = eng.generate(branches, GREEDY)  # all three resume from the same checkpoint concurrently
    assert [o.cached_tokens for o in outs] == [20, 20, 20]
    assert [o.token_ids for o in outs] == _cold(make_engine, branches)
    _no_leak(eng)


def test_eviction_under_tiny_budget_never_corrupts_live_requests(make_engine, tokenizer):
    rng = random.Random(4)
    system = _conversation(rng, tokenizer, 1, 40)
    prompts = [system + random_prompt(rng, rng.randrange(5, 30), tokenizer.base_size) for _ in range(4)]
    prompts += [random_prompt(rng, rng.randrange(20, 50), tokenizer.base_size) for _ in range(2)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    layout = make_engine().layout
    # room for two KDA slots and a few pages: decode growth preempts, checkpoints are evicted constantly
    eng = make_engine(memory_budget_bytes=(2 * layout.slot_blocks + 14) * layout.block_bytes, max_running=6)
    outs = eng.generate(prompts, params)
    s = eng.stats()
    assert s["prefix_evicted"] > 0 and s["preemptions"] > 0
    assert [o.token_ids for o in outs] == _cold(make_engine, prompts, params)
    _no_leak(eng)


def test_short_requests_are_not_starved_by_long_prompts(make_engine, tokenizer):
    rng = random.Random(9)
    eng = make_engine(short_prefill_budget=16, long_prefill_budget=16, long_prompt_threshold=64,
                      enable_prefix_cache=False)
    longs = [eng.add_request(random_prompt(rng, 150, tokenizer.base_size), GREEDY) for _ in range(4)]
    eng.step()
    eng.step()
    short = eng.add_request(random_prompt(rng, 30, tokenizer.base_size), GREEDY)
    progress = {r: eng.requests[r].num_computed for r in longs}
    steps = 0
    while not eng.requests[short].out_ids:
        eng.step()
        steps += 1
    assert steps <= 3  # 16 + 13 prompt tokens in two chunks, the last one in a decode step
    assert sum(eng.requests[r].num_computed for r in longs) >= sum(progress.values()) + 2 * 16  # longs kept going


def test_leftover_budget_extends_chunks_instead_of_leaving_a_remainder(make_engine, tokenizer):
    """Three new short prompts of 12 tokens, budgets 16 (short) + 24 (long): the second one's chunk is
    cut to the 4 tokens left of the short budget, the third takes the long budget; without the top-up
    the second one's 8-token remainder costs another forward, with it the long budget's leftover
    completes the chunk and all three prefill in one forward."""
    rng = random.Random(13)
    eng = make_engine(short_prefill_budget=16, long_prefill_budget=24, long_prompt_threshold=64,
                      enable_prefix_cache=False)
    prompts = [random_prompt(rng, 12, tokenizer.base_size) for _ in range(3)]
    chunks = []
    schedule = eng.scheduler.schedule

    def spy():
        plan = schedule()
        chunks.append([n for _, n in plan.prefill])
        return plan

    eng.scheduler.schedule = spy
    outs = eng.generate(prompts, GREEDY)
    assert chunks[0] == [12, 12, 12] and not any(chunks[1:])  # then decode steps only
    assert [o.token_ids for o in outs] == _cold(make_engine, prompts)


def test_long_prompts_with_a_cached_prefix_run_as_short_ones(make_engine, tokenizer):
    """Long / short is decided by the tokens left to compute after the prefix hit: two 90-token
    prompts extending a cached 80-token conversation run together although max_long_running is 1."""
    rng = random.Random(12)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    eng = make_engine(long_prompt_threshold=40, max_running=4, max_long_running=1, short_prefill_budget=32,
                      long_prefill_budget=32)
    base = _conversation(rng, tokenizer, 4, 19)
    eng.generate([base], params)
    prompts = [base + random_prompt(rng, 10, tokenizer.base_size) for _ in range(2)]
    ids = [eng.add_request(p, params) for p in prompts]
    assert all(eng.requests[r].long for r in ids)  # by total length, at submission
    eng.step()
    running = [eng.requests[r] for r in ids]
    assert all(r.status == "running" and not r.long for r in running)  # both admitted in one step
    assert all(r.num_computed >= len(base) - 1 for r in running)
    got = {r: [] for r in ids}
    while eng.has_unfinished():
        for out in eng.step():
            got[out.request_id] += out.new_token_ids
    assert [got[r] for r in ids] == _cold(make_engine, prompts, params)
    long_cold = make_engine(long_prompt_threshold=40, max_long_running=1, max_running=4, enable_prefix_cache=False)
    for p in prompts:  # without a cache they stay long: only one runs at a time
        long_cold.add_request(p, params)
    long_cold.step()
    assert len(long_cold.scheduler.running) == 1


def test_abort_frees_the_cache(make_engine, tokenizer):
    rng = random.Random(5)
    eng = make_engine(enable_prefix_cache=False)
    free0 = eng.pool.num_free
    a = eng.add_request(random_prompt(rng, 30, tokenizer.base_size), GREEDY)
    b = eng.add_request(random_prompt(rng, 10, tokenizer.base_size), GREEDY)
    for _ in range(3):
        eng.step()
    assert eng.pool.num_free < free0
    assert eng.abort(a) and eng.abort(b)
    assert not eng.abort(a)
    assert eng.pool.num_free == free0 and not eng.has_unfinished()
    assert eng.stats()["finished"] == {"abort": 2}


def test_pause_and_resume_with_appended_context(make_engine, tokenizer):
    rng = random.Random(6)
    pa, pb = random_prompt(rng, 12, tokenizer.base_size), random_prompt(rng, 7, tokenizer.base_size)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    eng = make_engine()
    a = eng.add_request(pa, params)
    b = eng.add_request(pb, params)
    got: dict[str, list[int]] = {a: [], b: []}

    def run(steps):
        for _ in range(steps):
            for o in eng.step():
                got[o.request_id] += o.new_token_ids

    run(2)
    eng.pause(a)
    before = list(got[a])
    while b in eng.requests:
        run(1)
    run(3)
    assert got[a] == before  # no progress while paused
    tool_result = random_prompt(rng, 6, tokenizer.base_size) + [tokenizer.eos_id]
    context = pa + got[a] + tool_result
    eng.resume(a, append_ids=tool_result, max_tokens=5)
    while a in eng.requests:
        run(1)
    cont = got[a][len(before):]
    assert len(cont) == 5
    # after the pause, greedy continuation == a fresh request on the whole context
    assert cont == _cold(make_engine, [context], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert got[b] == _cold(make_engine, [pb], params)[0]
    with pytest.raises(KeyError):
        eng.pause(a)


def test_request_limits_are_validated(make_engine, tokenizer):
    eng = make_engine(max_model_len=64)
    with pytest.raises(ValueError, match="maximum context length"):
        eng.add_request([1] * 64, GREEDY)
    with pytest.raises(ValueError, match="maximum context length"):
        eng.add_request([1] * 60, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="at least one token"):
        eng.add_request([], GREEDY)
    with pytest.raises(ValueError, match="token ids"):
        eng.add_request([tokenizer.vocab_size + 5], GREEDY)
    small = make_engine(memory_budget_bytes=(make_engine().layout.slot_blocks + 4) * make_engine().layout.block_bytes)
    with pytest.raises(ValueError, match="cache memory"):
        small.add_request([1] * 30, SamplingParams(max_tokens=30))


def test_forward_metrics_count_prefill_and_decode(make_engine, tokenizer):
    """The engine's phase split (what bench/serve.py reports and /metrics exports)."""
    from k3.serve.metrics import prometheus_text

    rng = random.Random(11)
    eng = make_engine()
    eng.generate([random_prompt(rng, n, tokenizer.base_size) for n in (7, 21)],
                 SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    m = eng.metrics.snapshot()
    # prefill runs each prompt but its last token; the 5 tokens come from 5 decode forwards of 2 rows
    assert m["prefill_forwards"] >= 1 and m["decode_forwards"] == 5 and m["decode_rows"] == 10
    assert m["prefill_seconds"] > 0 and m["decode_seconds"] > 0
    text = prometheus_text(eng.stats())
    assert f"k3_decode_forwards_total {float(m['decode_forwards'])!r}" in text
