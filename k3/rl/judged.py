"""The judge as a reward source of `k3 rl` (spec k3_posttraining.md §4): tasks without a verifier
(`Task.score is None`) are scored per completed group by a group scorer, normally the agentic
GenRM (`k3.reward.genrm`) with a k3 checkpoint in-process or an OpenAI-compatible endpoint.

    scorer = genrm_scorer(build_genrm("runs/judge/final"))            # or "http://host:8000/v1#model"
    mgr = RolloutManager(engine, tok, cfg, group_scorer=scorer)

A group scorer is `(task, final assistant messages, envs) -> one score in [0, 1] per attempt`. The
rollout manager turns anything else it returns or raises into the failure reward
(`RolloutConfig.judge_fallback`, counted in `judge_failures`); the GenRM itself turns malformed judge
replies into its own fallback reward (`GenRMConfig.fallback`, counted in its stats).
"""

from __future__ import annotations

import json
from typing import Any, Callable

from k3.reward.genrm import GenRM, GenRMConfig, ToolBox

GroupScorer = Callable[[Any, list[dict], list[Any]], list[float]]


def task_text(task: Any) -> str:
    """What the judge reads as the task: the opening conversation's user turns."""
    return "\n\n".join(str(m.get("content") or "") for m in task.messages if m.get("role") == "user")


def answer_text(message: dict) -> str:
    """What the judge reads as a candidate: the final message's response channel and its tool calls."""
    text = message.get("content") if isinstance(message.get("content"), str) else ""
    calls = message.get("tool_calls") or []
    if calls:
        text += "\n" + "\n".join(json.dumps(c.get("function", c), default=str)[:500] for c in calls)
    return text


def state_view(env: Any) -> Callable[[], str]:
    """A read-only view of a world's final state: the entities the episode changed, as JSON."""
    def view() -> str:
        snap = env.snapshot() if hasattr(env, "snapshot") else {}
        changed = sorted(env.changed()) if hasattr(env, "changed") else []
        return json.dumps({k: snap.get(k, "(deleted)") for k in changed[:20]}, indent=0, default=str)
    return view


def genrm_scorer(rm: GenRM) -> GroupScorer:
    """The GenRM as a group scorer: candidates = the attempts' final answers, states = views of their
    worlds (only when every attempt has one)."""
    def score(task: Any, messages: list[dict], envs: list[Any]) -> list[float]:
        states = [state_view(e) for e in envs] if envs and all(e is not None for e in envs) else None
        return rm.score(task_text(task), [answer_text(m) for m in messages], states)
    return score


def build_genrm(spec: str, cfg: GenRMConfig | None = None, device: Any = None, tools: ToolBox | None = None,
                max_tokens: int = 256, memory_budget_mb: int = 128) -> GenRM:
    """A GenRM on `spec`: `http(s)://HOST:PORT/v1#MODEL` (any OpenAI-compatible endpoint) or a k3
    checkpoint directory (official layout + tokenizer; served in-process by its own engine, frozen)."""
    from k3.reward.judge import engine_backend, openai_backend

    if spec.startswith(("http://", "https://")):
        url, _, model = spec.partition("#")
        backend = openai_backend(url, model or "default", max_tokens=max_tokens)
    else:
        import torch

        from k3.data.tokenizer import load_tokenizer
        from k3.model.causal_lm import K3ForCausalLM
        from k3.serve.engine import Engine, EngineConfig

        tok = load_tokenizer(spec)
        model = K3ForCausalLM.from_pretrained(spec, dtype=torch.float32).to(device or "cpu").eval()
        for p in model.parameters():
            p.requires_grad_(False)
        engine = Engine(model, tok, EngineConfig(memory_budget_bytes=memory_budget_mb << 20, page_size=16,
                                                 unit_size=16, max_running=64))
        backend = engine_backend(engine, tok, max_tokens=max_tokens)
    return GenRM(backend, cfg or GenRMConfig(), tools or ToolBox())


__all__ = ["GroupScorer", "answer_text", "build_genrm", "genrm_scorer", "state_view", "task_text"]
