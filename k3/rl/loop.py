"""`k3 rl`: the RL loop (the shared skeleton is k3.rl.trainer.OnPolicyTrainer). The engine serves
the trainer's own module (weight sync is then free; with `serve_dtype` set, `k3.rl.sync` copies into
a separate serving model after each update; under torchrun see k3.rl.dist), rollouts come from
`RolloutManager` (partial rollouts; judged tasks scored by the GenRM, k3.rl.judged), each step
trains once on the completed groups with the truncated-IS loss (`k3.rl.losses`) and Per-Head Muon +
AdamW (`k3.optim`, as `k3 train`).

Held-out evaluation (before the first step and after the last): the same rollout machinery on
held-out seeds, G sampled attempts per (task, effort), no partial rollouts, no training.
"""

from __future__ import annotations

import os
import random
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator

import torch

from k3.model.causal_lm import K3ForCausalLM
from k3.reward.genrm import GenRMConfig
from k3.rl.batch import attempt_advantages, pack, rollout_stats
from k3.rl.effort import EFFORTS, BudgetTracker
from k3.rl.judged import build_genrm, genrm_scorer
from k3.rl.losses import pg_loss
from k3.rl.report import plot_rl
from k3.rl.rollout import RolloutConfig, RolloutManager
from k3.rl.tasks import JUDGED_KINDS, build_tasks
from k3.rl.trainer import OnPolicyConfig, OnPolicyTrainer, jsonable


@dataclass
class RLConfig(OnPolicyConfig):
    """base: checkpoint directory (official layout + tokenizer). tasks / efforts: what to practise.
    serve_dtype: None = the engine serves the trainer's own module (no copy); e.g. "bfloat16" = a
    separate serving copy in that dtype, refreshed in place after every update (k3.rl.sync).
    judge: the reward source of tasks without a verifier (kind "open"): a k3 checkpoint directory
    (in-process) or `http(s)://HOST:PORT/v1#MODEL` (OpenAI-compatible); genrm: its settings.
    Other fields: k3.rl.trainer.OnPolicyConfig."""

    base: str = ""
    out: str = "runs/rl"
    eval_tasks: int = 32
    tasks: tuple[str, ...] = ("math",)
    efforts: tuple[str, ...] = EFFORTS
    serve_dtype: str | None = None
    judge: str = ""
    genrm: GenRMConfig = field(default_factory=GenRMConfig)
    rollout: RolloutConfig = field(
        default_factory=lambda: RolloutConfig(group_size=8, batch_groups=6, threshold=0.5))

    def validate(self) -> "RLConfig":
        if not self.base:
            raise ValueError("--base DIR is required (a checkpoint directory with tokenizer files)")
        self.validate_common()
        self.genrm.validate()
        missing = [e for e in self.efforts if e not in self.effort.multiples]
        if missing:
            raise ValueError(f"efforts {missing} have no permitted multiple in the effort config")
        judged = [k for k in self.tasks if k in JUDGED_KINDS]
        if judged and not self.judge:
            raise ValueError(f"task kinds {judged} have no verifier: pass --judge DIR|URL#MODEL")
        return self


@dataclass
class RLResult:
    out_dir: str
    steps: int
    before: dict[str, float]
    after: dict[str, float]
    interrupted: bool = False


