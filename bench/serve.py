"""Serving benchmark: the engine in-process, prefix cache on vs off.

(a) agentic trace: `--clients` sessions share a long system prompt (10K tokens by default); each
    runs `--turns` turns: the model answers (fixed length), a tool result is appended, repeat.
    Full sizes follow benchmarks.md B11's multi-turn protocol: 128 clients x 12 rounds.
    Every turn's prompt is the previous context plus new messages, at the token level (what an
    agent that echoes the model's tokens sends), so everything but the new messages is reusable.
(b) generated-shared-prefix (benchmarks.md §4.8, SGLang protocol): `--gsp-groups` groups of
    `--gsp-prompts` prompts; a group shares a `--gsp-system-len` system prompt, each prompt adds a
    `--gsp-question-len` question; `--gsp-output-len` output tokens; `--gsp-concurrency` in flight.

(c) batch decode: `--decode-batches` requests with `--decode-context`-token prompts decode together;
    tokens/s of pure decode steps (sampling included), CUDA graphs vs eager (`--decode-modes`).
(d) structured outputs (`--which structured`): the same batch decode with every request constrained
    by a JSON-schema grammar (k3.serve.structured; masks computed per step, applied to the logits)
    vs unconstrained; the random model stays inside a JSON string, the steady state of a long
    structured answer. `--tokenizer DIR` (default: a BPE tokenizer trained here to the model's vocab).

Reports throughput, time to first token and the share of reusable prompt tokens served from the
cache, as JSON lines (and Markdown tables with --markdown).

    python bench/serve.py --quick --markdown   # GPU, k3-small, reduced sizes (a few minutes on an H200)
    python bench/serve.py                      # GPU, k3-small, full sizes (benchmarks.md protocol)
    python bench/serve.py --tiny               # CPU smoke run: k3-tiny, small sizes
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from k3.config import get_preset  # noqa: E402
from k3.model.causal_lm import K3ForCausalLM  # noqa: E402
from k3.model.compile import compile_model  # noqa: E402
from k3.serve.engine import Engine, EngineConfig  # noqa: E402
from k3.serve.sampling import SamplingParams  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="CPU smoke sizes with k3-tiny")
    p.add_argument("--quick", action="store_true", help="reduced GPU sizes: fewer turns, clients, groups")
    p.add_argument("--preset", default=None, help="model preset (default k3-small, k3-tiny with --tiny)")
    p.add_argument("--checkpoint", default=None, help="load weights instead of random ones")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--which", default="decode,agentic,gsp",
                   help="comma list of: decode, agentic, gsp, structured")
    p.add_argument("--tokenizer", default=None, help="structured: tokenizer directory (default: trained here)")
    p.add_argument("--cache", default="on,off", help="comma list of: on, off")
    p.add_argument("--memory-budget-gb", type=float, default=None)
    p.add_argument("--page-size", type=int, default=None)
    p.add_argument("--unit-size", type=int, default=None)
    p.add_argument("--prefill-budget", type=int, default=None)
    p.add_argument("--kda-backend", default=None)
    p.add_argument("--no-cuda-graphs", action="store_true", help="agentic / gsp: decode eagerly")
    p.add_argument("--compile", action="store_true", help="compiled elementwise regions (k3.model.compile)")
    p.add_argument("--cuda-graph-max-len", type=int, default=32768)
    p.add_argument("--mla-decode", default="auto", choices=("auto", "paged", "gather"),
                   help="decode MLA attention: the paged kernel (auto = on CUDA) or gather + dense")
    # batch decode
    p.add_argument("--decode-batches", default=None, help="comma list of batch sizes")
    p.add_argument("--decode-context", type=int, default=None, help="prompt tokens per request")
    p.add_argument("--structured-batches", default=None, help="structured: comma list of batch sizes")
    p.add_argument("--structured-repeats", type=int, default=3, help="structured: alternating off/on runs")
    p.add_argument("--decode-steps", type=int, default=None, help="timed decode steps per batch size")
    p.add_argument("--decode-modes", default=None,
                   help="comma list of: graphs (CUDA), static (static path, eager), eager (dynamic path)")
    # agentic trace
    p.add_argument("--system-len", type=int, default=None)
    p.add_argument("--turns", type=int, default=None)
    p.add_argument("--clients", type=int, default=None)
    p.add_argument("--max-running", type=int, default=None, help="engine max_running (default: max(64, clients))")
    p.add_argument("--user-len", type=int, default=None)
    p.add_argument("--tool-len", type=int, default=None)
    p.add_argument("--output-len", type=int, default=None)
    # generated shared prefix
    p.add_argument("--gsp-groups", type=int, default=None)
    p.add_argument("--gsp-prompts", type=int, default=None)
    p.add_argument("--gsp-system-len", type=int, default=None)
    p.add_argument("--gsp-question-len", type=int, default=None)
    p.add_argument("--gsp-output-len", type=int, default=None)
    p.add_argument("--gsp-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--markdown", action="store_true")
    args = p.parse_args(argv)
    full = dict(preset="k3-small", memory_budget_gb=40.0, page_size=256, unit_size=512, prefill_budget=4096,
                system_len=10240, turns=12, clients=128, user_len=200, tool_len=600, output_len=128,
                gsp_groups=50, gsp_prompts=10, gsp_system_len=10240, gsp_question_len=256, gsp_output_len=128,
                gsp_concurrency=5)
    full.update(decode_batches="1,8,32,64", decode_context=1024, decode_steps=64)
    quick = dict(full, turns=6, clients=4, output_len=64, gsp_groups=8, gsp_prompts=5, gsp_output_len=64,
                 decode_steps=32)
    full.update(structured_batches="1,8,32")
    quick = dict(quick, structured_batches="1,8,32")
    tiny = dict(preset="k3-tiny", structured_batches="1,8,32", memory_budget_gb=0.25, page_size=32, unit_size=64, prefill_budget=512,
                system_len=384, turns=4, clients=2, user_len=24, tool_len=48, output_len=8,
                gsp_groups=3, gsp_prompts=3, gsp_system_len=384, gsp_question_len=32, gsp_output_len=8,
                gsp_concurrency=2, decode_batches="1,4", decode_context=40, decode_steps=3)
    for k, v in (tiny if args.tiny else quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


@dataclass
class Job:
    """One request of a workload: `prompt` ids; `reusable` = prompt tokens an ideal cache would have."""

    prompt: list[int]
    reusable: int
    session: int = 0
    submitted: float = 0.0
    first_token: float | None = None
    done: float | None = None
    output: list[int] = field(default_factory=list)
    cached: int = 0


class Tokens:
    """Random ordinary token ids; messages end with the stop id (turn boundaries for the cache)."""

    def __init__(self, vocab: int, eos: int, seed: int) -> None:
        self.rng, self.vocab, self.eos = random.Random(seed), vocab, eos

    def message(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(n)] + [self.eos]

    def gen_prompt(self) -> list[int]:
        return [7, 8, 9]  # stands in for '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'


def run_agentic(engine: Engine, args: argparse.Namespace, tok: Tokens) -> list[Job]:
    """Each client runs its turns one after another; clients run concurrently."""
    system = tok.message(args.system_len)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    turns_left = {c: args.turns for c in range(args.clients)}
    running: dict[str, Job] = {}
    jobs: list[Job] = []

    def submit(job: Job) -> None:
        job.submitted = time.perf_counter()
        running[engine.add_request(job.prompt, params)] = job
        jobs.append(job)

    def next_turn(job: Job) -> None:
        turns_left[job.session] -= 1
        if turns_left[job.session] > 0:
            # the model's answer closes its message, then a tool result and a new generation prompt;
            # everything the model already processed (all but the last sampled token) is reusable
            context = job.prompt + job.output
            prompt = context + [tok.eos] + tok.message(args.tool_len) + tok.gen_prompt()
            submit(Job(prompt, len(context) - 1, job.session))

    for c in range(args.clients):  # client 0 computes the shared system prompt, the others can reuse it
        submit(Job(system + tok.message(args.user_len) + tok.gen_prompt(), len(system) if c else 0, c))
    drive(engine, running, on_done=next_turn)
    return jobs


def run_gsp(engine: Engine, args: argparse.Namespace, tok: Tokens) -> list[Job]:
    """Groups in order; at most `gsp_concurrency` requests in flight."""
    queue: list[Job] = []
    for _ in range(args.gsp_groups):
        system = tok.message(args.gsp_system_len)
        for k in range(args.gsp_prompts):
            queue.append(Job(system + tok.message(args.gsp_question_len) + tok.gen_prompt(), len(system) if k else 0))
    params = SamplingParams(temperature=0, max_tokens=args.gsp_output_len, ignore_eos=True)
    running: dict[str, Job] = {}
    jobs: list[Job] = []

    def submit_next(_: Job | None = None) -> None:
        if queue:
            job = queue.pop(0)
            job.submitted = time.perf_counter()
            running[engine.add_request(job.prompt, params)] = job
            jobs.append(job)

    for _ in range(args.gsp_concurrency):
        submit_next()
    drive(engine, running, on_done=submit_next)
    return jobs


DECODE_WARMUP = 3


def run_decode(model, args: argparse.Namespace, mode: str, tok: Tokens, eos: int) -> list[dict]:
    """Batch-decode throughput of one mode at each batch size: B requests of `decode_context` prompt
    tokens are prefilled, then `decode_steps` steps where every request decodes one token are timed
    (sampling and engine bookkeeping included; graph captures happen before the timing)."""
    batches = [int(b) for b in args.decode_batches.split(",")]
    budget = max(args.prefill_budget, args.decode_context)
    engine = Engine(model, None, EngineConfig(
        memory_budget_bytes=int(min(args.memory_budget_gb, 8.0) * (1 << 30)), page_size=args.page_size,
        unit_size=args.unit_size, enable_prefix_cache=False, max_running=max(batches), short_prefill_budget=budget,
        long_prefill_budget=budget, max_model_len=model.config.text_config.max_position_embeddings,
        kda_backend=args.kda_backend, cuda_graphs=mode == "graphs", static_decode=mode == "static",
        cuda_graph_max_len=args.cuda_graph_max_len, paged_mla_decode=paged_mla(args)), eos_id=eos)
    runner = engine.runner
    if mode == "graphs" and (runner is None or not runner.use_graphs):
        raise SystemExit("decode mode 'graphs' needs CUDA and bfloat16 weights")
    rows = []
    for B in batches:
        total = DECODE_WARMUP + args.decode_steps + 1
        params = SamplingParams(temperature=0, max_tokens=total + 1, ignore_eos=True)
        ids = [engine.add_request(tok.message(args.decode_context - 1), params) for _ in range(B)]
        started: set[str] = set()
        while len(started) < B:  # prefill, and each request's first token
            started.update(o.request_id for o in engine.step() if o.new_token_ids)
        if runner is not None:  # every bucket the timed steps use
            runner.warmup(B, args.decode_context, args.decode_context + total + 1)
        for _ in range(DECODE_WARMUP):
            engine.step()
        sync(model)
        t0 = time.perf_counter()
        for _ in range(args.decode_steps):
            engine.step()
        sync(model)
        wall = time.perf_counter() - t0
        for rid in ids:
            engine.abort(rid)
        row = {"workload": "decode", "mode": mode, "batch": B, "context": args.decode_context,
               "steps": args.decode_steps, "ms_per_step": round(1e3 * wall / args.decode_steps, 3),
               "decode_tok_s": round(B * args.decode_steps / wall, 1),
               "graph_captures": runner.num_captures if runner is not None else 0}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


STRUCTURED_SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}


def bench_tokenizer(args: argparse.Namespace, vocab_size: int):
    """--tokenizer, or a BPE tokenizer trained on random words, padded to the model's vocabulary."""
    from k3.data.tokenizer import load_tokenizer, train_bpe_tokenizer

    if args.tokenizer:
        return load_tokenizer(args.tokenizer)
    rng = random.Random(args.seed)
    words = [''.join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randrange(2, 9))) for _ in range(400)]
    texts = [" ".join(rng.choice(words) for _ in range(80)) + ' {"a": [1, 2.5, true, null], "b": "x"}'
             for _ in range(400)]
    return train_bpe_tokenizer(texts, vocab_size)


