"""The default SFT data (no download): oracle trajectories of the practice worlds' train tasks plus
generated instruction-following items; and the held-out material the evaluation uses (held-out world
tasks and items, never trained on).

The worlds come from `k3.envs.worlds`: WORLDS (name -> world), make_world(name), task_seeds(split, n,
world=...) with disjoint "train" / "heldout" splits, oracle_trajectories(world, seeds) -> [{"messages",
"tools", "meta"}].
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from k3.sft import instruct
from k3.sft.data import conversation


def _worlds() -> Any:
    import k3.envs.worlds as worlds  # imported on use: the package is optional for --data runs

    return worlds


def world_conversations(split: str, per_world: int, thinking_effort: str | None = None) -> list[dict]:
    """Oracle trajectories of `per_world` tasks of every world in `split`, as conversations."""
    worlds = _worlds()
    out = []
    for name in sorted(worlds.WORLDS):
        seeds = worlds.task_seeds(split, per_world, world=name)
        for seed, t in zip(seeds, worlds.oracle_trajectories(name, seeds)):
            meta = dict(t.get("meta") or {})
            meta.setdefault("seed", seed)
            out.append(conversation(t["messages"], t.get("tools"), thinking_effort, f"<{name} {split} {seed}>",
                                    world=name, **{k: v for k, v in meta.items() if k != "world"}))
    return out


def default_train_conversations(world_tasks: int, instruct_items: int) -> list[dict]:
    """The training mix: world trajectories first, then the instruction items (the packer reorders)."""
    convs = world_conversations("train", world_tasks) if world_tasks else []
    return convs + [instruct.item_conversation(it) for it in instruct.instruct_items("train", instruct_items)]


@dataclass
class HeldOut:
    """What the behavioural evaluation reads (see k3.sft.eval)."""

    trajectories: list[dict] = field(default_factory=list)  # oracle trajectories of held-out tasks
    tool_turns: int = 0
    instruct_items: list[dict] = field(default_factory=list)
    tasks: list[tuple[str, int]] = field(default_factory=list)  # (world, seed), easiest first
    make_world: Callable[[str], Any] | None = None


def default_heldout(tool_turns: int, instruct_n: int, episodes: int) -> HeldOut:
    """Held-out trajectories (for teacher-forced tool calls), items and episode tasks. Episode tasks are
    the held-out tasks sorted by difficulty (then world, seed), taken round-robin over the worlds."""
    worlds = _worlds()
    per_world = max(1, -(-max(tool_turns, episodes) // max(1, len(worlds.WORLDS))))
    trajs = world_conversations("heldout", per_world)
    by_world: dict[str, list[tuple[int, int]]] = {}
    for c in trajs:
        by_world.setdefault(c["meta"]["world"], []).append((int(c["meta"].get("difficulty", 1)), c["meta"]["seed"]))
    queues = {w: sorted(v) for w, v in sorted(by_world.items())}
    tasks: list[tuple[str, int]] = []
    while len(tasks) < episodes and any(queues.values()):
        level = min(q[0][0] for q in queues.values() if q)  # easiest remaining difficulty first
        for w, q in queues.items():
            if q and q[0][0] == level and len(tasks) < episodes:
                tasks.append((w, q.pop(0)[1]))
    return HeldOut(trajs, tool_turns, instruct.instruct_items("heldout", instruct_n), tasks, worlds.make_world)


def validation_conversations(n: int, thinking_effort: str | None = None) -> list[dict]:
    """Held-out conversations for the validation loss: half world trajectories, half items."""
    worlds = _worlds()
    k = max(1, (n // 2) // max(1, len(worlds.WORLDS)))
    trajs = world_conversations("heldout", k, thinking_effort)
    items = [instruct.item_conversation(it) for it in instruct.instruct_items("heldout", n - len(trajs))]
    return trajs + items
