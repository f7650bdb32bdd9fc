"""`k3 train-draft` smoke run on a random k3-tiny checkpoint (CPU): the target's continuations are
generated, metrics / loss plot / checkpoint / final draft are written, a resumed run ends bit-identical
to an uninterrupted one, and the trained draft serves with a measured acceptance length."""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import load_file

from k3.cli import main
from k3.config import k3_tiny
from k3.data.tokenizer import train_bpe_tokenizer
from k3.draft.loop import DraftTrainConfig, DraftTrainer
from k3.model.causal_lm import K3ForCausalLM
from k3.model.draft import load_draft
from k3.serve.engine import Engine, EngineConfig
from k3.serve.sampling import SamplingParams

WORDS = "the quick brown fox jumps over a lazy dog while data flows through the model cache".split()


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(target dir with weights + tokenizer, a .jsonl corpus of prompts)."""
    root = tmp_path_factory.mktemp("draft")
    rng = random.Random(0)
    docs = [" ".join(rng.choice(WORDS) for _ in range(80)) for _ in range(40)]
    tok = train_bpe_tokenizer(docs, 512)
    torch.manual_seed(0)
    target = K3ForCausalLM(k3_tiny()).init_weights(seed=0)
    target.save_pretrained(root / "target")
    tok.save(root / "target")
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return str(root / "target"), str(corpus)


def _cfg(target: str, corpus: str, out: str, **kw) -> DraftTrainConfig:
    base = dict(target=target, out=out, data=corpus, max_steps=4, batch_size=2, lr=3e-3, warmup_steps=2,
                ttt_steps=2, num_prompts=6, val_prompts=3, prompt_len=8, gen_len=10, eval_every=2, save_every=2,
                draft={"intermediate_size": 256})
    return DraftTrainConfig(**(base | kw))


def test_train_draft_cli_writes_metrics_checkpoint_and_a_servable_draft(setup, tmp_path, capsys):
    target, corpus = setup
    out = tmp_path / "run"
    rc = main(["train-draft", "--target", target, "--data", corpus, "--out", str(out), "--max-steps", "4",
               "--batch-size", "2", "--ttt-steps", "2", "--num-prompts", "6", "--val-prompts", "3",
               "--prompt-len", "8", "--gen-len", "10", "--eval-every", "2", "--save-every", "2"])
    assert rc == 0
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if "loss" in r]
    evals = [r for r in recs if "val_loss" in r]
    assert [r["step"] for r in train] == [0, 1, 2, 3] and [r["step"] for r in evals] == [1, 3]
    assert all(len(r["step_acc"]) == 2 and len(r["step_loss"]) == 2 and r["tau_est"] >= 1.0 for r in train)
    assert all(len(r["val_step_acc"]) == 2 and r["val_tau_est"] >= 1.0 for r in evals)
    for f in ("loss.png", "data.jsonl", "val.jsonl", "train_config.json", "checkpoint/train_state.pt",
              "final/config.json", "final/model.safetensors"):
        assert (out / f).exists(), f
    seqs = [json.loads(line) for line in (out / "data.jsonl").read_text().splitlines()]
    assert len(seqs) == 6 and all(len(s["ids"]) > s["prompt_len"] == 8 for s in seqs)
    assert "draft saved to" in capsys.readouterr().err

    # the draft serves: sampled requests at temperature 1 accept drafts (the acceptance length measured)
    model = K3ForCausalLM.from_pretrained(target, dtype="float32")
    from k3.data.tokenizer import load_tokenizer

    eng = Engine(model, load_tokenizer(target), EngineConfig(memory_budget_bytes=32 << 20, page_size=8,
                                                             enable_prefix_cache=False, speculative_draft_tokens=3,
                                                             speculative_max_batch=0),
                 draft=load_draft(out / "final", model))
    eng.generate([s["ids"][:8] for s in seqs], SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=0))
    tau = eng.stats()["spec_mean_acceptance_length"]
    print(f"trained smoke draft, temperature 1, k=3: mean acceptance length {tau:.2f}")
    assert tau > 1.0

    # `k3 generate --draft` prints what the same engine prints without it (greedy)
    capsys.readouterr()
    common = ["generate", "--checkpoint", target, "--prompt", "the quick brown", "--max-new-tokens", "12",
              "--temperature", "0", "--device", "cpu"]
    assert main(common + ["--engine"]) == 0
    plain = capsys.readouterr()
    assert main(common + ["--draft", str(out / "final"), "--spec-tokens", "3"]) == 0
    spec = capsys.readouterr()
    assert spec.out == plain.out and len(plain.out) > len("the quick brown")
    assert "mean acceptance length" in spec.err


def test_resume_is_exact(setup, tmp_path):
    target, corpus = setup
    straight = DraftTrainer(_cfg(target, corpus, str(tmp_path / "a")))
    straight.run()
    part = DraftTrainer(_cfg(target, corpus, str(tmp_path / "b")))
    for _ in range(2):  # an interrupted run: two steps, a checkpoint, then the process ends
        part.train_step()
        part.step += 1
    part.save()
    resumed = DraftTrainer(_cfg(target, corpus, str(tmp_path / "b")), resume=True)
    assert resumed.step == 2
    resumed.run()
    a, b = load_file(tmp_path / "a" / "final" / "model.safetensors"), load_file(tmp_path / "b" / "final" / "model.safetensors")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(FileNotFoundError, match="nothing to resume"):
        DraftTrainer(_cfg(target, corpus, str(tmp_path / "c")), resume=True)
    with pytest.raises(ValueError, match="--target"):
        DraftTrainer(_cfg("", corpus, str(tmp_path / "d")))
