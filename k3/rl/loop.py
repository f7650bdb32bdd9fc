"""`k3 rl`: the RL loop on one device. The engine serves the trainer's own module (weight sync is
then free; `k3.rl.sync` also copies into a separate serving model), rollouts come from
`RolloutManager` (partial rollouts), each step trains once on the completed groups with the
truncated-IS loss (`k3.rl.losses`) and Per-Head Muon + AdamW (`k3.optim`, as `k3 train`).

Held-out evaluation (before the first step and after the last): the same rollout machinery on
held-out seeds, G sampled attempts per (task, effort), no partial rollouts, no training.
"""

from __future__ import annotations

import math
import os
import random
import signal
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator

import torch

from k3.data.tokenizer import load_tokenizer
from k3.model.causal_lm import K3ForCausalLM
from k3.optim import PerHeadMuon, build_param_groups
from k3.rl.batch import attempt_advantages, pack, rollout_stats
from k3.rl.effort import EFFORTS, BudgetTracker, EffortConfig
from k3.rl.losses import PGConfig, pg_loss
from k3.rl.report import plot_rl
from k3.rl.rollout import RolloutConfig, RolloutManager
from k3.rl.tasks import build_tasks
from k3.serve.engine import Engine, EngineConfig
from k3.train.metrics import MetricsLog, Progress, truncate_metrics
from k3.train.state import load_state, rng_state, save_state, set_rng_state, state_path


@dataclass
class RLConfig:
    """base: checkpoint directory (official layout + tokenizer). tasks / efforts: what to practise.
    train_tasks / eval_tasks: tasks per kind. eval_group: attempts per held-out (task, effort).
    lr / adamw_lr: Muon and AdamW learning rates (constant). micro_batch_tokens: tokens per
    forward/backward. memory_budget_mb: the engine's cache budget. math_partial: shaped credit for a
    wrong integer answer (0 = exact match only; pass rates always count exact answers). threads:
    torch intra-op threads (None: 1 on CPU, where decode is latency-bound and a loaded machine
    stalls a second thread; the library default on GPU hosts)."""

    base: str = ""
    out: str = "runs/rl"
    tasks: tuple[str, ...] = ("math",)
    efforts: tuple[str, ...] = EFFORTS
    max_steps: int = 40
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
    threads: int | None = None
    plots: bool = True
    pg: PGConfig = field(default_factory=PGConfig)
    effort: EffortConfig = field(default_factory=EffortConfig)
    rollout: RolloutConfig = field(default_factory=lambda: RolloutConfig(group_size=8, batch_groups=6))

    def validate(self) -> "RLConfig":
        if not self.base:
            raise ValueError("--base DIR is required (a checkpoint directory with tokenizer files)")
        if self.max_steps < 1 or self.train_tasks < 1 or self.eval_tasks < 0 or self.save_every < 1:
            raise ValueError("max_steps, train_tasks and save_every must be >= 1, eval_tasks >= 0")
        self.pg.validate()
        self.effort.validate()
        self.rollout.validate()
        missing = [e for e in self.efforts if e not in self.effort.multiples]
        if missing:
            raise ValueError(f"efforts {missing} have no permitted multiple in the effort config")
        return self


@dataclass
class RLResult:
    out_dir: str
    steps: int
    before: dict[str, float]
    after: dict[str, float]
    interrupted: bool = False


