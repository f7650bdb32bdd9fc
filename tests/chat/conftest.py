"""Shared fixtures: a small synthetic official-kind tokenizer (the real tiktoken.model is not
available offline), built once per session from a toy BPE trained in plain Python."""

from __future__ import annotations

import pytest

from k3.data.tokenizer import TikTokenTokenizer, load_tokenizer, train_tiktoken_ranks

CORPUS = [
    "The quick brown fox jumps over the lazy dog. I'm sure they'll call the weather tool.\n",
    "<|open|>message role=\"user\"<|sep|>Hello there<|close|>message<|sep|><|end_of_msg|>\n",
    '{"city": "Paris", "unit": "c", "days": [1, 2, 3], "ok": true, "none": null}\n',
    "你好，世界！今天天气怎么样？ 日本語のテキスト。 Привет, мир.\n",
    "def add(a, b):\n    return a + b  # 12345 + 678\n",
]


@pytest.fixture(scope="session")
def tok(tmp_path_factory: pytest.TempPathFactory) -> TikTokenTokenizer:
    ranks = train_tiktoken_ranks(CORPUS, num_merges=120)
    directory = tmp_path_factory.mktemp("k3tok")
    TikTokenTokenizer(ranks).save(directory)
    loaded = load_tokenizer(directory)
    assert isinstance(loaded, TikTokenTokenizer)
    return loaded
