"""The batched sampler (per-request `SamplingParams`, defined in `k3.model.sampling`) and incremental detokenisation with stop strings.

Sampling is reproducible per request: a seeded request draws its uniforms from its own
`random.Random(seed)`, one number per sampled token, so its output does not depend on which
other requests share the batch. Log-probabilities are those of the model (log-softmax of the raw
logits over the allowed vocabulary), not of the temperature/top-p processed distribution.
"""

from __future__ import annotations

import codecs
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from k3.model.sampling import SamplingParams


def make_rng(params: SamplingParams) -> random.Random:
    """The request's private uniform source (seeded requests are reproducible)."""
    return random.Random(params.seed) if params.seed is not None else random.Random()


@dataclass
class SampleResult:
    """token_ids [N]; logprob [N] (chosen token, None rows when not asked); top [N] lists of (id, lp)."""

    token_ids: list[int]
    logprobs: list[float | None]
    top: list[list[tuple[int, float]] | None]


def sample_batch(logits: torch.Tensor, params: Sequence[SamplingParams], rngs: Sequence[random.Random],
                 vocab_limit: int | None = None,
                 adjust: Callable[[torch.Tensor], torch.Tensor] | None = None) -> SampleResult:
    """logits [N, vocab] (any float dtype) -> one token per row, rows sampled with their own params.

    vocab_limit: ids >= vocab_limit are never sampled (the tokenizer may be smaller than the model).
    adjust: float32 logits [N, vocab] -> the logits to sample from (penalties, biases, grammar masks;
    see `LogitsAdjuster`); logprobs stay those of the model.
    """
    n = logits.shape[0]
    logits = limit_vocab(logits, vocab_limit)
    pick_from = adjust(logits) if adjust is not None else logits
    out = torch.empty(n, dtype=torch.long, device=logits.device)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if greedy:
        g = torch.tensor(greedy, device=logits.device)
        out[g] = pick_from[g].argmax(-1)
    if sampled:
        s = torch.tensor(sampled, device=logits.device)
        out[s] = _sample_rows(pick_from[s], [params[i] for i in sampled], [rngs[i] for i in sampled])
    lps, tops = token_logprobs(logits, out, params)
    return SampleResult(out.tolist(), lps, tops)


def limit_vocab(logits: torch.Tensor, vocab_limit: int | None) -> torch.Tensor:
    """logits [..., vocab] -> float32 logits with ids >= vocab_limit at -inf (a copy when changed)."""
    logits = logits.float()
    if vocab_limit is not None and vocab_limit < logits.shape[-1]:
        logits = logits.clone()
        logits[..., vocab_limit:] = float("-inf")
    return logits


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, params: Sequence[SamplingParams]
                   ) -> tuple[list[float | None], list[list[tuple[int, float]] | None]]:
    """The model's log-probabilities of the chosen tokens: logits [N, vocab] float32 (vocab-limited),
    token_ids [N] long -> (logprob per row, top-n (id, logprob) per row); None rows where not asked."""
    n = logits.shape[0]
    lps: list[float | None] = [None] * n
    tops: list[list[tuple[int, float]] | None] = [None] * n
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    if want:
        w = torch.tensor(want, device=logits.device)
        lsm = torch.log_softmax(logits[w], dim=-1)
        chosen = lsm.gather(-1, token_ids[w, None]).squeeze(-1).tolist()
        kmax = max(params[i].logprobs for i in want)
        top_v, top_i = (lsm.topk(kmax, dim=-1) if kmax else (lsm[:, :0], lsm[:, :0].long()))
        top_v, top_i = top_v.tolist(), top_i.tolist()
        for r, i in enumerate(want):
            k = params[i].logprobs
            lps[i] = chosen[r]
            tops[i] = list(zip(top_i[r][:k], top_v[r][:k]))
    return lps, tops


