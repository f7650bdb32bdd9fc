"""The decode model runner: its static-shape decode path (what CUDA graphs capture) against the
dynamic decode path on CPU, the engine with it on and off, and (marked gpu) graph replay on CUDA."""

from __future__ import annotations

import linecache
import random
import sys

import pytest
import torch
from torch.overrides import TorchFunctionMode

from k3.cli import build_parser
from k3.config import apply_overrides, k3_small, k3_tiny
from k3.model.causal_lm import K3ForCausalLM
from k3.serve.cache_manager import BlockPool, CacheLayout, PagedBatchCache, StaticDecodeCache
from k3.serve.engine import Engine, EngineConfig
from k3.serve.model_runner import DecodeRunner, bucket_sizes
from k3.serve.sampling import SamplingParams
from tests.serve.conftest import random_prompt

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture
def torch_kda(model):
    """Tests here switch the shared model's KDA backend; put the CPU default back afterwards."""
    yield model
    model.set_kda_backend("torch")


class Seqs:
    """Sequences decoded by hand against a block pool: pages, a KDA slot and the tokens of each."""

    def __init__(self, pool: BlockPool, prompts: list[list[int]]) -> None:
        self.pool, self.tokens = pool, [list(p) for p in prompts]
        self.slots = [pool.alloc(pool.layout.slot_blocks) for _ in prompts]
        pool.zero([b for s in self.slots for b in s])
        self.pages: list[list[int]] = [[] for _ in prompts]
        self.past = [0] * len(prompts)

    def reserve(self, upto: list[int]) -> None:
        """Pages covering positions < upto[i] of each sequence."""
        for i, n in enumerate(upto):
            more = self.pool.layout.pages_for(n) - len(self.pages[i])
            if more > 0:
                self.pages[i] += self.pool.alloc_pages(more)

    def prefill(self, model) -> None:
        """All tokens but the last, packed, through the dynamic (expanded MLA) path."""
        ns = [len(t) - 1 for t in self.tokens]
        self.reserve(ns)
        cache = PagedBatchCache(self.pool, self.pages, self.slots, self.past, ns, absorb_mla=False)
        dev = self.pool.device
        ids = torch.tensor([t for tok, n in zip(self.tokens, ns) for t in tok[:n]], device=dev)[None]
        model.model(ids, cu_seqlens=torch.tensor([0] + ns, device=dev).cumsum(0), cache=cache)
        cache.commit()
        self.past = ns

    def decode_args(self) -> tuple[list[int], list[int], list[list[int]], list[list[int]]]:
        self.reserve([p + 1 for p in self.past])
        return [t[p] for t, p in zip(self.tokens, self.past)], list(self.past), self.slots, self.pages

    def dynamic_decode(self, model) -> torch.Tensor:
        """The engine's eager decode path: [N, 1] rows over a PagedBatchCache."""
        ids, past, slots, pages = self.decode_args()
        cache = PagedBatchCache(self.pool, pages, slots, past, [1] * len(ids), absorb_mla=True)
        h, _ = model.model(torch.tensor(ids, device=self.pool.device)[:, None], cache=cache)
        cache.commit()
        return model.lm_head(h[:, -1])

    def push(self, next_ids: list[int]) -> None:
        for i, t in enumerate(next_ids):
            self.tokens[i].append(t)
            self.past[i] += 1


def _twin_pools(model, page_size: int, num_seqs: int = 8, num_pages: int = 64) -> tuple[BlockPool, BlockPool]:
    """Two identical empty pools with room for `num_seqs` slots and `num_pages` pages."""
    p = model.lm_head.weight
    layout = CacheLayout.from_config(model.config.text_config, page_size, p.dtype)
    n = 1 + num_seqs * layout.slot_blocks + num_pages
    return BlockPool(layout, n, p.device), BlockPool(layout, n, p.device)


def _assert_pools_close(a: BlockPool, b: BlockPool, slots: list[list[int]], pages: list[list[int]],
                        tol: float) -> None:
    # only page blocks: slot blocks hold fp32 states, which read as bf16 "pages" could be NaN patterns
    idx = torch.tensor(sorted({p for table in pages for p in table}), device=a.pages.device)
    torch.testing.assert_close(a.pages[idx], b.pages[idx], rtol=tol, atol=tol)
    (sa, ta), (sb, tb) = a.read_slots(slots), b.read_slots(slots)
    for layer in sa:
        torch.testing.assert_close(sa[layer], sb[layer], rtol=tol, atol=tol)
        torch.testing.assert_close(ta[layer], tb[layer], rtol=tol, atol=tol)
    assert not a.storage[0].any() and not b.storage[0].any(), "padding rows left data in the zero block"


