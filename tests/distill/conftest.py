"""The RL tests' fixtures (trained BPE tokenizer, random-weight k3-tiny, one torch thread)."""

from tests.rl.conftest import _one_thread, tokenizer  # noqa: F401  (pytest fixtures)
