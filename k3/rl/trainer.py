"""The on-policy loop shared by `k3 rl` (k3.rl.loop) and `k3 distill` (k3.distill.loop).

One step: the in-process engine samples groups (`RolloutManager.collect`: partial rollouts,
behaviour log-probs and weight versions per token), the subclass's `train_step` accumulates the
gradients of its loss over packed micro-batches and calls `update()` (clip, optimizer step, weight
sync into the engine, version bump), and the step's record is logged. Around it: the held-out
evaluations before and after, Ctrl-C (saves a checkpoint), periodic resumable checkpoints
(k3.train.state), the official-format export and the plots.

Several processes (torchrun; k3.rl.dist): the policy is sharded with FSDP2 for the update, rank 0
samples every group with its own engine on a full copy of the weights, the groups' tensors are
broadcast, each rank trains on its share of the micro-batches, and after the update rank 0's
serving copy gets the new full weights (`DistRL.sync_to_engine`). The loop is the same code.

Subclass contract (shapes and types are the subclasses' own):
    task_stream() -> Iterator[(Task, effort)]       the training stream (resumable)
    train_step(groups) -> dict[str, float]           one update; must call self.update() unless skipped
    evaluate_before() / evaluate_after()             held-out evaluation (they write their own records)
    state_extra() -> dict / load_state_extra(state)  what a resumable checkpoint adds
    result(after, interrupted) -> the run's result object
    progress_text(rec) -> str; plot() -> str | None (the PNG written); batch_record(groups) -> dict
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from k3.data.tokenizer import load_tokenizer
from k3.model.causal_lm import K3ForCausalLM
from k3.optim import PerHeadMuon, build_param_groups
from k3.rl.effort import EffortConfig
from k3.rl.losses import PGConfig
from k3.rl.rollout import RolloutConfig
from k3.rl.sync import sync_weights
from k3.serve.engine import Engine, EngineConfig
from k3.train.metrics import MetricsLog, Progress, truncate_metrics
from k3.train.state import load_state, rng_state, save_state, set_rng_state, state_path


@dataclass
class OnPolicyConfig:
    """Fields shared by RLConfig and DistillConfig. lr / adamw_lr: Muon and AdamW learning rates
    (constant). train_tasks / eval_tasks: tasks per kind; eval_group: attempts per held-out (task,
    effort). micro_batch_tokens: tokens per forward/backward. memory_budget_mb: the engine's cache
    budget. math_partial: shaped credit for a wrong integer answer (0 = exact only). tool_partial: the
    lookup world's shaped credit for milestones short of a correct submission (k3.rl.tasks.tools). threads: torch
    intra-op threads (None: 1 on CPU, where decode is latency-bound; the library default on GPUs)."""

    out: str = "runs/rl"
    max_steps: int = 25
    seed: int = 0
    lr: float = 1e-3
    adamw_lr: float = 3e-4
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    train_tasks: int = 512
    eval_tasks: int = 16
    eval_group: int = 4
    save_every: int = 10
    micro_batch_tokens: int = 4096
    memory_budget_mb: int = 256
    device: str | None = None
    math_levels: tuple[int, ...] = (1, 2)
    math_partial: float = 0.5
    tool_partial: float = 0.5
    threads: int | None = None
    plots: bool = True
    pg: PGConfig = field(default_factory=PGConfig)
    effort: EffortConfig = field(default_factory=EffortConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)

    def validate_common(self) -> None:
        if self.max_steps < 1 or self.train_tasks < 1 or self.eval_tasks < 0 or self.save_every < 1:
            raise ValueError("max_steps, train_tasks and save_every must be >= 1, eval_tasks >= 0")
        if not (0.0 <= self.math_partial < 1.0 and 0.0 <= self.tool_partial < 1.0):
            raise ValueError("--math-partial and --tool-partial must be in [0, 1) (a correct answer earns 1)")
        self.pg.validate()
        self.effort.validate()
        self.rollout.validate()


class OnPolicyTrainer:
    """The policy (`self.model`, fp32 masters), its optimizer, the engine that samples from it and
    the loop. Subclasses build `self.rollouts` (a RolloutManager on `self.engine`) and then call
    `self.start(resume)`. dist: a k3.rl.dist.DistRL under torchrun, else None."""

    metrics_name = "metrics.jsonl"

    def __init__(self, cfg: OnPolicyConfig, checkpoint: str, resume: bool, serve_dtype: str | None = None,
                 dist: Any = None) -> None:
        self.cfg, self.dist = cfg, dist
        self.device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if dist is not None:
            self.device = dist.device
        if cfg.threads is not None or self.device.type == "cpu":
            torch.set_num_threads(cfg.threads or 1)
        self.ckpt_dir = os.path.join(cfg.out, "checkpoint")
        if resume:
            state_path(self.ckpt_dir)
        self.checkpoint = checkpoint
        self.tok = load_tokenizer(checkpoint)
        self.model = K3ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).to(self.device)
        torch.manual_seed(cfg.seed)
        if dist is not None:  # rank 0 serves a full copy; the trainer's module becomes FSDP-sharded
            self.engine = dist.make_engine(self, serve_dtype)
            dist.shard(self.model)
        else:
            serving = self.model
            if serve_dtype is not None:
                serving = K3ForCausalLM.from_pretrained(checkpoint, dtype=serve_dtype).to(self.device)
            self.engine = self.new_engine(serving)
        geom = self.model.config.text_config
        groups = build_param_groups(self.model, geom, lr=cfg.lr, weight_decay=cfg.weight_decay, adamw_lr=cfg.adamw_lr)
        fused = self.model.config.kernels.muon_fused
        self.opt = PerHeadMuon(groups, fused=fused) if dist is None else dist.optimizer(groups, fused=fused)
        self.step = 0
        self.before: Any = {}
        self.rollouts: Any = None
        os.makedirs(cfg.out, exist_ok=True)

    @property
    def is_main(self) -> bool:
        return self.dist is None or self.dist.rank == 0

    def new_engine(self, model: torch.nn.Module) -> Engine:
        return Engine(model, self.tok, EngineConfig(memory_budget_bytes=self.cfg.memory_budget_mb << 20,
                                                    page_size=16, unit_size=16, max_running=256))

    def start(self, resume: bool) -> None:
        """Call at the end of the subclass's __init__ (after self.rollouts exists)."""
        if resume:
            self.load()
        path = os.path.join(self.cfg.out, self.metrics_name)
        self.log = MetricsLog(path, resume=resume) if self.is_main else _NullLog()
        self.progress = Progress(self.cfg.max_steps) if self.is_main else _NullProgress(self.cfg.max_steps)

    # ---- one step ------------------------------------------------------------------------------------
    def autocast(self):
        """bf16 matmuls on GPU (as k3 train); log-probs come back fp32."""
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def collect(self, source: Iterator) -> list:
        """Completed groups (rank 0 samples; under torchrun the other ranks receive them)."""
        if self.dist is not None:
            return self.dist.collect(self.rollouts, source)
        return self.rollouts.collect(source)

    def update(self) -> float:
        """Clip, optimizer step, weights into the engine, version + 1. Returns the gradient norm."""
        if self.dist is not None:
            gnorm = self.dist.clip_grad_norm(self.cfg.grad_clip)
        else:
            gnorm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.model.eval()
        if self.dist is not None:
            self.dist.sync_to_engine(self.model, self.engine)
        else:
            sync_weights(self.model, self.engine)  # a copy when serving separately; always drops stale prefixes
        self.rollouts.weights_updated()
        return float(gnorm)

    def rl_step(self, source: Iterator) -> dict[str, Any]:
        """Collect completed groups from `source`, train on them once; returns the step's metrics."""
        c0 = dict(self.rollouts.counters)
        g0 = self.engine.metrics.generated_tokens if self.engine is not None else 0
        t0 = time.perf_counter()
        groups = self.collect(source)
        t1 = time.perf_counter()
        rec: dict[str, Any] = {"step": self.step, "version": self.rollouts.version}
        rec |= self.train_step(groups)
        t2 = time.perf_counter()
        if self.is_main:  # the other ranks of a torchrun job hold no groups (and log nothing)
            rec |= self.batch_record(groups)
        gen = (self.engine.metrics.generated_tokens if self.engine is not None else 0) - g0
        rec |= {"groups": len(groups), "rollout_s": t1 - t0, "train_s": t2 - t1, "rollout_tokens": gen,
                "rollout_tok_s": gen / max(t1 - t0, 1e-9), "train_tok_s": rec["train_tokens"] / max(t2 - t1, 1e-9)}
        rec |= {k: v - c0[k] for k, v in self.rollouts.counters.items()}
        return rec

    # ---- the run ---------------------------------------------------------------------------------------
    def run(self) -> Any:
        stop = {"flag": False}
        prev = signal.signal(signal.SIGINT, lambda *_: stop.update(flag=True))
        try:
            return self._run(stop)
        finally:
            signal.signal(signal.SIGINT, prev)

    def _run(self, stop: dict) -> Any:
        cfg = self.cfg
        self.evaluate_before()
        source = self.task_stream()
        self.progress.t0 = time.perf_counter()
        first = self.step
        while self.step < cfg.max_steps and not self._stopped(stop):
            rec = self.rl_step(source)
            self.log.write(rec)
            self.progress.update(self.step - first, rec["loss"], rec["rollout_tok_s"], None, self.progress_text(rec))
            self.step += 1
            if self.step % cfg.save_every == 0 or self.step == cfg.max_steps:
                self.save()
        self.rollouts.abort_all()
        if self._stopped(stop):
            self.save()
            return self.result({}, interrupted=True)
        after = self.evaluate_after()
        self.export(os.path.join(cfg.out, "final"))
        png = self.plot() if cfg.plots and self.is_main else None
        if png:
            self.progress.message(f"plots: {png}")
        return self.result(after, interrupted=False)

    def _stopped(self, stop: dict) -> bool:
        """Ctrl-C on any rank stops every rank at the same step."""
        return self.dist.any_flag(stop["flag"]) if self.dist is not None else stop["flag"]

    # ---- checkpoints ------------------------------------------------------------------------------------
    def save(self) -> None:
        """Resumable state (k3.train.state). Attempts paused in the engine are not saved: a resumed run
        starts fresh groups after the last consumed one."""
        model_sd, opt_sd = self.model.state_dict(), self.opt.state_dict()
        if self.dist is not None:
            model_sd, opt_sd = self.dist.full_state(self.model, self.opt)
        if self.is_main:
            save_state(self.ckpt_dir, {"step": self.step, "version": self.rollouts.version, "before": self.before,
                                       "model": model_sd, "optimizer": opt_sd, "rng": rng_state()}
                       | self.state_extra())
        if self.dist is not None:
            self.dist.barrier()

    def load(self) -> None:
        st = load_state(self.ckpt_dir)
        if self.dist is not None:
            self.dist.load_full_state(self.model, self.opt, st["model"], st["optimizer"])
        else:
            self.model.load_state_dict(st["model"])
            self.opt.load_state_dict(st["optimizer"])
        self.step, self.before = st["step"], st["before"]
        self.rollouts.version = st["version"]
        self.load_state_extra(st)
        set_rng_state(st["rng"])
        if self.dist is not None:
            self.dist.sync_to_engine(self.model, self.engine)
        else:
            sync_weights(self.model, self.engine)
        if self.is_main:
            truncate_metrics(os.path.join(self.cfg.out, self.metrics_name), self.step - 1)

    def export(self, path: str) -> None:
        """The trained policy in the official checkpoint format, plus the tokenizer files."""
        model = self.model if self.dist is None else self.dist.full_model(self.model, self.checkpoint)
        if self.is_main:
            dtype = "float32" if model.config.dtype == "float32" else None
            model.save_pretrained(path, dtype=dtype)
            self.tok.save(path)
            self.progress.message(f"saved {path}")
        if self.dist is not None:
            self.dist.barrier()

    # ---- subclass hooks ----------------------------------------------------------------------------------
    def task_stream(self) -> Iterator:
        raise NotImplementedError

    def train_step(self, groups: list) -> dict[str, Any]:
        raise NotImplementedError

    def evaluate_before(self) -> None:
        raise NotImplementedError

    def evaluate_after(self) -> Any:
        raise NotImplementedError

    def batch_record(self, groups: list) -> dict[str, Any]:
        return {}

    def state_extra(self) -> dict[str, Any]:
        return {}

    def load_state_extra(self, state: dict) -> None:
        pass

    def progress_text(self, rec: dict) -> str:
        return ""

    def plot(self) -> str | None:
        return None

    def result(self, after: Any, interrupted: bool) -> Any:
        raise NotImplementedError


class _NullLog:
    """Non-zero ranks log nothing."""

    def write(self, rec: dict) -> None:
        pass


class _NullProgress:
    def __init__(self, total: int) -> None:
        self.t0 = 0.0

    def update(self, *args: Any, **kw: Any) -> None:
        pass

    def message(self, text: str) -> None:
        pass


def jsonable(x: Any) -> Any:
    """Config dataclass values as JSON-safe nested lists / dicts / scalars (tuples to lists, others str)."""
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x if isinstance(x, (int, float, str, bool, type(None))) else str(x)


__all__ = ["OnPolicyConfig", "OnPolicyTrainer", "jsonable"]