def _compare_static_to_dynamic(model, lens: list[int], steps: int, *, max_batch: int, max_len: int,
                               page_size: int = 4, seed: int = 0, static_kda: str = "torch",
                               tol: float = 1e-5, paged_mla: bool | None = None) -> DecodeRunner:
    """Decode `steps` tokens with both paths from identical pools; logits and pools must agree.
    static_kda: the KDA backend while the static path runs (the dynamic path always uses "torch");
    paged_mla: the static path's MLA attention (None: the paged kernel on CUDA, gather on CPU)."""
    rng = random.Random(seed)
    prompts = [random_prompt(rng, n, 4000) for n in lens]
    pool_d, pool_s = _twin_pools(model, page_size)
    dyn, sta = Seqs(pool_d, prompts), Seqs(pool_s, prompts)
    backend = model.model.layers[0].self_attn.kda_backend
    with torch.inference_mode():
        dyn.prefill(model)
        sta.prefill(model)
        runner = DecodeRunner(model, pool_s, max_batch=max_batch, max_len=max_len, use_graphs=False,
                              paged_mla=paged_mla)
        for _ in range(steps):
            ref = dyn.dynamic_decode(model)
            model.set_kda_backend(static_kda)
            got = runner.decode(*sta.decode_args())
            model.set_kda_backend(backend)
            assert dyn.pages == sta.pages and dyn.slots == sta.slots  # the same block ids in both pools
            torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
            _assert_pools_close(pool_s, pool_d, sta.slots, sta.pages, tol)
            nxt = ref.argmax(-1).tolist()
            dyn.push(nxt)
            sta.push(nxt)
    return runner


def test_bucket_sizes():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(64) == [1, 2, 4, 8, 16, 32, 64]
    assert bucket_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    with pytest.raises(ValueError, match="limit"):
        bucket_sizes(0)


def test_static_decode_equals_dynamic_with_padding_rows_and_page_crossings(torch_kda):
    model = torch_kda.set_kda_backend("torch")
    # 5 rows -> bucket of 8 (3 padding rows); lengths on, before and after page edges of 4 tokens;
    # 6 steps cross page boundaries and move the page bucket from 4 to 8 pages
    runner = _compare_static_to_dynamic(model, [4, 5, 9, 2, 14], 6, max_batch=8, max_len=64)
    assert runner.batch_buckets == [1, 2, 4, 8] and runner.max_pages == 16


def test_static_decode_with_the_triton_recurrent_kda_kernel(torch_kda):
    """The CUDA configuration of the KDA decode (the Triton recurrent kernel on gathered slot states),
    run by the Triton interpreter; a non-power-of-two batch limit gives a last bucket of 3."""
    model = torch_kda.set_kda_backend("torch")
    runner = _compare_static_to_dynamic(model, [3, 6, 2], 2, max_batch=3, max_len=32, seed=1, static_kda="triton")
    assert runner.batch_buckets == [1, 2, 3]


@pytest.fixture
def mla_calls(monkeypatch) -> list[tuple[str, str, bool]]:
    """Records every MLA cache access as (cache class, "append" (gather) or "write" (paged kernel),
    whether the forward was a decode (absorbed))."""
    calls: list[tuple[str, str, bool]] = []
    for cls in (StaticDecodeCache, PagedBatchCache):
        for name, kind in (("mla_append", "append"), ("mla_write", "write")):
            def wrapped(self, *args, _fn=getattr(cls, name), _kind=kind):
                calls.append((type(self).__name__, _kind, self.absorb_mla))
                return _fn(self, *args)

            monkeypatch.setattr(cls, name, wrapped)
    return calls


def test_static_decode_with_the_paged_mla_kernel_equals_dynamic(torch_kda, mla_calls):
    """The CUDA configuration of MLA decode (the paged Triton kernel reading the pool in place), run by
    the Triton interpreter, against the dynamic gather path: padding rows, page and page-bucket crossings."""
    model = torch_kda.set_kda_backend("torch")
    runner = _compare_static_to_dynamic(model, [4, 5, 9, 2, 14], 4, max_batch=8, max_len=64, paged_mla=True,
                                        tol=2e-5)
    assert runner.paged_mla
    static = {kind for cls, kind, _ in mla_calls if cls == "StaticDecodeCache"}
    assert static == {"write"}  # no gather in the static step


