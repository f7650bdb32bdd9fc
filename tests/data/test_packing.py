"""Token streams: tokenisation layout, row cutting and labels, the on-disk cache, unigram baseline."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import k3.data.tokenizer as tokmod
from k3.data.corpus import Document
from k3.data.packing import (
    IGNORE_INDEX,
    PackedRows,
    TokenStream,
    pack_documents,
    prepare_data,
    token_dtype,
    tokenizer_fingerprint,
    unigram_entropy,
)


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255, eos is 256; counts encode calls to observe cache hits."""

    def __init__(self, vocab_size: int = 257, tag: str = "v1") -> None:
        self.vocab_size, self.eos_id, self.tag = vocab_size, 256, tag
        self.encoded = 0

    def encode(self, text: str) -> list[int]:
        self.encoded += 1
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def save(self, directory) -> None:
        Path(directory, "byte_tokenizer.json").write_text(json.dumps({"kind": "bytes", "tag": self.tag}))


class BatchByteTokenizer(ByteTokenizer):
    def __init__(self) -> None:
        super().__init__()
        self.batches = 0

    def encode_batch(self, texts):
        self.batches += 1
        return [list(t.encode("utf-8")) for t in texts]


def _docs(*texts: str) -> list[Document]:
    return [Document(f"d{i}", t) for i, t in enumerate(texts)]


def _doc_index(stream: TokenStream) -> np.ndarray:
    """Reference: the document number of every stream position."""
    ids = np.zeros(stream.num_tokens, dtype=np.int64)
    ids[stream.doc_starts[1:]] = 1
    return np.cumsum(ids)


def _reference_row(stream: TokenStream, T: int, r: int):
    """Plain per-position reference for row r: targets masked where the next token belongs to
    another document; doc starts where a position's document differs from the previous one."""
    toks = np.asarray(stream.tokens, dtype=np.int64)
    doc = _doc_index(stream)
    x, y, starts = [], [], []
    for i in range(T):
        p = r * T + i
        x.append(toks[p])
        y.append(IGNORE_INDEX if doc[p + 1] != doc[p] else toks[p + 1])
        if p == 0 or doc[p] != doc[p - 1]:
            starts.append(i)
    return np.array(x), np.array(y), np.array(starts, dtype=np.int64)


# ------------------------------------------------------------------------------ layout


def test_pack_layout_each_document_then_eos(tmp_path):
    tok = ByteTokenizer()
    stream = pack_documents(_docs("ab", "c", "déf"), tok, tmp_path, show_progress=False)
    want = [97, 98, 256, 99, 256, 100, 195, 169, 102, 256]
    assert stream.tokens.dtype == np.uint16 and isinstance(stream.tokens, np.memmap)
    assert stream.tokens.tolist() == want
    assert stream.doc_starts.tolist() == [0, 3, 5]
    assert (stream.num_tokens, stream.num_docs, stream.eos_id, stream.vocab_size) == (10, 3, 256, 257)


def test_token_dtype():
    assert token_dtype(257) == np.uint16 and token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32 and token_dtype(163840) == np.uint32
    with pytest.raises(ValueError, match="vocab_size"):
        token_dtype(0)


def test_uint32_stream_for_large_vocab(tmp_path):
    stream = pack_documents(_docs("hi"), ByteTokenizer(vocab_size=100_000), tmp_path, show_progress=False)
    assert stream.tokens.dtype == np.uint32 and stream.tokens.tolist() == [104, 105, 256]


def test_ids_outside_vocab_are_rejected(tmp_path):
    with pytest.raises(ValueError, match=r"outside \[0, 100\)"):
        pack_documents(_docs("hi"), ByteTokenizer(vocab_size=100), tmp_path, show_progress=False)
    with pytest.raises(ValueError, match="no documents"):
        pack_documents([], ByteTokenizer(), tmp_path)


def test_batch_encode_is_used_when_available(tmp_path):
    tok = BatchByteTokenizer()
    stream = pack_documents(_docs("x" * 10, "y"), tok, tmp_path, show_progress=False)
    assert tok.batches == 1 and tok.encoded == 0
    assert stream.num_tokens == 13


