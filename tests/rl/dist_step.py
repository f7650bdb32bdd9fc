"""Helper of tests/rl/test_dist.py, run as one process or under torchrun: `k3 rl` for 2 steps on a fixed
base with length rewards (a random model never solves arithmetic); rank 0 writes the step losses, the
gradient norms and a checksum of the exported weights as JSON to OUT/result.json."""

import json
import os
import sys

import torch
from safetensors.torch import load_file

from k3.rl.dist import DistRL, wants_distributed
from k3.rl.effort import EffortConfig
from k3.rl.loop import RLConfig, RLTrainer
from k3.rl.rollout import RolloutConfig
from k3.train.metrics import read_metrics
from tests.rl.conftest import length_reward


def main(base: str, out: str) -> None:
    dist = DistRL("cpu") if wants_distributed() else None
    cfg = RLConfig(base=base, out=out, tasks=("math",), efforts=("low", "max"), max_steps=2, train_tasks=8,
                   eval_tasks=0, memory_budget_mb=32, device="cpu", plots=False, micro_batch_tokens=128,
                   effort=EffortConfig(multiples={"low": 1.0, "max": 2.0}, cap_factor=1.0),
                   rollout=RolloutConfig(group_size=2, batch_groups=2, threshold=0.5))
    trainer = RLTrainer(cfg, dist=dist)
    for t in trainer.train_tasks:
        t.score = length_reward
    trainer.run()
    if dist is None or dist.rank == 0:
        recs = [r for r in read_metrics(os.path.join(out, "metrics.jsonl")) if "event" not in r]
        sd = {}
        for f in sorted(os.listdir(os.path.join(out, "final"))):
            if f.endswith(".safetensors"):
                sd |= load_file(os.path.join(out, "final", f))
        res = {"loss": [r["loss"] for r in recs], "grad_norm": [r["grad_norm"] for r in recs],
               "train_tokens": [r["train_tokens"] for r in recs],
               "weights": {k: float(v.double().sum()) for k, v in sorted(sd.items()) if torch.is_floating_point(v)}}
        with open(os.path.join(out, "result.json"), "w") as fh:
            json.dump(res, fh)
    if dist is not None:
        dist.close()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1], sys.argv[2])
