"""Running agents against the practice worlds and BFCL: the loops behind `k3 eval`.

    report = evaluate_worlds(agent_factory, WorldsEvalConfig(tasks=10, harness="random"))
    print(format_table(report))

`agent_factory(env, seed) -> Agent` gives the agent of one episode: a shared endpoint / in-process
engine agent (thread-safe), or a fresh scripted agent (oracle, random). Episodes run in a thread
pool (`concurrency`): for an endpoint these are concurrent HTTP requests, for an `EngineAgent`
concurrent callers whose turns the engine batches. Each episode gets its own environment (closed
afterwards); a world or sandbox failure is recorded on its episode and never ends the run.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from k3.envs.base import Agent, Environment, run_episode
from k3.envs.harness import HarnessEnv, get_profile, sample_profile

AgentFactory = Callable[[Environment, int], Agent]


@dataclass
class WorldsEvalConfig:
    """worlds: names (None = every registered world); tasks: episodes per world, on the first
    `tasks` seeds of `split`; harness: a profile name, "random" (sampled per episode from the
    seed) or None (the world as declared); concurrency: episodes in flight."""

    worlds: tuple[str, ...] | None = None
    tasks: int = 10
    split: str = "heldout"
    harness: str | None = None
    max_turns: int = 24
    concurrency: int = 8


@dataclass
class EpisodeRecord:
    world: str
    seed: int
    task_id: str = ""
    kind: str = ""
    difficulty: int = 0
    harness: str = "none"
    score: float = 0.0
    success: bool = False
    turns: int = 0
    finished: bool = False
    tool_calls: int = 0
    tool_errors: int = 0
    invalid_calls: int = 0
    agent_error: str | None = None
    env_error: str | None = None
    seconds: float = 0.0
    details: dict = field(default_factory=dict)
    messages: list | None = None


class OnReset:
    """An agent built from `make()` at the first turn of each episode (oracles need the reset task)."""

    def __init__(self, make: Callable[[], Agent]) -> None:
        self.make, self.agent = make, None

    def act(self, messages: list[dict], tools: list[dict]) -> dict:
        if self.agent is None or not any(m.get("role") == "assistant" for m in messages):
            self.agent = self.make()
        return self.agent.act(messages, tools)


def oracle_factory(env: Environment, seed: int) -> Agent:
    return OnReset(env.oracle)


def random_factory(env: Environment, seed: int) -> Agent:
    from k3.envs.agents import RandomAgent  # the practice worlds' random baseline

    return RandomAgent(seed)


def shared(agent: Agent) -> AgentFactory:
    """One thread-safe agent (endpoint, engine) for every episode."""
    return lambda env, seed: agent


def default_registry() -> Any:
    """The practice worlds' registry (`WORLDS`, `make_world`, `task_seeds`)."""
    import k3.envs.worlds as registry

    if not hasattr(registry, "WORLDS"):
        raise ImportError("k3.envs.worlds has no world registry (WORLDS, make_world, task_seeds)")
    return registry


def check_worlds(names: tuple[str, ...] | None, registry: Any) -> tuple[str, ...]:
    """The worlds to run (ValueError naming the unknown ones)."""
    known = tuple(registry.WORLDS)
    if not names:
        return known
    bad = [n for n in names if n not in known]
    if bad:
        raise ValueError(f"unknown world(s) {', '.join(bad)}; known: {', '.join(known)}")
    return tuple(names)


def _profile(harness: str | None, world: str, seed: int) -> Any:
    if harness is None:
        return None
    if harness == "random":
        return sample_profile(random.Random(f"harness:{world}:{seed}"))
    return get_profile(harness)


