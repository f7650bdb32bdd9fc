"""Per-token loss weights for SFT: the decisions of an assistant turn count more than its boilerplate.

Most assistant targets of an agent trajectory are predictable without reading the context (the XTML tags
of a turn, the argument syntax, stock reasoning phrases); the few that depend on it -- which tool, which
argument values, how the reasoning starts under the requested thinking effort -- are where an
undertrained model is wrong, and in a per-token mean their gradient is diluted by everything else.
`encode_with_decisions` marks them while rendering a conversation:

* the name of each called tool (the value of a `call` tag's `tool` attribute),
* the value of each argument (the text inside an `argument` tag),
* the first `think_tokens` tokens of each think channel (its first words, or its closing tag when the
  reasoning is empty or shorter): where the effort message decides how long the model reasons.

Only assistant tokens are marked. `weighted_loss` turns (targets, weights) into the loss the trainer
minimises: sum_i w_i * CE_i / (number of targets), with the batch's weights normalised to mean 1 over
its targets (`normalise`), so the loss stays a per-token mean (all weights 1: exactly the plain mean).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from k3.chat.render import render_segments
from k3.chat.xtml import CLOSE, OPEN, SEP
from k3.data.packing import IGNORE_INDEX


def encode_with_decisions(messages: Sequence[dict], tokenizer: Any, tools: Sequence[dict] | None,
                          thinking_effort: str, think_tokens: int) -> tuple[list[int], list[int], list[int]]:
    """Render and tokenize exactly like `k3.chat.render.render` -> (ids, loss_mask, decision), each [n];
    decision[t] = 1 on the assistant tokens listed in the module docstring."""
    ids: list[int] = []
    mask: list[int] = []
    decision: list[int] = []
    pending: str | None = None  # "open" / "close": the next text segment is a tag's name
    tag: str | None = None  # the tag whose attributes are being written (between its name and SEP)
    attr, in_value = "", False  # the current attribute's key; between its `="` and `"`
    inside: str | None = None  # the tag whose content is being written
    think_left = 0  # reasoning tokens still to mark in this think channel
    for seg in render_segments(messages, tools, thinking_effort=thinking_effort):
        piece = tokenizer.encode(seg.text, allow_special=seg.special)
        mark = False
        text = seg.text
        if seg.special:
            if text == OPEN:
                pending, inside = "open", None
            elif text == CLOSE:
                mark = inside == "think" and think_left > 0  # a reasoning shorter than think_tokens ends here
                pending, inside, think_left = "close", None, 0
            elif text == SEP and tag is not None:
                inside, tag = tag, None
                think_left = think_tokens if inside == "think" else 0
        elif pending is not None:
            tag, attr, in_value = (text if pending == "open" else None), "", False
            pending = None
        elif tag is not None:  # the header's attributes: ` key`, `="`, value, `"` (an empty value has none)
            if in_value:
                in_value = text != '"'
                mark = in_value and tag == "call" and attr == " tool"
            elif text == '="':
                in_value = True
            else:
                attr = text
        elif inside == "argument":
            mark = True
        flags = [int(mark and seg.assistant)] * len(piece)
        if inside == "think" and not seg.special and think_left > 0 and seg.assistant:
            take = min(think_left, len(piece))
            flags[:take] = [1] * take
            think_left -= take
        ids.extend(piece)
        mask.extend([int(seg.assistant)] * len(piece))
        decision.extend(flags)
    return ids, mask, decision


def normalise(w: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Weights [...] float32 scaled to mean 1 over the positions whose target is not ignored (others 0)."""
    valid = targets != IGNORE_INDEX
    total = float(w[valid].sum())
    out = np.zeros(w.shape, dtype=np.float32)
    if total > 0:
        out[valid] = w[valid] * (valid.sum() / total)
    return out


def weighted_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., V], labels [...] (-100 = ignore), weights [...] (mean 1 over the batch's targets:
    `normalise`) -> (sum_i w_i CE_i / n, the plain mean CE, detached), n = the number of targets here.
    fp32; with every weight 1 the two are the same number."""
    ce = F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), ignore_index=IGNORE_INDEX,
                         reduction="none")
    n = (labels != IGNORE_INDEX).sum()
    return (ce * weights.flatten().float()).sum() / n, ce.detach().sum() / n
