"""A random-weight k3-tiny and a small BPE tokenizer with the chat special tokens, built once per
test session and shared by the LLM-agent and eval tests (same recipe as tests/serve)."""

from __future__ import annotations

import functools
import random

import torch

WORDS = ("the quick brown fox jumps over lazy dog weather Paris tool call result hello world data model "
         "file read write python error answer question think step plan mail note chat send").split()


@functools.lru_cache(maxsize=1)
def tiny_tokenizer():
    from k3.data.tokenizer import train_bpe_tokenizer

    rng = random.Random(0)
    docs = [" ".join(rng.choice(WORDS) for _ in range(60)) for _ in range(300)]
    docs += ['{"city": "Paris", "days": [1, 2, 3], "ok": true}', "def add(a, b):\n    return a + b\n"]
    return train_bpe_tokenizer(docs, 1024)


@functools.lru_cache(maxsize=1)
def tiny_model():
    from k3.config import k3_tiny
    from k3.model.causal_lm import K3ForCausalLM

    torch.manual_seed(0)  # reset_kda_parameters draws from the global generator
    return K3ForCausalLM(k3_tiny()).init_weights(seed=0).eval()


def engine_config(**overrides):
    """A small CPU engine: 32 MiB cache, 4k context, no CUDA graphs."""
    from k3.serve.engine import EngineConfig

    cfg = dict(memory_budget_bytes=32 << 20, page_size=8, unit_size=8, max_model_len=4096, cuda_graphs=False)
    cfg.update(overrides)
    return EngineConfig(**cfg)


def save_checkpoint(directory) -> str:
    """The tiny model and tokenizer saved as a checkpoint directory (what --checkpoint takes)."""
    tiny_model().save_pretrained(directory)
    tiny_tokenizer().save(directory)
    return str(directory)
