"""`k3 rl` under torchrun (gloo, 2 CPU processes): trainer FSDP2-sharded, rollouts on rank 0, weights
gathered into rank 0's engine after each update. Two steps give the losses, gradient norms and
exported weights of one process (the micro-batches are split over the ranks)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.rl.conftest import tiny_model

ROOT = Path(__file__).resolve().parents[2]


def _env():
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def _run(base, out, torchrun):
    pre = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29673"] \
        if torchrun else [sys.executable]
    r = subprocess.run(pre + [str(ROOT / "tests" / "rl" / "dist_step.py"), str(base), str(out)], cwd=ROOT,
                       env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-4000:]
    return json.loads((out / "result.json").read_text())


def test_torchrun_rl_matches_one_process(tokenizer, tmp_path):
    base = tmp_path / "base"
    tiny_model(tokenizer, seed=2).save_pretrained(base, dtype="float32")
    tokenizer.save(base)
    one = _run(base, tmp_path / "one", torchrun=False)
    two = _run(base, tmp_path / "two", torchrun=True)
    assert len(one["loss"]) == len(two["loss"]) == 2
    assert one["train_tokens"] == two["train_tokens"]  # the same rollouts were trained on
    assert any(g > 0 for g in one["grad_norm"])        # the steps did update
    for a, b in zip(one["loss"] + one["grad_norm"], two["loss"] + two["grad_norm"]):
        assert b == pytest.approx(a, rel=2e-3, abs=1e-6), (one, two)
    assert one["weights"].keys() == two["weights"].keys()
    for k, v in one["weights"].items():
        assert two["weights"][k] == pytest.approx(v, rel=1e-4, abs=1e-3), k
