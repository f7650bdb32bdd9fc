"""Draft training data: prompts from a corpus, continued by the target itself with the serving engine.

The draft must learn the target's distribution, not the corpus's, so every training sequence is a
prompt (a window of a corpus document: the default corpus of `k3.data.corpus`, or --data) followed by
the target's own greedy continuation (`k3.serve.engine.Engine`, continuous batching). Sequences are
stored as JSON lines {"ids": [...], "prompt_len": n} so a resumed run trains on the same data.
"""

from __future__ import annotations

import json
import os
import random
from typing import Any

from k3.data.corpus import iter_documents, split_documents


def corpus_prompts(tokenizer: Any, source: str | None, n: int, prompt_len: int, *, split: str = "train",
                   seed: int = 0, max_docs: int = 2000) -> list[list[int]]:
    """n prompts of `prompt_len` token ids: windows at seeded offsets of the first `max_docs` documents of
    `source` (None = the default corpus), from the "train" or the held-out "val" split (by document id)."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    docs = []
    for d in iter_documents(source):
        docs.append(d)
        if len(docs) >= max_docs:
            break
    train, val = split_documents(docs, val_fraction=0.2, seed=seed)
    pool = train if split == "train" else val
    if not pool:
        raise ValueError(f"{source or 'the default corpus'}: no documents in the {split} split")
    rng = random.Random(f"{seed}-{split}")
    out: list[list[int]] = []
    for _ in range(50 * n):
        if len(out) >= n:
            break
        text = rng.choice(pool).text
        start = rng.randrange(max(1, len(text) - 8 * prompt_len))
        ids = tokenizer.encode(text[start: start + 16 * prompt_len])
        if len(ids) >= prompt_len:
            out.append(ids[:prompt_len])
    if len(out) < n:
        raise ValueError(f"{source or 'the default corpus'}: found only {len(out)} of {n} prompts of {prompt_len} tokens")
    return out


def generate_sequences(target: Any, tokenizer: Any, prompts: list[list[int]], max_new_tokens: int,
                       *, memory_budget_bytes: int = 256 << 20, max_running: int = 16) -> list[dict]:
    """The target's greedy continuations: [{"ids": prompt + continuation, "prompt_len": len(prompt)}]."""
    from k3.serve.engine import Engine, EngineConfig
    from k3.serve.sampling import SamplingParams

    engine = Engine(target, tokenizer, EngineConfig(memory_budget_bytes=memory_budget_bytes, page_size=16,
                                                   unit_size=64, max_running=max_running,
                                                   enable_prefix_cache=False, cuda_graphs=False))
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_new_tokens))
    return [{"ids": list(p) + list(o.token_ids), "prompt_len": len(p)} for p, o in zip(prompts, outs)]


def save_sequences(path: str, seqs: list[dict]) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        for s in seqs:
            f.write(json.dumps(s) + "\n")
    os.replace(tmp, path)


def load_sequences(path: str) -> list[dict]:
    with open(path) as f:
        seqs = [json.loads(line) for line in f if line.strip()]
    for i, s in enumerate(seqs):
        if not isinstance(s.get("ids"), list) or not isinstance(s.get("prompt_len"), int) or len(s["ids"]) < 2:
            raise ValueError(f"{path}:{i + 1}: expected {{\"ids\": [>= 2 ints], \"prompt_len\": int}}")
    return seqs
