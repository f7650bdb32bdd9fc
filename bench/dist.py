"""Distributed `k3 train` vs one process: same losses, tokens/s per device, scaling, peak memory.

    python bench/dist.py --preset k3-small --data k3 --steps 6             # on a 2-GPU host (NCCL)
    python bench/dist.py --smoke                                           # CPU, gloo, k3-tiny

Runs `k3 train` once in one process and once under `torchrun --nproc-per-node N` per flag set
(none = FSDP2 over all ranks, `--ep N`, `--cp N`), all from the same seed, data and config, then
prints one table: the largest relative loss difference to the one-process run over the steps,
tokens/s per device, the scaling efficiency (tokens/s per device / one-process tokens/s), MFU and
peak memory per device where the run records them. `--long-seq L` adds a `--cp N` run whose only
stage has rows of L tokens (the long-context check: L = 2x the longest row one device fits).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = {"tokens_per_step": 512, "stages": [{"seq_len": 64, "fraction": 1.0}], "eval_every": 1000,
        "eval_tokens": 256, "eval_seq_len": 64, "save_every": 1000, "warmup_steps": 2, "val_fraction": 0.1,
        "qb_bins": 64}
SMALL = {"tokens_per_step": 131072, "micro_batch_tokens": 65536, "stages": [{"seq_len": 8192, "fraction": 1.0}],
         "eval_every": 1000, "eval_tokens": 65536, "eval_seq_len": 8192, "save_every": 1000, "val_fraction": 0.1}


def run_train(out: Path, cfg: dict, args: argparse.Namespace, flags: list[str], nproc: int, port: int) -> list[dict]:
    """One `k3 train` run (under torchrun when nproc > 1) -> its metrics records with a loss."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "cfg.json").write_text(json.dumps(cfg))
    train = ["-m", "k3", "train", "--preset", args.preset, "--data", args.data, "--max-steps", str(args.steps),
             "--seed", "0", "--config", str(out / "cfg.json"), "--out", str(out / "run"), *flags]
    if args.compile:
        train.append("--compile")
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-port", str(port), *train]
    else:
        cmd = [sys.executable, *train]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    if args.smoke:
        env["OMP_NUM_THREADS"] = "1"
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(flags) or 'fsdp'} x{nproc} failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    lines = (out / "run" / "metrics.jsonl").read_text().splitlines()
    return [rec for rec in map(json.loads, lines) if "loss" in rec]


def summarise(name: str, recs: list[dict], base: list[dict] | None, nproc: int, base_tok_s: float | None) -> str:
    steady = recs[min(2, len(recs) - 1):]  # the first steps include compilation and warm-up
    tok_s = statistics.median(r["tok_s"] for r in steady) / nproc
    diff = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(recs, base)) if base else 0.0
    scaling = f"{tok_s / base_tok_s:.1%}" if base_tok_s else "-"
    mfu = f"{statistics.median(r['mfu'] for r in steady):.1%}" if "mfu" in steady[-1] else "-"
    mem = f"{max(r['peak_mem_gb'] for r in recs):.1f}" if "peak_mem_gb" in recs[-1] else "-"
    return f"| {name} | {nproc} | {diff:.2e} | {tok_s:,.0f} | {scaling} | {mfu} | {mem} |"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="k3-small")
    p.add_argument("--data", default="k3", help="corpus (default: k3's own source)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--flags", default="fsdp,ep,cp", help="comma list of fsdp, ep, cp")
    p.add_argument("--long-seq", type=int, default=0, help="also a --cp run with rows of this many tokens")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--smoke", action="store_true", help="CPU / gloo / k3-tiny, a few steps")
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.smoke:
        args.preset, args.steps = "k3-tiny", min(args.steps, 4)
        cfg = dict(TINY)
    else:
        cfg = dict(SMALL) if args.preset == "k3-small" else dict(TINY)
    root = Path(args.out or tempfile.mkdtemp(prefix="k3dist_"))
    n = args.nproc
    base = run_train(root / "one", cfg, args, [], 1, 0)
    base_tok_s = statistics.median(r["tok_s"] for r in base[min(2, len(base) - 1):])
    rows = [summarise("one process", base, None, 1, None)]
    plans = {"fsdp": [], "ep": ["--ep", str(n)], "cp": ["--cp", str(n)]}
    for i, name in enumerate(f for f in args.flags.split(",") if f):
        recs = run_train(root / name, cfg, args, plans[name], n, 29700 + i)
        rows.append(summarise(f"torchrun {' '.join(plans[name]) or 'fsdp'}", recs, base, n, base_tok_s))
    if args.long_seq:
        long_cfg = dict(cfg, stages=[{"seq_len": args.long_seq, "fraction": 1.0}], eval_seq_len=args.long_seq,
                        tokens_per_step=args.long_seq, micro_batch_tokens=args.long_seq, eval_tokens=args.long_seq)
        recs = run_train(root / "cp_long", long_cfg, args, plans["cp"], n, 29790)
        rows.append(summarise(f"torchrun --cp {n}, rows of {args.long_seq}", recs, None, n, None))
    print(f"# {args.preset}, {args.steps} steps, {n} processes, runs in {root}")
    print("| run | procs | max rel. loss diff vs one process | tokens/s per device | scaling | MFU | peak GB |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
