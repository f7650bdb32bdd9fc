"""Serving benchmark: the engine in-process, prefix cache on vs off.

(a) agentic trace: `--clients` sessions share a long system prompt (10K tokens by default); each
    runs `--turns` turns: the model answers (fixed length), a tool result is appended, repeat.
    Every turn's prompt is the previous context plus new messages, at the token level (what an
    agent that echoes the model's tokens sends), so everything but the new messages is reusable.
(b) generated-shared-prefix (benchmarks.md §4.8, SGLang protocol): `--gsp-groups` groups of
    `--gsp-prompts` prompts; a group shares a `--gsp-system-len` system prompt, each prompt adds a
    `--gsp-question-len` question; `--gsp-output-len` output tokens; `--gsp-concurrency` in flight.

Reports throughput, time to first token and the share of reusable prompt tokens served from the
cache, as JSON lines (and a Markdown table with --markdown).

    python bench/serve.py                      # GPU, k3-small, full sizes
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
from k3.serve.engine import Engine, EngineConfig  # noqa: E402
from k3.serve.sampling import SamplingParams  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="CPU smoke sizes with k3-tiny")
    p.add_argument("--preset", default=None, help="model preset (default k3-small, k3-tiny with --tiny)")
    p.add_argument("--checkpoint", default=None, help="load weights instead of random ones")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--which", default="agentic,gsp", help="comma list of: agentic, gsp")
    p.add_argument("--cache", default="on,off", help="comma list of: on, off")
    p.add_argument("--memory-budget-gb", type=float, default=None)
    p.add_argument("--page-size", type=int, default=None)
    p.add_argument("--unit-size", type=int, default=None)
    p.add_argument("--prefill-budget", type=int, default=None)
    p.add_argument("--kda-backend", default=None)
    # agentic trace
    p.add_argument("--system-len", type=int, default=None)
    p.add_argument("--turns", type=int, default=None)
    p.add_argument("--clients", type=int, default=None)
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
                system_len=10240, turns=12, clients=8, user_len=200, tool_len=600, output_len=128,
                gsp_groups=50, gsp_prompts=10, gsp_system_len=10240, gsp_question_len=256, gsp_output_len=128,
                gsp_concurrency=5)
    tiny = dict(preset="k3-tiny", memory_budget_gb=0.25, page_size=32, unit_size=64, prefill_budget=512,
                system_len=384, turns=4, clients=2, user_len=24, tool_len=48, output_len=8,
                gsp_groups=3, gsp_prompts=3, gsp_system_len=384, gsp_question_len=32, gsp_output_len=8,
                gsp_concurrency=2)
    for k, v in (tiny if args.tiny else full).items():
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
    }


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
    cfg = model.config
    vocab, eos = cfg.text_config.vocab_size - 256, cfg.eos_token_id
    rows = []
    for which in args.which.split(","):
        for cache in args.cache.split(","):
            engine = Engine(model, None, EngineConfig(
                memory_budget_bytes=int(args.memory_budget_gb * (1 << 30)), page_size=args.page_size,
                unit_size=args.unit_size, enable_prefix_cache=cache == "on", short_prefill_budget=args.prefill_budget,
                long_prefill_budget=args.prefill_budget, long_prompt_threshold=4 * args.prefill_budget,
                max_model_len=cfg.text_config.max_position_embeddings, kda_backend=args.kda_backend), eos_id=eos)
            tok = Tokens(vocab, eos, args.seed)
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            jobs = run_agentic(engine, args, tok) if which == "agentic" else run_gsp(engine, args, tok)
            if device.type == "cuda":
                torch.cuda.synchronize()
            row = summarize(which, cache == "on", jobs, time.perf_counter() - t0, engine)
            row.update(device=str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
                       preset=args.preset, dtype=dtype, kda_backend=model.model.layers[0].self_attn.kda_backend
                       if hasattr(model.model.layers[0].self_attn, "kda_backend") else None)
            rows.append(row)
            print(json.dumps(row), flush=True)
            del engine
    if args.markdown:
        print(markdown(rows))
    return 0


def markdown(rows: list[dict]) -> str:
    cols = ["workload", "prefix_cache", "requests", "wall_s", "output_tok_s", "total_tok_s", "ttft_mean_s",
            "ttft_p90_s", "reusable_served_from_cache"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    by = {(r["workload"], r["prefix_cache"]): r for r in rows}
    for w in ("agentic", "gsp"):
        if (w, True) in by and (w, False) in by:
            lines.append(f"\n{w}: throughput with cache / without = "
                         f"{by[(w, True)]['total_tok_s'] / by[(w, False)]['total_tok_s']:.2f}x")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
