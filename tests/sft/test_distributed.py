"""The SFT data path under torchrun (gloo, 2 CPU processes, FSDP2): the same losses as one process."""

import json
import os
import subprocess
import sys
from pathlib import Path

from k3.train.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]


def _env():
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def _sft(base, data, out, torchrun):
    pre = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29671"] \
        if torchrun else [sys.executable]
    args = ["-m", "k3", "sft", "--base", str(base), "--data", str(data), "--out", str(out), "--max-steps", "2",
            "--deterministic", "--device", "cpu", "--no-eval-base", "--config", str(data.with_suffix(".cfg.json"))]
    r = subprocess.run(pre + args, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-4000:]
    return [x["loss"] for x in read_metrics(str(out / "metrics.jsonl")) if "loss" in x]


def test_torchrun_sft_matches_one_process(base_dir, tmp_path):
    convs = [{"messages": [{"role": "user", "content": f"Say {w}"},
                           {"role": "assistant", "reasoning_content": "Easy.", "content": f"{w} {w}"}]}
             for w in ("owls", "bees", "tea", "kites", "maps", "honey", "clocks", "rivers")] * 3
    data = tmp_path / "c.jsonl"
    data.write_text("\n".join(json.dumps(c) for c in convs) + "\n")
    cfg = {"tokens_per_step": 2048, "stages": [{"seq_len": 1024, "fraction": 1.0}], "warmup_steps": 1,
           "eval_every": 100, "eval_instruct_items": 0, "eval_tool_turns": 0, "eval_episodes": 0, "qb_bins": 64,
           "decision_weight": 1.0}  # torchrun trains unweighted (k3.sft.weights): compare like with like
    data.with_suffix(".cfg.json").write_text(json.dumps(cfg))
    one = _sft(base_dir, data, tmp_path / "one", torchrun=False)
    two = _sft(base_dir, data, tmp_path / "two", torchrun=True)
    assert len(one) == len(two) == 2
    for a, b in zip(one, two):
        assert abs(a - b) <= 2e-3 * abs(a), (one, two)
    assert (tmp_path / "two" / "final" / "config.json").exists()
