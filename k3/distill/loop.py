"""`k3 distill`: multi-teacher on-policy distillation on one device (docs/distill.md); the loop
skeleton (checkpoints, evaluation hooks, Ctrl-C, export) is k3.rl.trainer.OnPolicyTrainer.

Each step: (domain, effort) keys are drawn with the teachers' mixture weights, a task of that
domain is paired with that effort, the student samples G attempts per pair with the engine
(`k3.rl.rollout.RolloutManager`, partial rollouts, per-token behaviour log-probs and versions),
every attempt is routed to the teacher of its (domain, effort) (`k3.distill.teachers.Router`, exact),
the teacher scores the attempt's tokens in one prefill, and the student takes one optimizer step on
the reverse-KL loss (`k3.distill.losses.opd_loss`). Held-out reward / thinking length per
(domain, effort) are measured for every teacher and for the student before and after.
"""

from __future__ import annotations

import os
import random
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator

import torch

from k3.data.tokenizer import load_tokenizer
from k3.distill.batch import attempt_stats, evaluate_policy, pack_attempts
from k3.distill.losses import opd_loss
from k3.distill.report import plot_distill
from k3.distill.teachers import ModelTeacher, RemoteTeacher, Router, TeacherSpec, domain_of, vllm_prompt_logprobs
from k3.model.causal_lm import K3ForCausalLM
from k3.rl.effort import BudgetTracker
from k3.rl.rollout import RolloutConfig, RolloutManager
from k3.rl.tasks import build_tasks
from k3.rl.trainer import OnPolicyConfig, OnPolicyTrainer, jsonable


@dataclass
class DistillConfig(OnPolicyConfig):
    """student: checkpoint directory (official layout + tokenizer). teachers: one TeacherSpec per
    (domain, effort), weight = its share of the sampled pairs. Other fields: k3.rl.trainer.OnPolicyConfig.
    eval_teachers: measure each teacher's held-out stats once (reported next to the student's)."""

    student: str = ""
    teachers: list[TeacherSpec] = field(default_factory=list)
    out: str = "runs/distill"
    max_steps: int = 40
    eval_tasks: int = 8
    eval_teachers: bool = True
    rollout: RolloutConfig = field(default_factory=lambda: RolloutConfig(group_size=2, batch_groups=8))

    def validate(self) -> "DistillConfig":
        if not self.student:
            raise ValueError("--student DIR is required (a checkpoint directory with tokenizer files)")
        if not self.teachers:
            raise ValueError("at least one --teacher DOMAIN:EFFORT=DIR is required")
        keys = [t.key for t in self.teachers]
        dup = sorted({f"{d}:{e}" for d, e in keys if keys.count((d, e)) > 1})
        if dup:
            raise ValueError(f"two teachers for {', '.join(dup)}: routing must be unambiguous")
        missing = sorted({t.effort for t in self.teachers} - set(self.effort.multiples))
        if missing:
            raise ValueError(f"efforts {missing} have no permitted multiple in the effort config")
        self.validate_common()
        return self


@dataclass
class DistillResult:
    out_dir: str
    steps: int
    teachers: dict[str, dict[str, float]]
    before: dict[str, dict[str, float]]
    after: dict[str, dict[str, float]]
    interrupted: bool = False


def load_teacher(spec: TeacherSpec, vocab_size: int, device: torch.device) -> Any:
    """A ModelTeacher for a checkpoint directory, a RemoteTeacher for 'http(s)://URL#MODEL'."""
    if spec.path.startswith(("http://", "https://")):
        url, _, model = spec.path.partition("#")
        return RemoteTeacher(spec.name, vllm_prompt_logprobs(url, model or "default"), vocab_size)
    tok = load_tokenizer(spec.path)
    if tok.vocab_size != vocab_size:
        raise ValueError(f"teacher {spec.name} ({spec.path}) has a {tok.vocab_size}-token vocabulary, the student "
                         f"{vocab_size}: teachers must share the student's tokenizer")
    return ModelTeacher(spec.name, K3ForCausalLM.from_pretrained(spec.path, dtype=torch.float32).to(device))


