"""End-to-end training on a tiny corpus: losses fall, resume continues the exact same curve, the
final checkpoint loads in `k3 generate`."""

import json
import os
import subprocess
import sys

import pytest
import torch

from k3.config import ConfigError
from k3.train.config import Stage, TrainConfig, lr_factor, stage_at
from k3.train.metrics import read_metrics
from k3.train.trainer import Trainer

MODEL = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "q_lora_rank": 64, "kv_lora_rank": 32,
         "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16, "num_experts": 8,
         "num_experts_per_token": 2, "moe_intermediate_size": 32, "routed_expert_hidden_size": 32,
         "linear_attn_config": {"num_heads": 2, "head_dim": 16}}


def _cfg(corpus, out, tmp_path, **kw):
    base = dict(data=str(corpus), out=str(out), max_steps=6, seed=0, deterministic=True, tokens_per_step=256,
                stages=[Stage(64, 0.5), Stage(128, 0.5)], eval_every=3, eval_tokens=512, eval_seq_len=64,
                save_every=100, warmup_steps=2, val_fraction=0.1, model=MODEL, cache_dir=str(tmp_path / "cache"),
                qb_bins=64)
    base.update(kw)
    return TrainConfig(**base)


def _losses(out):
    return [r["loss"] for r in read_metrics(str(out / "metrics.jsonl")) if "loss" in r]


def _interrupt_at(monkeypatch, step: int):
    """Make Trainer.train_step raise KeyboardInterrupt (Ctrl-C) at `step`; returns the real method."""
    real_step = Trainer.train_step

    def interrupting(self):
        if self.step == step:
            raise KeyboardInterrupt
        return real_step(self)

    monkeypatch.setattr(Trainer, "train_step", interrupting)
    return real_step


def test_resume_continues_the_same_curve(corpus, tmp_path, monkeypatch):
    full = Trainer(_cfg(corpus, tmp_path / "a", tmp_path)).run()
    assert full.steps == 6 and not full.interrupted
    recs = read_metrics(str(tmp_path / "a" / "metrics.jsonl"))
    assert [r["seq_len"] for r in recs if r.get("event") == "stage"] == [64, 128]
    assert any("val_loss" in r for r in recs) and (tmp_path / "a" / "loss.png").exists()

    real_step = _interrupt_at(monkeypatch, 4)
    cut = Trainer(_cfg(corpus, tmp_path / "b", tmp_path)).run()
    assert cut.interrupted and cut.steps == 4 and not (tmp_path / "b" / "final").exists()
    monkeypatch.setattr(Trainer, "train_step", real_step)
    resumed = Trainer(_cfg(corpus, tmp_path / "b", tmp_path), resume=True).run()
    assert resumed.steps == 6
    assert _losses(tmp_path / "b") == _losses(tmp_path / "a")  # bit-identical curve
    a = torch.load(tmp_path / "a" / "checkpoint" / "train_state.pt", weights_only=False)["model"]
    b = torch.load(tmp_path / "b" / "checkpoint" / "train_state.pt", weights_only=False)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("micro", [64, 128, 200])
def test_micro_batches_accumulate_to_the_whole_batch_step(corpus, tmp_path, micro):
    """Gradient accumulation: a step over micro-batches (64 tokens = 1 row, 128 = 2 rows, 200 = 3 + 1
    rows at seq_len 64) gives the same loss, gradients, update and balancing biases as one forward."""
    kw = dict(max_steps=1, stages=[Stage(64, 1.0)], eval_every=100)
    whole = Trainer(_cfg(corpus, tmp_path / "w", tmp_path, **kw))
    acc = Trainer(_cfg(corpus, tmp_path / f"m{micro}", tmp_path, micro_batch_tokens=micro, **kw))
    grads = {}
    for name, t in (("whole", whole), ("acc", acc)):
        step = t.opt.step
        t.opt.step = lambda t=t, name=name, step=step: (
            grads.__setitem__(name, {k: p.grad.clone() for k, p in t.model.named_parameters() if p.grad is not None}),
            step())
    ra, rb = whole.train_step(), acc.train_step()
    assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-5)
    assert grads["whole"].keys() == grads["acc"].keys()
    for k, g in grads["whole"].items():
        torch.testing.assert_close(grads["acc"][k], g, rtol=1e-4, atol=1e-6, msg=k)
    pa, pb = dict(whole.model.named_parameters()), dict(acc.model.named_parameters())
    for k in pa:
        torch.testing.assert_close(pb[k], pa[k], rtol=1e-4, atol=1e-5, msg=k)
    for k, b in whole.model.named_buffers():
        if k.endswith("e_score_correction_bias"):
            torch.testing.assert_close(dict(acc.model.named_buffers())[k], b, rtol=0, atol=1e-6, msg=k)