def test_engine_greedy_outputs_identical_with_the_paged_mla_kernel(make_engine, tokenizer, torch_kda, mla_calls):
    """Greedy tokens of the gather path (dynamic decode) against the paged kernel in the static decode
    path and in the dynamic decode path (PagedBatchCache with one new token per row)."""
    rng = random.Random(5)
    prompts = [random_prompt(rng, n, tokenizer.base_size) for n in (3, 17, 40)]
    common = dict(short_prefill_budget=16, long_prefill_budget=24, long_prompt_threshold=30, max_running=2)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ref = [o.token_ids for o in make_engine(**common).generate(prompts, params)]
    assert ("PagedBatchCache", "append", True) in mla_calls and not any(k == "write" for _, k, _ in mla_calls)
    for static in (True, False):
        mla_calls.clear()
        eng = make_engine(static_decode=static, paged_mla_decode=True, **common)
        assert eng.paged_mla and (eng.runner is not None) == static and (not static or eng.runner.paged_mla)
        assert [o.token_ids for o in eng.generate(prompts, params)] == ref
        decode_kinds = {(cls, kind) for cls, kind, decode in mla_calls if decode}
        want = "StaticDecodeCache" if static else "PagedBatchCache"
        assert decode_kinds == {(want, "write")}, decode_kinds  # every decode step used the kernel


def test_decode_beyond_the_buckets_returns_none_and_bad_input_is_refused(model):
    pool, _ = _twin_pools(model, 4, num_seqs=1, num_pages=8)
    runner = DecodeRunner(model, pool, max_batch=2, max_len=8, use_graphs=False)
    slot = [1] * pool.layout.slot_blocks
    assert runner.bucket(3, 1) is None and runner.bucket(2, 3) is None and runner.bucket(2, 2) == (2, 2, 1)
    assert runner.decode([1, 2, 3], [0, 0, 0], [slot] * 3, [[2]] * 3) is None  # 3 rows > max_batch
    assert runner.decode([1], [8], [slot], [[2, 3, 4]]) is None  # position 8 needs a third page
    # 1..2 rows, contexts of 3..8 tokens (page 4: 1 or 2 pages); without graphs warmup captures nothing
    assert runner.buckets_for(5, 3, 8) == [(1, 1, 1), (1, 2, 1), (2, 1, 1), (2, 2, 1)]
    assert runner.buckets_for(1, 6, 100) == [(1, 2, 1)] and runner.warmup(2, 1, 8) == 0
    with pytest.raises(ValueError, match="does not cover position 4"):
        runner.decode([1], [4], [slot], [[2]])
    with pytest.raises(ValueError, match="slot has"):
        runner.decode([1], [0], [slot + [5]], [[2]])
    with pytest.raises(ValueError, match="one entry per row"):
        runner.decode([1, 2], [0], [slot], [[2]])
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA pool"):
        DecodeRunner(model, pool, max_batch=2, max_len=8, use_graphs=True)
    with pytest.raises(ValueError, match="max_len"):
        DecodeRunner(model, pool, max_batch=2, max_len=0, use_graphs=False)
    with pytest.raises(ValueError, match="cuda_graph_max_len"):
        EngineConfig(cuda_graph_max_len=0).validate()


def test_engine_greedy_outputs_identical_with_static_decode_on_and_off(make_engine, tokenizer, torch_kda):
    rng = random.Random(3)
    prompts = [random_prompt(rng, n, tokenizer.base_size) for n in (3, 17, 40, 64, 9, 30)]
    common = dict(short_prefill_budget=12, long_prefill_budget=20, long_prompt_threshold=30, max_running=5)
    off = make_engine(**common).generate(prompts, GREEDY)
    eng = make_engine(static_decode=True, **common)
    assert eng.runner is not None and not eng.runner.use_graphs and eng.runner.batch_buckets == [1, 2, 4, 5]
    buckets = []
    eng.runner.bucket = _spy(eng.runner.bucket, buckets)
    on = eng.generate(prompts, GREEDY)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert any(key is not None and n < key[0] for (n, _), key in buckets)  # padding rows were exercised
    assert make_engine().runner is None  # CPU default: the dynamic path, no runner


def test_engine_runs_long_contexts_dynamically_beyond_cuda_graph_max_len(make_engine, tokenizer, torch_kda):
    rng = random.Random(4)
    short, long = (random_prompt(rng, n, tokenizer.base_size) for n in (5, 28))
    off = make_engine(enable_prefix_cache=False)
    eng = make_engine(static_decode=True, cuda_graph_max_len=16, enable_prefix_cache=False)  # 2 pages of 8
    buckets = []
    eng.runner.bucket = _spy(eng.runner.bucket, buckets)
    for prompt, fits in ((short, True), (long, False)):
        buckets.clear()
        assert eng.generate([prompt], GREEDY)[0].token_ids == off.generate([prompt], GREEDY)[0].token_ids
        assert buckets and all((key is not None) == fits for _, key in buckets)


