"""`k3 train-draft`: train an EAGLE-3 draft on a target checkpoint's own generations (`k3.draft.loop`)."""

from __future__ import annotations

import argparse
import json


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train-draft", help="train an EAGLE-3 speculative-decoding draft for a checkpoint")
    p.add_argument("--target", required=True, help="target checkpoint directory (official layout + tokenizer)")
    p.add_argument("--data", default=None, help="corpus source of the prompts (folder, .jsonl or .parquet; "
                   "default: the default pre-training corpus); the target writes the continuations")
    p.add_argument("--out", default="runs/draft", help="run directory (the draft lands in OUT/final)")
    p.add_argument("--max-steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--ttt-steps", type=int, default=4, help="training-time-test unroll length K")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--val-prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--gen-len", type=int, default=96, help="tokens the target continues each prompt with")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--target-layers", default=None, metavar="L,M,H",
                   help="target layers whose hidden states the draft fuses (default: 1, depth/2, depth-1)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from k3.draft.loop import DraftTrainConfig, train_draft

    overrides = {}
    if args.target_layers:
        overrides["target_layers"] = tuple(int(x) for x in args.target_layers.split(","))
    cfg = DraftTrainConfig(target=args.target, out=args.out, data=args.data, max_steps=args.max_steps,
                           batch_size=args.batch_size, lr=args.lr, ttt_steps=args.ttt_steps,
                           num_prompts=args.num_prompts, val_prompts=args.val_prompts, prompt_len=args.prompt_len,
                           gen_len=args.gen_len, eval_every=args.eval_every, save_every=args.save_every,
                           seed=args.seed, device=args.device, draft=overrides)
    result = train_draft(cfg, resume=args.resume)
    print(json.dumps(result))
    return 0
