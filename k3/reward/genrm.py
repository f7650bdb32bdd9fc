"""Agentic generative reward model (spec k3_posttraining.md §4), built on `k3.reward.judge`.

    rm = GenRM(backend, GenRMConfig(mode="pairwise"), tools=ToolBox(run_code=executor))
    scores = rm.score(task, candidates)          # same interface as k3.reward.judge.Judge
    scores = rm.score(task, candidates, states)  # states[i]: () -> read-only view of candidate i's world

Steps per call of `score`:
1. Rubric: the judge writes task-specific criteria with weights (`- criterion (weight w)` lines);
   an unparseable rubric falls back to a single correctness criterion (counted in stats).
2. Tool checks (agentic): the judge's reply may request `TOOL run_code <k>` (run candidate k's code
   in a sandbox: exit status and output come back) or `TOOL view_state <k>` (the final state of
   candidate k's world through a read-only view). Results are appended and the judge asked again,
   up to `max_tool_rounds`; requests for tools the ToolBox lacks get an "unavailable" reply.
3. Comparison with the order randomised: listwise = every candidate in one prompt, judged in a
   random order and again in the reverse of that order (each candidate's score = the mean of its two
   verdicts); pairwise = every pair in both orders, a pair whose two verdicts prefer different
   candidates is a tie; a candidate's score = its win rate (ties count 1/2).
4. Parseable scores: `Candidate <k>: <score 0-10>` lines (`k3.reward.judge.parse_scores`).
5. Verbosity: the final score is s_i − β·max(0, ℓ_i/ℓ_adequate − 1), clamped to [0, 1], where
   ℓ_adequate is the shortest candidate whose mean absolute score is >= `adequate`.
A candidate without any verdict (malformed replies, a dead backend) gets `fallback` and is counted
in stats["fallback_rewards"]; nothing in here raises on judge output.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from itertools import combinations
from typing import Any, Callable, Sequence

from k3.reward.judge import Backend, parse_scores
from k3.reward.verifiers import extract_code

RUBRIC_PROMPT = ("Write a grading rubric specific to the task below: 2 to 5 criteria, one per line, as "
                 "`- <criterion> (weight <w>)`.\n\nTask:\n{task}")
COMPARE_PROMPT = ("Grade the candidate answers to the task with the rubric.{tools}\nFinish with exactly one line "
                  "per candidate, `Candidate <k>: <score>`, score from 0 to 10.\n\nTask:\n{task}\n\nRubric:\n"
                  "{rubric}\n\n{candidates}")
TOOLS_HINT = ("\nBefore scoring you may check claims with tools, one request per line: {names}. "
              "Reply with only the requests; their results come back and you are asked again.")
_RUBRIC_LINE = re.compile(r"^\s*[-*]\s*(.+?)\s*\(\s*weight\s*[:=]?\s*(\d+(?:\.\d+)?)\s*\)\s*$", re.I | re.M)
_TOOL_LINE = re.compile(r"TOOL\s+(run_code|view_state)\s+(\d+)", re.I)
DEFAULT_RUBRIC = [("the answer is correct and complete", 1.0)]


@dataclass
class GenRMConfig:
    """mode: "listwise" or "pairwise". beta / adequate: the verbosity penalty (module docstring); adequate
    is high on purpose: a short, partly right answer (a reward hacker's) must not set the length norm.
    fallback: the reward of a candidate without a verdict. max_tool_rounds: judge turns that may
    request tools before the scores are due. code_timeout_s: per run_code call. seed: order shuffling."""

    mode: str = "listwise"
    beta: float = 0.1
    adequate: float = 0.8
    fallback: float = 0.0
    max_tool_rounds: int = 2
    code_timeout_s: float = 5.0
    max_tool_output: int = 2000
    seed: int = 0

    def validate(self) -> "GenRMConfig":
        if self.mode not in ("listwise", "pairwise"):
            raise ValueError(f"mode must be 'listwise' or 'pairwise', got {self.mode!r}")
        if self.beta < 0 or not 0 <= self.fallback <= 1 or self.max_tool_rounds < 0:
            raise ValueError("beta >= 0, fallback in [0, 1] and max_tool_rounds >= 0 are required")
        return self


CodeExecutor = Callable[[str, float], tuple[int, str]]  # (python source, timeout s) -> (exit status, output)


@dataclass
class ToolBox:
    """The judge's tools. run_code: a sandboxed executor (`sandbox_executor()`); None = unavailable.
    view_state is per candidate: `score(..., states=[...])`."""

    run_code: CodeExecutor | None = None

    def names(self, has_states: bool) -> list[str]:
        return [n for n, ok in (("TOOL run_code <k>", self.run_code is not None),
                                ("TOOL view_state <k>", has_states)) if ok]


def parse_rubric(text: str) -> list[tuple[str, float]]:
    """`- criterion (weight w)` lines -> [(criterion, w)] with w > 0; [] when none parse."""
    return [(c.strip(), float(w)) for c, w in _RUBRIC_LINE.findall(text or "") if float(w) > 0]


def length_penalty(scores: list[float], lengths: list[int], adequate_mask: list[bool], beta: float) -> list[float]:
    """s_i − β·max(0, ℓ_i/ℓ_adequate − 1) clamped to [0, 1]; ℓ_adequate = min length over adequate
    candidates (no penalty when none is adequate)."""
    ok = [ln for ln, a in zip(lengths, adequate_mask) if a]
    if not ok or beta == 0:
        return [min(1.0, max(0.0, s)) for s in scores]
    base = max(1, min(ok))
    return [min(1.0, max(0.0, s - beta * max(0.0, ln / base - 1.0))) for s, ln in zip(scores, lengths)]


@dataclass
class GenRM:
    backend: Backend
    cfg: GenRMConfig = field(default_factory=GenRMConfig)
    tools: ToolBox = field(default_factory=ToolBox)
    stats: dict[str, int] = field(default_factory=lambda: {
        "calls": 0, "errors": 0, "malformed": 0, "fallback_rewards": 0, "rubric_fallbacks": 0,
        "tool_calls": 0, "order_disagreements": 0, "comparisons": 0})

    def __post_init__(self) -> None:
        self.cfg.validate()
        self.rng = random.Random(self.cfg.seed)
        self.last: dict[str, Any] = {}

    # ---- public ------------------------------------------------------------------------------------
    def score(self, task: str, candidates: Sequence[str],
              states: Sequence[Callable[[], str]] | None = None) -> list[float]:
        """Rewards in [0, 1], one per candidate, in the candidates' order. states: optional read-only
        views of each candidate's final world state (for `TOOL view_state`). `self.last` keeps the
        rubric, the raw per-candidate scores and the per-order verdicts of this call."""
        n = len(candidates)
        if states is not None and len(states) != n:
            raise ValueError(f"{len(states)} state views for {n} candidates")
        if n == 0:
            return []
        rubric = self._rubric(task)
        if self.cfg.mode == "pairwise" and n >= 2:
            raw, verdicts = self._pairwise(task, candidates, rubric, states)
        else:
            raw, verdicts = self._listwise(task, candidates, rubric, states)
        absolute = [sum(v) / len(v) if v else None for v in verdicts]
        judged = [i for i in range(n) if raw[i] is not None]
        shaped = length_penalty([raw[i] for i in judged], [len(candidates[i]) for i in judged],
                                [absolute[i] is not None and absolute[i] >= self.cfg.adequate for i in judged],
                                self.cfg.beta)
        out = [self.cfg.fallback] * n
        for i, v in zip(judged, shaped):
            out[i] = v
        self.stats["fallback_rewards"] += n - len(judged)
        self.last = {"rubric": rubric, "raw": raw, "absolute": absolute, "rewards": out}
        return out

    # ---- steps --------------------------------------------------------------------------------------
    def _rubric(self, task: str) -> list[tuple[str, float]]:
        parsed = parse_rubric(self._ask([{"role": "user", "content": RUBRIC_PROMPT.format(task=task)}]))
        if not parsed:
            self.stats["rubric_fallbacks"] += 1
            return list(DEFAULT_RUBRIC)
        return parsed

    def _listwise(self, task, candidates, rubric, states):
        """Two verdicts per candidate (a random order and its reverse) -> (mean score or None, verdicts)."""
        order = list(range(len(candidates)))
        self.rng.shuffle(order)
        verdicts: list[list[float]] = [[] for _ in candidates]
        firsts = []
        for shown in (order, order[::-1]) if len(order) > 1 else (order,):
            got = self.verdict(task, candidates, shown, states, rubric)
            for i, s in got.items():
                verdicts[i].append(s)
            firsts.append(got)
        if len(firsts) == 2:
            self.stats["comparisons"] += 1
            both = [i for i in firsts[0] if i in firsts[1]]
            if len(both) >= 2 and _argmax(firsts[0], both) != _argmax(firsts[1], both):
                self.stats["order_disagreements"] += 1
        raw = [sum(v) / len(v) if v else None for v in verdicts]
        return raw, verdicts

    def _pairwise(self, task, candidates, rubric, states):
        """Every pair in both orders; win rate per candidate (None when no pair of it was decided)."""
        n = len(candidates)
        wins, games = [0.0] * n, [0] * n
        verdicts: list[list[float]] = [[] for _ in candidates]
        pairs = list(combinations(range(n), 2))
        self.rng.shuffle(pairs)
        for a, b in pairs:
            prefs = []
            for shown in ([a, b], [b, a]):
                got = self.verdict(task, candidates, shown, states, rubric)
                for i, s in got.items():
                    verdicts[i].append(s)
                if a in got and b in got:
                    prefs.append((got[a] > got[b]) - (got[a] < got[b]))
            if not prefs:
                continue
            self.stats["comparisons"] += 1
            if len(prefs) == 2 and prefs[0] != prefs[1]:
                self.stats["order_disagreements"] += 1
                outcome = 0.5                       # position-dependent verdict: a tie
            else:
                outcome = 0.5 + 0.5 * prefs[0]      # 1 a wins, 0 b wins, 0.5 equal scores
            wins[a] += outcome
            wins[b] += 1 - outcome
            games[a] += 1
            games[b] += 1
        raw = [wins[i] / games[i] if games[i] else None for i in range(n)]
        return raw, verdicts

    def verdict(self, task: str, candidates: Sequence[str], shown: list[int],
                states: Sequence[Callable[[], str]] | None = None,
                rubric: list[tuple[str, float]] | None = None) -> dict[int, float]:
        """One judged comparison in a fixed order (shown[k] = the candidate at position k + 1, with tool
        rounds) -> {candidate index: score in [0, 1]} for the candidates the final reply scored; missing
        ones are counted as malformed. rubric None: the last call's rubric (else the default one)."""
        rubric = rubric or self.last.get("rubric") or list(DEFAULT_RUBRIC)
        text = "\n\n".join(f"Candidate {k + 1}:\n{candidates[i]}" for k, i in enumerate(shown))
        names = self.tools.names(states is not None)
        hint = TOOLS_HINT.format(names=", ".join(names)) if names and self.cfg.max_tool_rounds else ""
        rubric_text = "\n".join(f"- {c} (weight {w:g})" for c, w in rubric)
        messages = [{"role": "user", "content": COMPARE_PROMPT.format(tools=hint, task=task, rubric=rubric_text,
                                                                      candidates=text)}]
        reply = self._ask(messages)
        for _ in range(self.cfg.max_tool_rounds if hint else 0):
            requests = _TOOL_LINE.findall(reply)
            if not requests or any(v is not None for v in parse_scores(reply, len(shown))):
                break
            results = [self._tool(name.lower(), int(k), shown, candidates, states) for name, k in requests[:8]]
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "\n\n".join(results)}]
            reply = self._ask(messages)
        raw = parse_scores(reply, len(shown))
        out = {}
        for k, i in enumerate(shown):
            if raw[k] is None:
                self.stats["malformed"] += 1
            else:
                out[i] = raw[k] / 10.0
        return out

    def _tool(self, name: str, k: int, shown: list[int], candidates, states) -> str:
        """Result text of one tool request about shown candidate k (1-based)."""
        self.stats["tool_calls"] += 1
        head = f"[{name} {k}]"
        if not 1 <= k <= len(shown):
            return f"{head} error: no candidate {k}"
        i = shown[k - 1]
        try:
            if name == "run_code" and self.tools.run_code is not None:
                rc, output = self.tools.run_code(extract_code(candidates[i]), self.cfg.code_timeout_s)
                return f"{head} exit status {rc}\n{output[: self.cfg.max_tool_output]}"
            if name == "view_state" and states is not None:
                return f"{head}\n{str(states[i]())[: self.cfg.max_tool_output]}"
        except Exception as e:  # a failing tool is a result the judge reads, not a crash
            return f"{head} error: {type(e).__name__}: {e}"[: self.cfg.max_tool_output]
        return f"{head} unavailable"

    def _ask(self, messages: list[dict]) -> str:
        self.stats["calls"] += 1
        try:
            out = self.backend(messages)
            return out if isinstance(out, str) else ""
        except Exception:  # a dead endpoint means fallback rewards, never a crashed run
            self.stats["errors"] += 1
            return ""


def _argmax(scores: dict[int, float], keys: list[int]) -> int:
    return max(keys, key=lambda i: (scores[i], -i))


def sandbox_executor(backend: str = "auto") -> CodeExecutor:
    """run_code through k3.envs.sandbox (a fresh Sandbox per call: `Sandbox.create`, `exec`, `close`).
    ValueError when that module is absent."""
    import importlib.util

    if importlib.util.find_spec("k3.envs.sandbox") is None:
        raise ValueError("the run_code tool needs k3.envs.sandbox")
    from k3.envs.sandbox import Sandbox

    def run(source: str, timeout_s: float) -> tuple[int, str]:
        box = Sandbox.create(backend=backend)
        try:
            res = box.exec(["python3", "-"], timeout=timeout_s, stdin=source)
            return res.rc, (res.stdout or "") + (res.stderr or "")
        finally:
            box.close()

    return run


__all__ = ["CodeExecutor", "GenRM", "GenRMConfig", "ToolBox", "length_penalty", "parse_rubric", "sandbox_executor"]
