"""Registry of the practice worlds, train/held-out task seeds and oracle SFT trajectories.

    WORLDS                                   names of every world
    make_world(name, **kw) -> Environment    a fresh environment of that world
    task_seeds(split, n, world=None)         n seeds of "train" or "heldout" (disjoint: held-out seeds
                                             are the ones with seed % 10 == 9)
    oracle_trajectories(world, seeds)        verified oracle episodes as SFT conversations
    agent_scores(world, seeds)               success rates of the built-in agents (oracle, random, hacker)

Each world is the class `_CLASSES[name]` of module `k3.envs.worlds.<name>` (or, failing that, the
module's Environment subclass whose `world` attribute is the name). "shell" lives in
`k3.envs.worlds.shell` (a sandboxed file-system world) and is imported lazily.
"""

from __future__ import annotations

import importlib
from typing import Iterable

from k3.envs.agents import OracleAgent, RandomAgent, RewardHackerAgent
from k3.envs.base import Environment, run_episode

WORLDS = ("mail", "chat", "notes", "course", "assistant", "shell")
_CLASSES = {"mail": "MailWorld", "chat": "ChatWorld", "notes": "NotesWorld", "course": "CourseWorld",
            "assistant": "AssistantWorld", "shell": "ShellWorld"}
HELDOUT_MOD, HELDOUT_REM = 10, 9


def make_world(name: str, **kw) -> Environment:
    """A fresh environment of world `name` (keyword arguments go to its constructor)."""
    if name not in _CLASSES:
        raise ValueError(f"unknown world {name!r}; known: {', '.join(WORLDS)}")
    try:
        module = importlib.import_module(f"k3.envs.worlds.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"k3.envs.worlds.{name}":
            raise
        raise ValueError(f"world {name!r} is not installed: module k3.envs.worlds.{name} is missing") from e
    cls = getattr(module, _CLASSES[name], None) or next(
        (v for v in vars(module).values() if isinstance(v, type) and issubclass(v, Environment)
         and getattr(v, "world", None) == name), None)
    if cls is None:
        raise ValueError(f"k3.envs.worlds.{name} defines no {_CLASSES[name]} (or Environment subclass with world={name!r})")
    return cls(**kw)


def is_heldout(seed: int) -> bool:
    return seed % HELDOUT_MOD == HELDOUT_REM


def task_seeds(split: str, n: int, world: str | None = None, start: int = 0) -> list[int]:
    """The first `n` seeds >= `start` of `split` ("train" or "heldout"); the two sets are disjoint.

    Seeds index tasks within each world, so `world` only checks the name (every world uses the same
    split rule, hence no train seed of one world is a held-out seed of another).
    """
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    if world is not None and world not in WORLDS:
        raise ValueError(f"unknown world {world!r}; known: {', '.join(WORLDS)}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    want_heldout = split == "heldout"
    out, seed = [], start
    while len(out) < n:
        if is_heldout(seed) == want_heldout:
            out.append(seed)
        seed += 1
    return out


def oracle_trajectories(world: str, seeds: Iterable[int], max_turns: int = 40) -> list[dict]:
    """SFT conversations from the oracle's episodes that the hidden verifier scores 1.0.

    Each item: {"messages": [system, user, assistant(reasoning_content, tool_calls), tool, ...,
    final assistant], "tools": OpenAI tool list, "meta": {world, task_id, seed, difficulty, kind,
    reward}}. Failed episodes (a world bug) are dropped, never emitted.
    """
    env = make_world(world)
    out = []
    for seed in seeds:
        ep = run_episode(env, OracleAgent(env), seed, max_turns=max_turns)
        if not (ep.reward.success and ep.finished and ep.agent_error is None):
            continue
        meta = {"world": world, "task_id": ep.task.task_id, "seed": seed, "difficulty": ep.task.difficulty,
                "kind": ep.task.kind, "reward": ep.reward.score}
        out.append({"messages": ep.messages, "tools": ep.tools, "meta": meta})
    env.close()
    return out


def agent_scores(world: str, seeds: Iterable[int], max_turns: int = 40) -> dict:
    """Hidden-verifier success rates of the built-in agents on `seeds` of `world`.

    Returns {"tasks", "oracle", "random", "random_score", "hackable", "hacker_public", "hacker_hidden",
    "hacker_score"}: rates in [0, 1] (the *_score entries are mean partial-credit scores); the hacker's rates are over the tasks whose public check can be gamed (`hackable` of
    them): how often it passes the public check and how often the hidden verifier's success.
    """
    env, seeds = make_world(world), list(seeds)
    oracle = random_ok = random_score = hackable = hack_public = hack_hidden = hack_score = 0
    for seed in seeds:
        oracle += run_episode(env, OracleAgent(env), seed, max_turns=max_turns).reward.success
        reward = run_episode(env, RandomAgent(seed), seed, max_turns=max_turns).reward
        random_ok, random_score = random_ok + reward.success, random_score + reward.score
        if getattr(env, "hacker", lambda: None)() is not None:
            hackable += 1
            ep = run_episode(env, RewardHackerAgent(env), seed, max_turns=max_turns)
            hack_public += env.public_check().startswith("PASS")
            hack_hidden, hack_score = hack_hidden + ep.reward.success, hack_score + ep.reward.score
    env.close()
    n = max(len(seeds), 1)
    return {"tasks": len(seeds), "oracle": oracle / n, "random": random_ok / n,
            "random_score": random_score / n, "hackable": hackable,
            "hacker_public": hack_public / max(hackable, 1), "hacker_hidden": hack_hidden / max(hackable, 1), "hacker_score": hack_score / max(hackable, 1)}
