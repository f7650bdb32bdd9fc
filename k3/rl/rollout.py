"""Rollout manager on k3's in-process serving engine: groups of G attempts per (task, effort),
per-token behaviour log-probs and policy versions, multi-turn tool loops against k3.envs worlds,
and partial rollouts (docs/rl.md).

    mgr = RolloutManager(engine, tokenizer, RolloutConfig(group_size=8, batch_groups=8))
    groups = mgr.collect(source)      # source: iterator of (Task, effort); returns completed groups
    ... train on groups, sync weights ...
    mgr.weights_updated()             # version += 1; paused attempts continue under the new weights

Partial rollouts: `collect` keeps `batch_groups` groups in flight, steps the engine until the
completed fraction reaches `threshold`, pauses every unfinished request (`Engine.pause`: it keeps
its cache unless memory pressure preempts it, then it is re-prefilled) and returns the completed
groups. The next `collect` resumes them (`Engine.resume`) after topping the batch up with new
groups, so an attempt can span several updates; every generated token carries the version of the
weights that sampled it. With `partial=False` a collect waits until every group is done.

Tool turns: a turn ends at `<|end_of_msg|>`; its tool calls (k3.chat.parse) run in the task's
environment (resumed for the calls, paused while the model generates) and the rendered tool
messages plus the next generation prompt are appended; the next turn is a new engine request on
the whole context (the prefix cache's message-end checkpoints make that a short prefill).

Judged tasks: a task without a verifier (`Task.score is None`) is scored once its whole group has
finished, by the manager's `group_scorer` (k3.rl.judged: the GenRM over the G final answers, with
views of their worlds); a scorer that raises or returns anything but G finite numbers gives every
attempt `judge_fallback` (counted in `judge_failures`). Scores are clamped to [0, 1].
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from k3.chat import parse, render
from k3.rl.effort import BudgetTracker, EffortConfig, effort_reward, max_tokens_for
from k3.rl.tasks.base import Task
from k3.serve.sampling import SamplingParams

NO_VERSION = -1  # version tag of tokens the model did not sample (prompt, tool results)


@dataclass
class RolloutConfig:
    """group_size: G attempts per (task, effort). batch_groups: groups per training batch.
    partial: pause unfinished attempts once `threshold` of the batch's groups completed.
    temperature: sampling temperature (1.0: the engine's log-probs are those of the sampled
    distribution). max_turns: tool-loop turns per attempt. seed: base of per-request seeds."""

    group_size: int = 8
    batch_groups: int = 8
    partial: bool = True
    threshold: float = 0.75
    temperature: float = 1.0
    max_turns: int = 4
    seed: int = 0
    thinking: bool = True
    judge_fallback: float = 0.0

    def validate(self) -> "RolloutConfig":
        if self.group_size < 1 or self.batch_groups < 1 or self.max_turns < 1:
            raise ValueError("group_size, batch_groups and max_turns must be >= 1")
        if not 0 < self.threshold <= 1:
            raise ValueError(f"threshold must be in (0, 1], got {self.threshold}")
        if self.temperature <= 0:
            raise ValueError("RL sampling needs temperature > 0 (greedy has no behaviour distribution)")
        if not 0 <= self.judge_fallback <= 1:
            raise ValueError(f"judge_fallback must be in [0, 1], got {self.judge_fallback}")
        return self


@dataclass
class Attempt:
    """One sampled attempt. ids: the whole context (prompt, generated tokens, tool results);
    gen / mu / version: per position of ids: sampled by the model, its behaviour log-prob (0.0 when
    not sampled), the weight version that sampled it (NO_VERSION when not sampled)."""

    task: Task
    effort: str
    gid: int
    index: int
    ids: list[int]
    prompt_len: int
    messages: list[dict]
    cap: int
    budget: float
    gen: list[bool] = field(default_factory=list)
    mu: list[float] = field(default_factory=list)
    version: list[int] = field(default_factory=list)
    env: Any = None
    request_id: str | None = None
    turn_start: int = 0
    turns: int = 0
    finished: bool = False
    finish_reason: str | None = None
    last_message: dict = field(default_factory=dict)
    score: float = 0.0
    reward: float = 0.0
    think_tokens: int = 0
    answer_tokens: int = 0
    pauses: int = 0

    @property
    def generated(self) -> int:
        return sum(self.gen)


@dataclass
class Group:
    """G attempts at one (task, effort)."""

    gid: int
    task: Task
    effort: str
    attempts: list[Attempt]

    @property
    def done(self) -> bool:
        return all(a.finished for a in self.attempts)


class RolloutManager:
    def __init__(self, engine: Any, tokenizer: Any, cfg: RolloutConfig | None = None,
                 effort_cfg: EffortConfig | None = None, budgets: BudgetTracker | None = None,
                 group_scorer: Callable[[Task, list[dict], list[Any]], list[float]] | None = None) -> None:
        """group_scorer: scores the groups of judged tasks (Task.score None); module docstring."""
        self.engine, self.tok = engine, tokenizer
        self.group_scorer = group_scorer
        self.cfg = (cfg or RolloutConfig()).validate()
        self.effort_cfg = (effort_cfg or EffortConfig()).validate()
        self.budgets = budgets or BudgetTracker()
        self.close_id = tokenizer.special_tokens["<|close|>"]
        self.version = 0
        self.active: list[Group] = []
        self.by_request: dict[str, Attempt] = {}
        self.paused: list[Attempt] = []
        self.next_gid = 0
        self.counters = {"paused": 0, "resumed": 0, "tool_calls": 0, "render_fallbacks": 0, "engine_errors": 0,
                         "judge_failures": 0}

    # ---- public ------------------------------------------------------------------------------------
    def weights_updated(self) -> None:
        """The engine's weights changed (after k3.rl.sync.sync_weights): tag new tokens with version + 1."""
        self.version += 1

    def collect(self, source: Iterator[tuple[Task, str]] | None, max_steps: int = 10_000_000) -> list[Group]:
        """Top the batch up from `source` (None: no new groups), resume paused attempts, step the
        engine until enough groups completed, pause the rest (partial mode). Returns completed groups
        (at most batch_groups), oldest first."""
        if source is not None:
            while len(self.active) < self.cfg.batch_groups:
                item = next(source, None)
                if item is None:
                    break
                self._start_group(*item)
        self._resume_paused()
        n = len(self.active)
        need = math.ceil(self.cfg.threshold * n) if self.cfg.partial else n
        for _ in range(max_steps):
            if sum(g.done for g in self.active) >= need or not self.engine.has_unfinished():
                break
            self._step()
        else:
            raise RuntimeError(f"rollouts did not complete within {max_steps} engine steps")
        done = [g for g in self.active if g.done][: self.cfg.batch_groups]
        self.active = [g for g in self.active if not any(g is d for d in done)]
        for g in done:
            if g.task.score is None:
                self._judge(g)
        if self.cfg.partial:
            self._pause_unfinished()
        return done

    def abort_all(self) -> None:
        """Cancel every in-flight attempt (end of a run)."""
        for rid in list(self.by_request):
            self.engine.abort(rid)
        for g in self.active:
            for a in g.attempts:
                if a.env is not None:
                    a.env.close()
        self.active, self.by_request, self.paused = [], {}, []

    # ---- groups and turns ----------------------------------------------------------------------------
    def _start_group(self, task: Task, effort: str) -> None:
        if task.score is None and self.group_scorer is None:
            raise ValueError(f"task {task.task_id} has no verifier: RL on it needs a judge (group_scorer)")
        gid = self.next_gid
        self.next_gid += 1
        ref_len = task.budget_tokens if task.budget_tokens is not None else len(self.tok.encode(task.reference))
        budget = self.budgets.budget(task.task_id, ref_len)
        cap = max_tokens_for(budget, effort, self.effort_cfg)
        ids, _ = render(task.messages, self.tok, task.tools, thinking=self.cfg.thinking, thinking_effort=effort,
                        add_generation_prompt=True)
        attempts = []
        for i in range(self.cfg.group_size):
            a = Attempt(task=task, effort=effort, gid=gid, index=i, ids=list(ids), prompt_len=len(ids),
                        messages=[dict(m) for m in task.messages], cap=cap, budget=budget,
                        gen=[False] * len(ids), mu=[0.0] * len(ids), version=[NO_VERSION] * len(ids))
            if task.make_env is not None:
                a.env = task.make_env()
                a.env.pause()
            attempts.append(a)
            self._submit(a)
        self.active.append(Group(gid, task, effort, attempts))

    def _submit(self, a: Attempt) -> None:
        room = min(a.cap - a.generated, self.engine.max_tokens_limit(len(a.ids)))
        if room < 1:
            return self._finish(a, "length")
        seed = (self.cfg.seed * 1_000_003 + a.gid * 4099 + a.index * 131 + a.turns) % (2**62)
        params = SamplingParams(temperature=self.cfg.temperature, max_tokens=room, seed=seed, logprobs=0)
        a.turn_start = len(a.ids)
        try:
            a.request_id = self.engine.add_request(a.ids, params)
        except ValueError:  # context full: the attempt ends here
            self.counters["engine_errors"] += 1
            return self._finish(a, "length")
        self.by_request[a.request_id] = a

    def _step(self) -> None:
        for out in self.engine.step():
            a = self.by_request.get(out.request_id)
            if a is None:
                continue
            for tok, (lp, _) in zip(out.new_token_ids, out.new_logprobs):
                a.ids.append(tok)
                a.gen.append(True)
                a.mu.append(float(lp) if lp is not None else 0.0)
                a.version.append(self.version)
            if out.finished:
                del self.by_request[out.request_id]
                a.request_id = None
                self._end_turn(a, out.finish_reason, out.error)

    def _end_turn(self, a: Attempt, reason: str | None, error: str | None) -> None:
        a.turns += 1
        out_ids = a.ids[a.turn_start:]
        msg = parse(out_ids, self.tok)
        a.last_message = {"role": "assistant", **msg}
        calls = msg.get("tool_calls") or []
        if reason == "error":
            self.counters["engine_errors"] += 1
        if (a.env is None or not calls or reason != "stop" or a.turns >= self.cfg.max_turns
                or a.generated >= a.cap):
            return self._finish(a, reason or "stop")
        self.counters["tool_calls"] += len(calls)
        a.messages.append(a.last_message)
        a.env.resume()
        try:
            results = a.env.step(calls)
        finally:
            a.env.pause()
        suffix = self._continuation(a, results)
        if suffix is None:
            return self._finish(a, "render")
        a.messages.extend(results)
        a.ids += suffix
        a.gen += [False] * len(suffix)
        a.mu += [0.0] * len(suffix)
        a.version += [NO_VERSION] * len(suffix)
        self._submit(a)

    def _continuation(self, a: Attempt, results: list[dict]) -> list[int] | None:
        """Tokens of the tool messages and the next generation prompt, as rendered after the turn."""
        kw = dict(thinking=self.cfg.thinking, thinking_effort=a.effort)
        try:
            before, _ = render(a.messages, self.tok, a.task.tools, **kw)
            after, _ = render(a.messages + results, self.tok, a.task.tools, add_generation_prompt=True, **kw)
        except Exception:  # a parsed message the renderer refuses (model garbage): end the attempt
            self.counters["render_fallbacks"] += 1
            return None
        if after[: len(before)] != before:
            self.counters["render_fallbacks"] += 1
            return None
        return after[len(before):]

    def _finish(self, a: Attempt, reason: str) -> None:
        a.finished, a.finish_reason = True, reason
        gen_ids = [t for t, g in zip(a.ids, a.gen) if g]
        a.think_tokens = gen_ids.index(self.close_id) if self.close_id in gen_ids else len(gen_ids)
        a.answer_tokens = len(gen_ids) - a.think_tokens
        if a.task.score is None:  # judged with its group (`_judge`); the world stays open for the judge
            return
        try:
            a.score = float(a.task.score(a.last_message, a.env))
        except Exception:
            a.score = 0.0
        self._settle(a)

    def _settle(self, a: Attempt) -> None:
        """Reward from the score (effort budget), budget statistics, close the world."""
        n = a.generated
        a.reward = effort_reward(a.score, n, a.budget, a.effort, self.effort_cfg)
        self.budgets.observe(a.task.task_id, a.effort, a.score >= 1.0, n, capped=n >= a.cap)
        if a.env is not None:
            a.env.close()

    def _judge(self, g: Group) -> None:
        """Score a finished judged group with the group scorer; failures give the fallback score."""
        n = len(g.attempts)
        try:
            scores = [float(s) for s in self.group_scorer(g.task, [a.last_message for a in g.attempts],
                                                          [a.env for a in g.attempts])]
            if len(scores) != n or not all(math.isfinite(s) for s in scores):
                raise ValueError(f"the judge returned {len(scores)} scores for {n} attempts or a non-finite one")
            scores = [min(1.0, max(0.0, s)) for s in scores]
        except Exception:  # judge garbage or a dead judge: the documented failure reward, never a crash
            self.counters["judge_failures"] += 1
            scores = [self.cfg.judge_fallback] * n
        for a, s in zip(g.attempts, scores):
            a.score = s
            self._settle(a)

    # ---- partial rollouts ------------------------------------------------------------------------------
    def _pause_unfinished(self) -> None:
        for rid, a in self.by_request.items():
            self.engine.pause(rid)
            a.pauses += 1
            self.paused.append(a)
        self.counters["paused"] += len(self.paused)

    def _resume_paused(self) -> None:
        for a in self.paused:
            if a.request_id is not None:
                self.engine.resume(a.request_id)
                self.counters["resumed"] += 1
        self.paused = []


__all__ = ["NO_VERSION", "Attempt", "Group", "RolloutConfig", "RolloutManager"]