def _filtered_sorted(logits: torch.Tensor, params: Sequence[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature, top-k and top-p: logits [M, V] -> (unnormalised kept probabilities [M, V] in
    descending order, zero where dropped; the vocabulary order [M, V] long). Params must not be greedy."""
    dev = logits.device
    temp = torch.tensor([p.temperature for p in params], device=dev, dtype=torch.float32)
    sorted_logits, order = torch.sort(logits / temp[:, None], dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    rank = torch.arange(probs.shape[-1], device=dev)[None, :]
    top_k = torch.tensor([p.top_k or probs.shape[-1] for p in params], device=dev)
    top_p = torch.tensor([p.top_p for p in params], device=dev, dtype=torch.float32)
    # keep the smallest prefix whose mass reaches top_p (always at least the best token)
    drop = (rank >= top_k[:, None]) | ((probs.cumsum(-1) - probs) >= top_p[:, None])
    drop[:, 0] = False
    return probs.masked_fill(drop, 0.0), order


def target_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution `sample_batch` draws from: logits [M, V] float32 (vocab-limited), sampled
    (non-greedy) params per row -> probabilities [M, V] float32 in vocabulary order, rows summing to 1."""
    probs, order = _filtered_sorted(logits, params)
    p = torch.zeros_like(probs).scatter_(-1, order, probs)
    return p / p.sum(-1, keepdim=True)


def sample_from(probs: torch.Tensor, u: float) -> int:
    """Inverse-CDF draw from probs [V] (non-negative, any positive total) with the uniform u in [0, 1)."""
    cdf = probs.cumsum(-1)
    pick = int(torch.searchsorted(cdf, (u * cdf[-1]).reshape(1), right=True))
    # rounding at the top end must never land on a zero-probability id
    return min(pick, int((probs > 0).nonzero()[-1]))


def _sample_rows(logits: torch.Tensor, params: Sequence[SamplingParams], rngs: Sequence[random.Random]) -> torch.Tensor:
    """Temperature, top-k, top-p, then inverse-CDF sampling with one uniform per row. [M, V] -> [M]."""
    dev = logits.device
    probs, order = _filtered_sorted(logits, params)
    cdf = probs.cumsum(-1)
    u = torch.tensor([r.random() for r in rngs], device=dev, dtype=torch.float32)
    pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(-1)
    # guard against rounding at the top end and never pick a dropped (zero-probability) slot
    last_kept = (probs > 0).long().cumsum(-1).argmax(-1)
    pick = torch.minimum(pick, last_kept)
    return order.gather(-1, pick[:, None]).squeeze(-1)


@dataclass
class Detokenizer:
    """Incremental detokenisation of one request's output with stop strings.

    Text is the UTF-8 decoding of the tokens' bytes (special tokens as their names, or nothing with
    skip_special). Tokens are
    released in order once no stop string can still start inside their text; when a stop string
    matches, the output ends at the last token that lies wholly before it and `text` is cut
    exactly at the match.
    """

    tokenizer: Any
    stop: tuple[str, ...] = ()
    skip_special: bool = False  # special tokens add no text (they stay in the ids)
    ids: list[int] = field(default_factory=list)
    text: str = ""
    char_end: list[int] = field(default_factory=list)  # len(text) after each token
    released: int = 0
    stopped_at: int | None = None  # character index of a stop-string match
    matched: str | None = None  # the stop string that matched

    def __post_init__(self) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        # a tokenizer without special tokens (no is_special) has nothing to skip
        self._is_special = getattr(self.tokenizer, "is_special", None) if self.skip_special else None
        self._searched = 0

    def add(self, token_id: int) -> bool:
        """Append one token; returns True when a stop string matched."""
        self.ids.append(token_id)
        if self._is_special is None or not self._is_special(token_id):
            self.text += self._dec.decode(self.tokenizer.token_bytes(token_id))
        self.char_end.append(len(self.text))
        if self.stop:
            start = max(0, self._searched - self._hold)
            hits = [(i, s) for i, s in ((self.text.find(s, start), s) for s in self.stop) if i >= 0]
            self._searched = len(self.text)
            if hits:
                self.stopped_at, self.matched = min(hits)  # the earliest match (ties: any)
                self.text = self.text[: self.stopped_at]
                return True
        return False

    def release(self, final: bool) -> tuple[list[int], str]:
        """Newly releasable (token ids, text); with final, everything that remains."""
        start_tok = self.released
        start_chr = self.char_end[start_tok - 1] if start_tok else 0
        if self.stopped_at is not None:
            upto = sum(1 for e in self.char_end if e <= self.stopped_at)
            end_chr = self.stopped_at
        elif final:
            self.text += self._dec.decode(b"", final=True)
            upto, end_chr = len(self.ids), len(self.text)
        else:
            safe = len(self.text) - self._hold
            upto = start_tok
            while upto < len(self.ids) and self.char_end[upto] <= safe:
                upto += 1
            end_chr = self.char_end[upto - 1] if upto else 0
        upto = max(upto, start_tok)
        end_chr = max(end_chr, start_chr)
        self.released = upto
        return self.ids[start_tok:upto], self.text[start_chr:end_chr]


class NullDetokenizer:
    """Detokenizer stand-in without a tokenizer: ids only, no text, no stop strings."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.released = 0
        self.matched: str | None = None

    def add(self, token_id: int) -> bool:
        self.ids.append(token_id)
        return False

    def release(self, final: bool) -> tuple[list[int], str]:
        out = self.ids[self.released:]
        self.released = len(self.ids)
        return out, ""