def run_one(world: str, seed: int, factory: AgentFactory, cfg: WorldsEvalConfig, registry: Any,
            keep_messages: bool = False) -> EpisodeRecord:
    """One episode of `world` task `seed`; never raises."""
    rec = EpisodeRecord(world, seed)
    t0 = time.perf_counter()
    env = None
    try:
        env = registry.make_world(world)
        profile = _profile(cfg.harness, world, seed)
        if profile is not None:
            env, rec.harness = HarnessEnv(env, profile), profile.name
        ep = run_episode(env, factory(env, seed), seed, max_turns=cfg.max_turns,
                         view=env.view if profile is not None else None)
        rec.task_id, rec.kind, rec.difficulty = ep.task.task_id, ep.task.kind, ep.task.difficulty
        rec.score, rec.success, rec.turns, rec.finished = ep.reward.score, ep.reward.success, ep.turns, ep.finished
        rec.tool_calls, rec.tool_errors, rec.invalid_calls = ep.stats.calls, ep.stats.errors, ep.stats.invalid
        rec.agent_error, rec.details = ep.agent_error, ep.reward.details
        rec.messages = ep.messages if keep_messages else None
    except Exception as e:  # a world / sandbox failure is this episode's result, not the run's end
        rec.env_error = f"{type(e).__name__}: {e}"
    finally:
        if env is not None:
            try:
                env.close()
            except Exception as e:
                rec.env_error = rec.env_error or f"close failed: {type(e).__name__}: {e}"
    rec.seconds = time.perf_counter() - t0
    return rec


def evaluate_worlds(factory: AgentFactory, cfg: WorldsEvalConfig, registry: Any = None, *,
                    keep_messages: bool = False, progress: Callable[[EpisodeRecord], None] | None = None) -> dict:
    """Run `cfg.tasks` held-out (or train) tasks per world -> {"config", "worlds", "episodes"}."""
    registry = registry or default_registry()
    worlds = check_worlds(cfg.worlds, registry)
    jobs = [(w, s) for w in worlds for s in registry.task_seeds(cfg.split, cfg.tasks, w)]
    t0 = time.perf_counter()

    def one(job: tuple[str, int]) -> EpisodeRecord:
        rec = run_one(job[0], job[1], factory, cfg, registry, keep_messages)
        if progress is not None:
            progress(rec)
        return rec

    with ThreadPoolExecutor(max(1, cfg.concurrency)) as pool:
        records = list(pool.map(one, jobs))
    return {"config": asdict(cfg), "seconds": time.perf_counter() - t0,
            "worlds": {w: summarize([r for r in records if r.world == w]) for w in worlds},
            "all": summarize(records), "episodes": [asdict(r) for r in records]}


def summarize(records: list[EpisodeRecord]) -> dict:
    n = len(records)
    mean = lambda xs: sum(xs) / n if n else 0.0  # noqa: E731
    return {"episodes": n, "success_rate": mean([r.success for r in records]),
            "mean_score": mean([r.score for r in records]), "mean_turns": mean([r.turns for r in records]),
            "tool_errors": sum(r.tool_errors for r in records), "invalid_calls": sum(r.invalid_calls for r in records),
            "agent_errors": sum(r.agent_error is not None for r in records),
            "env_errors": sum(r.env_error is not None for r in records)}


def format_table(report: dict) -> str:
    """The per-world success table."""
    head = (f"{'world':<12}{'episodes':>9}{'success':>9}{'score':>8}{'turns':>7}{'tool err':>9}{'invalid':>8}"
            f"{'agent err':>10}{'env err':>8}")
    rows = [head, "-" * len(head)]
    for name, s in [*report["worlds"].items(), ("all", report["all"])]:
        rows.append(f"{name:<12}{s['episodes']:>9}{100 * s['success_rate']:>8.1f}%{s['mean_score']:>8.3f}"
                    f"{s['mean_turns']:>7.1f}{s['tool_errors']:>9}{s['invalid_calls']:>8}{s['agent_errors']:>10}"
                    f"{s['env_errors']:>8}")
    return "\n".join(rows)


# ------------------------------------------------------------------------------------------- BFCL


def evaluate_bfcl(category: str, agent: Agent | None, *, limit: int | None = None, concurrency: int = 8,
                  replay: bool = False) -> dict:
    """BFCL `category` with `agent` (or the ground-truth replay) -> {"summary", "entries"}."""
    from k3.envs.bfcl import RUNNERS, ReplayAgent, load_category, summarize as bfcl_summary

    entries = load_category(category, limit)
    runner = RUNNERS[category]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max(1, concurrency)) as pool:
        results = list(pool.map(lambda e: runner(e, ReplayAgent(e) if replay else agent), entries))
    summary = bfcl_summary(category, results)
    summary["seconds"] = time.perf_counter() - t0
    summary["agent"] = "ground-truth replay" if replay else type(agent).__name__
    return {"summary": summary, "entries": [asdict(r) for r in results]}