def run_structured(model, args: argparse.Namespace, tokenizer) -> list[dict]:
    """Batch-decode throughput with every request grammar-constrained (on) vs none (off), same engine
    settings as run_decode (CUDA graphs where available; masks are applied outside the graphs). Off and
    on alternate `--structured-repeats` times per batch size; the best of each is reported (on a shared
    machine the best run is the least disturbed one)."""
    from k3.serve.structured import GrammarCompiler, StructuredSpec

    batches = [int(b) for b in args.structured_batches.split(",")]
    spec = StructuredSpec(thinking=False, response_format={"type": "json_schema",
                                                           "json_schema": {"schema": STRUCTURED_SCHEMA}})
    factory = GrammarCompiler(tokenizer).compile(spec, 0)
    tok = Tokens(tokenizer.base_size, tokenizer.eos_id, args.seed)
    budget = max(args.prefill_budget, args.decode_context)
    engine = Engine(model, tokenizer, EngineConfig(
        memory_budget_bytes=int(min(args.memory_budget_gb, 8.0) * (1 << 30)), page_size=args.page_size,
        unit_size=args.unit_size, enable_prefix_cache=False, max_running=max(batches),
        short_prefill_budget=budget, long_prefill_budget=budget,
        max_model_len=model.config.text_config.max_position_embeddings, kda_backend=args.kda_backend,
        cuda_graphs=not args.no_cuda_graphs, cuda_graph_max_len=args.cuda_graph_max_len,
        paged_mla_decode=paged_mla(args)))
    rows = []
    for B in batches:
        best = {False: 0.0, True: 0.0}
        for _ in range(args.structured_repeats):
            for on in (False, True):
                best[on] = max(best[on], _timed_decode(engine, model, args, tok, B, factory if on else None))
        for on in (False, True):
            row = {"workload": "structured", "structured": on, "batch": B, "context": args.decode_context,
                   "steps": args.decode_steps, "repeats": args.structured_repeats,
                   "ms_per_step": round(1e3 * B / best[on], 3), "decode_tok_s": round(best[on], 1),
                   "vocab": tokenizer.vocab_size}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def _timed_decode(engine: Engine, model, args: argparse.Namespace, tok: Tokens, B: int, constraint) -> float:
    """B requests prefilled, then `decode_steps` timed decode steps -> tokens/s."""
    total = DECODE_WARMUP + args.decode_steps + 1
    params = SamplingParams(temperature=0, max_tokens=total + 1, ignore_eos=True)
    ids = [engine.add_request(tok.message(args.decode_context - 1), params, constraint=constraint) for _ in range(B)]
    started: set[str] = set()
    while len(started) < B:
        started.update(o.request_id for o in engine.step() if o.new_token_ids)
    if engine.runner is not None:
        engine.runner.warmup(B, args.decode_context, args.decode_context + total + 1)
    for _ in range(DECODE_WARMUP):
        engine.step()
    sync(model)
    t0 = time.perf_counter()
    for _ in range(args.decode_steps):
        engine.step()
    sync(model)
    wall = time.perf_counter() - t0
    for rid in ids:
        engine.abort(rid)
    return B * args.decode_steps / wall


