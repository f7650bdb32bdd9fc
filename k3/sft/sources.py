"""The default SFT data (no download): oracle trajectories of the practice worlds' train tasks plus
generated instruction-following items; and the held-out material the evaluation uses (held-out world
tasks and items, never trained on).

The worlds come from `k3.envs.worlds`: WORLDS (name -> world), make_world(name), task_seeds(split, n,
world=...) with disjoint "train" / "heldout" splits, oracle_trajectories(world, seeds) -> [{"messages",
"tools", "meta"}].
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Sequence

from k3.sft import effort, instruct
from k3.sft import eval as sft_eval
from k3.sft.data import conversation


def _worlds() -> Any:
    import k3.envs.worlds as worlds  # imported on use: the package is optional for --data runs

    return worlds


def world_conversations(split: str, per_world: int, worlds: Sequence[str] | None = None, max_difficulty: int = 3,
                        thinking_effort: str | None = None) -> list[dict]:
    """Oracle trajectories of the first `per_world` tasks of difficulty <= max_difficulty of each world in
    `split`, as conversations (meta: world, seed, difficulty, ...)."""
    reg = _worlds()
    out = []
    for name in (sorted(reg.WORLDS) if worlds is None else worlds):
        got: list[dict] = []
        start = 0
        while len(got) < per_world:
            seeds = reg.task_seeds(split, 2 * per_world, world=name, **({"start": start} if start else {}))
            fresh = [s for s in seeds if s >= start]
            if not fresh:
                break
            for seed, t in zip(fresh, reg.oracle_trajectories(name, fresh)):
                meta = dict(t.get("meta") or {})
                if int(meta.get("difficulty", 1)) <= max_difficulty and len(got) < per_world:
                    got.append(conversation(t["messages"], t.get("tools"), thinking_effort,
                                            f"<{name} {split} {meta.get('seed', seed)}>",
                                            **(meta | {"world": name, "seed": meta.get("seed", seed)})))
            start = max(fresh) + 1
        out += got
    return out


def with_effort(conv: dict, thinking_effort: str) -> dict:
    """A world conversation at `thinking_effort`: its reasoning expanded to that effort (k3.sft.effort)."""
    return conv | {"messages": effort.expand_trajectory(conv["messages"], thinking_effort),
                   "thinking_effort": thinking_effort}


def lean_tools(conv: dict, distractors: int) -> dict:
    """`conv` declaring only the tools its assistant calls plus `distractors` others of its list (chosen
    from the conversation's seed; the declaration order is kept). A world declares 8-13 tools, ~1.3-2.2K
    tokens of k3-tiny's tokenizer: most of a trajectory's context, none of its targets."""
    tools = conv.get("tools") or []
    used = {c.get("function", c).get("name") for m in conv["messages"] if m.get("role") == "assistant"
            for c in (m.get("tool_calls") or [])}
    rest = [t for t in tools if t.get("function", t).get("name") not in used]
    seed = (conv.get("meta") or {}).get("seed", 0)
    keep = {id(t) for t in random.Random(f"lean {seed}").sample(rest, min(distractors, len(rest)))}
    return conv | {"tools": [t for t in tools if t.get("function", t).get("name") in used or id(t) in keep]}


def evenly(k: int, fraction: float) -> bool:
    """True for `fraction` of k = 0, 1, 2, ... spread evenly (0.5: the odd k)."""
    return int((k + 1) * fraction) > int(k * fraction)


def default_train_conversations(worlds: Sequence[str], world_tasks: int, max_difficulty: int,
                                instruct_items: int, efforts: Sequence[str] = effort.EFFORT_LEVELS,
                                lean_fraction: float = 0.0, lean_distractors: int = 2) -> list[dict]:
    """The training mix: world trajectories first, then the instruction items (the packer reorders). The
    k-th conversation of each kind reasons at efforts[k % len(efforts)] (an empty `efforts`: every
    conversation keeps its one-line reasoning and renders at the run's thinking_effort); `lean_fraction` of
    the trajectories (evenly spread) declare only their tools plus `lean_distractors` (`lean_tools`)."""
    convs = world_conversations("train", world_tasks, worlds, max_difficulty) if world_tasks and worlds else []
    convs = [lean_tools(c, lean_distractors) if evenly(k, lean_fraction) else c for k, c in enumerate(convs)]
    items = instruct.instruct_items("train", instruct_items)
    if not efforts:
        return convs + [instruct.item_conversation(it) for it in items]
    return ([with_effort(c, effort.effort_for(k, efforts)) for k, c in enumerate(convs)]
            + [instruct.item_conversation(it, effort.effort_for(k, efforts)) for k, it in enumerate(items)])


class EasiestFirst:
    """A worlds registry whose task_seeds(split, n, world) are that split's tasks in order of difficulty
    (easiest first; ties by seed) among the first `pool` of them: the evaluation's episodes."""

    def __init__(self, registry: Any, pool: int = 64) -> None:
        self.registry, self.pool = registry, pool
        self.WORLDS = registry.WORLDS
        self.make_world = registry.make_world

    def task_seeds(self, split: str, n: int, world: str | None = None) -> list[int]:
        seeds = self.registry.task_seeds(split, max(n, self.pool), world=world)
        env = self.make_world(world)
        try:
            levels = []
            for s in seeds:
                env.reset(s)
                levels.append((env.task.difficulty, s))
        finally:
            env.close()
        return [s for _, s in sorted(levels)[:n]]


@dataclass
class HeldOut:
    """What the behavioural evaluation reads (see k3.sft.eval)."""

    trajectories: list[dict] = field(default_factory=list)  # oracle trajectories of held-out tasks
    tool_turns: int = 0
    instruct_items: list[dict] = field(default_factory=list)
    worlds: tuple[str, ...] = ()  # episodes: the easiest `tasks_per_world` held-out tasks of each
    tasks_per_world: int = 0
    registry: Any = None
    effort_prompts: list = field(default_factory=list)  # (messages, tools) requests for the thinking length
    efforts: tuple[str, ...] = ()
    effort_max_new_tokens: int = 256


def default_heldout(worlds: Sequence[str], max_difficulty: int, tool_turns: int, instruct_n: int,
                    episodes_per_world: int, effort_prompts: int = 0, efforts: Sequence[str] = (),
                    effort_max_new_tokens: int = 256) -> HeldOut:
    """Held-out trajectories (teacher-forced tool calls; the training mix's difficulties), instruction
    items, the worlds whose easiest held-out tasks are played, and `effort_prompts` requests (from the same
    trajectories and items) whose reasoning length is measured at each of `efforts`."""
    per_world = max(1, -(-tool_turns // (2 * max(1, len(worlds))))) if worlds and tool_turns else 0
    trajs = world_conversations("heldout", per_world, worlds, max_difficulty) if per_world else []
    registry = EasiestFirst(_worlds()) if worlds and episodes_per_world else None
    items = instruct.instruct_items("heldout", max(instruct_n, effort_prompts))
    prompts = sft_eval.effort_prompts(trajs, items, effort_prompts) if efforts else []
    return HeldOut(trajs, tool_turns, items[:instruct_n], tuple(worlds), episodes_per_world, registry,
                   prompts, tuple(efforts), effort_max_new_tokens)



def validation_conversations(worlds: Sequence[str], max_difficulty: int, n: int,
                             efforts: Sequence[str] = effort.EFFORT_LEVELS) -> list[dict]:
    """Held-out conversations for the validation loss: half world trajectories, half items, at the
    training mix's efforts."""
    k = (n // 2) // max(1, len(worlds)) if worlds else 0
    trajs = world_conversations("heldout", k, worlds, max_difficulty) if k else []
    items = instruct.instruct_items("heldout", n - len(trajs))
    if not efforts:
        return trajs + [instruct.item_conversation(it) for it in items]
    return ([with_effort(c, effort.effort_for(j, efforts)) for j, c in enumerate(trajs)]
            + [instruct.item_conversation(it, effort.effort_for(j, efforts)) for j, it in enumerate(items)])
