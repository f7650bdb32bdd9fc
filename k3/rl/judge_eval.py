"""Judge evaluation against hidden verifiers (spec k3_posttraining.md §4).

Items are tasks with candidates whose hidden-verifier scores are known: generated math (a correct and
a wrong answer, each concise and padded) and practice-world episodes (oracle, reward-hacker and random
agents; the candidate is the transcript's tool calls and final message, the judge may look at the
final state through a read-only view). Every pair of candidates of an item is judged; metrics:

    accuracy            pairs with a strict verifier preference where the judge (both orders averaged,
                        GenRM.score) strictly prefers the same candidate
    tie_rate            such pairs the judge scored equally (not counted as correct)
    position_bias_rate  pairs whose two single-order verdicts (A shown first, then B first) prefer
                        different candidates
    length_bias_rate    pairs the verifier scores equally, of different lengths, where the judge
                        strictly prefers the longer one (0 for an unbiased judge, 1 for a judge
                        that always rewards length)

Scripted backends (`oracle_backend`, `first_position_backend`, `longest_backend`) answer the prompts
of k3.reward.genrm without a model; they prove the metrics (tests) and give reference points.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from itertools import combinations
from typing import Callable

from k3.reward.genrm import GenRM
from k3.reward.verifiers import math_score
from k3.rl.judged import state_view


@dataclass
class EvalItem:
    """task: the prompt text. candidates: answers. truth: hidden-verifier score per candidate.
    states: optional read-only views of each candidate's final world state."""

    task: str
    candidates: list[str]
    truth: list[float]
    states: list[Callable[[], str]] | None = None


def math_items(n: int, level: int = 2, pad: int = 12) -> list[EvalItem]:
    """n arithmetic items (held-out seeds of k3.rl.tasks.math): candidates = correct and wrong answers,
    each concise and padded with `pad` filler sentences (truth by `math_score`)."""
    from k3.rl.tasks.base import split_seed
    from k3.rl.tasks.math import make_problem

    filler = " Let me double-check every step of this carefully once more." * pad
    items = []
    for i in range(n):
        q, ans, _ = make_problem(split_seed("heldout", i), level)
        cands = [f"The answer is {ans}.", f"The answer is {ans + 1 + i % 3}.",
                 f"{filler.strip()} The answer is {ans}.", f"{filler.strip()} The answer is {ans - 2 - i % 2}."]
        items.append(EvalItem(q, cands, [math_score(ans, c) for c in cands]))
    return items


def world_items(world: str, seeds: list[int]) -> list[EvalItem]:
    """Episodes of the oracle, reward-hacker (where the task has one) and random agents on each seed of
    a practice world (k3.envs.worlds); truth = the hidden verifier's score."""
    from k3.envs.agents import OracleAgent, RandomAgent, RewardHackerAgent
    from k3.envs.base import run_episode
    from k3.envs.worlds import make_world

    items = []
    for seed in seeds:
        cands, truth, states, task = [], [], [], ""
        for make_agent in (OracleAgent, RewardHackerAgent, lambda env: RandomAgent(seed=seed)):
            env = make_world(world)
            try:
                ep = run_episode(env, make_agent(env), seed, max_turns=24)
            except Exception:  # an agent that cannot act on this task (no hack script) gives no candidate
                continue
            task = ep.messages[0].get("content", "") if ep.messages else ""
            task = next((m.get("content", "") for m in ep.messages if m.get("role") == "user"), task)
            cands.append(transcript_text(ep.messages))
            truth.append(float(ep.reward.score))
            states.append(state_view(env))
        if len(cands) >= 2:
            items.append(EvalItem(task, cands, truth, states))
    return items


def transcript_text(messages: list[dict]) -> str:
    """The assistant's tool calls and final message as plain text (what a judge reads)."""
    lines = []
    for m in messages:
        if m.get("role") != "assistant":
            continue
        for c in m.get("tool_calls") or []:
            fn = c.get("function", c)
            lines.append(f"call {fn.get('name')}({fn.get('arguments')})")
        if m.get("content"):
            lines.append(str(m["content"]))
    return "\n".join(lines) or "(no answer)"


