"""Held-out multiple-choice evaluation of a vision-language model.

For every example with ``choices`` (colour / shape / count questions), each candidate answer is
rendered as the assistant turn of the same chat and scored by the sum of its assistant-token
log-probabilities given the image and the question; the prediction is the best-scoring
candidate. Accuracy is reported overall and per kind next to the chance level (1 / len(choices)).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from k3.data.packing import IGNORE_INDEX
from k3.data.vision_data import collate_examples, render_example

__all__ = ["VisionEvalResult", "evaluate_vision", "score_candidates", "score_candidates_reference"]


@dataclass
class VisionEvalResult:
    """accuracy / chance: means over the scored examples; per_kind: kind -> {accuracy, chance, n}."""

    accuracy: float
    chance: float
    n: int
    per_kind: dict[str, dict[str, float]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"accuracy": self.accuracy, "chance": self.chance, "n": self.n, "per_kind": self.per_kind}

    def summary(self) -> str:
        kinds = ", ".join(f"{k} {v['accuracy']:.1%} (chance {v['chance']:.1%}, n={int(v['n'])})"
                          for k, v in sorted(self.per_kind.items()))
        return (f"held-out vision accuracy {self.accuracy:.1%} vs chance {self.chance:.1%} "
                f"over {self.n} questions: {kinds}")


def _render_chunk(model: Any, tokenizer: Any, chunk: Sequence[Any], offset: int) -> tuple[list[list], list[torch.Tensor]]:
    """Rendered candidate rows per example and each example's pixels."""
    rows, pixels = [], []
    for i, ex in enumerate(chunk):
        if not ex.choices:
            raise ValueError(f"examples[{offset + i}]: has no choices to score")
        rows.append([render_example(ex, tokenizer, model.vision.cfg, answer=c) for c in ex.choices])
        pixels.append(rows[-1][0].pixels)
    return rows, pixels


@torch.no_grad()
def score_candidates_reference(model: Any, tokenizer: Any, examples: Sequence[Any], *,
                               batch_rows: int = 64) -> list[list[float]]:
    """Plain reference of `score_candidates`: every candidate chat is a full padded row."""
    device = model.lm_head.weight.device
    out: list[list[float]] = []
    for k, ex in enumerate(examples):
        (rows,), _ = _render_chunk(model, tokenizer, [ex], k)
        scores: list[float] = []
        for r0 in range(0, len(rows), batch_rows):
            batch = collate_examples(rows[r0:r0 + batch_rows], model.config.pad_token_id).to(device)
            logits = model(batch.input_ids, media=[r.pixels.to(device) for r in rows[r0:r0 + batch_rows]]).logits
            keep = batch.labels != IGNORE_INDEX
            lp = torch.log_softmax(logits.float(), -1).gather(-1, batch.labels.clamp(min=0)[..., None]).squeeze(-1)
            scores.extend((lp * keep).sum(1).tolist())
        out.append(scores)
    return out


@torch.no_grad()
def score_candidates(model: Any, tokenizer: Any, examples: Sequence[Any], *, examples_per_chunk: int = 32
                     ) -> list[list[float]]:
    """Per example, the summed assistant-token log-prob of each of its `choices` ([n_choices] floats).

    The candidates of one example share everything up to the assistant answer, so that prefix
    (with the image) is prefilled once into the cache, the cache rows are repeated once per
    candidate (`HybridCache.select`) and only the candidate suffixes run after it. Equal to
    `score_candidates_reference` up to float rounding (tested).
    """
    if model.vision is None:
        raise ValueError("model: has no vision encoder (config.vision_config is None)")
    device = model.lm_head.weight.device
    out: list[list[float]] = []
    for c0 in range(0, len(examples), examples_per_chunk):
        rows, pixels = _render_chunk(model, tokenizer, examples[c0:c0 + examples_per_chunk], c0)
        prefixes, suffixes, owners = [], [], []
        for i, cands in enumerate(rows):
            p = cands[0].loss_mask.index(1)  # the first assistant token: where candidates diverge at the earliest
            for r in cands:
                if r.ids[:p] != cands[0].ids[:p] or r.loss_mask.index(1) != p:
                    raise ValueError(f"examples[{c0 + i}]: candidate chats do not share the prompt")
                suffixes.append(r.ids[p:])
                owners.append(i)
            prefixes.append(cands[0].ids[:p])
        cache = model.new_cache(len(prefixes))
        first = _packed_forward(model, prefixes, device, cache, media=[x.to(device) for x in pixels])
        cache = cache.select(owners)
        rest = _packed_forward(model, suffixes, device, cache)
        scores = []
        for j, suf in enumerate(suffixes):
            # token 0 of the suffix is predicted by the prefix's last position, token t by suffix position t-1
            logits = torch.cat([first[owners[j]][-1:], rest[j][:-1]]).float()
            lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(suf, device=device)[:, None])
            scores.append(float(lp.sum()))
        at = 0
        for cands in rows:
            out.append(scores[at:at + len(cands)])
            at += len(cands)
    return out


def _packed_forward(model: Any, seqs: list[list[int]], device: torch.device, cache: Any,
                    media: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """One packed forward of `seqs` (cu_seqlens) through `cache`; per-sequence logits [len, vocab]."""
    lens = [len(s) for s in seqs]
    ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long, device=device)[None]
    cu = torch.tensor([0, *lens], device=device).cumsum(0)
    logits = model(ids, cu_seqlens=cu, cache=cache, media=media).logits[0]
    return list(logits.split(lens))


def evaluate_vision(model: Any, tokenizer: Any, examples: Sequence[Any]) -> VisionEvalResult:
    """Multiple-choice accuracy on the examples that have `choices` (others are ignored)."""
    scored = [e for e in examples if e.choices]
    if not scored:
        raise ValueError("examples: none has choices (colour / shape / count questions are scored)")
    was_training = model.training
    model.eval()
    try:
        scores = score_candidates(model, tokenizer, scored)
    finally:
        model.train(was_training)
    hits: dict[str, list[float]] = defaultdict(list)
    chance: dict[str, list[float]] = defaultdict(list)
    for ex, s in zip(scored, scores):
        best = max(range(len(s)), key=s.__getitem__)
        hits[ex.kind].append(float(ex.choices[best] == ex.answer))
        chance[ex.kind].append(1.0 / len(ex.choices))
    per_kind = {k: {"accuracy": sum(v) / len(v), "chance": sum(chance[k]) / len(v), "n": len(v)}
                for k, v in hits.items()}
    all_hits = [h for v in hits.values() for h in v]
    all_chance = [c for v in chance.values() for c in v]
    return VisionEvalResult(sum(all_hits) / len(all_hits), sum(all_chance) / len(all_chance), len(all_hits), per_kind)
