"""Shared fixtures for the RL tests: a small BPE tokenizer trained here and a random-weight k3-tiny
whose vocabulary matches it (so engine and trainer log-probs cover the same ids), one torch thread."""

from __future__ import annotations

import random

import pytest
import torch

from k3.config import k3_tiny
from k3.data.tokenizer import train_bpe_tokenizer
from k3.model.causal_lm import K3ForCausalLM

WORDS = ("what is the value of lookup submit tool answer think plus minus number key red blue green gold "
         "write python function returns test").split()


def _corpus(n_docs: int = 80, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    docs = [" ".join(rng.choice(WORDS) for _ in range(40)) + f" {rng.randint(0, 199)} + {rng.randint(0, 99)}"
            for _ in range(n_docs)]
    return docs + ['{"key": "red", "answer": 42, "value": 17}', "def f(x):\n    return 3 * x + 1\n"]


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here runs on one intra-op thread (`one_thread`, tests/conftest.py)."""


@pytest.fixture(scope="session")
def tokenizer():
    return train_bpe_tokenizer(_corpus(), 576)


def tiny_model(tokenizer, seed: int = 0) -> K3ForCausalLM:
    cfg = k3_tiny()
    cfg.text_config.vocab_size = tokenizer.vocab_size
    base = tokenizer.vocab_size - 256
    cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = base, base + 2, base + 255
    cfg.media_placeholder_token_id = base + 21
    torch.manual_seed(seed)
    return K3ForCausalLM(cfg.validate()).init_weights(seed=seed)


@pytest.fixture(scope="session")
def model(tokenizer):
    return tiny_model(tokenizer).eval()


def length_reward(msg: dict, env: object) -> float:
    """A stand-in reward for a random model (which never solves the tasks): the reply's length in
    characters mod 97, scaled to [0, 1]. Two replies of a group get the same reward only if their lengths
    agree mod 97, so groups have non-zero advantages and the update path runs (a parity reward left every
    group uniform whenever the samples' lengths happened to share a parity)."""
    text = (msg.get("reasoning_content") or "") + (msg.get("content") or "")
    return (len(text) % 97) / 96
