"""SFT through the trainer: the loss equals pre-training's on an all-ones mask, paused-and-resumed equals
uninterrupted, a run writes the trainer's outputs plus the behavioural evaluation of base and result."""

import json

import numpy as np
import torch

from k3.data.loader import collate_rows
from k3.data.packing import PackedRows, TokenStream
from k3.model.causal_lm import K3ForCausalLM
from k3.sft.config import SFTConfig
from k3.sft.loop import SFTTrainer, sft
from k3.sft.packing import collate, pack, targets_from_mask
from k3.train.metrics import read_metrics


def _cfg(base, out, **kw):
    d = dict(base=str(base), out=str(out), max_steps=4, seed=0, deterministic=True, tokens_per_step=1024,
             stages=[{"seq_len": 512, "fraction": 1.0}], eval_every=2, save_every=100, warmup_steps=1,
             worlds=["keys"], world_tasks=3, instruct_items=12, val_conversations=4, eval_tool_turns=2, eval_instruct_items=2,
             eval_episodes=1, eval_max_turns=2, eval_max_new_tokens=4, qb_bins=64)
    d.update(kw)
    return SFTConfig.from_dict(d).validate()


def test_all_ones_mask_is_the_pretraining_loss(base_dir, tokenizer):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 256, n).tolist() for n in (40, 25)]
    eos = tokenizer.eos_id
    stream = TokenStream.from_token_lists(docs, eos_id=eos, vocab_size=512)
    pre = collate_rows(PackedRows(stream, stream.num_tokens - 1), [0])
    sft_docs = [targets_from_mask(d + [eos], [1] * (len(d) + 1)) for d in docs]
    ours = collate(pack(sft_docs, 67, tokenizer.pad_id), [0])
    model = K3ForCausalLM.from_pretrained(base_dir, dtype="float32").eval()
    n = pre.num_tokens
    assert torch.equal(ours.input_ids[:, :n], pre.input_ids) and torch.equal(ours.labels[:, :n], pre.labels)
    assert ours.num_targets == pre.num_targets and (ours.labels[:, n:] == -100).all()
    with torch.no_grad():
        a = model(pre.input_ids, labels=pre.labels, cu_seqlens=pre.cu_seqlens, return_logits=False).loss
        b = model(ours.input_ids, labels=ours.labels, cu_seqlens=ours.cu_seqlens, return_logits=False).loss
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def _losses(out):
    return [r["loss"] for r in read_metrics(str(out / "metrics.jsonl")) if "loss" in r]


def test_run_outputs_and_resume_exactness(base_dir, tmp_path, worlds, monkeypatch):
    result, behaviour = sft(_cfg(base_dir, tmp_path / "a"))
    a = tmp_path / "a"
    assert result.steps == 4 and (a / "final" / "config.json").exists() and (a / "final" / "tokenizer.json").exists()
    assert (a / "loss.png").exists() and (a / "checkpoint" / "train_state.pt").exists()
    recs = read_metrics(str(a / "metrics.jsonl"))
    beh = [r for r in recs if "behaviour" in r]
    assert [r["step"] for r in beh] == [0, 4] == [b["step"] for b in behaviour]
    for r in beh:
        assert r["behaviour"]["tool_calls"]["n"] == 2 and r["behaviour"]["instruct"]["n"] == 2
        assert r["behaviour"]["episodes"]["n"] == 1 and r["behaviour"]["episodes"]["errors"] == 0
        # the default mix lists low three times: each distinct effort is measured once, in order
        assert list(r["behaviour"]["thinking"]["mean_think_tokens"]) == ["low", "high", "max"]
    assert json.loads((a / "train_config.json").read_text())["base"] == str(base_dir)
    K3ForCausalLM.from_pretrained(a / "final")  # the official format loads

    real_step = SFTTrainer.train_step

    def interrupting(self):
        if self.step == 2:
            raise KeyboardInterrupt
        return real_step(self)

    monkeypatch.setattr(SFTTrainer, "train_step", interrupting)
    cut, _ = sft(_cfg(base_dir, tmp_path / "b", eval_base=False))
    assert cut.interrupted and cut.steps == 2
    monkeypatch.setattr(SFTTrainer, "train_step", real_step)
    resumed, _ = sft(_cfg(base_dir, tmp_path / "b", eval_base=False), resume=True)
    assert resumed.steps == 4
    assert _losses(tmp_path / "b") == _losses(a)  # bit-identical curve
    sa = torch.load(a / "checkpoint" / "train_state.pt", weights_only=False)["model"]
    sb = torch.load(tmp_path / "b" / "checkpoint" / "train_state.pt", weights_only=False)["model"]
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_eval_only_scores_a_checkpoint_without_training(base_dir, tmp_path, worlds, capsys):
    """`k3 sft --base DIR --eval-only`: the held-out record of the checkpoint alone (the config's eval keys),
    a summary line and the JSON record; nothing is trained or written."""
    from k3.cli import build_parser

    cfg = tmp_path / "eval.json"
    cfg.write_text(json.dumps({"worlds": ["keys"], "eval_tool_turns": 3, "eval_instruct_items": 2, "eval_episodes": 1,
                               "eval_max_turns": 2, "eval_max_new_tokens": 4, "eval_effort_prompts": 2,
                               "eval_effort_max_new_tokens": 4}))
    out = tmp_path / "nothing"
    args = build_parser().parse_args(["sft", "--base", str(base_dir), "--eval-only", "--config", str(cfg),
                                      "--out", str(out), "--device", "cpu"])
    assert args.func(args) == 0
    summary, record = capsys.readouterr().out.strip().splitlines()[-2:]
    rec = json.loads(record)
    assert summary.startswith(f"{base_dir}: tool-call valid") and rec["tool_calls"]["n"] == 3
    assert rec["instruct"]["n"] == 2 and rec["episodes"]["n"] == 1
    assert list(rec["thinking"]["mean_think_tokens"]) == ["low", "high", "max"]
    assert not out.exists()