class HostReads(TorchFunctionMode):
    """Records every torch call that reads tensor values back to the host (a sync on CUDA, and a
    failed capture in a CUDA graph): .item(), .tolist(), bool/int conversion, nonzero, bincount,
    boolean-mask indexing... as (name, source line)."""

    BAD = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "bincount",
                     "unique", "masked_select", "cpu", "numpy"})

    def __init__(self) -> None:
        super().__init__()
        self.hits: list[tuple[str, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        bad = name in self.BAD
        if name in ("__getitem__", "__setitem__", "index_put_", "index_put") and len(args) > 1:
            idx = args[1] if isinstance(args[1], (tuple, list)) else (args[1],)
            bad = any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in idx)
        if bad:
            caller = sys._getframe(1)
            self.hits.append((name, linecache.getline(caller.f_code.co_filename, caller.f_lineno).strip()))
        return func(*args, **(kwargs or {}))


def test_static_step_reads_nothing_back_to_the_host(torch_kda):
    """The static step on CPU makes no host read except the CPU expert loop's group sizes (on CUDA in
    bf16 the experts run as grouped GEMMs with device offsets; the gpu tests capture the real thing)."""
    model = torch_kda.set_kda_backend("torch")
    rng = random.Random(8)
    seqs = Seqs(_twin_pools(model, 4)[0], [random_prompt(rng, n, 4000) for n in (5, 9, 3)])
    with torch.inference_mode():
        seqs.prefill(model)
        runner = DecodeRunner(model, seqs.pool, max_batch=4, max_len=32, use_graphs=False)
        runner.decode(*seqs.decode_args())  # fills the input buffer for bucket (4, 4)
        with HostReads() as reads:
            runner._step(4, 4, 1)
    assert reads.hits and all(h == ("tolist", "sizes = counts.tolist()") for h in reads.hits), reads.hits
    with HostReads() as reads:  # the detector works
        torch.arange(3)[torch.arange(3) > 0].sum().item()
    assert [n for n, _ in reads.hits] == ["__getitem__", "item"]


def test_serve_cli_no_cuda_graphs(tokenizer):
    from k3.cli.serve import build

    args = build_parser().parse_args(["serve", "--preset", "k3-tiny", "--tokenizer", tokenizer.directory,
                                      "--device", "cpu", "--no-cuda-graphs", "--memory-budget-mb", "16"])
    _, engine = build(args)
    assert engine.config.cuda_graphs is False and engine.runner is None
    args = build_parser().parse_args(["serve", "--preset", "k3-tiny", "--tokenizer", tokenizer.directory])
    assert args.no_cuda_graphs is False and args.cuda_graph_max_len == 16384


def _spy(fn, calls: list):
    """fn(a, b[, t]) recording ((a, b), result) in `calls`."""
    def wrapped(a: int, b: int, t: int = 1):
        out = fn(a, b, t)
        calls.append(((a, b), out))
        return out

    return wrapped


# --------------------------------------------------------------------------------------------- GPU

def _small_like():
    """k3-small widths (hidden 1024, 8 x 128 KDA heads, 64 experts top-8, latent 256 + 64) in 4 layers."""
    return apply_overrides(k3_small(), {"num_hidden_layers": 4,
                                        "linear_attn_config": {"full_attn_layers": [2, 4], "kda_layers": [1, 3]}})


def _gpu_model(cfg, dtype=torch.bfloat16) -> K3ForCausalLM:
    torch.manual_seed(0)
    return K3ForCausalLM(cfg).init_weights(seed=0).to_dtype(dtype).to("cuda").eval()


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [k3_tiny, _small_like], ids=["k3-tiny", "k3-small-like"])
def test_graph_replay_equals_eager_static_decode(cfg):
    model = _gpu_model(cfg())
    rng = random.Random(0)
    prompts = [random_prompt(rng, n, 4000) for n in (5, 17, 33, 8, 60)]
    pool_e, pool_g = _twin_pools(model, 8)
    eager, graph = Seqs(pool_e, prompts), Seqs(pool_g, prompts)
    with torch.inference_mode():
        eager.prefill(model)
        graph.prefill(model)
        r_e = DecodeRunner(model, pool_e, max_batch=8, max_len=256, use_graphs=False)
        r_g = DecodeRunner(model, pool_g, max_batch=8, max_len=256, use_graphs=True)
        for _ in range(12):  # 5 rows -> 8-row bucket; the 60-token row moves from the 8- to the 16-page bucket
            a = r_e.decode(*eager.decode_args())
            b = r_g.decode(*graph.decode_args())
            # the same kernels replayed: equal up to a cuBLAS algorithm choice on the capture stream
            torch.testing.assert_close(b.float(), a.float(), rtol=1e-2, atol=1e-2)
            _assert_pools_close(pool_g, pool_e, graph.slots, graph.pages, 1e-2)
            nxt = a.argmax(-1).tolist()
            eager.push(nxt)
            graph.push(nxt)
    assert r_g.capture_error is None and set(r_g.graphs) == {(8, 8), (8, 16)} and r_g.num_captures == 2


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [k3_tiny, _small_like], ids=["k3-tiny", "k3-small-like"])
def test_static_decode_equals_dynamic_on_cuda_fp32(cfg):
    """The static path's CUDA kernels (Triton recurrent KDA, masked absorbed MLA) against the dynamic
    path (chunked Triton KDA), fp32 (PyTorch's default: no TF32 in matmuls)."""
    model = _gpu_model(cfg(), torch.float32)
    model.set_kda_backend("triton")
    _compare_static_to_dynamic(model, [3, 20, 9], 6, max_batch=4, max_len=64, page_size=8, seed=2,
                               static_kda="triton", tol=2e-4)


