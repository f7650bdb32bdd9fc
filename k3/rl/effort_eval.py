"""Does a policy's thinking length follow the requested effort by itself, or only through the caps?

`k3 rl` samples each effort up to its own cap (cap_factor·m_e·b), so a model that never stops shows
low < high < max thinking just from the caps. This evaluation samples the held-out math tasks at
every effort with a cap far above what the model writes (`--cap-factor`, default 8: caps 8b / 16b /
32b), so only the effort message in the prompt can separate the lengths; it reports mean thinking
and answer tokens per effort with standard errors clustered by task, and the share of attempts cut
at the cap.

    python -m k3.rl.effort_eval DIR [DIR ...] [--kind math|worlds] [--tasks 32] [--group 4] [--cap-factor 8]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from k3.data.tokenizer import load_tokenizer
from k3.model.causal_lm import K3ForCausalLM
from k3.rl.batch import rollout_stats
from k3.rl.effort import EFFORTS, BudgetTracker, EffortConfig, parse_efforts
from k3.rl.rollout import RolloutConfig, RolloutManager
from k3.rl.tasks import build_tasks
from k3.serve.engine import Engine, EngineConfig


def effort_lengths(checkpoint: str, tasks: int = 32, group: int = 4, cap_factor: float = 8.0, seed: int = 0,
                   efforts: tuple[str, ...] = EFFORTS, kind: str = "math") -> dict[str, float]:
    """Held-out stats (k3.rl.batch.rollout_stats) plus `capped_<effort>`: the share of attempts that
    reached the sampling cap. Same held-out seeds and sampling seeds as `k3 rl`'s evaluation; kind:
    the held-out task kind ("math" or "worlds", the embedded lookup world)."""
    tok = load_tokenizer(checkpoint)
    model = K3ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    engine = Engine(model, tok, EngineConfig(memory_budget_bytes=256 << 20, page_size=16, unit_size=16,
                                             max_running=256))
    held = build_tasks((kind,), "heldout", tasks, math_levels=(1, 2), math_partial=0.5, tool_partial=0.5)
    rc = RolloutConfig(group_size=group, batch_groups=len(held) * len(efforts), partial=False, seed=10_000 + seed)
    mgr = RolloutManager(engine, tok, rc, EffortConfig(cap_factor=cap_factor), BudgetTracker(min_samples=10**9))
    groups = mgr.collect(iter([(t, e) for t in held for e in efforts]))
    rec = rollout_stats(groups, efforts)
    for e in efforts:
        atts = [a for g in groups if g.effort == e for a in g.attempts]
        rec[f"capped_{e}"] = sum(a.generated >= a.cap for a in atts) / max(1, len(atts))
    return rec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoints", nargs="+")
    p.add_argument("--kind", choices=("math", "worlds"), default="math", help="held-out task kind")
    p.add_argument("--efforts", default="low,high,max", help="comma-separated subset of low,high,max")
    p.add_argument("--tasks", type=int, default=32)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--cap-factor", type=float, default=8.0)
    args = p.parse_args(argv)
    try:
        efforts = parse_efforts(args.efforts)
    except ValueError as e:
        p.error(str(e))
    torch.set_num_threads(1)
    cols = " / ".join(efforts)
    print(f"| checkpoint | kind | cap factor | reward (± se) | pass | thinking {cols} (± se) | answer {cols} | "
          f"capped {cols} |")
    print("|---|---|---|---|---|---|---|---|")
    for ck in args.checkpoints:
        r = effort_lengths(ck, args.tasks, args.group, args.cap_factor, efforts=efforts, kind=args.kind)
        think = " / ".join(f"{r[f'think_{e}']:.1f} ± {r.get(f'think_se_{e}', float('nan')):.1f}" for e in efforts)
        ans = " / ".join(f"{r[f'answer_{e}']:.1f}" for e in efforts)
        cap = " / ".join(f"{r[f'capped_{e}']:.0%}" for e in efforts)
        reward = f"{r['reward']:.3f} ± {r.get('reward_se', float('nan')):.3f}"
        print(f"| {ck} | {args.kind} | {args.cap_factor:g} | {reward} | "
              f"{r['pass_rate']:.1%} | {think} | {ans} | {cap} |", flush=True)
        print(json.dumps({"checkpoint": ck, "kind": args.kind, "cap_factor": args.cap_factor} | r), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