class DistillTrainer(OnPolicyTrainer):
    def __init__(self, cfg: DistillConfig, resume: bool = False, teachers: dict | None = None,
                 runner: Any = None) -> None:
        """teachers: optional prebuilt (domain, effort) -> teacher objects (tests, remote stand-ins).
        runner: the sandbox of the code domain's unit tests (k3.reward.verifiers.CodeRunner)."""
        super().__init__(cfg.validate(), cfg.student, resume)
        self.router = Router(teachers or {s.key: load_teacher(s, self.tok.vocab_size, self.device)
                                          for s in cfg.teachers})
        self.domains = sorted({s.domain for s in cfg.teachers})
        kw = dict(math_levels=cfg.math_levels, math_partial=cfg.math_partial, tool_partial=cfg.tool_partial,
                  runner=runner)
        self.train_tasks = {d: build_tasks((d,), "train", cfg.train_tasks, **kw) for d in self.domains}
        heldout = {d: build_tasks((d,), "heldout", cfg.eval_tasks, **kw) for d in self.domains}
        self.eval_tasks = {s.key: heldout[s.domain] for s in cfg.teachers}
        for d, ts in self.train_tasks.items():  # routing is by the task's own kind: check it matches
            bad = [t.task_id for t in ts if domain_of(t) != d]
            if bad:
                raise ValueError(f"tasks {bad[:3]} built for domain {d} report another domain")
        self.rollouts = RolloutManager(self.engine, self.tok, cfg.rollout, cfg.effort, BudgetTracker())
        self.draws = 0
        self.teacher_eval: dict = {}
        self.start(resume)

    # ---- task stream -----------------------------------------------------------------------------------
    def task_stream(self) -> Iterator[tuple[Any, str]]:
        """(task, effort) pairs: the key drawn with the mixture weights, the task the next of its domain
        (seeded; draw n is a pure function of (seed, n), so a resumed run continues the stream)."""
        keys = [s.key for s in self.cfg.teachers]
        weights = [s.weight for s in self.cfg.teachers]
        while True:
            rng = random.Random(self.cfg.seed * 1_000_003 + self.draws)
            domain, effort = rng.choices(keys, weights)[0]
            tasks = self.train_tasks[domain]
            self.draws += 1
            yield tasks[rng.randrange(len(tasks))], effort

    # ---- evaluation ------------------------------------------------------------------------------------
    def evaluate_student(self) -> dict[str, dict[str, float]]:
        self.model.eval()
        return evaluate_policy(self.engine, self.tok, self.eval_tasks, self.cfg.eval_group, self.cfg.rollout,
                               self.cfg.effort, 10_000 + self.cfg.seed)

    def evaluate_teachers(self) -> dict[str, dict[str, float]]:
        """Each in-process teacher on its own (domain, effort) held-out tasks (remote ones are skipped)."""
        out = {}
        for key, teacher in self.router.teachers.items():
            if isinstance(teacher, ModelTeacher):
                eng = self.new_engine(teacher.model)
                out |= evaluate_policy(eng, self.tok, {key: self.eval_tasks[key]}, self.cfg.eval_group,
                                       self.cfg.rollout, self.cfg.effort, 10_000 + self.cfg.seed)
        return out

    def evaluate_before(self) -> None:
        cfg = self.cfg
        if self.step > 0 or self.before:
            return
        if cfg.eval_teachers and cfg.eval_tasks:
            self.progress.message("held-out evaluation of the teachers")
            self.teacher_eval = self.evaluate_teachers()
            self.log.write({"event": "eval", "when": "teachers", "step": 0, "stats": self.teacher_eval})
        self.progress.message("held-out evaluation of the student before distillation")
        self.before = self.evaluate_student() if cfg.eval_tasks else {}
        self.log.write({"event": "eval", "when": "before", "step": 0, "stats": self.before})

    def evaluate_after(self) -> dict[str, dict[str, float]]:
        after = self.evaluate_student() if self.cfg.eval_tasks else {}
        self.log.write({"event": "eval", "when": "after", "step": self.step, "stats": after})
        return after

    # ---- training --------------------------------------------------------------------------------------
    def train_step(self, groups: list) -> dict[str, Any]:
        """One update on the attempts of completed groups; metrics overall and per teacher."""
        by_key: dict[tuple[str, str], list] = {}
        for g in groups:
            by_key.setdefault((domain_of(g.task), g.effort), []).extend(g.attempts)
        work = [(key, mb) for key, atts in by_key.items()
                for mb in pack_attempts(atts, self.rollouts.version, self.cfg.micro_batch_tokens)]
        total = sum(mb.num_sequences for _, mb in work)
        rec: dict[str, Any] = {"loss": 0.0, "reverse_kl": 0.0, "mask_frac": 0.0, "train_tokens": 0, "grad_norm": 0.0}
        per: dict[str, dict[str, float]] = {}
        if total == 0:
            return rec | {"skipped": 1.0}
        self.model.train()
        for key, mb in work:
            teacher = self.router.route(*key)
            t_lp = teacher.score(mb.ids, mb.cu_seqlens).to(self.device)
            dev = self.device
            logp = self.model.token_logprobs(mb.ids.to(dev), cu_seqlens=mb.cu_seqlens)
            loss, m = opd_loss(logp, t_lp, mb.behaviour_logp.to(dev), mb.response_mask.to(dev),
                               mb.staleness.to(dev), mb.seq_ids.to(dev), self.cfg.pg)
            share = mb.num_sequences / total  # the step's loss is the mean over sequences
            (loss * share).backward()
            rec["loss"] += float(loss.detach()) * share
            rec["train_tokens"] += int(mb.ids.numel())
            name = f"{key[0]}:{key[1]}"
            p = per.setdefault(name, {"kl_sum": 0.0, "tok": 0.0})
            p["kl_sum"] += m["reverse_kl"] * m["tokens"]
            p["tok"] += m["tokens"]
            rec["mask_frac"] += m["mask_frac"] * share
        rec["grad_norm"] = self.update()
        tok = sum(p["tok"] for p in per.values())
        rec["reverse_kl"] = sum(p["kl_sum"] for p in per.values()) / max(tok, 1.0)
        for name, p in per.items():
            rec[f"kl/{name}"] = p["kl_sum"] / max(p["tok"], 1.0)
        for (d, e), atts in by_key.items():
            for k, v in attempt_stats(atts).items():
                if k != "task_reward":  # per-task means are for held-out pairing, not step records
                    rec[f"{k}/{d}:{e}"] = v
        return rec

    def progress_text(self, rec: dict) -> str:
        return f"reverse KL {rec['reverse_kl']:.3f}"

    def plot(self) -> str | None:
        png = os.path.join(self.cfg.out, "distill.png")
        ok = plot_distill(os.path.join(self.cfg.out, "metrics.jsonl"), png, [s.name for s in self.cfg.teachers])
        return png if ok else None

    def result(self, after: Any, interrupted: bool) -> DistillResult:
        return DistillResult(self.cfg.out, self.step, self.teacher_eval, self.before, after, interrupted=interrupted)

    # ---- checkpoints ---------------------------------------------------------------------------------------
    def state_extra(self) -> dict[str, Any]:
        return {"draws": self.draws, "teacher_eval": self.teacher_eval, "config": jsonable(asdict(self.cfg))}

    def load_state_extra(self, st: dict) -> None:
        self.draws, self.teacher_eval = st["draws"], st["teacher_eval"]


def train_distill(cfg: DistillConfig, resume: bool = False, runner: Any = None) -> DistillResult:
    return DistillTrainer(cfg, resume=resume, runner=runner).run()


__all__ = ["DistillConfig", "DistillResult", "DistillTrainer", "load_teacher", "train_distill"]