def test_progress_goes_to_stderr(tmp_path, capsys):
    pack_documents(_docs("some text"), ByteTokenizer(), tmp_path, show_progress=True)
    out, err = capsys.readouterr()
    assert out == "" and "tokenising" in err


def test_real_bpe_round_trip(tmp_path):
    texts = ["def add(a, b):\n    return a + b\n", "class Point:\n    x: int = 0\n", "# é 中文 comment\nprint(1)\n"]
    tok = tokmod.train_bpe_tokenizer(texts * 20, vocab_size=700)
    stream = pack_documents(_docs(*texts), tok, tmp_path, show_progress=False)
    ends = list(stream.doc_starts[1:]) + [stream.num_tokens]
    for text, s, e in zip(texts, stream.doc_starts, ends):
        ids = stream.tokens[s:e].tolist()
        assert ids[-1] == tok.eos_id and tok.eos_id not in ids[:-1]
        assert ids[:-1] == tok.encode(text) and tok.decode(ids[:-1]) == text


# ------------------------------------------------------------------------------ rows


@pytest.mark.parametrize("T", [1, 2, 3, 5, 8])
def test_rows_match_reference_on_awkward_documents(T):
    # documents of length 1 (eos only), 2, and ones spanning several rows
    docs = [[], [5], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [], [], [7, 7], list(range(20, 37)), [3]]
    stream = TokenStream.from_token_lists(docs, eos_id=0, vocab_size=64)
    rows = PackedRows(stream, T)
    assert len(rows) == (stream.num_tokens - 1) // T
    for r in range(len(rows)):
        row = rows[r]
        x, y, starts = _reference_row(stream, T, r)
        assert row.x.dtype == np.int64 and row.y.dtype == np.int64 and row.x.shape == row.y.shape == (T,)
        np.testing.assert_array_equal(row.x, x)
        np.testing.assert_array_equal(row.y, y)
        np.testing.assert_array_equal(row.doc_starts, starts)
        # -100 exactly at document ends: the masked inputs are the eos tokens
        assert np.all(row.x[row.y == IGNORE_INDEX] == 0)
    with pytest.raises(IndexError):
        rows[len(rows)]


def test_row_targets_overlap_next_row():
    stream = TokenStream.from_token_lists([list(range(1, 30))], eos_id=0, vocab_size=64)
    rows = PackedRows(stream, 4)
    for r in range(len(rows) - 1):
        assert rows[r].y[-1] == rows[r + 1].x[0]


def test_rows_errors():
    stream = TokenStream.from_token_lists([[1, 2]], eos_id=0, vocab_size=8)  # 3 tokens
    assert len(PackedRows(stream, 2)) == 1
    with pytest.raises(ValueError, match="seq_len=3"):
        PackedRows(stream, 3)
    with pytest.raises(ValueError, match="seq_len"):
        PackedRows(stream, 0)


def test_stream_validation():
    with pytest.raises(ValueError, match="doc_starts"):
        TokenStream(np.zeros(4, np.uint16), np.array([1]), eos_id=0, vocab_size=8)
    with pytest.raises(ValueError, match="ascending"):
        TokenStream(np.zeros(4, np.uint16), np.array([0, 2, 2]), eos_id=0, vocab_size=8)
    with pytest.raises(ValueError, match="eos_id"):
        TokenStream(np.zeros(4, np.uint16), np.array([0]), eos_id=8, vocab_size=8)


# ------------------------------------------------------------------------------ cache


def test_cache_reuse_and_keys(tmp_path):
    docs = _docs("alpha", "beta gamma", "delta")
    tok = ByteTokenizer()
    first = pack_documents(docs, tok, tmp_path, show_progress=False)
    assert tok.encoded == 3
    again = pack_documents(list(docs), tok, tmp_path, show_progress=False)
    assert tok.encoded == 3, "second run must not tokenise"
    assert again.path == first.path and again.fingerprint == first.fingerprint
    np.testing.assert_array_equal(again.tokens, first.tokens)
    entries = lambda: sorted(p.name for p in (tmp_path / "packed").iterdir())  # noqa: E731
    assert len(entries()) == 1 and not any(n.startswith(".") for n in entries())
    # a different tokenizer (different saved files) or corpus gets its own entry
    other_tok = ByteTokenizer(tag="v2")
    pack_documents(docs, other_tok, tmp_path, show_progress=False)
    assert other_tok.encoded == 3 and len(entries()) == 2
    pack_documents(docs[:2], tok, tmp_path, show_progress=False)
    assert tok.encoded == 5 and len(entries()) == 3
    # the entry opens standalone
    loaded = TokenStream.load(first.path)
    assert loaded.tokens.tolist() == first.tokens.tolist() and loaded.doc_starts.tolist() == [0, 6, 17]