class RLTrainer:
    def __init__(self, cfg: RLConfig, resume: bool = False, runner: Any = None) -> None:
        self.cfg = cfg.validate()
        self.device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if cfg.threads is not None or self.device.type == "cpu":
            torch.set_num_threads(cfg.threads or 1)
        self.ckpt_dir = os.path.join(cfg.out, "checkpoint")
        if resume:
            state_path(self.ckpt_dir)
        self.tok = load_tokenizer(cfg.base)
        self.model = K3ForCausalLM.from_pretrained(cfg.base, dtype=torch.float32).to(self.device)
        torch.manual_seed(cfg.seed)
        self.engine = Engine(self.model, self.tok, EngineConfig(memory_budget_bytes=cfg.memory_budget_mb << 20,
                                                                page_size=16, unit_size=16, max_running=256))
        geom = self.model.config.text_config
        self.opt = PerHeadMuon(build_param_groups(self.model, geom, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                                  adamw_lr=cfg.adamw_lr))
        self.ref = None
        if cfg.pg.kl_coef > 0:
            self.ref = K3ForCausalLM.from_pretrained(cfg.base, dtype=torch.float32).to(self.device).eval()
        self.budgets = BudgetTracker()
        self.train_tasks = build_tasks(cfg.tasks, "train", cfg.train_tasks, runner=runner,
                                       math_levels=cfg.math_levels, math_partial=cfg.math_partial)
        self.eval_tasks = build_tasks(cfg.tasks, "heldout", cfg.eval_tasks, runner=runner,
                                      math_levels=cfg.math_levels, math_partial=cfg.math_partial)
        self.rollouts = RolloutManager(self.engine, self.tok, cfg.rollout, cfg.effort, self.budgets)
        self.step, self.consumed = 0, 0
        self.before: dict[str, float] = {}
        os.makedirs(cfg.out, exist_ok=True)
        if resume:
            self._resume()
        self.log = MetricsLog(os.path.join(cfg.out, "metrics.jsonl"), resume=resume)
        self.progress = Progress(cfg.max_steps)

    # ---- task stream ----------------------------------------------------------------------------------
    def _source(self) -> Iterator[tuple[Any, str]]:
        """Every task at every effort (consecutive groups), tasks reshuffled each epoch (seeded)."""
        epoch = 0
        while True:
            order = list(range(len(self.train_tasks)))
            random.Random(self.cfg.seed * 1009 + epoch).shuffle(order)
            for i in order:
                for e in self.cfg.efforts:
                    yield self.train_tasks[i], e
            epoch += 1

    def _counted(self, it: Iterator) -> Iterator:
        for item in it:
            self.consumed += 1
            yield item

    # ---- evaluation ----------------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """Held-out reward / pass rate / think tokens per effort (sampled, temperature 1, fixed seeds)."""
        if not self.eval_tasks:
            return {}
        rc = RolloutConfig(group_size=self.cfg.eval_group, batch_groups=len(self.eval_tasks) * len(self.cfg.efforts),
                           partial=False, temperature=self.cfg.rollout.temperature, max_turns=self.cfg.rollout.max_turns,
                           seed=10_000 + self.cfg.seed, thinking=self.cfg.rollout.thinking)
        mgr = RolloutManager(self.engine, self.tok, rc, self.cfg.effort, BudgetTracker(min_samples=10**9))
        groups = mgr.collect(iter([(t, e) for t in self.eval_tasks for e in self.cfg.efforts]))
        return rollout_stats(groups, self.cfg.efforts)

    # ---- training ------------------------------------------------------------------------------------
    def train_step(self, groups: list) -> dict[str, float]:
        """One update on completed groups: returns loss metrics (clip/mask fractions, staleness)."""
        items = attempt_advantages(groups, self.cfg.pg.adv_eps)
        micro = pack(items, self.rollouts.version, self.cfg.micro_batch_tokens)
        total = sum(mb.num_response for mb in micro)
        agg: dict[str, float] = {"loss": 0.0, "train_tokens": 0.0, "clip_frac": 0.0, "mask_frac": 0.0,
                                 "stale_masked_frac": 0.0, "mean_ratio": 0.0, "staleness_mean": 0.0,
                                 "staleness_max": 0.0, "grad_norm": 0.0}
        if total == 0:  # every group's rewards were equal: no advantage, no update (the weights stay)
            return agg | {"skipped": 1.0}
        self.model.train()
        for mb in micro:
            ids = mb.ids.to(self.device)
            logp = self.model.token_logprobs(ids, cu_seqlens=mb.cu_seqlens)
            ref = None
            if self.ref is not None:
                with torch.no_grad():
                    ref = self.ref.token_logprobs(ids, cu_seqlens=mb.cu_seqlens)
            dev = self.device
            loss, m = pg_loss(logp, mb.behaviour_logp.to(dev), mb.token_advantages.to(dev),
                              mb.response_mask.to(dev), mb.staleness.to(dev), self.cfg.pg, ref)
            share = mb.num_response / total  # micro-batch losses weighted to the step's mean over tokens
            (loss * share).backward()
            agg["loss"] += float(loss.detach()) * share
            agg["train_tokens"] += int(mb.ids.numel())
            for k, v in m.items():
                if k == "staleness_max":
                    agg[k] = max(agg.get(k, 0.0), v)
                elif k != "tokens":
                    agg[k] = agg.get(k, 0.0) + v * share
        gnorm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.model.eval()
        self.engine.on_weights_updated()   # the engine serves this module: only its prefix cache is stale
        self.rollouts.weights_updated()
        agg["grad_norm"] = float(gnorm)
        return agg

    # ---- the run ---------------------------------------------------------------------------------------
    def run(self) -> RLResult:
        stop = {"flag": False}
        prev = signal.signal(signal.SIGINT, lambda *_: stop.update(flag=True))
        try:
            return self._run(stop)
        finally:
            signal.signal(signal.SIGINT, prev)

    def _run(self, stop: dict) -> RLResult:
        cfg = self.cfg
        if not self.before:
            self.progress.message(f"held-out evaluation before training ({len(self.eval_tasks)} tasks x "
                                  f"{len(cfg.efforts)} efforts x {cfg.eval_group} samples)")
            self.before = self.evaluate()
            self.log.write({"event": "eval", "when": "before", "step": self.step} | self.before)
            self.progress.message("before: " + _summary(self.before, cfg.efforts))
        source = self._counted(_skip(self._source(), self.consumed))
        self.progress.t0 = time.perf_counter()
        first = self.step
        while self.step < cfg.max_steps and not stop["flag"]:
            rec = self._one_step(source)
            self.log.write(rec)
            extra = (f"reward {rec.get('reward', float('nan')):.3f} pass {rec.get('pass_rate', float('nan')):.0%} "
                     f"think " + "/".join(f"{rec.get(f'think_{e}', float('nan')):.0f}" for e in cfg.efforts))
            self.progress.update(self.step - first, rec["loss"], rec["rollout_tok_s"], None, extra)
            self.step += 1
            if self.step % cfg.save_every == 0 or self.step == cfg.max_steps:
                self.save()
        self.rollouts.abort_all()
        if stop["flag"]:
            self.save()
            return RLResult(cfg.out, self.step, self.before, {}, interrupted=True)
        after = self.evaluate()
        self.log.write({"event": "eval", "when": "after", "step": self.step} | after)
        self.progress.message("after:  " + _summary(after, cfg.efforts))
        self.export(os.path.join(cfg.out, "final"))
        if cfg.plots and plot_rl(os.path.join(cfg.out, "metrics.jsonl"), os.path.join(cfg.out, "rl.png"), cfg.efforts):
            self.progress.message(f"plots: {os.path.join(cfg.out, 'rl.png')}")
        return RLResult(cfg.out, self.step, self.before, after)

    def _one_step(self, source: Iterator) -> dict[str, Any]:
        c0 = dict(self.rollouts.counters)
        g0 = self.engine.metrics.generated_tokens
        t0 = time.perf_counter()
        groups = self.rollouts.collect(source)
        t1 = time.perf_counter()
        rec: dict[str, Any] = {"step": self.step, "version": self.rollouts.version}
        rec |= self.train_step(groups)
        t2 = time.perf_counter()
        rec |= rollout_stats(groups, self.cfg.efforts)
        gen = self.engine.metrics.generated_tokens - g0
        rec |= {"groups": len(groups), "rollout_s": t1 - t0, "train_s": t2 - t1, "rollout_tokens": gen,
                "rollout_tok_s": gen / max(t1 - t0, 1e-9), "train_tok_s": rec["train_tokens"] / max(t2 - t1, 1e-9)}
        rec |= {k: v - c0[k] for k, v in self.rollouts.counters.items()}
        return rec

    # ---- checkpoints ------------------------------------------------------------------------------------
    def save(self) -> None:
        """Resumable state (k3.train.state). Attempts paused in the engine are not saved: a resumed run
        starts fresh groups after the last consumed one."""
        save_state(self.ckpt_dir, {
            "step": self.step, "consumed": self.consumed, "version": self.rollouts.version,
            "before": self.before, "rl_config": _jsonable(asdict(self.cfg)),
            "model": self.model.state_dict(), "optimizer": self.opt.state_dict(),
            "budgets": self.budgets.state_dict(), "rng": rng_state(),
        })

    def _resume(self) -> None:
        st = load_state(self.ckpt_dir)
        self.model.load_state_dict(st["model"])
        self.opt.load_state_dict(st["optimizer"])
        self.budgets.load_state_dict(st["budgets"])
        self.step, self.consumed, self.before = st["step"], st["consumed"], st["before"]
        self.rollouts.version = st["version"]
        set_rng_state(st["rng"])
        self.engine.on_weights_updated()
        truncate_metrics(os.path.join(self.cfg.out, "metrics.jsonl"), self.step - 1)

    def export(self, path: str) -> None:
        """The trained policy in the official checkpoint format, plus the tokenizer files."""
        dtype = "float32" if self.model.config.dtype == "float32" else None
        self.model.save_pretrained(path, dtype=dtype)
        self.tok.save(path)
        self.progress.message(f"saved {path}")


def _skip(it: Iterator, n: int) -> Iterator:
    for _ in range(n):
        next(it)
    return it


def _summary(rec: dict[str, float], efforts: tuple[str, ...]) -> str:
    kinds = " ".join(f"{k[5:]} {v:.0%}" for k, v in rec.items() if k.startswith("pass_") and
                     k[5:] not in efforts and k != "pass_rate")
    think = " ".join(f"{e} {rec.get(f'think_{e}', float('nan')):.1f}" for e in efforts)
    return (f"reward {rec.get('reward', float('nan')):.3f} pass {rec.get('pass_rate', float('nan')):.1%} "
            f"({kinds}); mean thinking tokens {think}")


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x if isinstance(x, (int, float, str, bool, type(None))) else str(x)


def train_rl(cfg: RLConfig, resume: bool = False, runner: Any = None) -> RLResult:
    return RLTrainer(cfg, resume=resume, runner=runner).run()


__all__ = ["RLConfig", "RLResult", "RLTrainer", "train_rl"]
