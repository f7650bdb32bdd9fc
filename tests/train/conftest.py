"""Shared fixtures of the training tests."""

import pytest
import torch


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A folder of 40 small Python-like files (300 words each from a 10-word vocabulary)."""
    d = tmp_path_factory.mktemp("corpus")
    words = ["def", "return", "self", "import", "class", "for", "in", "if", "else", "print"]
    g = torch.Generator().manual_seed(0)
    for i in range(40):
        idx = torch.randint(0, len(words), (300,), generator=g).tolist()
        (d / f"f{i}.py").write_text(" ".join(words[j] for j in idx) + "\n")
    return d
