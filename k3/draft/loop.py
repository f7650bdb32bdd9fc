"""`k3 train-draft`: train an EAGLE-3 draft for a frozen target checkpoint.

A small loop (the pre-training `Trainer` is built around training the K3 model itself: Muon groups,
expert balancing, FSDP) reusing its helpers: `MetricsLog` (metrics.jsonl), `Progress` (the progress
line), `plot_losses` (loss.png), `save_state` / `load_state` (atomic checkpoints) and the run-config
file. Data (`k3.draft.data`): the target's own greedy continuations of corpus prompts, generated once
into OUT/data.jsonl (train) and OUT/val.jsonl (held-out prompts). Each step: a batch of sequences,
the training-time-test unroll of `k3.draft.ttt` (loss per step, per-step top-1 agreement, tau), AdamW.

Exact resume: the batch of step s is a pure function of (seed, s) and the state file holds the draft,
the optimizer and the step; `--resume` continues bit-identically (the tests check it).

Outputs: OUT/metrics.jsonl, OUT/loss.png, OUT/checkpoint/train_state.pt, OUT/final/ (the draft
checkpoint: config.json + model.safetensors, loadable with `k3.model.draft.load_draft`).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from k3.draft import data
from k3.draft.ttt import target_states, teacher_logprobs, ttt_forward
from k3.model.draft import DraftConfig, EagleDraft, save_draft
from k3.train.metrics import MetricsLog, Progress, plot_losses, truncate_metrics
from k3.train.state import load_state, save_run_config, save_state, state_path


@dataclass
class DraftTrainConfig:
    """target: the target checkpoint dir; out: the run dir; data: corpus source of the prompts (None =
    the default corpus). num_prompts / val_prompts: training / held-out prompts; prompt_len /
    gen_len: their tokens and the target's continuation. ttt_steps: unroll length K. draft: overrides
    of DraftConfig.for_target (e.g. {"target_layers": [1, 3, 6]})."""

    target: str = ""
    out: str = "runs/draft"
    data: str | None = None
    max_steps: int = 300
    batch_size: int = 8
    lr: float = 2e-3
    warmup_steps: int = 20
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    ttt_steps: int = 4
    num_prompts: int = 256
    val_prompts: int = 32
    prompt_len: int = 32
    gen_len: int = 96
    eval_every: int = 50
    save_every: int = 50
    seed: int = 0
    device: str = "cpu"
    draft: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> "DraftTrainConfig":
        if not self.target:
            raise ValueError("k3 train-draft needs --target DIR (the checkpoint the draft speculates for)")
        for name in ("max_steps", "batch_size", "ttt_steps", "num_prompts", "val_prompts", "prompt_len", "gen_len",
                     "eval_every", "save_every"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"DraftTrainConfig.{name} must be a positive integer, got {v!r}")
        return self


class DraftTrainer:
    def __init__(self, cfg: DraftTrainConfig, *, resume: bool = False) -> None:
        from k3.data.tokenizer import load_tokenizer
        from k3.model.causal_lm import K3ForCausalLM

        self.cfg = cfg.validate()
        os.makedirs(cfg.out, exist_ok=True)
        self.device = torch.device(cfg.device)
        self.target = K3ForCausalLM.from_pretrained(cfg.target, dtype="float32", device=self.device).eval()
        for p in self.target.parameters():
            p.requires_grad_(False)
        self.tokenizer = load_tokenizer(cfg.target)
        self.vocab_limit = min(self.tokenizer.vocab_size, self.target.config.text_config.vocab_size)
        torch.manual_seed(cfg.seed)
        self.draft = EagleDraft(DraftConfig.for_target(self.target.config, **cfg.draft)).to(self.device)
        self.draft.attach(self.target)
        self.opt = torch.optim.AdamW(self.draft.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.step = 0
        if resume:
            state_path(os.path.join(cfg.out, "checkpoint"))  # nothing to resume: say so before generating data
        self.train_seqs, self.val_seqs = self._data(resume)
        self._states: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
        if resume:
            self._resume()
        save_run_config(cfg.out, asdict(cfg))

    # ---- data ----------------------------------------------------------------------------------------
    def _data(self, resume: bool) -> tuple[list[dict], list[dict]]:
        out = []
        for name, split, n in (("data.jsonl", "train", self.cfg.num_prompts), ("val.jsonl", "val", self.cfg.val_prompts)):
            path = os.path.join(self.cfg.out, name)
            if not (resume and os.path.exists(path)):
                prompts = data.corpus_prompts(self.tokenizer, self.cfg.data, n, self.cfg.prompt_len, split=split,
                                              seed=self.cfg.seed)
                t0 = time.perf_counter()
                seqs = data.generate_sequences(self.target, self.tokenizer, prompts, self.cfg.gen_len)
                print(f"k3 train-draft: generated {len(seqs)} {split} continuations with the target "
                      f"in {time.perf_counter() - t0:.0f}s -> {path}", flush=True)
                data.save_sequences(path, seqs)
            out.append(data.load_sequences(path))
        return out[0], out[1]

    def batch(self, seqs: list[dict], step: int | None) -> tuple[torch.Tensor, ...]:
        """(ids [B, T], lengths [B], prompt_lens [B], aux [B, T, 3H], teacher log-probs [B, T, V]);
        step None = all of seqs, else the seeded batch of that step (a pure function of seed and step:
        resumable)."""
        if step is None:
            chosen = list(range(len(seqs)))
        else:
            g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + step)
            chosen = [int(i) for i in torch.randint(len(seqs), (self.cfg.batch_size,), generator=g)]
        T = max(len(seqs[i]["ids"]) for i in chosen)
        ids = torch.zeros(len(chosen), T, dtype=torch.long, device=self.device)
        d = self.target.config.text_config.hidden_size
        aux = torch.zeros(len(chosen), T, 3 * d, device=self.device)
        final = torch.zeros(len(chosen), T, d, device=self.device)
        for b, i in enumerate(chosen):
            n = len(seqs[i]["ids"])
            ids[b, :n] = torch.tensor(seqs[i]["ids"])
            aux[b, :n], final[b, :n] = self._target_states(seqs, i)
        lengths = torch.tensor([len(seqs[i]["ids"]) for i in chosen], device=self.device)
        prompt = torch.tensor([seqs[i]["prompt_len"] for i in chosen], device=self.device)
        return ids, lengths, prompt, aux, teacher_logprobs(self.target, final, self.vocab_limit)

    def _target_states(self, seqs: list[dict], i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The frozen target's (aux [T, 3H], final hidden [T, H]) of sequence i, computed once and kept
        (the target is the expensive part of a step)."""
        key = ("train" if seqs is self.train_seqs else "val", i)
        if key not in self._states:
            ids = torch.tensor(seqs[i]["ids"], device=self.device)[None]
            aux, final = target_states(self.target, ids, self.draft.config.target_layers)
            self._states[key] = (aux[0], final[0])
        return self._states[key]

    # ---- training --------------------------------------------------------------------------------------
    def lr_at(self, step: int) -> float:
        c = self.cfg
        if step < c.warmup_steps:
            return c.lr * (step + 1) / c.warmup_steps
        t = (step - c.warmup_steps) / max(1, c.max_steps - c.warmup_steps)
        return c.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))

    def train_step(self) -> dict[str, Any]:
        ids, lengths, prompt, aux, logp = self.batch(self.train_seqs, self.step)
        for g in self.opt.param_groups:
            g["lr"] = self.lr_at(self.step)
        self.draft.train()
        out = ttt_forward(self.draft, aux, logp, ids, lengths, prompt, self.cfg.ttt_steps, self.vocab_limit)
        self.opt.zero_grad(set_to_none=True)
        out.loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(self.draft.parameters(), self.cfg.grad_clip)
        self.opt.step()
        return {"step": self.step, "loss": float(out.loss.detach()), "step_loss": out.step_loss, "step_acc": out.step_acc,
                "tau_est": out.tau, "grad_norm": float(gnorm), "lr": self.lr_at(self.step),
                "tokens": int(lengths.sum())}

    @torch.no_grad()
    def evaluate(self) -> dict[str, Any]:
        """Held-out prompts: loss, per-step agreement and the tau estimate at K = ttt_steps."""
        self.draft.eval()
        ids, lengths, prompt, aux, logp = self.batch(self.val_seqs, None)
        out = ttt_forward(self.draft, aux, logp, ids, lengths, prompt, self.cfg.ttt_steps, self.vocab_limit)
        return {"step": self.step, "val_loss": float(out.loss), "val_step_acc": out.step_acc, "val_tau_est": out.tau}

    def run(self) -> dict[str, Any]:
        c = self.cfg
        log = MetricsLog(os.path.join(c.out, "metrics.jsonl"), resume=self.step > 0)
        progress = Progress(c.max_steps)
        last_eval: dict[str, Any] = {}
        while self.step < c.max_steps:
            t0 = time.perf_counter()
            rec = self.train_step()
            rec["tok_s"] = rec["tokens"] / max(time.perf_counter() - t0, 1e-9)
            log.write(rec)
            done = self.step + 1
            if done % c.eval_every == 0 or done == c.max_steps:
                last_eval = self.evaluate() | {"step": self.step}
                log.write(last_eval)
            progress.update(self.step, rec["loss"], rec["tok_s"], None,
                            extra=f"acc0 {rec['step_acc'][0]:.2f} tau~{rec['tau_est']:.2f}"
                                  + (f" val tau~{last_eval['val_tau_est']:.2f}" if last_eval else ""))
            self.step = done
            if done % c.save_every == 0 or done == c.max_steps:
                self.save()
        log.close()
        plot_losses(os.path.join(c.out, "metrics.jsonl"), os.path.join(c.out, "loss.png"))
        save_draft(self.draft, os.path.join(c.out, "final"))
        progress.message(f"k3 train-draft: draft saved to {os.path.join(c.out, 'final')}"
                         + (f" (held-out tau~{last_eval['val_tau_est']:.2f} at K={c.ttt_steps})" if last_eval else ""))
        return last_eval

    # ---- checkpoints ------------------------------------------------------------------------------------
    def save(self) -> None:
        save_state(os.path.join(self.cfg.out, "checkpoint"), {
            "step": self.step, "draft": self.draft.state_dict(), "optimizer": self.opt.state_dict(),
            "draft_config": self.draft.config.to_dict()})

    def _resume(self) -> None:
        state = load_state(os.path.join(self.cfg.out, "checkpoint"))
        if state["draft_config"] != self.draft.config.to_dict():
            raise ValueError("--resume: the checkpoint's draft config differs from this run's "
                             f"({state['draft_config']} vs {self.draft.config.to_dict()})")
        self.draft.load_state_dict(state["draft"])
        self.opt.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
        truncate_metrics(os.path.join(self.cfg.out, "metrics.jsonl"), self.step - 1)


def train_draft(cfg: DraftTrainConfig, resume: bool = False) -> dict[str, Any]:
    """Run (or resume) a draft training run; returns the last held-out evaluation record."""
    return DraftTrainer(cfg, resume=resume).run()