def context_range(which: str, args: argparse.Namespace) -> tuple[int, int, int]:
    """(concurrent requests, shortest, longest context in tokens) of a workload's decode steps."""
    if which == "agentic":
        first = args.system_len + args.user_len + 5
        return args.clients, first, first + (args.turns - 1) * (args.output_len + args.tool_len + 5) + args.output_len
    first = args.gsp_system_len + args.gsp_question_len + 5
    return args.gsp_concurrency, first, first + args.gsp_output_len


def sync(model) -> None:
    if model.lm_head.weight.is_cuda:
        torch.cuda.synchronize()


def drive(engine: Engine, running: dict[str, Job], on_done) -> None:
    while running:
        for out in engine.step():
            job = running[out.request_id]
            now = time.perf_counter()
            if out.new_token_ids and job.first_token is None:
                job.first_token = now
            job.output += out.new_token_ids
            if out.finished:
                job.done, job.cached = now, out.cached_tokens
                del running[out.request_id]
                on_done(job)


def summarize(name: str, cache: bool, jobs: list[Job], wall: float, engine: Engine) -> dict:
    ttft = [j.first_token - j.submitted for j in jobs if j.first_token is not None]
    prompt = sum(len(j.prompt) for j in jobs)
    out = sum(len(j.output) for j in jobs)
    reusable = sum(j.reusable for j in jobs)
    cached = sum(j.cached for j in jobs)
    q = statistics.quantiles(ttft, n=10) if len(ttft) >= 2 else [ttft[0]] * 9
    return {
        "workload": name, "prefix_cache": cache, "requests": len(jobs), "wall_s": round(wall, 3),
        "prompt_tokens": prompt, "output_tokens": out, "cached_tokens": cached, "reusable_tokens": reusable,
        "reusable_served_from_cache": round(cached / reusable, 4) if reusable else None,
        "output_tok_s": round(out / wall, 2), "total_tok_s": round((prompt + out) / wall, 2),
        "req_s": round(len(jobs) / wall, 3), "ttft_mean_s": round(statistics.mean(ttft), 4),
        "ttft_p50_s": round(statistics.median(ttft), 4), "ttft_p90_s": round(q[8], 4),
        "preemptions": engine.scheduler.num_preemptions,
        "checkpoints": len(engine.prefix) if engine.prefix is not None else 0,
        **forward_split(engine.metrics.snapshot()),
    }


