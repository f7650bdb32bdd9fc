"""Generative judge (spec k3_posttraining.md §4): `Judge.score(task, candidates) -> list[float]`.

Steps: the judge model writes a rubric for the task (criteria with weights), then scores every
candidate against it, with the candidates shown in a randomised order (the order is undone before
returning); a verbosity penalty β·max(0, ℓ_i/ℓ_adequate − 1) is subtracted, where ℓ_adequate is the
shortest candidate that scored at least `adequate` before the penalty. Scores are clamped to [0, 1].

The judge's output format is fixed and parsed leniently: one line per candidate,
`Candidate <k>: <score>` with score in [0, 10]. Any candidate the reply does not score (malformed
output, a refusal, an exception from the backend) gets `fallback` and increments
`stats["malformed"]`; nothing raises on judge garbage.

Backends are callables `complete(messages) -> str`: `openai_backend(base_url, model)` for any
OpenAI-compatible endpoint (stdlib HTTP, no dependency), `engine_backend(engine, tokenizer)` for a
k3 checkpoint served in-process.
"""

from __future__ import annotations

import json
import random
import re
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

Backend = Callable[[list[dict]], str]

RUBRIC_PROMPT = ("Write a grading rubric for answers to the task below: 2 to 5 criteria, one per line, as "
                 "`- <criterion> (weight <w>)`.\n\nTask:\n{task}")
SCORE_PROMPT = ("Grade each candidate answer to the task with the rubric. Reply with exactly one line per "
                "candidate, `Candidate <k>: <score>`, score from 0 to 10.\n\nTask:\n{task}\n\nRubric:\n{rubric}"
                "\n\n{candidates}")
_LINE = re.compile(r"candidate\s*#?\s*(\d+)\s*[:=\-]\s*\**\s*(-?\d+(?:\.\d+)?)\s*(?:/\s*10)?", re.I)


@dataclass
class JudgeConfig:
    """beta: verbosity penalty per unit of excess length ratio. adequate: pre-penalty score that counts
    as an adequate answer (for ℓ_adequate). fallback: score of an unscored candidate. seed: order shuffling."""

    beta: float = 0.1
    adequate: float = 0.5
    fallback: float = 0.0
    seed: int = 0
    rubric: bool = True


@dataclass
class Judge:
    backend: Backend
    cfg: JudgeConfig = field(default_factory=JudgeConfig)
    stats: dict[str, int] = field(default_factory=lambda: {"calls": 0, "malformed": 0, "errors": 0})

    def __post_init__(self) -> None:
        self.rng = random.Random(self.cfg.seed)

    def score(self, task: str, candidates: Sequence[str]) -> list[float]:
        """Scores in [0, 1], one per candidate, in the candidates' order. A pair is judged in both
        orders; when the two verdicts prefer different candidates (position bias) both get the mean."""
        n = len(candidates)
        if n == 0:
            return []
        rubric = self._ask([{"role": "user", "content": RUBRIC_PROMPT.format(task=task)}]) if self.cfg.rubric else ""
        self._unscored: set[int] = set()
        if n == 2:
            a, b = self._judge(task, candidates, rubric, [0, 1]), self._judge(task, candidates, rubric, [1, 0])
            if (a[0] - a[1]) * (b[0] - b[1]) < 0:
                self.stats["order_disagreements"] = self.stats.get("order_disagreements", 0) + 1
                tie = (a[0] + a[1] + b[0] + b[1]) / 4
                scores = [tie, tie]
            else:
                scores = [(a[0] + b[0]) / 2, (a[1] + b[1]) / 2]
        else:
            order = list(range(n))
            self.rng.shuffle(order)
            scores = self._judge(task, candidates, rubric, order)
        # the verbosity penalty compares judged candidates only; an unscored one keeps the fallback
        judged = [i for i in range(n) if i not in self._unscored]
        shaped = verbosity_penalty([scores[i] for i in judged], [len(candidates[i]) for i in judged],
                                   self.cfg.beta, self.cfg.adequate)
        out = [self.cfg.fallback] * n
        for i, v in zip(judged, shaped):
            out[i] = v
        return out

    def _judge(self, task: str, candidates: Sequence[str], rubric: str, order: list[int]) -> list[float]:
        """One scoring call with shown position k holding candidate order[k] -> scores in [0, 1] in the
        candidates' order (fallback where the reply gave none)."""
        shown = "\n\n".join(f"Candidate {k + 1}:\n{candidates[i]}" for k, i in enumerate(order))
        reply = self._ask([{"role": "user", "content": SCORE_PROMPT.format(task=task, rubric=rubric or "(none)",
                                                                           candidates=shown)}])
        raw = parse_scores(reply, len(candidates))
        scores = [self.cfg.fallback] * len(candidates)
        for k, i in enumerate(order):
            if raw[k] is None:
                self.stats["malformed"] += 1
                self._unscored.add(i)
            else:
                scores[i] = raw[k] / 10.0
        return scores

    def _ask(self, messages: list[dict]) -> str:
        self.stats["calls"] += 1
        try:
            out = self.backend(messages)
            return out if isinstance(out, str) else ""
        except Exception:  # a dead endpoint scores the fallback, never crashes training
            self.stats["errors"] += 1
            return ""


