"""The engine thread: streaming to asyncio, cancellation freeing the cache, overload refusal."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from k3.serve.async_engine import AsyncEngine, Overloaded
from k3.serve.sampling import SamplingParams
from tests.serve.conftest import random_prompt


def test_stream_cancel_and_overload(make_engine, tokenizer):
    rng = random.Random(0)
    engine = make_engine(enable_prefix_cache=False, max_waiting=3)
    free0 = engine.pool.num_free
    runner = AsyncEngine(engine)
    runner.start()

    async def scenario():
        p = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
        full = runner.submit(random_prompt(rng, 12, tokenizer.base_size), p)
        long = runner.submit(random_prompt(rng, 12, tokenizer.base_size),
                             SamplingParams(temperature=0, max_tokens=500, ignore_eos=True))
        got = [o async for o in full]
        first = await long.__anext__()  # the long request is running: cancel it mid-generation
        long.close()
        assert [o async for o in long] == []
        return got, first

    got, first = asyncio.run(scenario())
    assert got[-1].finished and sum(len(o.new_token_ids) for o in got) == 5
    assert not first.finished
    deadline = time.time() + 30
    while engine.has_unfinished() or engine.pool.num_free != free0:
        assert time.time() < deadline, "the cancelled request kept its cache"
        time.sleep(0.05)
    assert runner.aborted == 1

    async def flood():
        runner.shutdown()  # nothing is consumed: submissions pile up as waiting
        streams = []
        with pytest.raises(Overloaded):
            for _ in range(10):
                streams.append(runner.submit([1, 2, 3], SamplingParams(max_tokens=2)))
        return len(streams)

    assert asyncio.run(flood()) == 3
