"""n > 1 in the engine: siblings fork the computed prompt (one prefill), sample on their own, and give
back every block; aborting the first sample before the fork leaves its siblings running."""

from __future__ import annotations

import random

import torch

from k3.serve.logits import adjust_row
from k3.serve.sampling import SamplingParams
from tests.serve.conftest import random_prompt


def run(engine, rids):
    outs = {r: [] for r in rids}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] += o.new_token_ids
    return outs


def test_forked_siblings_match_independent_runs(make_engine, tokenizer):
    prompt = random_prompt(random.Random(3), 40, tokenizer.base_size)
    ref = make_engine().generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    eng = make_engine(enable_prefix_cache=False)  # nothing kept after finishing: every block must come back
    eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), request_id="a",
                    fork_ids=["a-1", "a-2", "a-3"])
    outs = run(eng, ["a", "a-1", "a-2", "a-3"])
    assert all(v == ref.token_ids for v in outs.values())  # greedy: every sibling continues the same state
    assert eng.metrics.forked_requests == 3 and eng.metrics.prompt_tokens_computed == len(prompt)
    assert eng.pool.num_free == eng.pool.usable


def test_seeded_siblings_differ_and_aborts_before_the_fork(make_engine, tokenizer):
    prompt = random_prompt(random.Random(4), 30, tokenizer.base_size)
    eng = make_engine()
    eng.add_request(prompt, SamplingParams(temperature=1.0, seed=1, max_tokens=8, ignore_eos=True), request_id="s",
                    fork_ids=["s-1"])
    outs = run(eng, ["s", "s-1"])
    assert outs["s"] != outs["s-1"] and len(outs["s-1"]) == 8
    eng.add_request(prompt, SamplingParams(max_tokens=4, ignore_eos=True), request_id="b", fork_ids=["b-1", "b-2"])
    assert eng.abort("b")  # before the fork: the siblings go on alone
    outs = run(eng, ["b-1", "b-2"])
    assert len(outs["b-1"]) == len(outs["b-2"]) == 4 and eng.metrics.forked_requests == 1
    eng.add_request(prompt, SamplingParams(max_tokens=4), request_id="c", fork_ids=["c-1"])
    assert eng.abort("c-1") and eng.abort("c") and not eng.has_unfinished()


def test_adjust_row_penalties_bias_and_min_tokens():
    class Req:
        def __init__(self, params, out_ids):
            self.params, self.out_ids, self.constraint = params, out_ids, None

    row = torch.zeros(8)
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=1.0, logit_bias={3: 2.0}, min_tokens=3,
                       stop_token_ids=(5,))
    out = adjust_row(row, Req(p, [1, 1, 2]), eos_id=7)
    assert out.tolist() == [0, -2.5, -1.5, 2.0, 0, 0, 0, 0]  # 3 tokens sampled: min_tokens is met
    out = adjust_row(row, Req(p, [1]), eos_id=7)
    assert out[5] == float("-inf") and out[7] == float("-inf") and out[1] == -1.5
