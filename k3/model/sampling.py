"""Sampling parameters: one `SamplingParams` for the serving engine (`k3.serve`) and the plain
cached generation loop (`k3.model.generate`, which honours the fields it documents)."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    """temperature 0 = greedy; top_p in (0, 1]; top_k 0 = off; max_tokens >= 1.

    stop: strings that end generation (excluded from the returned text); stop_token_ids: ids that
    end generation (kept in token_ids, excluded from text); the tokenizer's stop id is added unless
    ignore_eos. logprobs: None = off, n >= 0 = the chosen token's logprob plus the top n.
    presence_penalty / frequency_penalty in [-2, 2] (OpenAI semantics, over the output tokens so far):
    logit -= presence * [count > 0] + frequency * count. logit_bias: {token id: bias in [-100, 100]}
    added to the logits. min_tokens: the stop ids are masked until this many tokens were sampled.
    skip_special_tokens: special (reserved, control) tokens are left out of the returned text.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        for name in ("top_k", "max_tokens", "seed", "logprobs"):
            if isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be an integer, got a boolean")
        self.stop = tuple(self.stop)
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature <= 100:
            raise ValueError(f"temperature must be a number in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must hold non-empty strings")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -2 <= v <= 2:
                raise ValueError(f"{name} must be a number in [-2, 2], got {v!r}")
        self.logit_bias = {int(k): float(v) for k, v in dict(self.logit_bias).items()}
        if any(not -100 <= v <= 100 for v in self.logit_bias.values()):
            raise ValueError("logit_bias values must be in [-100, 100]")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def adjusts_logits(self) -> bool:
        """True when sampling needs this request's logits changed (penalties, bias, min_tokens)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias or self.min_tokens)
