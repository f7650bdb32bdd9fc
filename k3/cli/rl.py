"""`k3 rl`: reinforcement learning from a checkpoint on embedded generated tasks (docs/rl.md)."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("rl", help="RL on generated math / tool-world / code tasks with effort budgets")
    p.add_argument("--base", required=True,
                   help="checkpoint directory (official layout + tokenizer), e.g. k3 sft's final/")
    p.add_argument("--tasks", default="math",
                   help="comma-separated subset of math,worlds,code,open (default math: sized for a small model "
                        "on CPU; open = questions without a verifier, scored by --judge)")
    p.add_argument("--efforts", default="low,high,max", help="comma-separated subset of low,high,max")
    p.add_argument("--out", default="runs/rl", help="output directory")
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--group-size", type=int, default=None, help="attempts per (task, effort)")
    p.add_argument("--batch-groups", type=int, default=None, help="groups per training batch")
    p.add_argument("--threshold", type=float, default=None,
                   help="partial rollouts: completed fraction of the batch at which the rest is paused")
    p.add_argument("--no-partial", action="store_true", help="wait for every attempt of the batch")
    p.add_argument("--lr", type=float, default=None, help="Muon learning rate")
    p.add_argument("--eval-tasks", type=int, default=None, help="held-out tasks per kind")
    p.add_argument("--kl-coef", type=float, default=None, help="KL-to-base coefficient (0 = off)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default 1 on CPU)")
    p.add_argument("--math-partial", type=float, default=None,
                   help="shaped credit for a wrong integer answer (0 = exact match only; default 0.5)")
    p.add_argument("--tool-partial", type=float, default=None,
                   help="shaped credit of the lookup world when the submission is wrong: milestones reached "
                        "(a tool call, a valid declared call, the target looked up) x P/3 (0 = exact; default 0.5)")
    p.add_argument("--judge", default=None,
                   help="reward source of tasks without a verifier: a k3 checkpoint DIR (in-process GenRM) or "
                        "http(s)://HOST:PORT/v1#MODEL (OpenAI-compatible endpoint)")
    p.add_argument("--judge-mode", choices=("listwise", "pairwise"), default=None, help="GenRM comparison mode")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")
    p.set_defaults(func=run)


def build_config(args: argparse.Namespace):
    from k3.rl.effort import parse_efforts
    from k3.rl.loop import RLConfig
    from k3.rl.tasks import parse_kinds

    cfg = RLConfig(base=args.base, out=args.out, tasks=parse_kinds(args.tasks), efforts=parse_efforts(args.efforts))
    for key in ("max_steps", "seed", "device", "lr", "eval_tasks", "threads", "math_partial", "tool_partial", "judge"):
        if getattr(args, key) is not None:
            setattr(cfg, key, getattr(args, key))
    if args.group_size is not None:
        cfg.rollout.group_size = args.group_size
    if args.batch_groups is not None:
        cfg.rollout.batch_groups = args.batch_groups
    if args.threshold is not None:
        cfg.rollout.threshold = args.threshold
    if args.no_partial:
        cfg.rollout.partial = False
    if args.kl_coef is not None:
        cfg.pg.kl_coef = args.kl_coef
    if args.judge_mode is not None:
        cfg.genrm.mode = args.judge_mode
    cfg.rollout.seed = cfg.seed
    return cfg.validate()


def sandbox_runner():
    """The code tasks' runner: a k3.envs.sandbox.Sandbox behind k3.reward.verifiers.SandboxRunner
    (ValueError when that module is absent)."""
    import importlib.util

    if importlib.util.find_spec("k3.envs.sandbox") is None:
        raise ValueError("--tasks code needs k3.envs.sandbox (the sandbox that runs the unit tests)")
    from k3.envs.sandbox import Sandbox
    from k3.reward.verifiers import SandboxRunner

    return SandboxRunner(Sandbox.create())


def run(args: argparse.Namespace) -> int:
    from k3.rl.dist import DistRL, wants_distributed
    from k3.rl.loop import train_rl

    try:
        cfg = build_config(args)
        runner = sandbox_runner() if "code" in cfg.tasks else None
    except ValueError as e:
        print(f"k3 rl: error: {e}", file=sys.stderr)
        return 2
    dist = DistRL(cfg.device) if wants_distributed() else None  # torchrun: trainer sharded, rollouts on rank 0
    try:
        res = train_rl(cfg, resume=args.resume, runner=runner, dist=dist)
    finally:
        if dist is not None:
            dist.close()
    if dist is not None and dist.rank != 0:
        return 0
    if res.interrupted:
        print(f"interrupted at step {res.steps}; resume with: k3 rl --base {cfg.base} --out {res.out_dir} --resume",
              file=sys.stderr)
        return 130
    b, a = res.before, res.after
    print(f"done: {res.steps} steps in {res.out_dir}; held-out reward {b.get('reward', 0):.3f} -> "
          f"{a.get('reward', 0):.3f}, pass rate {b.get('pass_rate', 0):.1%} -> {a.get('pass_rate', 0):.1%}; "
          "mean thinking tokens " + ", ".join(f"{e} {a.get(f'think_{e}', 0):.1f}" for e in cfg.efforts)
          + f"; final checkpoint {res.out_dir}/final")
    return 0
