"""`k3 sft`: supervised fine-tuning of a checkpoint on XTML conversations. With only --base it trains on
the default data (practice-world oracle trajectories + generated instruction-following items) and
evaluates the base model and the result on held-out tasks."""

from __future__ import annotations

import argparse
import os
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sft", help="fine-tune a checkpoint on conversations (default: worlds + instructions)")
    p.add_argument("--base", default=None, help="official-format checkpoint dir, e.g. runs/<t>/final of `k3 train`")
    p.add_argument("--data", default=None, help="conversations: a JSONL file, a folder of *.jsonl/*.parquet, or Parquet")
    p.add_argument("--out", default=None, help="output directory (default runs/sft-<timestamp>)")
    p.add_argument("--config", default=None, help="JSON/TOML file of SFTConfig overrides")
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--on-bad", choices=("skip", "error"), default=None,
                   help="malformed conversations: skip them (reported by file:line, default) or stop")
    p.add_argument("--thinking-effort", choices=("low", "medium", "high", "max"), default=None,
                   help="effort rendered for conversations that set none (default low)")
    p.add_argument("--no-eval-base", action="store_true", help="skip the base model's evaluation at step 0")
    p.add_argument("--eval-only", action="store_true",
                   help="no training: evaluate --base on the held-out set (the config's eval_* keys, e.g. "
                        "eval_tool_turns) and print the summary line and the JSON record")
    p.add_argument("--deterministic", action="store_true", help="deterministic algorithms (1 thread on CPU)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--micro-batch-tokens", type=int, default=None)
    p.add_argument("--ep", type=int, default=1, help="expert-parallel degree (under torchrun)")
    p.add_argument("--cp", type=int, default=1, help="context-parallel degree (under torchrun)")
    p.set_defaults(func=run)


def build_config(args: argparse.Namespace):
    """SFT defaults < --config file < flags; with --resume the run's saved config comes first."""
    from k3.sft.config import SFTConfig
    from k3.train.config import load_overrides
    from k3.train.state import load_run_config

    d = (load_run_config(args.out) or {}) if args.resume else {}
    if args.config:
        d.update(load_overrides(args.config))
    for key in ("base", "data", "out", "max_steps", "seed", "on_bad", "thinking_effort", "device",
                "micro_batch_tokens"):
        v = getattr(args, key)
        if v is not None:
            d[key] = v
    if args.no_eval_base:
        d["eval_base"] = False
    if args.deterministic:
        d["deterministic"] = True
    if not d.get("out"):
        import time
        d["out"] = time.strftime("runs/sft-%Y%m%d-%H%M%S")
    return SFTConfig.from_dict(d).validate()


def run(args: argparse.Namespace) -> int:
    from k3.sft.loop import sft

    if args.resume and not args.out:
        print("error: --resume needs --out DIR (the run to continue)", file=sys.stderr)
        return 2
    cfg = build_config(args)
    if args.eval_only:
        return _eval_only(cfg)
    result, behaviour = sft(cfg, resume=args.resume, ep=args.ep, cp=args.cp)
    if result.interrupted:
        print(f"interrupted; resume with: k3 sft --out {result.out_dir} --resume", file=sys.stderr)
        return 130
    if os.environ.get("RANK", "0") != "0":
        return 0
    from k3.sft.eval import summary

    print(f"done: {result.steps} steps in {result.out_dir}; held-out val loss {result.first_val_loss:.3f} -> "
          f"{result.last_val_loss:.3f}; final checkpoint {result.out_dir}/final")
    for rec in behaviour:
        print(f"{'base' if rec['step'] == 0 else 'step ' + str(rec['step'])}: {summary(rec)}")
    return 0


def _eval_only(cfg) -> int:  # noqa: ANN001
    import json

    from k3.sft.eval import summary
    from k3.sft.loop import evaluate_checkpoint

    rec = evaluate_checkpoint(cfg)
    print(f"{cfg.base}: {summary(rec)}")
    print(json.dumps(rec))
    return 0
