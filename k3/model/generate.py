"""Sampling and a simple cached generation loop (the serving engine has its own scheduler)."""

from __future__ import annotations

from typing import Iterator

import torch

from k3.model.causal_lm import K3ForCausalLM
from k3.model.sampling import SamplingParams


def sample(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [N, vocab] -> next ids [N] (greedy when temperature == 0)."""
    if p.temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / p.temperature
    if p.top_k:
        kth = torch.topk(logits, min(p.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, -1)
        drop = probs.cumsum(-1) - probs > p.top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = torch.softmax(logits, -1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate_stream(model: K3ForCausalLM, prompts: list[list[int]], params: SamplingParams, *,
                    seed: int | None = None) -> Iterator[tuple[int, int]]:
    """Yield (prompt index, token id) as tokens are sampled, using the hybrid cache.

    The prompts are prefilled together as packed sequences, then every unfinished sequence decodes one
    token per step; a sequence stops at one of `params.stop_token_ids` (which is yielded) or after
    `params.max_tokens`. Of `params` this loop honours temperature, top_p, top_k, max_tokens,
    stop_token_ids and seed (used when `seed` is None); the serving engine (`k3.serve`) does the rest.
    """
    for ids in prompts:
        if not ids:
            raise ValueError("every prompt needs at least one token")
    if params.stop or params.adjusts_logits or params.logprobs is not None:
        raise ValueError("generate: stop strings, penalties, logit_bias, min_tokens and logprobs need the "
                         "serving engine (k3.serve.Engine)")
    seed = params.seed if seed is None else seed
    device = model.lm_head.weight.device
    gen = None
    if seed is not None:
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
    n = len(prompts)
    cache = model.new_cache(n, capacity=max(len(p) for p in prompts) + params.max_tokens)
    packed = torch.tensor([t for p in prompts for t in p], device=device)[None]
    cu = torch.tensor([0] + [len(p) for p in prompts], device=device).cumsum(0)
    logits = model(packed, cu_seqlens=cu, cache=cache).logits[0, cu[1:] - 1]  # each prompt's last position
    live = list(range(n))
    stop = set(params.stop_token_ids)
    for step in range(params.max_tokens):
        nxt = sample(logits, params, gen).tolist()
        keep = []
        for row, (seq, tok) in enumerate(zip(live, nxt)):
            yield seq, tok
            if tok not in stop:
                keep.append(row)
        if not keep or step + 1 == params.max_tokens:
            return
        if len(keep) < len(live):
            cache = cache.select(keep)
            live = [live[r] for r in keep]
            nxt = [nxt[r] for r in keep]
        logits = model(torch.tensor(nxt, device=device)[:, None], cache=cache).logits[:, -1]


def generate(model: K3ForCausalLM, prompts: list[list[int]], params: SamplingParams, *,
             seed: int | None = None) -> list[list[int]]:
    """Generated ids per prompt (stop ids included when hit)."""
    out: list[list[int]] = [[] for _ in prompts]
    for seq, tok in generate_stream(model, prompts, params, seed=seed):
        out[seq].append(tok)
    return out
