"""Speculative decoding on the static runner (what CUDA graphs capture): verify steps of [N, k + 1] tokens
through `DecodeRunner.run` + `commit_verify`, and the learned draft's static KV cache and chain.

CPU (eager static path, fp32): a verify step's logits and its per-token KDA states equal decode steps one
token at a time; the selection rollback writes exactly the state after the kept tokens; greedy engine
outputs with a draft / n-gram speculation on the static path equal plain decoding (rejections, prefix-cache
hits, stops); sampled requests stay exact; the ring-buffer draft chain equals the draft run directly.
GPU (marked gpu): graph replay of verify steps and of the draft chain against the eager static path,
and engine outputs with graphs on equal graphs off."""

from __future__ import annotations

import random

import pytest
import torch

from k3.config import k3_tiny
from k3.model.causal_lm import K3ForCausalLM
from k3.model.draft import DraftConfig, EagleDraft
from k3.serve.cache_manager import BlockPool, CacheLayout
from k3.serve.engine import Engine, EngineConfig
from k3.serve.model_runner import DecodeRunner
from k3.serve.sampling import SamplingParams
from tests.serve.conftest import random_prompt
from tests.serve.test_draft_spec import SmallVocab, _oracle, _prompts
from tests.serve.test_model_runner import HostReads, Seqs

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _pools(model, page_size: int = 4) -> tuple[BlockPool, BlockPool]:
    """Two identical empty pools with room for 3 slots and 48 pages."""
    p = model.lm_head.weight
    layout = CacheLayout.from_config(model.config.text_config, page_size, p.dtype)
    n = 1 + 3 * layout.slot_blocks + 48
    return BlockPool(layout, n, p.device), BlockPool(layout, n, p.device)


def _verify_vs_decode(model, tol: float, use_graphs: bool = False) -> None:
    """Verify 3 rows x up to 4 tokens in one static step on pool A, decode the same tokens one step at a
    time on pool B: logits agree at every real token; after commit_verify(kept) A's slots equal B's
    states after `kept` tokens, and a following decode step agrees."""
    rng = random.Random(1)
    prompts = [random_prompt(rng, n, 4000) for n in (5, 11, 3)]
    pool_a, pool_b = _pools(model)
    a, b = Seqs(pool_a, prompts), Seqs(pool_b, prompts)
    new = [[rng.randrange(4000) for _ in range(n)] for n in (4, 2, 4)]
    kept = [3, 2, 1]
    with torch.inference_mode():
        a.prefill(model)
        b.prefill(model)
        ra = DecodeRunner(model, pool_a, max_batch=4, max_len=64, use_graphs=use_graphs, max_new=4)
        rb = DecodeRunner(model, pool_b, max_batch=4, max_len=64, use_graphs=False)
        ids, past, slots, pages = a.decode_args()
        a.reserve([p + len(t) for p, t in zip(past, new)])
        logits, _ = ra.run([[i] + t[:-1] for i, t in zip(ids, new)], past, slots, a.pages)
        logits = logits.float().clone()
        states = []  # B's slot states after each step
        for j in range(4):
            live = [i for i in range(3) if j < len(new[i])]
            tok, pst, slt, pgs = b.decode_args()
            step = rb.decode([tok[i] for i in live], [pst[i] for i in live], [slt[i] for i in live],
                             [pgs[i] for i in live]).float()
            for n, i in enumerate(live):
                torch.testing.assert_close(logits[i, j], step[n], rtol=tol, atol=tol)
                b.tokens[i].append(new[i][j])
                b.past[i] += 1
            states.append(pool_b.read_slots(b.slots))
        ra.commit_verify(kept)
        sa, ta = pool_a.read_slots(a.slots)
        for i, k in enumerate(kept):
            sb, tb = states[k - 1]
            for layer in sa:
                torch.testing.assert_close(sa[layer][i], sb[layer][i], rtol=tol, atol=tol)
                torch.testing.assert_close(ta[layer][i], tb[layer][i], rtol=tol, atol=tol)
        assert not pool_a.storage[0].any(), "padding tokens left data in the zero block"