def test_fused_loss_trains_like_the_default(corpus, tmp_path, monkeypatch):
    """kernels.cross_entropy="triton" in the train config's model overrides (the fused linear +
    cross-entropy; the Triton interpreter on a CPU): a step over two
    micro-batches gives the default path's loss and gradients, and the validation loss (the fused
    forward under no_grad) agrees, to fp32 rounding."""
    from k3.model import fused

    calls = []
    real = fused.linear_cross_entropy
    monkeypatch.setattr(fused, "linear_cross_entropy", lambda *a, **k: calls.append(1) or real(*a, **k))
    kw = dict(max_steps=1, stages=[Stage(64, 1.0)], eval_every=100, micro_batch_tokens=128)
    res = {}
    for ce in ("torch", "triton"):
        t = Trainer(_cfg(corpus, tmp_path / ce, tmp_path, model=dict(MODEL, kernels={"cross_entropy": ce}), **kw))
        grads = {}
        step = t.opt.step
        t.opt.step = lambda t=t, step=step: (
            grads.update({k: p.grad.clone() for k, p in t.model.named_parameters() if p.grad is not None}), step())
        rec = t.train_step()
        res[ce] = (rec["loss"], grads, t.evaluate())
        assert bool(calls) == (ce == "triton")
    (la, ga, va), (lb, gb, vb) = res["torch"], res["triton"]
    assert lb == pytest.approx(la, rel=1e-6) and vb == pytest.approx(va, rel=1e-6)
    assert ga.keys() == gb.keys()
    for k, g in ga.items():
        torch.testing.assert_close(gb[k], g, rtol=1e-4, atol=1e-5 * g.abs().max().item() + 1e-8, msg=k)


def test_micro_batch_tokens_is_validated():
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        TrainConfig(tokens_per_step=256, stages=[Stage(64, 1.0)], micro_batch_tokens=512).validate()
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        TrainConfig(tokens_per_step=256, stages=[Stage(64, 1.0)], micro_batch_tokens=0).validate()


@pytest.mark.parametrize("preset,stages", [("k3-small", [8192, 32768, 65536]),
                                           ("kimi-k3", [8192, 65536, 262144, 1 << 20])])
def test_gpu_preset_recipes(preset, stages):
    """k3-small's single-GPU recipe and the full K3 schedule 8K -> 64K -> 256K -> 1M: valid, constant tokens
    per step, 64K / 1M-token micro-batches, compiled; explicit keys still win."""
    cfg = TrainConfig.from_dict({"preset": preset}).validate()
    assert [s.seq_len for s in cfg.stages] == stages
    assert cfg.micro_batch_tokens in (1 << 16, 1 << 20) and cfg.tokens_per_step % cfg.micro_batch_tokens == 0
    assert cfg.compile and cfg.eval_seq_len == 8192
    for T in stages:  # every stage's micro-batch holds whole rows
        assert cfg.micro_batch_tokens % T == 0 or T % cfg.micro_batch_tokens == 0
    assert TrainConfig.from_dict({"preset": preset, "compile": False, "max_steps": 7}).max_steps == 7


def test_validation_batches_stay_within_a_micro_batch(corpus, tmp_path, capsys):
    """With gradient accumulation a validation forward holds no more tokens than a training micro-batch
    (a whole-step validation batch would need the memory of the whole step); the data line says how
    many tokens the run reads."""
    t = Trainer(_cfg(corpus, tmp_path / "v", tmp_path, micro_batch_tokens=128, eval_seq_len=64))
    assert t.data.val_batches and all(b.num_tokens <= 128 for b in t.data.val_batches)
    printed = capsys.readouterr()
    assert "this run reads 1,536 tokens" in printed.out + printed.err


def test_trainer_logs_tflops(corpus, tmp_path):
    """Training lines carry the step's model TFLOP/s (per GPU); MFU only where the peak is known (not on a CPU)."""
    Trainer(_cfg(corpus, tmp_path / "f", tmp_path, max_steps=2)).run()
    lines = [r for r in read_metrics(str(tmp_path / "f" / "metrics.jsonl")) if "loss" in r]
    assert lines and all(r["tflops"] > 0 and "mfu" not in r for r in lines)