class RLTrainer(OnPolicyTrainer):
    def __init__(self, cfg: RLConfig, resume: bool = False, runner: Any = None, group_scorer: Any = None,
                 dist: Any = None) -> None:
        """runner: the code tasks' sandbox (k3.reward.verifiers.CodeRunner). group_scorer: scores judged
        tasks (k3.rl.judged; default: the GenRM on `cfg.judge` when judged kinds are trained).
        dist: k3.rl.dist.DistRL under torchrun."""
        super().__init__(cfg.validate(), cfg.base, resume, serve_dtype=cfg.serve_dtype, dist=dist)
        self.ref = None
        if cfg.pg.kl_coef > 0:
            self.ref = K3ForCausalLM.from_pretrained(cfg.base, dtype=torch.float32).to(self.device).eval()
        self.budgets = BudgetTracker()
        kw = dict(runner=runner, math_levels=cfg.math_levels, math_partial=cfg.math_partial,
                  tool_partial=cfg.tool_partial)
        self.train_tasks = build_tasks(cfg.tasks, "train", cfg.train_tasks, **kw)
        self.eval_tasks = build_tasks(cfg.tasks, "heldout", cfg.eval_tasks, **kw)
        if group_scorer is None and any(k in JUDGED_KINDS for k in cfg.tasks) and self.is_main:
            group_scorer = genrm_scorer(build_genrm(cfg.judge, cfg.genrm, device=self.device))
        self.group_scorer = group_scorer
        self.rollouts = RolloutManager(self.engine, self.tok, cfg.rollout, cfg.effort, self.budgets,
                                       group_scorer=group_scorer)
        self.consumed = 0
        self.start(resume)

    # ---- task stream ----------------------------------------------------------------------------------
    def task_stream(self) -> Iterator[tuple[Any, str]]:
        """The training (task, effort) stream after the groups already consumed (resume), counting."""
        return self._counted(_skip(self._source(), self.consumed))

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
        if self.dist is not None:
            return self.dist.on_main(self._evaluate_local)
        return self._evaluate_local()

    def _evaluate_local(self) -> dict[str, float]:
        rc = RolloutConfig(group_size=self.cfg.eval_group, batch_groups=len(self.eval_tasks) * len(self.cfg.efforts),
                           partial=False, temperature=self.cfg.rollout.temperature,
                           max_turns=self.cfg.rollout.max_turns, seed=10_000 + self.cfg.seed,
                           thinking=self.cfg.rollout.thinking, judge_fallback=self.cfg.rollout.judge_fallback)
        mgr = RolloutManager(self.engine, self.tok, rc, self.cfg.effort, BudgetTracker(min_samples=10**9),
                             group_scorer=self.group_scorer)
        groups = mgr.collect(iter([(t, e) for t in self.eval_tasks for e in self.cfg.efforts]))
        return rollout_stats(groups, self.cfg.efforts)

    def evaluate_before(self) -> None:
        cfg = self.cfg
        if self.before:
            return
        self.progress.message(f"held-out evaluation before training ({len(self.eval_tasks)} tasks x "
                              f"{len(cfg.efforts)} efforts x {cfg.eval_group} samples)")
        self.before = self.evaluate()
        self.log.write({"event": "eval", "when": "before", "step": self.step} | self.before)
        self.progress.message("before: " + _summary(self.before, cfg.efforts))

    def evaluate_after(self) -> dict[str, float]:
        after = self.evaluate()
        self.log.write({"event": "eval", "when": "after", "step": self.step} | after)
        self.progress.message("after:  " + _summary(after, self.cfg.efforts))
        return after

    # ---- training ------------------------------------------------------------------------------------
    def train_step(self, groups: list) -> dict[str, float]:
        """One update on completed groups: returns loss metrics (clip/mask fractions, staleness)."""
        items = attempt_advantages(groups, self.cfg.pg.adv_eps)
        micro = pack(items, self.rollouts.version, self.cfg.micro_batch_tokens)
        if self.dist is not None:  # rank 0 sampled and packed; every rank gets the same micro-batches
            micro = self.dist.broadcast(micro)
        total = sum(mb.num_response for mb in micro)
        agg: dict[str, float] = {"loss": 0.0, "train_tokens": 0.0, "clip_frac": 0.0, "mask_frac": 0.0,
                                 "stale_masked_frac": 0.0, "mean_ratio": 0.0, "staleness_mean": 0.0,
                                 "staleness_max": 0.0, "grad_norm": 0.0}
        if total == 0:  # every group's rewards were equal: no advantage, no update (the weights stay)
            return agg | {"skipped": 1.0}
        self.model.train()
        work = [(mb, True) for mb in micro] if self.dist is None else self.dist.my_share(micro)
        for mb, real in work:
            # micro-batch losses weighted to the step's mean over tokens; padding passes (torchrun) weigh 0
            share = mb.num_response / total if real else 0.0
            loss, m = self._micro_loss(mb)
            (loss * share).backward()
            agg["loss"] += float(loss.detach()) * share
            agg["train_tokens"] += int(mb.ids.numel()) if real else 0
            for k, v in m.items():  # a padding pass adds zeros (every rank reduces the same keys)
                if not real:
                    agg.setdefault(k, 0.0)
                elif k == "staleness_max":
                    agg[k] = max(agg.get(k, 0.0), v)
                else:
                    agg[k] = agg.get(k, 0.0) + v * share
        agg.pop("tokens", None)
        if self.dist is not None:
            agg = self.dist.reduce_metrics(agg, maxed=("staleness_max",))
        agg["grad_norm"] = self.update()
        return agg

    def _micro_loss(self, mb: Any) -> tuple[torch.Tensor, dict[str, float]]:
        dev = self.device
        ids = mb.ids.to(dev)
        with self.autocast():
            logp = self.model.token_logprobs(ids, cu_seqlens=mb.cu_seqlens)
            ref = None
            if self.ref is not None:
                with torch.no_grad():
                    ref = self.ref.token_logprobs(ids, cu_seqlens=mb.cu_seqlens)
        return pg_loss(logp, mb.behaviour_logp.to(dev), mb.token_advantages.to(dev), mb.response_mask.to(dev),
                       mb.staleness.to(dev), self.cfg.pg, ref)

    def batch_record(self, groups: list) -> dict[str, Any]:
        return rollout_stats(groups, self.cfg.efforts)

    def progress_text(self, rec: dict) -> str:
        return (f"reward {rec.get('reward', float('nan')):.3f} ± {rec.get('reward_se', float('nan')):.3f} pass {rec.get('pass_rate', float('nan')):.0%} "
                f"think " + "/".join(f"{rec.get(f'think_{e}', float('nan')):.0f}" for e in self.cfg.efforts))

    def plot(self) -> str | None:
        png = os.path.join(self.cfg.out, "rl.png")
        return png if plot_rl(os.path.join(self.cfg.out, "metrics.jsonl"), png, self.cfg.efforts) else None

    def result(self, after: Any, interrupted: bool) -> RLResult:
        return RLResult(self.cfg.out, self.step, self.before, after, interrupted=interrupted)

    # ---- checkpoints ------------------------------------------------------------------------------------
    def state_extra(self) -> dict[str, Any]:
        return {"consumed": self.consumed, "rl_config": jsonable(asdict(self.cfg)),
                "budgets": self.budgets.state_dict()}

    def load_state_extra(self, st: dict) -> None:
        self.budgets.load_state_dict(st["budgets"])
        self.consumed = st["consumed"]


def _skip(it: Iterator, n: int) -> Iterator:
    for _ in range(n):
        next(it)
    return it


def _summary(rec: dict[str, float], efforts: tuple[str, ...]) -> str:
    kinds = " ".join(f"{k[5:]} {v:.0%}" for k, v in rec.items() if k.startswith("pass_") and
                     k[5:] not in efforts and k != "pass_rate")
    think = " ".join(f"{e} {rec.get(f'think_{e}', float('nan')):.1f} ± {rec.get(f'think_se_{e}', float('nan')):.1f}"
                     for e in efforts)
    nan = float("nan")
    return (f"reward {rec.get('reward', nan):.3f} ± {rec.get('reward_se', nan):.3f} pass {rec.get('pass_rate', nan):.1%} "
            f"({kinds}); mean thinking tokens {think}")


def train_rl(cfg: RLConfig, resume: bool = False, runner: Any = None, dist: Any = None) -> RLResult:
    return RLTrainer(cfg, resume=resume, runner=runner, dist=dist).run()


__all__ = ["RLConfig", "RLResult", "RLTrainer", "train_rl"]
