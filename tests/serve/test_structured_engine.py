"""Grammar-constrained requests (k3.serve.structured) inside the engine, next to the features that
touch decoding: the prefix cache (a repeated constrained prompt hits it and still validates), n > 1
forks (one grammar state per sample), n-gram and learned-draft speculative decoding (constrained rows
decode plainly while other rows verify drafts), and the static decode path that CUDA graphs capture
(the mask is added to the logits the graph returns, outside it: the same tokens as the dynamic path);
plain rows are never touched. k3-tiny, random weights, CPU."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from k3.chat import parse, render_segments
from k3.config import k3_tiny
from k3.model.causal_lm import K3ForCausalLM
from k3.model.draft import DraftConfig, EagleDraft
from k3.serve.engine import Engine, EngineConfig
from k3.serve.logits import make_adjust
from k3.serve.sampling import SamplingParams
from k3.serve.structured import GrammarCompiler, StructuredSpec
from tests.serve.schemas import PERSON

FMT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
REPEAT = [5, 6, 7, 8, 9] * 8  # a prompt whose suffix recurs: the n-gram proposer always finds drafts


def json_prompt(tok) -> list[int]:
    segs = render_segments([{"role": "user", "content": "a person"}], thinking=False, add_generation_prompt=True,
                           response_format=FMT)
    return [t for s in segs for t in tok.encode(s.text, allow_special=s.special)]


def run(eng, requests: list[tuple[list[int], SamplingParams, object]]) -> list[dict]:
    """Submit (prompt, params, constraint factory or None) and step to the end: per request its ids,
    cached prompt tokens and finish reason."""
    rids = [eng.add_request(p, sp, constraint=c) for p, sp, c in requests]
    res = {r: {"ids": [], "cached": 0, "finish": None} for r in rids}
    while eng.has_unfinished():
        for out in eng.step():
            r = res[out.request_id]
            r["ids"] += out.new_token_ids
            r["cached"], r["finish"] = out.cached_tokens, out.finish_reason
    return [res[r] for r in rids]


def valid_json(tok, ids: list[int]) -> dict:
    msg = parse(ids, tok, start="response")
    value = json.loads(msg["content"])
    jsonschema.validate(value, PERSON)
    return value


@pytest.fixture(scope="module")
def person(tokenizer):
    return GrammarCompiler(tokenizer).compile(StructuredSpec(thinking=False, response_format=FMT), 10_000)


def test_prefix_cache_hit_still_validates(make_engine, tokenizer, person):
    eng = make_engine()
    prompt = json_prompt(tokenizer)
    sp = SamplingParams(temperature=1.0, seed=3, max_tokens=120)
    first, = run(eng, [(prompt, sp, person)])
    second, = run(eng, [(prompt, sp, person)])
    assert first["finish"] == second["finish"] == "stop"
    assert second["cached"] >= len(prompt) - 1  # the whole prompt came from the cache
    assert valid_json(tokenizer, first["ids"]) == valid_json(tokenizer, second["ids"])  # same seed, same sample


def test_forked_samples_each_follow_the_grammar(make_engine, tokenizer, person):
    """n = 3: the siblings fork the computed prompt and each gets its own grammar state."""
    eng = make_engine()
    eng.add_request(json_prompt(tokenizer), SamplingParams(temperature=1.0, seed=5, max_tokens=120),
                    request_id="a", fork_ids=["a-1", "a-2"], constraint=person)
    ids: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for out in eng.step():
            ids.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert eng.metrics.forked_requests == 2
    values = [valid_json(tokenizer, ids[r]) for r in ("a", "a-1", "a-2")]
    assert len({json.dumps(v) for v in values}) > 1  # seeds seed, seed + 1, seed + 2: different samples


def _verified(eng) -> set[str]:
    """Record the ids of the requests that go through the speculative verify path."""
    seen: set[str] = set()
    own = eng.spec.run

    def run_(drafted):
        seen.update(r.request_id for r, _, _ in drafted)
        return own(drafted)

    eng.spec.run = run_
    return seen


@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_speculative_decoding_beside_constrained_rows(make_engine, model, tokenizer, person, kind):
    if kind == "ngram":
        eng = make_engine(speculative_ngram=3)
    else:
        torch.manual_seed(1)
        draft = EagleDraft(DraftConfig.for_target(model.config)).attach(model).eval()
        eng = Engine(model, tokenizer, make_engine(speculative_draft_tokens=3).config, draft=draft)
    seen = _verified(eng)
    plain = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    sp = SamplingParams(temperature=0, max_tokens=120)
    ref = run(make_engine(), [(json_prompt(tokenizer), sp, person)])[0]["ids"]
    out = run(eng, [(REPEAT, plain, None), (json_prompt(tokenizer), sp, person)])
    assert eng.stats()["spec_draft_tokens"] > 0 and len(seen) == 1  # only the plain request verified drafts
    assert out[1]["ids"] == ref  # the constrained row decoded plainly: greedy output unchanged
    valid_json(tokenizer, out[1]["ids"])


def test_static_decode_path_masks_outside_the_graph(make_engine, tokenizer, person):
    """static_decode runs the runner's static-shape step that CUDA graphs capture and replay; the
    grammar bias is added to the logits it returns, so the graph never sees a mask."""
    sp = SamplingParams(temperature=0, max_tokens=120)
    eng = make_engine(static_decode=True, max_running=4)
    calls = [0]
    own = eng.runner.run  # the engine's static step (decode and verify) goes through DecodeRunner.run

    def counted(*a, **kw):
        calls[0] += 1
        return own(*a, **kw)

    eng.runner.run = counted
    got = run(eng, [(json_prompt(tokenizer), sp, person), (REPEAT, SamplingParams(temperature=0, max_tokens=8,
                                                                                   ignore_eos=True), None)])
    ref = run(make_engine(max_running=4), [(json_prompt(tokenizer), sp, person)])
    assert calls[0] > 0 and got[0]["ids"] == ref[0]["ids"]
    valid_json(tokenizer, got[0]["ids"])


def test_plain_rows_are_never_touched(tokenizer, person):
    """make_adjust: a batch of plain requests samples from the logits as they are (None: no copy, no
    mask); in a mixed batch only the constrained row changes, and its allowed set is the grammar's."""
    class Req:
        def __init__(self, constraint=None):
            self.params, self.out_ids, self.constraint = SamplingParams(), [], constraint

    assert make_adjust([Req(), Req()], tokenizer.eos_id) is None
    c = person()
    logits = torch.randn(3, 1100)
    out = make_adjust([Req(), Req(c), Req()], tokenizer.eos_id)(logits)
    assert torch.equal(out[[0, 2]], logits[[0, 2]])
    allowed = c.allowed(1100)
    assert torch.equal(out[1][allowed], logits[1][allowed]) and (out[1][~allowed] < -1e38).all()
    assert allowed.sum() == 1  # after the generation prompt the JSON value must open with `{`


@pytest.mark.gpu
def test_cuda_graphs_replay_beside_constrained_rows(tokenizer, person):
    """On CUDA (bf16): decode steps replayed as graphs give the static eager path's tokens for a batch
    of a constrained and a free row; the constrained output validates."""
    torch.manual_seed(0)
    model = K3ForCausalLM(k3_tiny()).init_weights(seed=0).to_dtype(torch.bfloat16).to("cuda").eval()
    cfg = dict(memory_budget_bytes=256 << 20, page_size=16, unit_size=16, max_running=8, max_model_len=4096,
               enable_prefix_cache=False)
    reqs = [(json_prompt(tokenizer), SamplingParams(temperature=0, max_tokens=120), person),
            (REPEAT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), None)]
    off = run(Engine(model, tokenizer, EngineConfig(cuda_graphs=False, static_decode=True, **cfg)), reqs)
    eng = Engine(model, tokenizer, EngineConfig(**cfg))
    on = run(eng, reqs)
    runner = eng.runner
    assert runner.use_graphs and runner.capture_error is None and runner.num_captures >= 1
    assert [o["ids"] for o in on] == [o["ids"] for o in off]
    valid_json(tokenizer, on[0]["ids"])