def test_verify_step_equals_decode_steps_and_commit_selects_the_kept_state(model):
    _verify_vs_decode(model, 1e-5)


def test_verify_refuses_bad_input(model):
    pool, _ = _pools(model)
    runner = DecodeRunner(model, pool, max_batch=2, max_len=16, use_graphs=False, max_new=3)
    slot = [1] * pool.layout.slot_blocks
    assert runner.bucket(1, 1, 2) == (1, 1, 3) and runner.bucket(1, 1, 4) is None
    assert runner.run([[1, 2, 3, 4]], [0], [slot], [[2]]) is None  # more tokens than max_new
    with pytest.raises(ValueError, match="does not cover position 4"):
        runner.run([[1, 2, 3]], [2], [slot], [[2]])
    with pytest.raises(ValueError, match="at least one token"):
        runner.run([[]], [0], [slot], [[2]])
    runner.run([[1, 2]], [0], [slot], [[2]])
    with pytest.raises(ValueError, match="one kept count in 1..3"):
        runner.commit_verify([4])


def _engine(model, draft=None, k: int = 4, **overrides) -> Engine:
    cfg = {"memory_budget_bytes": 16 << 20, "page_size": 8, "unit_size": 8, "checkpoint_every_units": 2,
           "checkpoint_min_gap": 2, "max_model_len": 1024, "enable_prefix_cache": False,
           "speculative_draft_tokens": k, "max_running": 8, "speculative_draft_window": 128,
           "speculative_max_batch": 0}  # verify at every batch size
    cfg.update(overrides)
    return Engine(model, SmallVocab(), EngineConfig(**cfg), draft=draft)


@pytest.fixture(scope="module")
def draft(model) -> EagleDraft:
    torch.manual_seed(1)
    return EagleDraft(DraftConfig.for_target(model.config)).attach(model).eval()


def _spy_buckets(eng: Engine) -> list:
    seen, own = [], eng.runner.bucket

    def bucket(*args):
        key = own(*args)
        seen.append(key)
        return key

    eng.runner.bucket = bucket
    return seen


def test_static_greedy_with_draft_and_ngram_equals_plain(model, draft):
    prompts = _prompts(2, [5, 17, 9, 30, 3, 150])  # short contexts attend over 64 columns, the 150-token one wraps
    sp = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (24, 13, 30, 7, 21, 16)]
    plain = _engine(model).generate(prompts, sp)
    full = [p + o.token_ids for p, o in zip(prompts, plain)]
    for kw, oracle in (({"draft": draft}, False), ({"draft": draft}, True), ({"speculative_ngram": 3}, False)):
        eng = _engine(model, static_decode=True, **kw)
        seen = _spy_buckets(eng)
        if oracle:  # (greedy drafts reach the verify step on the device either way)
            _oracle(eng, full)
        assert [o.token_ids for o in eng.generate(prompts, sp)] == [o.token_ids for o in plain]
        s = eng.stats()
        assert any(key is not None and key[2] == eng.runner.max_new for key in seen)  # static verify steps ran
        assert s["spec_verify_forwards"] > 0 and s["spec_rerun_forwards"] > 0
        if oracle:  # (the random draft / random prompts for n-gram mostly fail)
            assert 0 < s["spec_accepted_tokens"] < s["spec_draft_tokens"]