def dynamo_compiles() -> int:
    """Frames torch.compile has compiled so far in this process (0 without --compile)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def forward_split(m: dict) -> dict:
    """Where the engine's time went: prefill vs decode forwards (counts, seconds, mean decode batch)."""
    return {"prefill_forwards": m["prefill_forwards"], "prefill_s": round(m["prefill_seconds"], 3),
            "decode_forwards": m["decode_forwards"], "decode_s": round(m["decode_seconds"], 3),
            "mean_decode_batch": round(m["decode_rows"] / m["decode_forwards"], 2) if m["decode_forwards"] else None}


def make_engine(model: K3ForCausalLM, args: argparse.Namespace, cache: bool, eos: int) -> Engine:
    cfg = model.config
    return Engine(model, None, EngineConfig(
        memory_budget_bytes=int(args.memory_budget_gb * (1 << 30)), page_size=args.page_size,
        unit_size=args.unit_size, enable_prefix_cache=cache, short_prefill_budget=args.prefill_budget,
        long_prefill_budget=args.prefill_budget, long_prompt_threshold=4 * args.prefill_budget,
        max_model_len=cfg.text_config.max_position_embeddings, kda_backend=args.kda_backend,
        cuda_graphs=not args.no_cuda_graphs, cuda_graph_max_len=args.cuda_graph_max_len,
        paged_mla_decode=paged_mla(args), max_running=args.max_running or max(64, args.clients)), eos_id=eos)