def evaluate_judge(rm: GenRM, items: list[EvalItem]) -> dict[str, float]:
    """The module docstring's metrics over every candidate pair of every item."""
    c = {"decided": 0, "correct": 0, "ties": 0, "pairs": 0, "flips": 0, "tied_truth": 0, "longer": 0}
    for it in items:
        for a, b in combinations(range(len(it.candidates)), 2):
            pair = [it.candidates[a], it.candidates[b]]
            st = [it.states[a], it.states[b]] if it.states else None
            s = rm.score(it.task, pair, st)
            first = rm.verdict(it.task, pair, [0, 1], st)
            second = rm.verdict(it.task, pair, [1, 0], st)
            c["pairs"] += 1
            if 0 in first and 1 in first and 0 in second and 1 in second:
                c["flips"] += _sign(first[0] - first[1]) != _sign(second[0] - second[1])
            ta, tb = it.truth[a], it.truth[b]
            if ta != tb:
                c["decided"] += 1
                c["correct"] += _sign(s[0] - s[1]) == _sign(ta - tb)
                c["ties"] += s[0] == s[1]
            elif len(pair[0]) != len(pair[1]):
                c["tied_truth"] += 1
                longer = 0 if len(pair[0]) > len(pair[1]) else 1
                c["longer"] += s[longer] > s[1 - longer]
    div = lambda x, y: x / y if y else float("nan")  # noqa: E731
    return {"accuracy": div(c["correct"], c["decided"]), "tie_rate": div(c["ties"], c["decided"]),
            "position_bias_rate": div(c["flips"], c["pairs"]), "length_bias_rate": div(c["longer"], c["tied_truth"]),
            "pairs": float(c["pairs"]), "decided_pairs": float(c["decided"]), "tied_pairs": float(c["tied_truth"]),
            "fallback_rewards": float(rm.stats["fallback_rewards"]), "malformed": float(rm.stats["malformed"])}


def _sign(x: float) -> int:
    return (x > 0) - (x < 0)


# ---- scripted backends ----------------------------------------------------------------------------------
_CAND = re.compile(r"Candidate (\d+):\n(.*?)(?=\n\nCandidate \d+:\n|\Z)", re.S)
_TASK = re.compile(r"Task:\n(.*?)\n\nRubric:", re.S)


def _shown(messages: list[dict]) -> tuple[str, list[str]] | None:
    text = messages[0]["content"]
    if "Rubric:" not in text:
        return None
    task = _TASK.search(text)
    body = text.split("Rubric:", 1)[1]
    return (task.group(1) if task else ""), [m.group(2) for m in _CAND.finditer(body)]


def _scripted(score_fn: Callable[[str, list[str]], list[float]]) -> Callable[[list[dict]], str]:
    def complete(messages: list[dict]) -> str:
        parsed = _shown(messages)
        if parsed is None:
            return "- correctness (weight 3)\n- concision (weight 1)"
        task, shown = parsed
        return "\n".join(f"Candidate {k + 1}: {s:.1f}" for k, s in enumerate(score_fn(task, shown)))
    return complete


def oracle_backend(truth: Callable[[str, str], float]) -> Callable[[list[dict]], str]:
    """Scores each shown candidate 10·truth(task, candidate text): a judge that knows the hidden verifier."""
    return _scripted(lambda task, shown: [10.0 * truth(task, c) for c in shown])


def first_position_backend() -> Callable[[list[dict]], str]:
    """Prefers whatever is shown first (10, the rest 5): the pure position bias."""
    return _scripted(lambda task, shown: [10.0 if k == 0 else 5.0 for k in range(len(shown))])


def longest_backend() -> Callable[[list[dict]], str]:
    """Scores by length only (the longest 10): the pure length bias."""
    def fn(task: str, shown: list[str]) -> list[float]:
        m = max(len(c) for c in shown) or 1
        return [10.0 * len(c) / m for c in shown]
    return _scripted(fn)


def truth_table(items: list[EvalItem]) -> Callable[[str, str], float]:
    """truth(task, candidate) looked up in the items (for `oracle_backend`)."""
    table = {(it.task.strip(), c.strip()): t for it in items for c, t in zip(it.candidates, it.truth)}
    return lambda task, cand: table.get((task.strip(), cand.strip()), 0.0)


__all__ = ["EvalItem", "evaluate_judge", "first_position_backend", "longest_backend", "math_items",
           "oracle_backend", "transcript_text", "truth_table", "world_items"]
