"""QAT as a later training stage (as K3 does it, from SFT on): continue a finished `k3 train` run for
--steps more optimizer steps from its last checkpoint, with or without MXFP4 fake quantisation, so that
bf16, PTQ-MXFP4 and QAT-MXFP4 models share the same pre-training.

    python bench/qat_finetune.py --run runs/x --out runs/x-qat --steps 10 --qat mxfp4
    python bench/qat_finetune.py --run runs/x --out runs/x-cont --steps 10          # the bf16 control
    k3 quantize --checkpoint runs/x-cont/final --out runs/x-ptq --format mxfp4 --eval-run runs/x-cont
    k3 quantize --checkpoint runs/x-qat/final --eval-run runs/x-qat

The continuation reuses the run's config (max_steps raised by --steps, same learning-rate schedule
otherwise), its model, optimizer, balancer and data-loader state; `final/` of the QAT continuation holds
packed MXFP4 experts.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from k3.train.config import TrainConfig  # noqa: E402
from k3.train.state import load_run_config, load_state  # noqa: E402
from k3.train.trainer import Trainer  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, help="a finished k3 train run directory")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--qat", default=None, help="mxfp4 or mxfp4,mxfp8 (default: no QAT, the control)")
    args = ap.parse_args(argv)
    d = load_run_config(args.run)
    if d is None:
        print(f"error: no run in {args.run}", file=sys.stderr)
        return 2
    st = load_state(str(Path(args.run) / "checkpoint"))
    cfg = TrainConfig.from_dict(d | {"out": args.out, "max_steps": st["step"] + args.steps, "qat": args.qat,
                                     "eval_every": args.steps})
    trainer = Trainer(cfg)
    trainer.model.load_state_dict(st["model"])
    trainer.opt.load_state_dict(st["optimizer"])
    trainer.qb.load_state_dict(st["qb"])
    trainer.data.loader.load_state_dict(st["loader"])
    trainer.step, trainer.stage, trainer.val_history = st["step"], -1, list(st["val_history"])
    res = trainer.run()
    print(f"done: steps {st['step']} -> {res.steps}, val loss {res.last_val_loss:.4f}; {args.out}/final")
    return 0


if __name__ == "__main__":
    sys.exit(main())