def paged_mla(args: argparse.Namespace) -> bool | None:
    return None if args.mla_decode == "auto" else args.mla_decode == "paged"


def warm_up(model: K3ForCausalLM, args: argparse.Namespace, vocab: int, eos: int) -> None:
    """A small untimed agentic run with the cache on and off: every Triton kernel variant the timed runs
    use (prefill with and without a restored initial state, varlen, decode) is compiled here, so JIT
    compilation does not land in whichever timed run comes first."""
    small = argparse.Namespace(**vars(args))
    small.system_len, small.turns, small.clients = 2 * args.unit_size + 7, 2, 2
    small.user_len, small.tool_len, small.output_len = 16, 32, 4
    for cache in (True, False):
        run_agentic(make_engine(model, small, cache, eos), small, Tokens(vocab, eos, args.seed + 1))
    sync(model)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    if device.type == "cpu":
        torch.set_num_threads(1)  # decode-sized ops: a second thread only adds sync cost
    if args.checkpoint:
        model = K3ForCausalLM.from_pretrained(args.checkpoint, dtype=dtype, device=device)
    else:
        torch.manual_seed(args.seed)
        model = K3ForCausalLM(get_preset(args.preset)).init_weights(seed=args.seed).to_dtype(dtype).to(device)
    if args.compile:
        compile_model(model)
    cfg = model.config
    vocab, eos = cfg.text_config.vocab_size - 256, cfg.eos_token_id
    meta = dict(device=str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
                preset=args.preset, dtype=dtype, compiled=args.compile, mla_decode=args.mla_decode)
    rows, t_start = [], time.perf_counter()
    if any(w not in ("decode", "structured") for w in args.which.split(",")):
        warm_up(model, args, vocab, eos)
    for which in args.which.split(","):
        if which == "structured":
            rows += [dict(r, **meta) for r in run_structured(model, args, bench_tokenizer(args, cfg.text_config.vocab_size))]
            continue
        if which == "decode":
            modes = args.decode_modes or ("graphs,eager" if device.type == "cuda" else "static,eager")
            for mode in modes.split(","):
                rows += run_decode(model, args, mode, Tokens(vocab, eos, args.seed), eos)
            continue
        for cache in args.cache.split(","):
            engine = make_engine(model, args, cache == "on", eos)
            tok = Tokens(vocab, eos, args.seed)
            if engine.runner is not None:  # graph captures before the clock starts
                engine.runner.warmup(*context_range(which, args))
            sync(model)
            compiles = dynamo_compiles()
            t0 = time.perf_counter()
            jobs = run_agentic(engine, args, tok) if which == "agentic" else run_gsp(engine, args, tok)
            sync(model)
            row = summarize(which, cache == "on", jobs, time.perf_counter() - t0, engine)
            row["recompiles"] = dynamo_compiles() - compiles  # torch.compile work inside the timed run
            row.update(meta, kda_backend=model.model.layers[0].self_attn.kda_backend
                       if hasattr(model.model.layers[0].self_attn, "kda_backend") else None,
                       cuda_graphs=engine.runner is not None and engine.runner.use_graphs,
                       graph_captures=engine.runner.num_captures if engine.runner is not None else 0)
            rows.append(row)
            print(json.dumps(row), flush=True)
            del engine
    print(json.dumps({"total_wall_s": round(time.perf_counter() - t_start, 1), **meta}), flush=True)
    if args.markdown:
        print(markdown(rows))
    return 0


