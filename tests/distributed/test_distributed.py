"""Distributed training on CPU with gloo and 2 processes (torchrun subprocesses): every check
compares against one process on the same global batch. Fixed ports per test."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from k3.train.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
WORKERS = Path(__file__).with_name("workers.py")
MODEL = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "q_lora_rank": 64, "kv_lora_rank": 32,
         "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16, "num_experts": 8,
         "num_experts_per_token": 2, "moe_intermediate_size": 32, "routed_expert_hidden_size": 32,
         "linear_attn_config": {"num_heads": 2, "head_dim": 16}}


def _env():
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def torchrun(args, port, nproc=2, timeout=240):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(port)]
    r = subprocess.run(cmd + [str(a) for a in args], cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    return r.stdout


@pytest.mark.parametrize("check,port", [("fsdp", 29611), ("ep", 29612), ("cp", 29613)])
def test_equals_one_process(check, port):
    """fsdp: loss, every gradient, clipping, two optimizer steps and the full-state round trip.
    ep: plain EP and MoonEP == dense experts forward/backward (skewed router, exact S*K per rank,
    redundant copies planned), then a whole model with EP + FSDP == one process.
    cp: a whole model with CP + FSDP == one process on rows whose documents cross the segment
    edge (also inside the conv halo) or start exactly at it."""
    assert f"OK {check}" in torchrun([WORKERS, check], port)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    words = ["def", "return", "self", "import", "class", "for", "in", "if", "else", "print"]
    import random
    rnd = random.Random(0)
    for i in range(40):
        (d / f"f{i}.py").write_text(" ".join(rnd.choice(words) for _ in range(300)) + "\n")
    return d


def _train(corpus, tmp_path, name, flags, port=None):
    tmp_path.mkdir(exist_ok=True)
    cfg = dict(tokens_per_step=256, stages=[{"seq_len": 64, "fraction": 1.0}], eval_every=100, eval_tokens=256,
               eval_seq_len=64, save_every=100, warmup_steps=2, val_fraction=0.1, model=MODEL,
               cache_dir=str(tmp_path / "cache"), qb_bins=64, cpu_bf16=False)  # fp32: compare like with like
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    out = tmp_path / name
    args = ["-m", "k3", "train", "--preset", "k3-tiny", "--max-steps", 4, "--seed", 0, "--deterministic",
            "--config", tmp_path / "cfg.json", "--data", corpus, "--out", out, *flags]
    if port is None:
        r = subprocess.run([sys.executable] + [str(a) for a in args], cwd=ROOT, env=_env(), capture_output=True,
                           text=True, timeout=240)
        assert r.returncode == 0, r.stderr[-4000:]
    else:
        torchrun(args, port)
    return [r["loss"] for r in read_metrics(str(out / "metrics.jsonl")) if "loss" in r]


@pytest.fixture(scope="module")
def one_process(corpus, tmp_path_factory):
    """The single-process run (--ep/--cp are no-ops without torchrun, so it serves every flag)."""
    return _train(corpus, tmp_path_factory.mktemp("one"), "one", [])


@pytest.mark.parametrize("flags,port", [([], 29621), (["--ep", "2"], 29622), (["--cp", "2"], 29623),
                                        (["--micro-batch-tokens", "128"], 29624)])
def test_torchrun_train_matches_one_process(corpus, one_process, tmp_path, flags, port):
    two = _train(corpus, tmp_path, "two", flags, port=port)
    assert len(one_process) == len(two) == 4
    for a, b in zip(one_process, two):
        assert abs(a - b) <= 2e-3 * abs(a), (one_process, two)
    assert (tmp_path / "two" / "final" / "config.json").exists()
    recs = read_metrics(str(tmp_path / "two" / "metrics.jsonl"))
    if "--ep" in flags:
        assert all(r["ep_load_balanced"] == 1.0 and r["ep_load_plain"] >= 1.0 for r in recs if "loss" in r)
        # the 2-rank sharded (DCP) checkpoint resumes in one process with the identical model
        from k3.train.config import TrainConfig
        from k3.train.trainer import Trainer
        cfg = json.loads((tmp_path / "cfg.json").read_text())
        cfg.update(preset="k3-tiny", max_steps=4, seed=0, deterministic=True, data=str(corpus),
                   out=str(tmp_path / "two"))
        t = Trainer(TrainConfig.from_dict(cfg), resume=True)
        assert t.step == 4 and t.evaluate() == pytest.approx(recs[-1]["val_loss"], rel=1e-6)
        t.log.close()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_save_two_ranks_load_one(tmp_path):
    """Sharded DCP checkpoint from EP + FSDP on 2 ranks -> one process without a process group:
    the same loss at the checkpoint, the same loss after one more optimizer step (optimizer state
    restored), and the official-format export loads with from_pretrained to the same loss."""
    sys.path.insert(0, str(WORKERS.parent))
    import workers
    from k3.distributed.checkpoint import export_official, load_dcp
    from k3.model.causal_lm import K3ForCausalLM
    from k3.optim import HeadGeometry, PerHeadMuon, build_param_groups

    ckpt = tmp_path / "dcp"
    torchrun([WORKERS, "dcp", ckpt], 29631)
    first, second, third = json.loads((ckpt / "losses.json").read_text())
    model = workers.tiny_model()
    opt = PerHeadMuon(build_param_groups(model, HeadGeometry.from_config(model.config.text_config), lr=1e-2,
                                         weight_decay=0.1))
    load_dcp(ckpt, model, opt)
    ids, labels, cu, _ = workers.batch()
    loss = model(ids, labels=labels, cu_seqlens=cu).loss
    assert abs(loss.item() - second) <= 1e-5 * second, (loss.item(), first, second)
    loss.backward()
    opt.step()
    after = model(ids, labels=labels, cu_seqlens=cu).loss.item()
    assert abs(after - third) <= 1e-4 * third, (after, third)
    export_official(ckpt, tmp_path / "official", workers.tiny_model().config)
    again = K3ForCausalLM.from_pretrained(tmp_path / "official", dtype="float32")
    assert abs(again(ids, labels=labels, cu_seqlens=cu).loss.item() - second) <= 1e-5 * second
