"""`k3 sft`: the pre-training loop (`k3.train.trainer.Trainer`) with a different batch source, initial
weights and evaluation. Everything else -- Per-Head Muon, Quantile Balancing, warmup-stable-decay,
gradient accumulation, torchrun / FSDP2, atomic checkpoints and exact resume, metrics.jsonl, loss.png,
the progress line and the official-format `final/` -- is the trainer's own.

* data: conversations (--data, or the default mix of k3.sft.sources) rendered to ids + assistant-only
  targets and packed into rows (k3.sft.packing); validation loss on held-out conversations.
* weights: the base checkpoint's (`K3ForCausalLM.from_pretrained(base)`), its tokenizer (saved beside
  it) and its model config; `preset` / `model` overrides are ignored.
* evaluation: the behavioural scores of k3.sft.eval on the base model (step 0, unless eval_base is off),
  every `behavior_eval_every` steps, and at the end, as {"step", "behaviour": {...}} metrics lines.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from k3.config import ConfigError, K3Config
from k3.data.packing import IGNORE_INDEX
from k3.data.tokenizer import load_tokenizer
from k3.model.causal_lm import K3ForCausalLM
from k3.sft import eval as sft_eval
from k3.sft import instruct
from k3.sft import sources
from k3.sft.config import SFTConfig
from k3.sft.data import load_conversations
from k3.sft.packing import SFTLoader, encode_conversation, encode_weighted, pack, val_batches
from k3.sft.weights import weighted_loss
from k3.train.data import TrainData
from k3.train.trainer import Trainer, TrainResult


def _require_base(cfg: SFTConfig) -> str:
    if not cfg.base:
        raise ConfigError("k3 sft needs --base DIR: an official-format checkpoint (e.g. the final/ of `k3 train`)")
    if not os.path.isfile(os.path.join(cfg.base, "config.json")):
        raise FileNotFoundError(f"--base {cfg.base}: no config.json (expected an official-format checkpoint dir)")
    return cfg.base


def _target_entropy(targets: np.ndarray) -> float:
    """Unigram entropy (nats) of the trained targets: the loss of always predicting their frequencies."""
    counts = np.bincount(targets[targets >= 0].ravel())
    p = counts[counts > 0] / max(1, counts.sum())
    return float(-(p * np.log(p)).sum())


class SFTTrainer(Trainer):
    """The trainer with conversations as data and the base checkpoint as initial weights."""

    cfg: SFTConfig

    def __init__(self, cfg: SFTConfig, *, resume: bool = False, ep: int = 1, cp: int = 1) -> None:
        self.tokenizer = load_tokenizer(_require_base(cfg))
        self.heldout: sources.HeldOut | None = None
        self.behaviour: list[dict[str, Any]] = []
        super().__init__(cfg, resume=resume, ep=ep, cp=cp)

    # ---- hooks of Trainer
    def make_model_config(self) -> K3Config:
        mc = K3Config.load(self.cfg.base)
        mc.dtype = "float32" if self.device.type == "cpu" else "bfloat16"
        mc.quantization_config = None
        if self.tokenizer.vocab_size != mc.text_config.vocab_size:
            raise ConfigError(f"--base {self.cfg.base}: tokenizer vocab {self.tokenizer.vocab_size} != model vocab "
                              f"{mc.text_config.vocab_size}")
        return mc.validate()

    def make_model(self) -> K3ForCausalLM:
        return K3ForCausalLM.from_pretrained(self.cfg.base, dtype="float32")

    def make_data(self) -> TrainData:
        cfg, log = self.cfg, self.progress.message
        if cfg.data:
            convs, bad = load_conversations(cfg.data, cfg.on_bad)
            for b in bad[:10]:
                log(f"skipped malformed conversation {b}")
            if len(bad) > 10:
                log(f"... skipped {len(bad) - 10} more malformed conversations")
            # held-out conversations: a deterministic slice of the file(s), never trained on
            n_val = min(cfg.val_conversations, len(convs) // 10)
            val, train = convs[:n_val], convs[n_val:]
        else:
            train = sources.default_train_conversations(cfg.worlds, cfg.world_tasks, cfg.max_difficulty,
                                                        cfg.instruct_items, cfg.efforts, cfg.lean_fraction,
                                                        cfg.lean_distractors)
            val = sources.validation_conversations(cfg.worlds, cfg.max_difficulty, cfg.val_conversations, cfg.efforts)
        weighted = cfg.decision_weight != 1 and self.par is None
        if cfg.decision_weight != 1 and self.par is not None:
            log(f"note: decision_weight={cfg.decision_weight} applies to one-process runs; under torchrun every "
                "target weighs 1")
        packed = self._pack(train, weighted)
        if packed.num_rows == 0:
            raise ConfigError(f"no conversation has an assistant token within its first seq_len={cfg.seq_len} tokens; "
                              "raise the stage's seq_len with --config")
        B = cfg.tokens_per_step // cfg.seq_len
        loader = SFTLoader(packed, B, seed=cfg.seed)
        vb = val_batches(self._pack(val), max(1, (cfg.micro_batch_tokens or cfg.tokens_per_step) // cfg.seq_len)) \
            if val else []
        log(f"sft data: {packed.num_conversations} train conversations in {packed.num_rows} rows of {cfg.seq_len} "
            f"({packed.num_targets:,} assistant targets, {packed.truncated} cut at the row length, {packed.dropped} "
            f"without an assistant token in it dropped); "
            f"{len(val)} held-out conversations; {cfg.max_steps * B / packed.num_rows:.2f} epochs")
        return TrainData(self.tokenizer, loader, vb, _target_entropy(packed.y), packed.num_targets)

    def _pack(self, convs: list[dict], weighted: bool = False):
        cfg = self.cfg
        if weighted:  # the caller decides (decision_weight != 1, one process)
            docs = [encode_weighted(c, self.tokenizer, cfg.thinking_effort, cfg.decision_weight,
                                    cfg.decision_think_tokens) for c in convs]
        else:
            docs = [encode_conversation(c, self.tokenizer, cfg.thinking_effort) for c in convs]
        return pack(docs, cfg.seq_len, self.tokenizer.pad_id)

    def text_loss(self, batch, ids, labels, cu):
        """The trainer's loss, or with decision weights (one process) the weighted mean of
        k3.sft.weights.weighted_loss (logged: the plain mean)."""
        if batch.loss_weights is None or self.par is not None:
            return super().text_loss(batch, ids, labels, cu)
        # logits only at the targets (an SFT row is mostly context with no target: ~1/4 of the lm_head
        # and softmax work); the same loss as over all positions, ignored ones contributing nothing
        keep = (labels.flatten() != IGNORE_INDEX).nonzero().squeeze(1)
        logits = self.model(ids, cu_seqlens=cu, logits_index=keep).logits
        weights = batch.loss_weights.to(logits.device).flatten().index_select(0, keep)
        return weighted_loss(logits, labels.flatten().index_select(0, keep), weights)

    def evaluate(self) -> float:
        val = super().evaluate() if self.data.val_batches else float("nan")
        cfg = self.cfg
        at_start = self.step == 0 and cfg.eval_base
        periodic = cfg.behavior_eval_every and self.step % cfg.behavior_eval_every == 0 and self.step > 0
        if at_start or periodic or self.step == cfg.max_steps:
            self.evaluate_behaviour()
        return val

    # ---- behavioural evaluation
    def _heldout(self) -> sources.HeldOut:
        if self.heldout is None:
            self.heldout = heldout_for(self.cfg, self.progress.message)
        return self.heldout

    def evaluate_behaviour(self) -> dict[str, Any] | None:
        if not self.main or self.par is not None:
            return None  # generation runs on one process (rank 0 of a torchrun job writes nothing here)
        heldout = self._heldout()
        # the serving engine picks its own KDA backend: training continues on the one it had
        backends = {m: m.kda_backend for m in self.model.modules() if hasattr(m, "kda_backend")}
        try:
            rec = run_behaviour(self.model, self.tokenizer, self.cfg, heldout)
        finally:
            for m, b in backends.items():
                m.kda_backend = b
            self.model.train()
        label = "base" if self.step == 0 else f"step {self.step}"
        self.log.write({"step": self.step, "behaviour": rec})
        self.behaviour.append({"step": self.step, **rec})
        self.progress.message(f"{label}: {sft_eval.summary(rec)}")
        return rec


def heldout_for(cfg: SFTConfig, message: Any = print) -> sources.HeldOut:
    """The held-out set the config's eval keys describe (never trained on)."""
    try:
        return sources.default_heldout(cfg.worlds, cfg.max_difficulty, cfg.eval_tool_turns, cfg.eval_instruct_items,
                                       cfg.eval_episodes, cfg.eval_effort_prompts, list(dict.fromkeys(cfg.efforts)),
                                       cfg.eval_effort_max_new_tokens)
    except ImportError as e:  # no practice worlds in this install: instruction items only
        message(f"note: no world evaluation ({e})")
        return sources.HeldOut(instruct_items=instruct.instruct_items("heldout", cfg.eval_instruct_items))