def test_static_draft_prefix_hits_stops_and_sampling(model, draft):
    base = _prompts(3, [20])[0]
    prompts = [base + [1, 2], base + [4], base[:17] + [5, 6, 7]]
    stop = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=(7, 11))
    plain = _engine(model, enable_prefix_cache=True).generate(prompts, stop)
    eng = _engine(model, draft, k=3, enable_prefix_cache=True, static_decode=True)
    _oracle(eng, [p + o.token_ids for p, o in zip(prompts, plain)], bad=4)
    got = eng.generate(prompts[:1], stop) + eng.generate(prompts[1:], stop)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in plain]
    assert eng.stats()["prefix_hit_tokens"] > 0
    # sampled requests (drafts drawn from q, eager chain) mixed with greedy ones: seeded runs repeat
    mixed = [SamplingParams(temperature=0.7, max_tokens=10, seed=5, ignore_eos=True), GREEDY]
    one = _engine(model, draft, static_decode=True).generate(prompts[:2], mixed)
    two = _engine(model, draft, static_decode=True).generate(prompts[:2], mixed)
    assert [o.token_ids for o in one] == [o.token_ids for o in two]
    assert one[1].token_ids == _engine(model).generate(prompts[1:2], GREEDY)[0].token_ids


def test_speculative_max_batch_decodes_large_steps_plainly(model, draft):
    prompts = _prompts(9, [6, 11, 8])
    sp = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (6, 9, 20)]
    plain = [o.token_ids for o in _engine(model).generate(prompts, sp)]
    eng = _engine(model, draft, static_decode=True, speculative_max_batch=1)
    steps = []
    own = eng.spec.split
    eng.spec.split = lambda decode: steps.append(len(decode)) or own(decode)
    assert [o.token_ids for o in eng.generate(prompts, sp)] == plain
    assert steps and max(steps) == 1 and eng.stats()["spec_verify_forwards"] > 0  # only the last request drafted
    with pytest.raises(ValueError, match="speculative_max_batch"):
        EngineConfig(speculative_max_batch=-1).validate()


def test_static_draft_chain_equals_the_draft_run_directly(model, draft):
    """The proposer's ring-buffer KV and static chain (prefeed + last k + 1 entries + k steps) give the
    drafts the draft layer itself computes over the whole context, step by step; several requests of
    different lengths prefeed together in chunks of half the window (window 32: chunks of 16)."""
    for lengths, window in (([23], 128), ([23, 9, 20], 32)):
        _check_chain(model, draft, _prompts(5, lengths), window)


def _check_chain(model, draft, prompts: list[list[int]], window: int) -> None:
    eng = _engine(model, draft, k=3, static_decode=True, speculative_draft_window=window)
    prop = eng.spec.proposer
    ids = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)) for p in prompts]
    reqs = [eng.requests[i] for i in ids]
    got, own = [], prop.propose

    def propose(cands):
        out = own(cands)
        got.extend((list(r.tokens), d.host()) for (r, _), (d, _) in zip(cands, out))  # greedy: DraftIds
        return out

    prop.propose = propose
    while eng.has_unfinished():
        eng.step()
    assert len(got) >= len(prompts) and all(r.status == "finished" for r in reqs)
    assert max(len(t) for t, _ in got) < window  # the ring still holds every position
    layers = list(draft.config.target_layers)
    with torch.inference_mode():
        for tokens, drafts in got[: 3 * len(prompts)]:
            n = len(tokens) - 1  # positions with target states: 0..n-1; entry i = (state i, token i + 1)
            _, hidden = model.model(torch.tensor([tokens[:n]]), hidden_state_layers=layers)
            aux = torch.cat([hidden[i] for i in layers], -1)
            hid, k, v = draft(torch.tensor([tokens[1: n + 1]]), draft.fuse(aux))
            h, want = hid[:, -1], []
            for j in range(len(drafts)):
                d = int(draft.logits(h)[0, :32].argmax())
                want.append(d)
                hid, k1, v1 = draft(torch.tensor([[d]]), h[:, None], k, v, torch.ones(1, k.shape[1], dtype=torch.bool))
                k, v, h = torch.cat([k, k1], 1), torch.cat([v, v1], 1), hid[:, -1]
            assert drafts == want


