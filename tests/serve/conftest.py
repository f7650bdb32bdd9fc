"""Shared fixtures for the serving tests: a random-weight k3-tiny, a small BPE tokenizer trained
here, and engine factories. Serving is latency-bound on tiny tensors, where a second intra-op
thread only adds synchronisation cost (and stalls badly on a loaded 2-core machine), so these
tests run torch with one thread."""

from __future__ import annotations

import random

import pytest
import torch

from k3.config import k3_tiny
from k3.data.tokenizer import train_bpe_tokenizer
from k3.model.causal_lm import K3ForCausalLM
from k3.serve.engine import Engine, EngineConfig

WORDS = ("the quick brown fox jumps over lazy dog weather Paris tool call result hello world data model serve "
         "cache token agent search file read write python error retry answer question think step plan").split()


def corpus(n_docs: int = 300, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    docs = [" ".join(rng.choice(WORDS) for _ in range(60)) for _ in range(n_docs)]
    docs += ['{"city": "Paris", "days": [1, 2, 3], "ok": true}', "def add(a, b):\n    return a + b\n"]
    return docs


@pytest.fixture(autouse=True)
def _one_thread():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    tok = train_bpe_tokenizer(corpus(), 1024)
    directory = tmp_path_factory.mktemp("serve_tok")
    tok.save(directory)
    tok.directory = str(directory)
    return tok


@pytest.fixture(scope="session")
def model() -> K3ForCausalLM:
    torch.manual_seed(0)  # reset_kda_parameters draws from the global generator
    return K3ForCausalLM(k3_tiny()).init_weights(seed=0).eval()


@pytest.fixture
def make_engine(model, tokenizer):
    def make(**overrides) -> Engine:
        cfg = dict(memory_budget_bytes=32 << 20, page_size=8, unit_size=8, checkpoint_every_units=4,
                   checkpoint_min_gap=2, max_model_len=4096)
        cfg.update(overrides)
        return Engine(model, tokenizer, EngineConfig(**cfg))

    return make


def random_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    """n random ordinary token ids (pass the tokenizer's base_size: specials come after it)."""
    return [rng.randrange(vocab) for _ in range(n)]