def evaluate_checkpoint(cfg: SFTConfig) -> dict[str, Any]:
    """`k3 sft --eval-only`: the behavioural evaluation of the checkpoint `cfg.base` alone (no training), on
    the held-out set of the config's eval keys -- the record a run writes for its base and its result."""
    tok = load_tokenizer(_require_base(cfg))
    model = K3ForCausalLM.from_pretrained(cfg.base, dtype="float32")
    model.to(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return run_behaviour(model, tok, cfg, heldout_for(cfg))


def run_behaviour(model: K3ForCausalLM, tokenizer: Any, cfg: SFTConfig, heldout: sources.HeldOut) -> dict[str, Any]:
    """k3.sft.eval.evaluate_behaviour of `model` on `heldout` through a greedy engine agent with the config's
    effort, token and turn limits (the agent is closed afterwards)."""
    agent = sft_eval.make_agent(model, tokenizer, thinking_effort=cfg.thinking_effort,
                                max_new_tokens=cfg.eval_max_new_tokens)
    try:
        return sft_eval.evaluate_behaviour(agent, heldout, cfg.eval_max_turns, lambda text: len(tokenizer.encode(text)))
    finally:
        agent.close()


def sft(cfg: SFTConfig, resume: bool = False, ep: int = 1, cp: int = 1) -> tuple[TrainResult, list[dict[str, Any]]]:
    """Run SFT -> (the trainer's result, the behavioural evaluation records in step order)."""
    trainer = SFTTrainer(cfg, resume=resume, ep=ep, cp=cp)
    try:
        return trainer.run(), trainer.behaviour
    finally:
        if trainer.par is not None:
            trainer.par.close()