def parse_scores(reply: str, n: int) -> list[float | None]:
    """`Candidate k: s` lines -> score per shown position (None where absent or out of [0, 10]); the
    first score given for a candidate wins."""
    out: list[float | None] = [None] * n
    for k, s in _LINE.findall(reply or ""):
        i, v = int(k) - 1, float(s)
        if 0 <= i < n and out[i] is None and 0.0 <= v <= 10.0:
            out[i] = v
    return out


def verbosity_penalty(scores: list[float], lengths: list[int], beta: float, adequate: float) -> list[float]:
    """score_i − β·max(0, ℓ_i/ℓ_adequate − 1), clamped to [0, 1]; ℓ_adequate = the shortest length among
    candidates scoring >= adequate (no penalty when none does)."""
    ok = [ln for s, ln in zip(scores, lengths) if s >= adequate]
    if not ok or beta == 0:
        return [min(1.0, max(0.0, s)) for s in scores]
    base = max(1, min(ok))
    return [min(1.0, max(0.0, s - beta * max(0.0, ln / base - 1.0))) for s, ln in zip(scores, lengths)]


def openai_backend(base_url: str, model: str, api_key: str | None = None, timeout_s: float = 120.0,
                   max_tokens: int = 1024) -> Backend:
    """complete(messages) via POST {base_url}/chat/completions (temperature 0)."""
    url = base_url.rstrip("/") + "/chat/completions"

    def complete(messages: list[dict]) -> str:
        body = json.dumps({"model": model, "messages": messages, "temperature": 0, "max_tokens": max_tokens})
        req = urllib.request.Request(url, body.encode(), {"Content-Type": "application/json"} |
                                     ({"Authorization": f"Bearer {api_key}"} if api_key else {}))
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            data = json.loads(r.read())
        return data["choices"][0]["message"].get("content") or ""

    return complete


def engine_backend(engine: Any, tokenizer: Any, max_tokens: int = 512) -> Backend:
    """complete(messages) with a k3 checkpoint in-process (greedy, non-thinking render; the response
    channel, or the raw text when the model does not produce one)."""
    from k3.chat import parse, render
    from k3.serve.sampling import SamplingParams

    def complete(messages: list[dict]) -> str:
        ids, _ = render(messages, tokenizer, thinking=False, thinking_effort=None, add_generation_prompt=True)
        room = min(max_tokens, engine.max_tokens_limit(len(ids)))
        out = engine.generate([ids], SamplingParams(temperature=0, max_tokens=max(1, room)))[0]
        msg = parse(out.token_ids, tokenizer, start="response")
        return msg.get("content") or tokenizer.decode(out.token_ids)

    return complete


__all__ = ["Judge", "JudgeConfig", "engine_backend", "openai_backend", "parse_scores", "verbosity_penalty"]
