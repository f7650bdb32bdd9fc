"""`k3 train`: the README's main job. With no arguments it trains k3-tiny on the Python standard
library source of the running interpreter in about ten minutes on 2 CPU cores."""

from __future__ import annotations

import argparse
import os
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="pre-train a K3 model (default: k3-tiny on the stdlib source)")
    p.add_argument("--preset", default=None, help="model preset (default k3-tiny)")
    p.add_argument("--config", default=None, help="JSON/TOML file of overrides (train keys + a `model` table)")
    p.add_argument("--data", default=None, help="folder of text/code files, JSONL with a `text` field, or Parquet")
    p.add_argument("--out", default=None, help="output directory (default runs/<timestamp>)")
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--deterministic", action="store_true", help="deterministic algorithms (1 thread on CPU)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--micro-batch-tokens", type=int, default=None,
                   help="tokens per forward/backward; a step accumulates gradients over micro-batches")
    p.add_argument("--qat", default=None, metavar="FORMATS",
                   help="quantisation-aware training of the routed experts: mxfp4 (weights) or mxfp4,mxfp8 "
                        "(+ their input activations); the final checkpoint stores the experts packed MXFP4")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel degree (under torchrun)")
    p.add_argument("--cp", type=int, default=1, help="context-parallel degree (under torchrun)")
    p.set_defaults(func=run)


def build_config(args: argparse.Namespace):
    """Preset defaults < --config file < flags; with --resume the run's own saved config takes the
    place of the preset defaults, so `k3 train --out DIR --resume` needs no other flag."""
    from k3.train.config import TrainConfig, load_overrides
    from k3.train.state import load_run_config

    d = (load_run_config(args.out) or {}) if args.resume else {}
    if args.config:
        d.update(load_overrides(args.config))
    for key in ("preset", "data", "out", "max_steps", "seed", "device", "micro_batch_tokens", "qat"):
        v = getattr(args, key)
        if v is not None:
            d[key] = v
    if args.deterministic:
        d["deterministic"] = True
    if args.compile:
        d["compile"] = True
    if args.activation_checkpointing:
        d["activation_checkpointing"] = True
    return TrainConfig.from_dict(d).validate()  # a bad value is an error message here, not a traceback later


def run(args: argparse.Namespace) -> int:
    from k3.train.trainer import train

    if args.resume and not args.out:
        print("error: --resume needs --out DIR (the run to continue)", file=sys.stderr)
        return 2
    # a bad config value or file, a preset too large for this machine, a changed config on --resume,
    # nothing to resume, a missing corpus: k3.cli.main turns them into one error line and exit code 2
    cfg = build_config(args)
    result = train(cfg, resume=args.resume, ep=args.ep, cp=args.cp)
    if result.interrupted:
        print(f"interrupted; resume with: k3 train --out {result.out_dir} --resume", file=sys.stderr)
        return 130
    if os.environ.get("RANK", "0") != "0":
        return 0
    print(f"done: {result.steps} steps in {result.out_dir}; val loss {result.first_val_loss:.3f} -> "
          f"{result.last_val_loss:.3f} (unigram baseline {result.unigram_entropy:.3f} nats/token); "
          f"final checkpoint {result.out_dir}/final")
    if result.vision_eval is not None:
        v = result.vision_eval
        print(f"vision: held-out multiple-choice accuracy {v['accuracy']:.1%} vs chance {v['chance']:.1%} "
              f"({v['n']} questions; " + ", ".join(f"{k} {d['accuracy']:.1%}/{d['chance']:.1%}"
                                                  for k, d in sorted(v["per_kind"].items())) + ")")
    return 0