@pytest.mark.gpu
def test_static_decode_makes_no_host_sync():
    model = _gpu_model(_small_like())
    rng = random.Random(5)
    seqs = Seqs(_twin_pools(model, 16, num_seqs=2)[0], [random_prompt(rng, n, 4000) for n in (9, 40)])
    with torch.inference_mode():
        seqs.prefill(model)
        runner = DecodeRunner(model, seqs.pool, max_batch=4, max_len=128, use_graphs=False)
        runner.decode(*seqs.decode_args())  # loads the buffer; compiles the kernels
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            runner._step(2, 4)
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
def test_engine_graphs_on_equals_off_and_captures_once_per_bucket():
    model = _gpu_model(k3_tiny())
    rng = random.Random(6)
    prompts = [random_prompt(rng, n, 4000) for n in (12, 50, 7, 33, 60, 21)]  # the 60-token row crosses from the 4- to the 8-page bucket
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    cfg = dict(memory_budget_bytes=256 << 20, page_size=16, unit_size=16, max_running=8, max_model_len=4096,
               enable_prefix_cache=False)
    off = Engine(model, None, EngineConfig(cuda_graphs=False, static_decode=True, **cfg)).generate(prompts, params)
    assert Engine(model, None, EngineConfig(cuda_graphs=False, **cfg)).runner is None
    eng = Engine(model, None, EngineConfig(**cfg))
    runner = eng.runner
    assert runner is not None and runner.use_graphs
    buckets = []
    runner.bucket = _spy(runner.bucket, buckets)
    on = eng.generate(prompts, params)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    used = {key for _, key in buckets}
    assert runner.capture_error is None and set(runner.graphs) == used and runner.num_captures == len(used) >= 2
    eng.generate(prompts, params)  # the same schedule again: replays only
    assert runner.num_captures == len(used)
    assert runner.warmup(8, 7, 90 + 24) == len(runner.buckets_for(8, 7, 114)) - len(used)  # only the missing


@pytest.mark.gpu
def test_engine_paged_mla_kernel_equals_gather_on_cuda_fp32():
    """Greedy engine outputs on CUDA in fp32: the paged kernel (static and dynamic decode paths, exact
    fp32 dots) against the gather + dense path; a 300-token prompt spans many pages and splits."""
    model = _gpu_model(k3_tiny(), torch.float32)
    rng = random.Random(7)
    prompts = [random_prompt(rng, n, 4000) for n in (12, 300, 7, 75)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    cfg = dict(memory_budget_bytes=256 << 20, page_size=16, unit_size=16, max_running=4, max_model_len=4096)
    ref = [o.token_ids for o in Engine(model, None, EngineConfig(paged_mla_decode=False, **cfg)).generate(
        prompts, params)]
    for static in (True, False):
        eng = Engine(model, None, EngineConfig(static_decode=static, paged_mla_decode=True, **cfg))
        assert eng.paged_mla and (eng.runner is not None) == static
        assert [o.token_ids for o in eng.generate(prompts, params)] == ref
