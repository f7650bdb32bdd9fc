"""Learned-draft (EAGLE-3) speculative decoding benchmark: decode tokens/s without speculation, with the
draft and with n-gram speculation, and the mean acceptance length tau, at several batch sizes.

The target is --checkpoint (or a preset with random weights); the draft is --draft, or trained here for
--train-steps on the target's own greedy continuations of random prompts (`k3.draft.ttt`; a random
target is hard to predict, so use a trained checkpoint for meaningful tau). Each row runs B requests
with --prompt-len prompts and --new-tokens greedy tokens to completion in one engine; outputs with the
draft must equal those without (checked and reported: exact in fp32; in bf16 a near-tie argmax may
flip: a verify step's GEMMs see k + 1 times the rows of a decode step's; docs/draft.md). Plain decoding uses the engine's default path (CUDA graphs
on GPU), and so do speculative rows: verify steps are [rows, k + 1] CUDA-graph buckets of the same runner and
the greedy draft chain is one graph per row bucket (`k3.serve.draft_spec`).

    python bench/draft.py --markdown                       # GPU: k3-small, batches 1, 8, 32
    python bench/draft.py --checkpoint CK --draft CK_DRAFT # a trained target and its `k3 train-draft` draft
    python bench/draft.py --tiny                           # CPU smoke run: k3-tiny, tiny sizes
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from k3.config import get_preset  # noqa: E402
from k3.draft.ttt import target_pass, ttt_forward  # noqa: E402
from k3.model.causal_lm import K3ForCausalLM  # noqa: E402
from k3.model.draft import DraftConfig, EagleDraft, load_draft  # noqa: E402
from k3.serve.engine import Engine, EngineConfig  # noqa: E402
from k3.serve.spec_policy import resolve_max_batch  # noqa: E402
from k3.serve.sampling import SamplingParams  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="CPU smoke sizes with k3-tiny")
    p.add_argument("--preset", default=None, help="model preset (default k3-small, k3-tiny with --tiny)")
    p.add_argument("--checkpoint", default=None, help="target weights instead of random ones")
    p.add_argument("--draft", default=None, help="a `k3 train-draft` draft dir (default: train one here)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--batches", default=None, help="comma list of batch sizes (default 1,8,32; tiny: 1,2)")
    p.add_argument("--spec-tokens", type=int, default=4)
    p.add_argument("--spec-max-batch", type=int, default=None, help="EngineConfig.speculative_max_batch (default: the "
                   "engine's; 0: no limit); modes with the suffix -all (draft-all, ngram-all) speculate at every batch")
    p.add_argument("--prompt-len", type=int, default=None)
    p.add_argument("--new-tokens", type=int, default=None)
    p.add_argument("--train-steps", type=int, default=None, help="draft training steps when --draft is not given")
    p.add_argument("--modes", default="plain,draft,ngram", help="comma list of: plain, draft, ngram, draft-all, "
                   "ngram-all (-all: no speculation batch limit)")
    p.add_argument("--prompts", default=None, help="a .jsonl of {\"ids\", \"prompt_len\"} (e.g. a train-draft run's "
                   "held-out val.jsonl): its prompts instead of random ones (cycled to fill a batch)")
    p.add_argument("--requests", type=int, default=None, help="requests per row (default: the batch size); "
                   "more than the batch size queue, at most `batch` decoding together")
    p.add_argument("--warmup", choices=("full", "short"), default="full", help="full: run each row's workload "
                   "once untimed (captures every CUDA graph it needs), short: one 4-token request")
    p.add_argument("--static-decode", action="store_true", help="the static (CUDA-graph) path eagerly where graphs "
                   "are off (CPU: what the GPU runs, without graphs)")
    p.add_argument("--profile", choices=("plain", "draft"), default=None, help="cProfile the timed run of this "
                   "mode at the last batch size (host time: top functions by own and cumulative time)")
    p.add_argument("--markdown", action="store_true")
    a = p.parse_args(argv)
    a.preset = a.preset or ("k3-tiny" if a.tiny else "k3-small")
    a.device = a.device or ("cpu" if a.tiny or not torch.cuda.is_available() else "cuda")
    a.dtype = a.dtype or ("float32" if a.device == "cpu" else "bfloat16")
    a.batches = [int(x) for x in (a.batches or ("1,2" if a.tiny else "1,8,32")).split(",")]
    a.prompt_len = a.prompt_len or (8 if a.tiny else 64)
    a.new_tokens = a.new_tokens or (8 if a.tiny else 128)
    a.train_steps = a.train_steps if a.train_steps is not None else (3 if a.tiny else 300)
    return a


def load_target(a: argparse.Namespace) -> K3ForCausalLM:
    if a.checkpoint:
        return K3ForCausalLM.from_pretrained(a.checkpoint, dtype=a.dtype, device=a.device).eval()
    torch.manual_seed(0)
    return K3ForCausalLM(get_preset(a.preset)).init_weights(seed=0).to_dtype(a.dtype).to(a.device).eval()


def prompts(a: argparse.Namespace, vocab: int, n: int, seed: int) -> list[list[int]]:
    if a.prompts and seed == 2:  # the measured rows (training data stays random / the draft's own)
        with open(a.prompts) as f:
            recs = [json.loads(line) for line in f if line.strip()]
        return [recs[i % len(recs)]["ids"][: recs[i % len(recs)]["prompt_len"]] for i in range(n)]
    rng = random.Random(seed)
    return [[rng.randrange(vocab - 256) for _ in range(a.prompt_len)] for _ in range(n)]


def engine(a: argparse.Namespace, target, draft=None, ngram: int = 0, batch: int | None = None,
           max_batch: int | None = None) -> Engine:
    """batch: the most requests decoding together (default: the largest batch size); max_batch: the
    speculation batch limit (default: --spec-max-batch, else the engine's)."""
    limit = max_batch if max_batch is not None else a.spec_max_batch
    cfg = EngineConfig(memory_budget_bytes=(256 << 20) if a.tiny else (8 << 30), page_size=16 if a.tiny else 128,
                       static_decode=a.static_decode,
                       enable_prefix_cache=False, max_running=batch or max(a.batches), speculative_ngram=ngram,
                       speculative_draft_tokens=a.spec_tokens,
                       **({} if limit is None else {"speculative_max_batch": limit}))
    return Engine(target, None, cfg, eos_id=-1, draft=draft)


def train_here(a: argparse.Namespace, target) -> EagleDraft:
    """A draft trained on the target's greedy continuations of random prompts (float32 master weights)."""
    vocab = target.config.text_config.vocab_size
    ps = prompts(a, vocab, 16 if a.tiny else 256, seed=1)
    t0 = time.perf_counter()
    outs = engine(a, target).generate(ps, SamplingParams(temperature=0, max_tokens=a.new_tokens, ignore_eos=True))
    rows = torch.tensor([p + o.token_ids for p, o in zip(ps, outs)], device=a.device)
    draft = train_on_rows(target, rows, a.prompt_len, a.spec_tokens, steps=a.train_steps, batch_size=4 if a.tiny else 16)
    print(f"# draft trained here in {time.perf_counter() - t0:.0f}s (data generation included)", flush=True)
    return draft


def train_on_rows(target, rows: torch.Tensor, prompt_len: int, k: int, *, steps: int, seconds: float | None = None,
                  batch_size: int = 16, lr: float = 2e-3, log_every: int = 0) -> EagleDraft:
    """A fresh draft (float32 master weights, returned in the target's dtype, eval) trained with the
    training-time test on rows [N, T] long: prompts of prompt_len tokens + the target's own greedy
    continuations. Stops after `steps` steps or, when given, `seconds` of training (the first step,
    kernel compilation, not counted); prints a progress line every `log_every` steps (0: at the end)."""
    dev = rows.device
    torch.manual_seed(0)
    draft = EagleDraft(DraftConfig.for_target(target.config)).to(dev).attach(target)
    opt = torch.optim.AdamW(draft.parameters(), lr=lr)
    lengths = torch.full((batch_size,), rows.shape[1], device=dev)
    prompt_lens = torch.full((batch_size,), prompt_len, device=dev)
    t0 = time.perf_counter()
    for step in range(steps):
        ids = rows[torch.randint(len(rows), (batch_size,), generator=torch.Generator().manual_seed(step))]
        with torch.autocast(dev.type, torch.bfloat16, enabled=dev.type == "cuda"):
            aux, logp = target_pass(target, ids, draft.config.target_layers)
            out = ttt_forward(draft, aux, logp, ids, lengths, prompt_lens, k)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        opt.step()
        if step == 0:
            t0 = time.perf_counter()
        done = step + 1 == steps or (seconds is not None and time.perf_counter() - t0 > seconds)
        if done or (log_every and (step + 1) % log_every == 0):
            print(f"# draft step {step + 1}: loss {out.loss.item():.3f}, per-step top-1 agreement "
                  f"{[round(x, 2) for x in out.step_acc]}, tau estimate {out.tau:.2f} at K={k} "
                  f"({time.perf_counter() - t0:.0f}s)", flush=True)
        if done:
            break
    return draft.to(target.lm_head.weight.dtype).eval()


def run_row(a: argparse.Namespace, eng: Engine, batch: int, ps: list[list[int]]) -> tuple[dict, list[list[int]]]:
    """Time `ps` (greedy, a.new_tokens each) through `eng` -> (the row's numbers, the output ids)."""
    sp = SamplingParams(temperature=0, max_tokens=a.new_tokens, ignore_eos=True)
    if a.warmup == "full":  # the same workload untimed first: every CUDA graph bucket it uses gets captured
        eng.generate(ps, sp)
    else:
        eng.generate(ps[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # kernels only
    before = eng.stats()
    if a.device == "cuda":
        torch.cuda.synchronize()
    prof = None
    if a.profile and (eng.spec is not None) == (a.profile == "draft") and batch == a.batches[-1]:
        import cProfile

        prof = cProfile.Profile()
    t0 = time.perf_counter()
    if prof is not None:
        prof.enable()
    outs = eng.generate(ps, sp)
    if a.device == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    if prof is not None:
        import pstats

        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
    s = eng.stats()
    rows = s["spec_verify_rows"] - before["spec_verify_rows"]
    acc = s["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    toks = sum(len(o.token_ids) for o in outs)
    spent = {k: round(s[k] - before[k], 3) for k in ("spec_propose_seconds", "spec_verify_seconds", "decode_seconds",
                                                    "prefill_seconds")}
    runner = eng.runner
    # decode only: the tokens after each request's first (sampled from its prefill) over the time outside
    # prefill forwards (host-timed; a prefill's time includes waiting for its own device work)
    decode_s = max(dt - spent["prefill_seconds"], 1e-9)
    return {"batch": batch, "requests": len(ps), "tokens": toks, "seconds": round(dt, 3), "tok_s": round(toks / dt, 1),
            "decode_tok_s": round((toks - len(ps)) / decode_s, 1),
            "tau": round((acc + rows) / rows, 3) if rows else None, "steps": s["steps"] - before["steps"],
            "verify_forwards": s["spec_verify_forwards"] - before["spec_verify_forwards"], **spent,
            "graphs": runner.num_captures if runner is not None and runner.use_graphs else 0,
            "draft_graphs": len(getattr(eng.spec.proposer, "graphs", {})) if eng.spec is not None else 0
            }, [o.token_ids for o in outs]


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    target = load_target(a)
    vocab = target.config.text_config.vocab_size
    modes = a.modes.split(",")
    draft = None
    if any(m.startswith("draft") for m in modes):
        draft = load_draft(a.draft, target) if a.draft else train_here(a, target)
    measure(a, target, draft, modes, lambda batch: prompts(a, vocab, max(batch, a.requests or 0), seed=2))
    return 0


def measure(a: argparse.Namespace, target, draft, modes: list[str], make_prompts, deadline: float | None = None
            ) -> list[dict]:
    """Every (batch in a.batches, mode) row, printed as JSON as it finishes (a markdown table at the end
    with --markdown); make_prompts(batch) -> the row's prompts. Modes: plain, draft, ngram, and
    draft-all / ngram-all (no speculation batch limit). Outputs are compared with the first mode's.
    deadline: a `time.perf_counter()` value after which the remaining rows are skipped (reported)."""
    known = {"plain", "draft", "ngram", "draft-all", "ngram-all"}
    if set(modes) - known:
        raise SystemExit(f"unknown modes {sorted(set(modes) - known)}; choose from {sorted(known)}")
    limit = resolve_max_batch(a.spec_max_batch, torch.device(a.device).type)
    results = []
    for batch in a.batches:
        ref = None
        ps = make_prompts(batch)
        for mode in modes:
            if deadline is not None and time.perf_counter() > deadline:
                print(f"# time budget spent: batch {batch} {mode} skipped", flush=True)
                continue
            base = mode.removesuffix("-all")
            if base != mode and base in modes and (limit == 0 or batch <= limit):
                continue  # the policy allows this batch: the same engine as `base`
            eng = engine(a, target, draft=draft if base == "draft" else None,
                         ngram=a.spec_tokens if base == "ngram" else 0, batch=batch,
                         max_batch=0 if mode.endswith("-all") else None)
            row, outs = run_row(a, eng, batch, ps)
            del eng  # its cache pool and graphs (the engine holds reference cycles: collect now)
            gc.collect()
            if a.device == "cuda":
                torch.cuda.empty_cache()
            ref = outs if ref is None else ref
            same = sum(o == r for o, r in zip(outs, ref))
            row |= {"mode": mode, "preset": a.checkpoint or a.preset, "device": a.device, "k": a.spec_tokens,
                    "same_output": same == len(ref), "same_requests": f"{same}/{len(ref)}"}
            results.append(row)
            print(json.dumps(row), flush=True)
            if same != len(ref):  # exact on CPU fp32; in bf16 a near-tie argmax may flip between the verify
                # forward's kernels and the decode step's (n-gram speculation has the same property)
                first = [next((j for j, (x, y) in enumerate(zip(o, r)) if x != y), None) for o, r in zip(outs, ref)]
                print(f"# MISMATCH: {mode} output differs from {modes[0]} in {len(ref) - same} of {len(ref)} requests "
                      f"at batch {batch} (first differing token: {[f for f in first if f is not None][:8]})", flush=True)
    if a.markdown:
        print("\n| batch | mode | tokens/s | speed-up | decode-only tokens/s | speed-up | tau | prefill s | "
              "speculated steps | outputs == first |\n|---|---|---|---|---|---|---|---|---|---|")
        base = {r["batch"]: r for r in results if r["mode"] == modes[0]}
        for r in results:
            b = base[r["batch"]]
            print(f"| {r['batch']} | {r['mode']} | {r['tok_s']:.1f} | {r['tok_s'] / b['tok_s']:.2f}x | "
                  f"{r['decode_tok_s']:.1f} | {r['decode_tok_s'] / b['decode_tok_s']:.2f}x | "
                  f"{r['tau'] if r['tau'] is not None else '-'} | {r['prefill_seconds']:.3f} | "
                  f"{r['verify_forwards']}/{r['steps']} | {r['same_requests']} |")
    return results


if __name__ == "__main__":
    sys.exit(main())
