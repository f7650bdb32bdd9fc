"""Behavioural evaluation of an SFT model on held-out prompts (never trained on).

* tool calls (teacher-forced): at each assistant turn of a held-out oracle trajectory that calls tools,
  the model writes the next turn from the oracle's prefix. `valid`: the turn parses (k3.chat.parse) into
  at least one call and every call names a declared tool with arguments valid against its JSON schema
  (k3.envs.schema.parse_call). `right_tool`: the first call's name equals the oracle's.
* instruction following: held-out generated items (k3.sft.instruct), the response checked by code.
* episodes: held-out world tasks, easiest first, played end to end through k3.envs.base.run_episode;
  success = the hidden verifier's score is 1.

Generation is greedy (temperature 0) and stops at <|end_of_msg|>; nothing the model writes can raise.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any, Sequence

import torch

from k3.chat.parse import parse
from k3.chat.render import render
from k3.chat.xtml import END_OF_MSG
from k3.envs.base import run_episode
from k3.envs.schema import parse_call
from k3.model.generate import SamplingParams, generate
from k3.sft import instruct


class ModelAgent:
    """An in-process agent: renders the conversation (thinking mode at `thinking_effort`), generates the
    assistant turn greedily, parses it into an OpenAI assistant message. `act` / `act_batch`."""

    def __init__(self, model: Any, tokenizer: Any, *, thinking_effort: str = "low", max_new_tokens: int = 96,
                 prefill_tokens: int = 16384) -> None:
        self.model, self.tok = model, tokenizer
        self.effort, self.max_new = thinking_effort, max_new_tokens
        self.prefill_tokens = prefill_tokens  # prompts prefilled together (bounds the logits' memory)
        self.stop = (tokenizer.special_id(END_OF_MSG),)

    def act(self, messages: list[dict], tools: list[dict] | None) -> dict:
        return self.act_batch([(messages, tools)])[0]

    @torch.no_grad()
    def act_batch(self, requests: Sequence[tuple[list[dict], list[dict] | None]]) -> list[dict]:
        prompts = [render(m, self.tok, t or None, thinking_effort=self.effort, add_generation_prompt=True)[0]
                   for m, t in requests]
        was_training = self.model.training
        self.model.eval()
        outs: list[list[int]] = []
        params = SamplingParams(temperature=0.0, max_new_tokens=self.max_new, stop_ids=self.stop)
        for group in _groups(prompts, self.prefill_tokens):
            outs += generate(self.model, [prompts[i] for i in group], params)
        self.model.train(was_training)
        return [_assistant(parse(ids, self.tok)) for ids in outs]


def _groups(prompts: list[list[int]], budget: int) -> list[list[int]]:
    groups, cur, size = [], [], 0
    for i, p in enumerate(prompts):
        if cur and size + len(p) > budget:
            groups.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += len(p)
    return groups + ([cur] if cur else [])


def _assistant(parsed: dict) -> dict:
    msg = {"role": "assistant", "content": parsed.get("content", ""),
           "reasoning_content": parsed.get("reasoning_content", "")}
    if parsed.get("tool_calls"):
        msg["tool_calls"] = parsed["tool_calls"]
    return msg


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


def eval_tool_calls(agent: ModelAgent, trajectories: Sequence[dict], limit: int) -> dict[str, Any]:
    points = tool_call_points(trajectories, limit)
    if not points:
        return {"n": 0}
    replies = agent.act_batch([(msgs, tools) for msgs, tools, _ in points])
    valid = right = 0
    for (_, tools, oracle), reply in zip(points, replies):
        calls = reply.get("tool_calls") or []
        valid += bool(calls) and all(not parse_call(c, tools)[2] for c in calls)
        want = oracle["tool_calls"][0].get("function", oracle["tool_calls"][0]).get("name")
        right += bool(calls) and calls[0]["function"]["name"] == want
    return {"n": len(points), "valid": valid / len(points), "right_tool": right / len(points)}


# ----------------------------------------------------------------------------- instructions


def eval_instructions(agent: ModelAgent, items: Sequence[dict]) -> dict[str, Any]:
    if not items:
        return {"n": 0}
    replies = agent.act_batch([([{"role": "user", "content": it["prompt"]}], None) for it in items])
    kinds: dict[str, list[bool]] = defaultdict(list)
    for it, reply in zip(items, replies):
        kinds[it["kind"]].append(instruct.check(it, reply.get("content")))
    passed = sum(sum(v) for v in kinds.values())
    return {"n": len(items), "pass": passed / len(items),
            "per_kind": {k: sum(v) / len(v) for k, v in sorted(kinds.items())}}


# ----------------------------------------------------------------------------- episodes


def eval_episodes(agent: ModelAgent, tasks: Sequence[tuple[str, int]], make_world: Any,
                  max_turns: int) -> dict[str, Any]:
    """tasks: (world name, held-out seed) pairs; make_world(name) -> a fresh Environment."""
    if not tasks:
        return {"n": 0}
    per: dict[str, list[float]] = defaultdict(list)
    for world, seed in tasks:
        env = make_world(world)
        try:
            ep = run_episode(env, agent, seed, max_turns=max_turns)
        finally:
            env.close()
        per[world].append(ep.reward.score)
    scores = [s for v in per.values() for s in v]
    return {"n": len(scores), "success": sum(s >= 1.0 for s in scores) / len(scores),
            "mean_reward": sum(scores) / len(scores),
            "per_world": {w: sum(s >= 1.0 for s in v) / len(v) for w, v in sorted(per.items())}}


def evaluate_behaviour(agent: ModelAgent, heldout: Any, max_turns: int) -> dict[str, Any]:
    """All three evaluations on `heldout` (k3.sft.sources.HeldOut) -> one JSON-able record."""
    t0 = time.perf_counter()
    rec = {"tool_calls": eval_tool_calls(agent, heldout.trajectories, heldout.tool_turns),
           "instruct": eval_instructions(agent, heldout.instruct_items),
           "episodes": eval_episodes(agent, heldout.tasks, heldout.make_world, max_turns)}
    rec["seconds"] = time.perf_counter() - t0
    return rec


def summary(rec: dict[str, Any]) -> str:
    """One line: tool-call validity, right tool, instruction pass rate, episode success."""
    parts = []
    tc, ins, ep = rec.get("tool_calls", {}), rec.get("instruct", {}), rec.get("episodes", {})
    if tc.get("n"):
        parts.append(f"tool-call valid {tc['valid']:.0%} right tool {tc['right_tool']:.0%} ({tc['n']} turns)")
    if ins.get("n"):
        parts.append(f"instructions {ins['pass']:.0%} ({ins['n']})")
    if ep.get("n"):
        parts.append(f"episodes success {ep['success']:.0%} ({ep['n']})")
    return "; ".join(parts) + f" [{rec.get('seconds', 0):.0f} s]"
