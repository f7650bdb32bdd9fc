"""RL benchmark: rollout tokens/s, trainer tokens/s and idle fraction, with and without partial
rollouts, on a long-tailed distribution of attempt lengths (docs/rl.md).

Random-weight model of `--preset`, a small BPE tokenizer trained here; synthetic tasks whose
length budgets follow a Pareto distribution (attempt caps from `--min-len` to `--max-len`, tail
index `--alpha`); rewards are a hash of the output (half the attempts score 1), so every step has
advantages and trains. Each mode runs `--warmup` + `--steps` RL steps of `k3.rl.loop.RLTrainer`
(engine and trainer on one device, the engine serving the trainer's module).

idle fraction = 1 − generated tokens / (engine steps × attempts in flight at full batch): the
share of the decode batch's rows left empty while the long tail finishes.

    python bench/rl.py --smoke                           # CPU smoke: k3-tiny, 1 step per mode, caps 8..32
    python bench/rl.py                                   # CPU: k3-tiny, short lengths, 1 + 3 steps per mode
    python bench/rl.py --preset k3-small --device cuda   # one GPU (bash bench/gpu_all.sh rl)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from k3.config import get_preset  # noqa: E402
from k3.data.tokenizer import train_bpe_tokenizer  # noqa: E402
from k3.model.causal_lm import K3ForCausalLM  # noqa: E402
from k3.rl.effort import EffortConfig  # noqa: E402
from k3.rl.loop import RLConfig, RLTrainer  # noqa: E402
from k3.rl.rollout import RolloutConfig  # noqa: E402
from k3.rl.tasks.base import Task  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="CPU end-to-end check: 1 step per mode, caps 8..32, G 2")
    p.add_argument("--preset", default="k3-tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--group-size", type=int, default=None, help="default 4 (CPU) / 8 (GPU)")
    p.add_argument("--batch-groups", type=int, default=None, help="default 4 (CPU) / 32 (GPU)")
    p.add_argument("--min-len", type=int, default=None, help="shortest attempt cap (default 8 CPU / 128 GPU)")
    p.add_argument("--max-len", type=int, default=None, help="longest attempt cap (default 64 CPU / 2048 GPU)")
    p.add_argument("--alpha", type=float, default=1.2, help="Pareto tail index of the caps")
    p.add_argument("--threshold", type=float, default=0.5,
                   help="partial rollouts: completed fraction of the batch that ends a collect")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--memory-budget-mb", type=int, default=None)
    p.add_argument("--serve-dtype", default=None,
                   help="engine copy dtype (default bfloat16 on GPU: a bf16 serving copy synced after each "
                        "update; the CPU default serves the fp32 trainer module itself)")
    p.add_argument("--out", default=None, help="JSON lines file for the results")
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.warmup = 1, 0
        args.group_size, args.min_len, args.max_len = args.group_size or 2, args.min_len or 8, args.max_len or 32
    return args


def make_base(preset: str, directory: str) -> None:
    """Random-weight `preset` with a small tokenizer (the model keeps its vocabulary; the engine
    samples only the tokenizer's ids)."""
    rng = random.Random(0)
    words = "the value of a task answer tool think step number plus result".split()
    docs = [" ".join(rng.choice(words) for _ in range(30)) for _ in range(60)]
    tok = train_bpe_tokenizer(docs, 1024)
    cfg = get_preset(preset)
    torch.manual_seed(0)
    K3ForCausalLM(cfg).init_weights(seed=0).save_pretrained(directory, dtype="float32")
    tok.save(directory)


def pareto_caps(n: int, lo: int, hi: int, alpha: float, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [min(hi, int(lo * rng.paretovariate(alpha))) for _ in range(n)]


def synthetic_tasks(n: int, caps: list[int]) -> list[Task]:
    """Tasks with budget caps[i] tokens (= the attempt cap with multiple 1 and cap factor 1)."""
    def score(msg: dict, env=None) -> float:
        text = (msg.get("reasoning_content") or "") + (msg.get("content") or "")
        return float(hashlib.sha1(text.encode()).digest()[0] & 1)

    return [Task(task_id=f"bench-{i}", kind="bench", messages=[{"role": "user", "content": f"task {i}"}],
                 reference="", score=score, budget_tokens=caps[i]) for i in range(n)]


def run_mode(args, base: str, partial: bool, gpu: bool) -> dict:
    G = args.group_size or (8 if gpu else 4)
    B = args.batch_groups or (32 if gpu else 4)
    lo, hi = args.min_len or (128 if gpu else 8), args.max_len or (2048 if gpu else 64)
    cfg = RLConfig(base=base, out=tempfile.mkdtemp(prefix="rlbench_"), efforts=("low",), train_tasks=1, eval_tasks=0,
                   max_steps=args.steps + args.warmup, device=args.device, plots=False,
                   memory_budget_mb=args.memory_budget_mb or (16384 if gpu else 256),
                   micro_batch_tokens=16384 if gpu else 4096,
                   serve_dtype=args.serve_dtype or ("bfloat16" if gpu else None),
                   effort=EffortConfig(multiples={"low": 1.0}, cap_factor=1.0, min_budget=1),
                   rollout=RolloutConfig(group_size=G, batch_groups=B, partial=partial, threshold=args.threshold))
    tr = RLTrainer(cfg)
    n = (args.steps + args.warmup + 2) * B * 2
    tr.train_tasks = synthetic_tasks(n, pareto_caps(n, lo, hi, args.alpha, seed=1))
    source = tr.task_stream()
    recs = []
    for step in range(args.warmup + args.steps):
        s0 = tr.engine.metrics.steps
        t0 = time.perf_counter()
        rec = tr.rl_step(source)
        if gpu:
            torch.cuda.synchronize()
        rec["wall_s"] = time.perf_counter() - t0
        rec["engine_steps"] = tr.engine.metrics.steps - s0
        tr.step += 1
        if step >= args.warmup:
            recs.append(rec)
    tr.rollouts.abort_all()
    gen = sum(r["rollout_tokens"] for r in recs)
    roll_s = sum(r["rollout_s"] for r in recs)
    train_tok = sum(r["train_tokens"] for r in recs)
    train_s = sum(r["train_s"] for r in recs)
    wall = sum(r["wall_s"] for r in recs)
    groups = sum(r["groups"] for r in recs)
    return {"preset": args.preset, "device": str(tr.device), "partial": partial, "group_size": G,
            "batch_groups": B, "caps": [lo, hi, args.alpha], "steps": len(recs),
            "wall_s_per_step": wall / len(recs), "wall_s_per_group": wall / max(groups, 1),
            "groups_per_step": groups / len(recs), "rollout_tok_s": gen / roll_s, "train_tok_s": train_tok / train_s,
            "idle_fraction": 1 - gen / max(1, sum(r["engine_steps"] for r in recs) * G * B),
            "rollout_share": roll_s / wall, "staleness_mean": sum(r["staleness_mean"] for r in recs) / len(recs)}


def main(argv=None) -> int:
    args = parse_args(argv)
    gpu = args.device.startswith("cuda")
    with tempfile.TemporaryDirectory(prefix="rlbench_base_") as base:
        make_base(args.preset, base)
        rows = [run_mode(args, base, partial, gpu) for partial in (False, True)]
    sync, part = rows
    summary = {"speedup_per_group": sync["wall_s_per_group"] / part["wall_s_per_group"],
               "idle_fraction": [sync["idle_fraction"], part["idle_fraction"]]}
    for r in rows + [summary]:
        print(json.dumps(r))
    if args.out:
        with open(args.out, "a") as f:
            for r in rows + [summary]:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