def test_resume_refuses_a_changed_config(corpus, tmp_path):
    Trainer(_cfg(corpus, tmp_path / "c", tmp_path, max_steps=2)).run()
    with pytest.raises(ValueError, match="lr"):
        Trainer(_cfg(corpus, tmp_path / "c", tmp_path, max_steps=2, lr=0.5), resume=True)


def test_schedule_helpers():
    cfg = TrainConfig(max_steps=100, warmup_steps=10, decay_fraction=0.2, min_lr_ratio=0.1, tokens_per_step=4096,
                      stages=[Stage(256, 0.7), Stage(1024, 0.2), Stage(4096, 0.1)])
    assert lr_factor(cfg, 0) == pytest.approx(0.1) and lr_factor(cfg, 50) == 1.0
    assert lr_factor(cfg, 99) == pytest.approx(0.1 + 0.9 * (1 / 20))
    assert [stage_at(cfg, s) for s in (0, 69, 70, 89, 90, 99)] == [0, 0, 1, 1, 2, 2]
    with pytest.raises(ValueError, match="stages"):
        TrainConfig(stages=[Stage(100, 1.0)]).validate()


def test_cli_train_then_generate(corpus, tmp_path):
    cfg = tmp_path / "over.json"
    cfg.write_text(json.dumps({"model": MODEL, "tokens_per_step": 256, "stages": [{"seq_len": 64, "fraction": 1.0}],
                               "eval_every": 2, "eval_tokens": 256, "eval_seq_len": 64, "val_fraction": 0.1,
                               "cache_dir": str(tmp_path / "cache")}))
    out = tmp_path / "run"
    run = subprocess.run([sys.executable, "-m", "k3", "train", "--data", str(corpus), "--out", str(out),
                          "--max-steps", "3", "--config", str(cfg)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert (out / "final" / "config.json").exists() and (out / "final" / "tokenizer.json").exists()
    gen = subprocess.run([sys.executable, "-m", "k3", "generate", "--checkpoint", str(out / "final"), "--prompt",
                          "def ", "--max-new-tokens", "5", "--seed", "0"], capture_output=True, text=True, timeout=300)
    assert gen.returncode == 0, gen.stderr[-2000:]
    assert gen.stdout.startswith("def ")


def test_cli_resume_needs_only_the_run_directory(corpus, tmp_path):
    """`k3 train --out DIR --resume` continues with the run's own config (saved as DIR/train_config.json):
    no need to repeat --data / --config / --preset; an explicit flag that changes the config is refused."""
    over = tmp_path / "over.json"
    over.write_text(json.dumps({"model": MODEL, "tokens_per_step": 256, "stages": [{"seq_len": 64, "fraction": 1.0}],
                                "eval_every": 2, "eval_tokens": 256, "eval_seq_len": 64, "val_fraction": 0.1,
                                "save_every": 2, "cache_dir": str(tmp_path / "cache")}))
    out = tmp_path / "run"
    first = subprocess.run([sys.executable, "-m", "k3", "train", "--data", str(corpus), "--out", str(out),
                            "--max-steps", "2", "--config", str(over)], capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    saved = json.loads((out / "train_config.json").read_text())
    assert saved["data"] == str(corpus) and saved["model"] == MODEL and saved["max_steps"] == 2
    again = subprocess.run([sys.executable, "-m", "k3", "train", "--out", str(out), "--resume"],
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resumed from" in again.stderr + again.stdout and "done: 2 steps" in again.stdout
    changed = subprocess.run([sys.executable, "-m", "k3", "train", "--out", str(out), "--resume", "--seed", "5"],
                             capture_output=True, text=True, timeout=300)
    assert changed.returncode == 2 and "error: cannot resume" in changed.stderr and "seed" in changed.stderr
    assert "Traceback" not in changed.stderr
    nothing = subprocess.run([sys.executable, "-m", "k3", "train", "--out", str(tmp_path / "none"), "--resume",
                              "--config", str(over), "--data", str(corpus)], capture_output=True, text=True, timeout=300)
    assert nothing.returncode == 2 and "nothing to resume" in nothing.stderr and "Traceback" not in nothing.stderr
    assert not (tmp_path / "none").exists()  # refused before anything was written


@pytest.mark.parametrize("argv,message", [
    (["--config", "{cfg}"], "train config lr=-1: learning rates must be positive"),
    (["--data", "{missing}"], "no such file or folder"),
    (["--preset", "nope"], "unknown preset 'nope'"),
    (["--config", "{tmp}"], "Is a directory"),
    (["--config", "{missing}"], "No such file or directory"),
])
def test_cli_bad_input_is_a_message_and_leaves_nothing(tmp_path, argv, message):
    cfg = tmp_path / "bad.json"
    cfg.write_text(json.dumps({"lr": -1}))
    argv = [a.format(cfg=cfg, missing=tmp_path / "missing", tmp=tmp_path) for a in argv]
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "k3", "train", "--out", str(out), *argv], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2 and "error: " in r.stderr and message in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and not out.exists()


def test_a_preset_too_large_for_the_machine_is_refused_before_any_work(tmp_path):
    """kimi-k3's training state (~41 TiB) on this machine: a clear error naming the sizes and the way out
    (exit code 2, no traceback), and nothing written."""
    out = tmp_path / "big"
    r = subprocess.run([sys.executable, "-m", "k3", "train", "--preset", "kimi-k3", "--out", str(out),
                        "--device", "cpu"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "error: preset 'kimi-k3'" in r.stderr and "GiB" in r.stderr and "torchrun" in r.stderr
    assert "Traceback" not in r.stderr and not out.exists()


def test_gpu_recipe_on_a_cpu_is_announced():
    """k3-small's 512K-token steps on a CPU: one line up front saying what a step costs there; k3-tiny: none."""
    from types import SimpleNamespace

    from k3.config import get_preset
    from k3.model.causal_lm import K3ForCausalLM

    for preset, expect in (("k3-small", True), ("k3-tiny", False)):
        msgs: list[str] = []
        cfg = TrainConfig.from_dict({"preset": preset})
        with torch.device("meta"):
            active = K3ForCausalLM(get_preset(preset)).num_parameters()[1]
        fake = SimpleNamespace(model_config=get_preset(preset), cfg=cfg, num_params=(0, active),
                               progress=SimpleNamespace(message=msgs.append))
        Trainer._warn_slow_cpu_steps(fake)
        assert bool(msgs) == expect, msgs
        if expect:
            assert "524,288 tokens" in msgs[0] and "GPU recipe" in msgs[0]


@pytest.mark.parametrize("overrides,message", [
    ({"val_fraction": 0.2, "eval_seq_len": 4096}, "the validation split has"),
    ({"val_fraction": 0.2, "tokens_per_step": 65536}, "a step of the 128-token stage needs 512"),
])
def test_a_corpus_too_small_for_the_recipe_is_refused_up_front(tmp_path, overrides, message):
    """Every stage's step and one validation row must fit the splits; checked before training, so a long
    run cannot stop at its stage switch (exit code 2, no traceback, nothing written)."""
    data = tmp_path / "data"
    data.mkdir()
    for i in range(10):
        (data / f"f{i}.py").write_text("".join(f"def f{i}_{j}(x):\n    return x * {j}\n" for j in range(40)))
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(overrides))
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "k3", "train", "--data", str(data), "--config", str(cfg), "--out",
                        str(out)], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "HOME": str(tmp_path)})
    assert r.returncode == 2 and message in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and not out.exists()


def test_cpu_bf16_is_close_to_fp32_and_resumes_exactly(corpus, tmp_path, monkeypatch):
    """`cpu_bf16` (bf16 autocast + bf16 Newton-Schulz on the CPU): the first loss is the fp32 one up to
    bf16 rounding, both runs learn, and paused-and-resumed == uninterrupted bit for bit."""
    kw = dict(max_steps=4, stages=[Stage(64, 1.0)], eval_every=100)
    fp32 = Trainer(_cfg(corpus, tmp_path / "f", tmp_path, **kw)).run()
    full = Trainer(_cfg(corpus, tmp_path / "a", tmp_path, cpu_bf16=True, **kw)).run()
    assert fp32.steps == full.steps == 4
    la, lf = _losses(tmp_path / "a"), _losses(tmp_path / "f")
    assert la[0] == pytest.approx(lf[0], rel=2e-2) and la[-1] < la[0]
    real_step = _interrupt_at(monkeypatch, 2)
    assert Trainer(_cfg(corpus, tmp_path / "b", tmp_path, cpu_bf16=True, **kw)).run().interrupted
    monkeypatch.setattr(Trainer, "train_step", real_step)
    assert Trainer(_cfg(corpus, tmp_path / "b", tmp_path, cpu_bf16=True, **kw), resume=True).run().steps == 4
    assert _losses(tmp_path / "b") == la


def test_cpu_bf16_must_be_a_bool(corpus, tmp_path):
    with pytest.raises(ConfigError, match="cpu_bf16"):
        _cfg(corpus, tmp_path / "x", tmp_path, cpu_bf16="yes").validate()
