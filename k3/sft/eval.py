"""Behavioural evaluation of an SFT model on held-out prompts (never trained on).

* tool calls (teacher-forced): at each assistant turn of a held-out oracle trajectory that calls tools,
  the model writes the next turn from the oracle's prefix. `valid`: the turn parses (k3.chat.parse) into
  at least one call and every call names a declared tool with arguments valid against its JSON schema
  (k3.envs.schema.parse_call). `right_tool`: the first call's name equals the oracle's.
* instruction following: held-out generated items (k3.sft.instruct), the response checked by code.
* episodes: held-out world tasks played end to end through the loop of `k3 eval worlds`
  (k3.envs.evaluate, k3.envs.base.run_episode); success = the hidden verifier's score is 1, reported
  per difficulty (1 = easiest).
* thinking length: mean reasoning tokens per requested thinking effort on held-out requests (tool-call
  points and instruction items); `ordered` when they rise low < high < max.

Generation is greedy (temperature 0) and stops at <|end_of_msg|>; nothing the model writes can raise.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any, Sequence

from k3.envs.schema import parse_call
from k3.sft import instruct


def make_agent(model: Any, tokenizer: Any, *, thinking_effort: str = "low", max_new_tokens: int = 96,
               memory_budget_bytes: int = 256 << 20) -> Any:
    """A greedy in-process agent on `model` (k3.envs.llm_agent.EngineAgent: the serving engine, prefix cache,
    continuous batching); close() it when done. The engine puts the model in eval mode."""
    from k3.envs.llm_agent import AgentConfig, EngineAgent
    from k3.serve.engine import EngineConfig

    cfg = AgentConfig(temperature=0.0, max_new_tokens=max_new_tokens, thinking_effort=thinking_effort)
    return EngineAgent(model, tokenizer, cfg, engine_config=EngineConfig(memory_budget_bytes=memory_budget_bytes,
                                                                         cuda_graphs=False))


def _replies(agent: Any, requests: list[tuple[list[dict], list[dict] | None]]) -> list[dict]:
    """Assistant messages for `requests` (agent.act_batch as EngineAgent's); a request the agent cannot
    serve (longer than the context) gets an empty reply, which scores as a failure."""
    out = agent.act_batch(requests, return_exceptions=True)
    return [r if isinstance(r, dict) else {"role": "assistant", "content": ""} for r in out]


# ----------------------------------------------------------------------------- tool calls


def tool_call_points(trajectories: Sequence[dict], limit: int) -> list[tuple[list[dict], list[dict], dict]]:
    """(prefix messages, tools, the oracle's turn) at every assistant turn with tool calls, round-robin over
    the trajectories so that `limit` points cover many tasks and every turn depth."""
    per = [[(c["messages"][:k], c.get("tools") or [], m) for k, m in enumerate(c["messages"])
            if m.get("role") == "assistant" and m.get("tool_calls")] for c in trajectories]
    points, depth = [], 0
    while len(points) < limit and any(depth < len(p) for p in per):
        points += [p[depth] for p in per if depth < len(p)]
        depth += 1
    return points[:limit]


def eval_tool_calls(agent: Any, trajectories: Sequence[dict], limit: int) -> dict[str, Any]:
    points = tool_call_points(trajectories, limit)
    if not points:
        return {"n": 0}
    replies = _replies(agent, [(msgs, tools) for msgs, tools, _ in points])
    valid = right = 0
    for (_, tools, oracle), reply in zip(points, replies):
        calls = reply.get("tool_calls") or []
        valid += bool(calls) and all(not parse_call(c, tools)[2] for c in calls)
        want = oracle["tool_calls"][0].get("function", oracle["tool_calls"][0]).get("name")
        right += bool(calls) and calls[0]["function"]["name"] == want
    return {"n": len(points), "valid": valid / len(points), "right_tool": right / len(points)}


# ----------------------------------------------------------------------------- instructions


def eval_instructions(agent: Any, items: Sequence[dict]) -> dict[str, Any]:
    if not items:
        return {"n": 0}
    replies = _replies(agent, [([{"role": "user", "content": it["prompt"]}], None) for it in items])
    kinds: dict[str, list[bool]] = defaultdict(list)
    for it, reply in zip(items, replies):
        kinds[it["kind"]].append(instruct.check(it, reply.get("content")))
    passed = sum(sum(v) for v in kinds.values())
    return {"n": len(items), "pass": passed / len(items),
            "per_kind": {k: sum(v) / len(v) for k, v in sorted(kinds.items())}}


# ----------------------------------------------------------------------------- thinking length


def effort_prompts(trajectories: Sequence[dict], items: Sequence[dict], n: int) -> list[tuple[list[dict], Any]]:
    """`n` held-out requests for the thinking-length metric: alternately the first tool-call point of a
    trajectory (prefix up to its first assistant turn, with its tools) and an instruction item."""
    tool = [(msgs, tools) for msgs, tools, _ in tool_call_points(trajectories, len(trajectories))]
    plain = [([{"role": "user", "content": it["prompt"]}], None) for it in items]
    out: list[tuple[list[dict], Any]] = []
    for k in range(max(len(tool), len(plain))):
        out += ([tool[k]] if k < len(tool) else []) + ([plain[k]] if k < len(plain) else [])
    return out[:n]


def eval_thinking_length(agent: Any, requests: Sequence[tuple[list[dict], Any]], efforts: Sequence[str],
                         count_tokens: Any, max_new_tokens: int) -> dict[str, Any]:
    """Mean reasoning length (tokens, `count_tokens(text) -> int`) of the agent's replies to `requests` at
    each thinking effort. The agent is an EngineAgent-like object whose `config` (an AgentConfig) is swapped
    per effort and restored. `ordered`: the means rise strictly in the order of `efforts`."""
    import dataclasses

    if not requests or not efforts:
        return {"n": 0}
    base = agent.config
    means: dict[str, float] = {}
    try:
        for e in efforts:
            agent.config = dataclasses.replace(base, thinking_effort=e, max_new_tokens=max_new_tokens)
            replies = _replies(agent, list(requests))
            means[e] = sum(count_tokens(r.get("reasoning_content") or "") for r in replies) / len(replies)
    finally:
        agent.config = base
    vals = [means[e] for e in efforts]
    return {"n": len(requests), "mean_think_tokens": means,
            "ordered": all(a < b for a, b in zip(vals, vals[1:]))}


# ----------------------------------------------------------------------------- episodes


def eval_episodes(agent: Any, worlds: Sequence[str], tasks_per_world: int, max_turns: int,
                  registry: Any = None) -> dict[str, Any]:
    """The first `tasks_per_world` held-out tasks of each world, played through the `k3 eval worlds` loop
    (k3.envs.evaluate.evaluate_worlds, episodes in parallel on the shared agent): success overall, per
    world and per difficulty (1 = easiest)."""
    if not worlds or not tasks_per_world:
        return {"n": 0}
    from k3.envs.evaluate import WorldsEvalConfig, evaluate_worlds, shared

    cfg = WorldsEvalConfig(worlds=tuple(worlds), tasks=tasks_per_world, split="heldout", max_turns=max_turns)
    eps = evaluate_worlds(shared(agent), cfg, registry)["episodes"]
    by_world, by_level = defaultdict(list), defaultdict(list)
    for e in eps:
        by_world[e["world"]].append(e["success"])
        by_level[e["difficulty"]].append(e["success"])
    rate = lambda v: sum(v) / len(v)  # noqa: E731
    return {"n": len(eps), "success": rate([e["success"] for e in eps]),
            "mean_reward": sum(e["score"] for e in eps) / len(eps),
            "per_world": {w: rate(v) for w, v in sorted(by_world.items())},
            "per_difficulty": {str(k): rate(v) for k, v in sorted(by_level.items())},
            "errors": sum(e["agent_error"] is not None or e["env_error"] is not None for e in eps)}


def evaluate_behaviour(agent: Any, heldout: Any, max_turns: int, count_tokens: Any = None) -> dict[str, Any]:
    """All evaluations on `heldout` (k3.sft.sources.HeldOut) -> one JSON-able record. The thinking-length
    metric runs when heldout.effort_prompts and `count_tokens` (text -> tokens) are given."""
    t0 = time.perf_counter()
    rec = {"tool_calls": eval_tool_calls(agent, heldout.trajectories, heldout.tool_turns),
           "instruct": eval_instructions(agent, heldout.instruct_items),
           "episodes": eval_episodes(agent, heldout.worlds, heldout.tasks_per_world, max_turns, heldout.registry)}
    if heldout.effort_prompts and count_tokens is not None:
        rec["thinking"] = eval_thinking_length(agent, heldout.effort_prompts, heldout.efforts, count_tokens,
                                               heldout.effort_max_new_tokens)
    rec["seconds"] = time.perf_counter() - t0
    return rec


def summary(rec: dict[str, Any]) -> str:
    """One line: tool-call validity, right tool, instruction pass rate, episode success, think tokens."""
    parts = []
    tc, ins, ep = rec.get("tool_calls", {}), rec.get("instruct", {}), rec.get("episodes", {})
    if tc.get("n"):
        parts.append(f"tool-call valid {tc['valid']:.0%} right tool {tc['right_tool']:.0%} ({tc['n']} turns)")
    if ins.get("n"):
        parts.append(f"instructions {ins['pass']:.0%} ({ins['n']})")
    if ep.get("n"):
        levels = " ".join(f"d{k} {v:.0%}" for k, v in ep["per_difficulty"].items())
        parts.append(f"episodes success {ep['success']:.0%} ({ep['n']}; {levels})")
    th = rec.get("thinking", {})
    if th.get("n"):
        parts.append("think tokens " + " < ".join(f"{e} {v:.0f}" for e, v in th["mean_think_tokens"].items())
                     + ("" if th["ordered"] else " (not ordered)"))
    return "; ".join(parts) + f" [{rec.get('seconds', 0):.0f} s]"
