"""Teachers for multi-teacher on-policy distillation: exact routing by (domain, effort), in-process k3
teachers and remote top-k teachers.

A teacher scores token sequences the student sampled: `teacher.score(ids, cu_seqlens) -> [1, T]`
fp32 log π_T(x_t | x_<t) (0 at each document's first position), the layout of
`K3ForCausalLM.token_logprobs`. Teachers share the student's tokenizer (checked when loaded).

Remote teachers (`RemoteTeacher`) get per position the teacher's top-k log-probs plus, when the
server reports it, the log-prob of the actual token (vLLM's `prompt_logprobs` does). The
approximation when the sampled token is absent: the mass the top-k leaves, 1 − Σ_topk p, is spread
uniformly over the other V − k tokens, so log π_T(y_t) ≈ log((1 − Σ_topk p) / (V − k)) (floored at
`floor_logp`). It is exact whenever the token is reported and over-estimates the teacher's
log-prob of a rare token only up to that uniform share; the number of approximated tokens is counted.
"""

from __future__ import annotations

import json
import math
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

DOMAINS = ("math", "worlds", "code")
KIND_TO_DOMAIN = {"math": "math", "world": "worlds", "code": "code"}  # k3.rl.tasks Task.kind -> domain


class Teacher(Protocol):
    name: str

    def score(self, ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor: ...


def domain_of(task: Any) -> str:
    """The routing domain of a k3.rl.tasks Task (its kind; world tasks are "worlds")."""
    kind = getattr(task, "kind", None)
    if kind not in KIND_TO_DOMAIN:
        raise ValueError(f"task {getattr(task, 'task_id', task)!r} has kind {kind!r}, which no domain covers "
                         f"(known: {', '.join(KIND_TO_DOMAIN)})")
    return KIND_TO_DOMAIN[kind]


@dataclass
class TeacherSpec:
    """One `--teacher DOMAIN:EFFORT=PATH[@WEIGHT]` entry. weight: its share of the sampled tasks."""

    domain: str
    effort: str
    path: str
    weight: float = 1.0

    @property
    def key(self) -> tuple[str, str]:
        return (self.domain, self.effort)

    @property
    def name(self) -> str:
        return f"{self.domain}:{self.effort}"


def parse_teacher(text: str, efforts: tuple[str, ...] = ("low", "high", "max")) -> TeacherSpec:
    """'math:low=runs/t/final' or 'math:low=http://host:8000/v1#model@0.5' -> TeacherSpec (ValueError
    with the expected format otherwise)."""
    fmt = "expected DOMAIN:EFFORT=PATH[@WEIGHT], e.g. math:low=runs/teacher/final"
    if "=" not in text or ":" not in text.split("=", 1)[0]:
        raise ValueError(f"--teacher {text!r}: {fmt}")
    head, path = text.split("=", 1)
    domain, effort = (s.strip() for s in head.split(":", 1))
    weight = 1.0
    if "@" in path and path.rsplit("@", 1)[1].replace(".", "", 1).isdigit():
        path, w = path.rsplit("@", 1)
        weight = float(w)
    if domain not in DOMAINS:
        raise ValueError(f"--teacher {text!r}: domain {domain!r} is not one of {', '.join(DOMAINS)}")
    if effort not in efforts:
        raise ValueError(f"--teacher {text!r}: effort {effort!r} is not one of {', '.join(efforts)}")
    if not path or weight <= 0:
        raise ValueError(f"--teacher {text!r}: {fmt} (weight > 0)")
    return TeacherSpec(domain, effort, path, weight)


class Router:
    """(domain, effort) -> teacher, exact: no fallback to another effort or domain."""

    def __init__(self, teachers: dict[tuple[str, str], Any]) -> None:
        if not teachers:
            raise ValueError("distillation needs at least one teacher")
        self.teachers = dict(teachers)

    def route(self, domain: str, effort: str) -> Any:
        try:
            return self.teachers[(domain, effort)]
        except KeyError:
            have = ", ".join(f"{d}:{e}" for d, e in self.teachers)
            raise KeyError(f"no teacher for {domain}:{effort} (teachers: {have})") from None

    def keys(self) -> list[tuple[str, str]]:
        return list(self.teachers)


class ModelTeacher:
    """A k3 checkpoint in-process: `K3ForCausalLM.token_logprobs` (chunked over the vocabulary; the
    [T, vocab] logits are never held). Its parameters are frozen, so no autograd graph is recorded.

    training_numerics: score with grad mode on (nothing requires grad, so nothing is saved for a
    backward) so the forward takes the same kernels as the student's training forward (some fused
    projections differ between grad and no-grad mode in the last bits); a student equal to its
    teacher then gets d_t = 0 exactly. False: no_grad mode (the serving kernels)."""

    def __init__(self, name: str, model: torch.nn.Module, training_numerics: bool = True) -> None:
        self.name, self.model, self.training_numerics = name, model.eval(), training_numerics
        for p in self.model.parameters():
            p.requires_grad_(False)

    def score(self, ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        dev = next(self.model.parameters()).device
        with torch.set_grad_enabled(self.training_numerics):
            return self.model.token_logprobs(ids.to(dev), cu_seqlens=cu_seqlens).float().detach()


TopK = list[dict[int, float]]  # per position: token id -> log-prob (the top-k, plus the actual token if known)


@dataclass
class RemoteTeacher:
    """A teacher behind `fetch(ids: list[int]) -> TopK` (one entry per position; position 0 unused).
    vocab_size: V of the shared tokenizer. stats: tokens scored and tokens approximated."""

    name: str
    fetch: Callable[[list[int]], TopK]
    vocab_size: int
    floor_logp: float = -30.0
    stats: dict[str, int] = field(default_factory=lambda: {"tokens": 0, "approximated": 0})

    @torch.no_grad()
    def score(self, ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(ids.shape, dtype=torch.float32)
        flat = ids[0].tolist()
        bounds = cu_seqlens.tolist()
        for s, e in zip(bounds[:-1], bounds[1:]):
            doc = flat[s:e]
            table = self.fetch(doc)
            if len(table) != len(doc):
                raise ValueError(f"teacher {self.name}: {len(table)} log-prob entries for {len(doc)} tokens")
            for t in range(1, len(doc)):
                out[0, s + t] = self.token_logp(table[t], doc[t])
        return out

    def token_logp(self, top: dict[int, float], token: int) -> float:
        """log π_T(token) from one position's entries (module docstring's approximation when absent)."""
        self.stats["tokens"] += 1
        if token in top:
            return max(float(top[token]), self.floor_logp)
        self.stats["approximated"] += 1
        rest = 1.0 - sum(math.exp(v) for v in top.values())
        others = max(self.vocab_size - len(top), 1)
        if rest <= 0:
            return self.floor_logp
        return max(math.log(rest / others), self.floor_logp)


def vllm_prompt_logprobs(base_url: str, model: str, k: int = 20,
                         timeout_s: float = 120.0) -> Callable[[list[int]], TopK]:
    """fetch() for an OpenAI-compatible /completions endpoint that accepts token-id prompts and
    `prompt_logprobs` (vLLM): one request per document, max_tokens 1."""
    url = base_url.rstrip("/") + "/completions"

    def fetch(ids: list[int]) -> TopK:
        body = json.dumps({"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": k})
        req = urllib.request.Request(url, body.encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            data = json.loads(r.read())
        rows = data["choices"][0].get("prompt_logprobs") or []
        return [{int(t): float(v["logprob"] if isinstance(v, dict) else v) for t, v in (row or {}).items()}
                for row in rows]

    return fetch


__all__ = ["DOMAINS", "KIND_TO_DOMAIN", "ModelTeacher", "RemoteTeacher", "Router", "Teacher", "TeacherSpec",
           "domain_of", "parse_teacher", "vllm_prompt_logprobs"]