def markdown(rows: list[dict]) -> str:
    out = []
    work = [r for r in rows if r["workload"] not in ("decode", "structured")]
    if work:
        cols = ["workload", "prefix_cache", "requests", "wall_s", "output_tok_s", "total_tok_s", "ttft_mean_s",
                "ttft_p90_s", "reusable_served_from_cache", "prefill_forwards", "prefill_s", "decode_forwards",
                "decode_s", "mean_decode_batch", "recompiles"]
        out += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        out += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in work]
        by = {(r["workload"], r["prefix_cache"]): r for r in work}
        for w in ("agentic", "gsp"):
            if (w, True) in by and (w, False) in by:
                out.append(f"\n{w}: throughput with cache / without = "
                           f"{by[(w, True)]['total_tok_s'] / by[(w, False)]['total_tok_s']:.2f}x")
    dec = [r for r in rows if r["workload"] == "decode"]
    if dec:
        modes = list(dict.fromkeys(r["mode"] for r in dec))
        tab = {(r["batch"], r["mode"]): r for r in dec}
        head = ["batch"] + [f"{m} tok/s" for m in modes] + [f"{m} ms/step" for m in modes]
        ratio = len(modes) == 2
        if ratio:
            head.append(f"{modes[0]} / {modes[1]}")
        out += ["", f"batch decode, {dec[0]['context']}-token contexts:", "| " + " | ".join(head) + " |",
                "|" + "---|" * len(head)]
        for b in dict.fromkeys(r["batch"] for r in dec):
            cells = [str(b)] + [str(tab[(b, m)]["decode_tok_s"]) if (b, m) in tab else "" for m in modes]
            cells += [str(tab[(b, m)]["ms_per_step"]) if (b, m) in tab else "" for m in modes]
            if ratio and all((b, m) in tab for m in modes):
                cells.append(f"{tab[(b, modes[0])]['decode_tok_s'] / tab[(b, modes[1])]['decode_tok_s']:.2f}x")
            out.append("| " + " | ".join(cells) + " |")
    st = {(r["batch"], r["structured"]): r for r in rows if r["workload"] == "structured"}
    if st:
        out += ["", "batch decode with structured outputs (JSON schema) on vs off:",
                "| batch | off tok/s | on tok/s | on / off |", "|---|---|---|---|"]
        for b in dict.fromkeys(k[0] for k in st):
            if (b, False) in st and (b, True) in st:
                off, on = st[(b, False)]["decode_tok_s"], st[(b, True)]["decode_tok_s"]
                out.append(f"| {b} | {off} | {on} | {on / off:.2f}x |")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