def test_static_speculative_pieces_read_nothing_back_to_the_host(model, draft):
    """What the graphs capture (verify step, rollback selection, greedy draft chain) makes no host read
    on CPU except the CPU expert loop's group sizes (grouped GEMMs with device offsets on CUDA bf16)."""
    prompts = _prompts(8, [9, 14])
    eng = _engine(model, draft, k=3, static_decode=True)
    seen = []
    own_run, own_greedy = eng.runner.run, eng.spec.proposer._greedy

    def run(*args, **kwargs):
        out = own_run(*args, **kwargs)
        if eng.runner._last_key[2] > 1 and not seen:
            with HostReads() as reads:
                eng.runner._step(*eng.runner._last_key)
                eng.runner._select(eng.runner._last_key[0])
                own_greedy(1)
            seen.append(reads.hits)
        return out

    eng.runner.run = run
    eng.generate(prompts, GREEDY)
    assert seen and all(h == ("tolist", "sizes = counts.tolist()") for h in seen[0]), seen


# ------------------------------------------------------------------------------------------------ GPU

def _gpu_model(dtype=torch.bfloat16) -> K3ForCausalLM:
    torch.manual_seed(0)
    return K3ForCausalLM(k3_tiny()).init_weights(seed=0).to_dtype(dtype).to("cuda").eval()


@pytest.mark.gpu
def test_verify_graph_replay_equals_decode_steps_on_cuda():
    """bf16 graphs: a verify step's logits and kept states against single-token decode steps. The same
    KDA and paged-MLA kernels run per token; GEMMs see k + 1 times the rows, so bf16 rounding may differ
    (tolerance), while fp32 on CUDA (eager static path) must agree to 1e-4."""
    _verify_vs_decode(_gpu_model(), 3e-2, use_graphs=True)
    _verify_vs_decode(_gpu_model(torch.float32), 1e-4, use_graphs=False)


@pytest.mark.gpu
def test_engine_with_draft_graphs_on_equals_off_and_captures():
    model = _gpu_model()
    torch.manual_seed(1)
    d = EagleDraft(DraftConfig.for_target(model.config)).to("cuda", torch.bfloat16).attach(model).eval()
    prompts = _prompts(6, [12, 50, 7, 33, 60, 21])
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    cfg = dict(memory_budget_bytes=256 << 20, page_size=16, max_model_len=4096, max_running=8)
    off = _engine(model, d, cuda_graphs=False, static_decode=True, **cfg)
    on = _engine(model, d, **cfg)
    full = [p + o.token_ids for p, o in zip(prompts, _engine(model, cuda_graphs=False, static_decode=True,
                                                             **cfg).generate(prompts, sp))]
    _oracle(off, full)
    _oracle(on, full)
    a, b = off.generate(prompts, sp), on.generate(prompts, sp)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert on.runner.capture_error is None and any(k[2] > 1 for k in on.runner.graphs) and on.runner.commit_graphs
    prop = on.spec.proposer
    assert prop.use_graphs and prop.capture_error is None and prop.graphs
    assert on.stats()["spec_accepted_tokens"] > 0


@pytest.mark.gpu
def test_fp32_cuda_static_greedy_with_draft_equals_plain():
    model = _gpu_model(torch.float32)
    torch.manual_seed(1)
    d = EagleDraft(DraftConfig.for_target(model.config)).to("cuda").attach(model).eval()
    prompts = _prompts(7, [12, 50, 7, 33])
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    cfg = dict(memory_budget_bytes=256 << 20, page_size=16, max_model_len=4096, static_decode=True)
    plain = _engine(model, **cfg).generate(prompts, sp)
    eng = _engine(model, d, **cfg)
    _oracle(eng, [p + o.token_ids for p, o in zip(prompts, plain)])
    assert [o.token_ids for o in eng.generate(prompts, sp)] == [o.token_ids for o in plain]
