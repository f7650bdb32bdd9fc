"""`k3 distill`: multi-teacher on-policy distillation of specialist teachers into one student
(docs/distill.md)."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("distill", help="merge (domain, effort) teachers into one student by on-policy distillation")
    p.add_argument("--student", required=True, help="student checkpoint directory (official layout + tokenizer)")
    p.add_argument("--teacher", action="append", default=[], metavar="DOMAIN:EFFORT=DIR[@WEIGHT]",
                   help="a teacher for one (domain, effort), e.g. math:low=runs/t/final@2; DIR may be "
                        "http://host:port/v1#model (a vLLM-style endpoint returning prompt top-k log-probs). Repeat.")
    p.add_argument("--out", default="runs/distill", help="output directory")
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--group-size", type=int, default=None, help="student samples per (task, effort)")
    p.add_argument("--batch-groups", type=int, default=None, help="groups per training batch")
    p.add_argument("--no-partial", action="store_true", help="wait for every attempt of the batch")
    p.add_argument("--lr", type=float, default=None, help="Muon learning rate")
    p.add_argument("--eval-tasks", type=int, default=None, help="held-out tasks per domain")
    p.add_argument("--eval-group", type=int, default=None, help="held-out samples per task")
    p.add_argument("--no-teacher-eval", action="store_true", help="skip the teachers' held-out evaluation")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default 1 on CPU)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")
    p.set_defaults(func=run)


def build_config(args: argparse.Namespace):
    from k3.distill.loop import DistillConfig
    from k3.distill.teachers import parse_teacher

    cfg = DistillConfig(student=args.student, out=args.out, teachers=[parse_teacher(t) for t in args.teacher])
    for key in ("max_steps", "seed", "device", "lr", "eval_tasks", "eval_group", "threads"):
        if getattr(args, key) is not None:
            setattr(cfg, key, getattr(args, key))
    if args.group_size is not None:
        cfg.rollout.group_size = args.group_size
    if args.batch_groups is not None:
        cfg.rollout.batch_groups = args.batch_groups
    cfg.rollout.partial = not args.no_partial
    cfg.eval_teachers = not args.no_teacher_eval
    cfg.rollout.seed = cfg.seed
    return cfg.validate()


def run(args: argparse.Namespace) -> int:
    from k3.cli.rl import sandbox_runner
    from k3.distill.loop import DistillTrainer

    import os

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        print("k3 distill: error: runs in one process (torchrun is supported by k3 rl's trainer only)", file=sys.stderr)
        return 2
    try:
        cfg = build_config(args)
        runner = sandbox_runner() if any(t.domain == "code" for t in cfg.teachers) else None
        trainer = DistillTrainer(cfg, resume=args.resume, runner=runner)
    except ValueError as e:  # bad teachers / tokenizers / task domains: one line, nothing started
        print(f"k3 distill: error: {e}", file=sys.stderr)
        return 2
    res = trainer.run()
    if res.interrupted:
        print(f"interrupted at step {res.steps}; resume with the same command and --resume", file=sys.stderr)
        return 130
    print(f"done: {res.steps} steps in {res.out_dir}; final checkpoint {res.out_dir}/final")
    print(format_table(res.teachers, res.before, res.after))
    return 0


def format_table(teachers: dict, before: dict, after: dict) -> str:
    """Held-out reward and thinking tokens per (domain, effort): teacher, student before, student after
    (± standard errors clustered by task; the ratio's paired by task, k3.distill.batch.paired_ratio, or
    from the two marginal errors when per-task rewards are absent)."""
    from k3.distill.batch import paired_ratio

    nan = float("nan")
    rows = ["| teacher | teacher reward | student before | student after | after/teacher | "
            "think teacher | think before | think after |", "|---|---|---|---|---|---|---|---|"]
    for name in sorted(set(teachers) | set(after)):
        t, b, a = teachers.get(name, {}), before.get(name, {}), after.get(name, {})
        tr, ar = t.get("reward", nan), a.get("reward", nan)
        ratio = ar / tr if tr == tr and tr > 0 else nan
        rse = ratio * ((a.get("reward_se", nan) / ar) ** 2 + (t.get("reward_se", nan) / tr) ** 2) ** 0.5 \
            if ratio == ratio and ar > 0 else nan
        if t.get("task_reward") and a.get("task_reward"):
            ratio, rse = paired_ratio(t, a)
        pm = lambda d, k, f: f"{d.get(k, nan):{f}} ± {d.get(k + '_se', nan):{f}}"  # noqa: E731
        rows.append(f"| {name} | {pm(t, 'reward', '.3f')} | {pm(b, 'reward', '.3f')} | {pm(a, 'reward', '.3f')} | "
                    f"{ratio:.0%} ± {rse:.0%} | {pm(t, 'think', '.1f')} | {pm(b, 'think', '.1f')} | "
                    f"{pm(a, 'think', '.1f')} |")
    return "\n".join(rows)