def test_failed_tokenisation_leaves_no_cache_entry(tmp_path):
    class Broken(ByteTokenizer):
        def encode(self, text):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        pack_documents(_docs("x"), Broken(), tmp_path, show_progress=False)
    assert list((tmp_path / "packed").iterdir()) == []


def test_tokenizer_fingerprint():
    a, b = ByteTokenizer(), ByteTokenizer()
    assert tokenizer_fingerprint(a) == tokenizer_fingerprint(b)
    assert tokenizer_fingerprint(a) != tokenizer_fingerprint(ByteTokenizer(tag="v2"))
    assert tokenizer_fingerprint(a) != tokenizer_fingerprint(ByteTokenizer(vocab_size=300))

    class NoSave:
        vocab_size, eos_id = 10, 1

    with pytest.raises(ValueError, match="fingerprint"):
        tokenizer_fingerprint(NoSave())


def test_bpe_fingerprint_survives_save_and_load(tmp_path):
    tok = tokmod.train_bpe_tokenizer(["def f(x):\n    return x\n"] * 30, vocab_size=600)
    tok.save(tmp_path)
    assert tokenizer_fingerprint(tokmod.load_tokenizer(tmp_path)) == tokenizer_fingerprint(tok)


# ------------------------------------------------------------------------------ unigram baseline


def test_unigram_entropy_matches_reference():
    docs = [[1, 1, 2, 3], [3, 3, 3], [4]]
    stream = TokenStream.from_token_lists(docs, eos_id=0, vocab_size=16)
    counts = Counter(stream.tokens.tolist())
    n = sum(counts.values())
    want = -sum(c / n * math.log(c / n) for c in counts.values())
    assert unigram_entropy(stream) == pytest.approx(want, rel=1e-12)
    uniform = TokenStream.from_token_lists([[1, 2, 3]], eos_id=0, vocab_size=16)
    assert unigram_entropy(uniform) == pytest.approx(math.log(4), rel=1e-12)


# ------------------------------------------------------------------------------ one-call setup


def test_prepare_data_trains_once_and_caches(tmp_path, monkeypatch):
    src = tmp_path / "src"
    for i in range(12):
        (src / f"m{i:02d}.py").parent.mkdir(parents=True, exist_ok=True)
        (src / f"m{i:02d}.py").write_text(f"def f{i}(x):\n    return x * {i} + {i * i}\n" * 5)
    cache = tmp_path / "cache"
    data = prepare_data(src, cache_dir=cache, vocab_size=600, val_fraction=0.25, show_progress=False)
    assert data.num_train_docs + data.num_val_docs == 12 and data.num_val_docs >= 1
    assert data.train.vocab_size == data.tokenizer.vocab_size and data.val is not None

    def no_training(*args, **kwargs):
        raise AssertionError("tokenizer must come from the cache")

    monkeypatch.setattr(tokmod, "train_bpe_tokenizer", no_training)
    again = prepare_data(src, cache_dir=cache, vocab_size=600, val_fraction=0.25, show_progress=False)
    assert again.train.path == data.train.path and again.val.path == data.val.path
    tok_dir = next((cache / "tokenizers").iterdir())
    from_dir = prepare_data(src, cache_dir=cache, tokenizer=tok_dir, val_fraction=0.25, show_progress=False)
    assert from_dir.train.path == data.train.path
    no_val = prepare_data(src, cache_dir=cache, tokenizer=tok_dir, val_fraction=0.0, show_progress=False)
    assert no_val.val is None and no_val.num_train_docs == 12
