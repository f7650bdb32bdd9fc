"""Teacher log-prob scoring benchmark for on-policy distillation (docs/distill.md).

A random-weight teacher of `--preset` (`k3.distill.teachers.ModelTeacher`: `token_logprobs`,
vocabulary-chunked, no [T, vocab] logits held) scores packed batches of student samples: rows of
`--docs` documents of `--doc-len` tokens. Reported per batch shape: teacher tokens/s (median of
`--iters` after `--warmup`; the default training-numerics kernels and the no-grad serving kernels,
see ModelTeacher), peak device memory of the scoring call above the weights, the size the
full fp32 logits of that batch would have taken, and the student's forward + backward of
`k3.distill.losses.opd_loss` on the same batch for comparison.

    python bench/distill.py --smoke                          # CPU: k3-tiny, short batches
    python bench/distill.py --preset k3-small --device cuda  # one GPU (bf16 weights)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from k3.config import get_preset  # noqa: E402
from k3.distill.losses import opd_loss  # noqa: E402
from k3.distill.teachers import ModelTeacher  # noqa: E402
from k3.model.causal_lm import K3ForCausalLM  # noqa: E402
from k3.rl.losses import PGConfig  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="CPU smoke: k3-tiny, fp32, small batches")
    p.add_argument("--preset", default="k3-small")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--shapes", default="8x1024,16x2048,8x8192", help="DOCSxDOC_LEN,... packed into one row each")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--no-student", action="store_true", help="skip the student forward + backward")
    p.add_argument("--out", default=None, help="JSON lines file for the results")
    args = p.parse_args(argv)
    if args.smoke:
        args.preset, args.device, args.dtype, args.shapes, args.iters, args.warmup = (
            "k3-tiny", "cpu", "float32", "2x32", 1, 1)
    return args


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _timed(fn, dev: torch.device, iters: int, warmup: int) -> tuple[float, int]:
    """(median seconds, peak bytes allocated above the starting point; 0 on CPU)."""
    for _ in range(warmup):
        fn()
    _sync(dev)
    base = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(dev) - base if dev.type == "cuda" else 0
    return statistics.median(times), peak


def bench_shape(teacher: ModelTeacher, student: K3ForCausalLM | None, docs: int, doc_len: int, vocab: int,
                dev: torch.device, iters: int, warmup: int) -> dict:
    g = torch.Generator().manual_seed(docs * 7 + doc_len)
    ids = torch.randint(0, vocab, (1, docs * doc_len), generator=g).to(dev)
    cu = torch.arange(0, docs * doc_len + 1, doc_len, dtype=torch.int32)
    n = ids.numel()
    sec, peak = _timed(lambda: teacher.score(ids, cu), dev, iters, warmup)
    serving = ModelTeacher("bench-serving", teacher.model, training_numerics=False)
    s_sec, s_peak = _timed(lambda: serving.score(ids, cu), dev, iters, warmup)
    rec = {"docs": docs, "doc_len": doc_len, "tokens": n, "teacher_tok_s": n / sec, "teacher_peak_mib": peak / 2**20,
           "teacher_nograd_tok_s": n / s_sec, "teacher_nograd_peak_mib": s_peak / 2**20,
           "full_logits_fp32_mib": n * vocab * 4 / 2**20}
    if student is not None:
        t_lp = teacher.score(ids, cu)
        mask = torch.ones_like(ids, dtype=torch.bool)
        mask[0, cu[:-1].long()] = False
        seq = (torch.arange(n, device=dev) // doc_len)[None]
        zeros = torch.zeros_like(ids)

        def step():
            lp = student.token_logprobs(ids, cu_seqlens=cu)
            loss, _ = opd_loss(lp.float(), t_lp, lp.detach().float(), mask, zeros, seq, PGConfig())
            loss.backward()
            student.zero_grad(set_to_none=True)
        s_sec, s_peak = _timed(step, dev, iters, warmup)
        rec |= {"student_fwd_bwd_tok_s": n / s_sec, "student_peak_mib": s_peak / 2**20}
    return rec


def main(argv=None) -> int:
    args = parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cpu":
        torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    dtype = getattr(torch, args.dtype)
    cfg = get_preset(args.preset)
    vocab = cfg.text_config.vocab_size
    model = K3ForCausalLM(cfg).init_weights(seed=0).to_dtype(dtype).to(dev)
    teacher = ModelTeacher("bench", model)
    student = None
    if not args.no_student:
        student = K3ForCausalLM(get_preset(args.preset)).init_weights(seed=1).to_dtype(dtype).to(dev).train()
    rows = []
    print("| preset | device | dtype | docs x len | tokens | teacher tok/s | teacher peak MiB | no-grad teacher tok/s "
          "| no-grad peak MiB | full fp32 logits MiB | student fwd+bwd tok/s | student peak MiB |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        docs, doc_len = (int(x) for x in shape.lower().split("x"))
        r = bench_shape(teacher, student, docs, doc_len, vocab, dev, args.iters, args.warmup)
        r |= {"preset": args.preset, "device": str(dev), "dtype": args.dtype,
              "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"}
        rows.append(r)
        print(f"| {args.preset} | {r['gpu']} | {args.dtype} | {docs} x {doc_len} | {r['tokens']} | "
              f"{r['teacher_tok_s']:.0f} | {r['teacher_peak_mib']:.0f} | {r['teacher_nograd_tok_s']:.0f} | "
              f"{r['teacher_nograd_peak_mib']:.0f} | {r['full_logits_fp32_mib']:.0f} | "
              f"{r.get('student_fwd_bwd_tok_s', float('nan')):.0f} | {r.get('student_peak_mib', float('nan')):.0f} |",
              flush=True)
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
