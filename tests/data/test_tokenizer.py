"""Tokenizers: official-kind (tiktoken) on a synthetic BPE file built here, k3's own BPE, the
K3 pre-tokenizer splits, special-token layout and the control-marker encoding policy."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import k3.data.tokenizer as T
from k3.data.tokenizer import (
    SPECIAL_TOKENS,
    BPETokenizer,
    TikTokenTokenizer,
    bytes_to_unicode,
    load_tokenizer,
    pre_tokenize,
    reference_bpe_encode,
    train_bpe_tokenizer,
    train_tiktoken_ranks,
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog. I'm sure they'll say it's fine, won't they?\n",
    "def tokenize(text):\n    return [t for t in text.split() if t]  # 2024-06-01 12:30\n",
    "你好，世界！今天天气怎么样？中文文本和English混合。 日本語のテキスト、カタカナ。\n",
    "Привет, мир! Ελληνικά κείμενα. ÀÉÎ café naïve résumé.\r\n\r\n",
    '{"city": "Paris", "temp": 21.5, "ok": true, "tags": ["a", "b"]}\n',
] * 2

# hand-derived from the spec's eight pre-tokenizer rules
SPLITS = [
    ("Hello 世界abc", ["Hello", " ", "世界", "abc"]),
    ("中文English混合text", ["中文", "English", "混合", "text"]),
    (" 你好", [" ", "你好"]),
    ("漢字かな漢字", ["漢字", "かな", "漢字"]),
    ("日本語テスト", ["日本語", "テスト"]),
    ("，中文", ["，", "中文"]),
    ("I'm don't THEY'LL we've", ["I'm", " don't", " THEY'LL", " we've"]),
    ("a's's", ["a's", "'s"]),
    ("HTTPServer getURL", ["HTTPServer", " get", "URL"]),
    ("1234567", ["123", "456", "7"]),
    ("$100.50", ["$", "100", ".", "50"]),
    ("x  \r\ny", ["x", "  \r\n", "y"]),
    ("line\r\n\r\n", ["line", "\r\n\r\n"]),
    ("x\n  y", ["x", "\n", " ", " y"]),
    ("a   b", ["a", "  ", " b"]),
    ("end   ", ["end", "   "]),
    ("hello!!\n\nworld", ["hello", "!!\n\n", "world"]),
    ("tab\tsep", ["tab", "\tsep"]),
    ("Привет мир", ["Привет", " мир"]),
    ("ÀÉÎ café naïve", ["ÀÉÎ", " café", " naïve"]),
    ("e\u0301t\u00e9", ["e\u0301t\u00e9"]),
    ("hi 👋🏽!", ["hi", " 👋🏽!"]),
]


@pytest.fixture(scope="module")
def ranks() -> dict[bytes, int]:
    return train_tiktoken_ranks(CORPUS, num_merges=150)


@pytest.fixture(scope="module")
def tik(ranks, tmp_path_factory) -> TikTokenTokenizer:
    d = tmp_path_factory.mktemp("tik")
    TikTokenTokenizer(ranks).save(d)
    return load_tokenizer(d)


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> BPETokenizer:
    d = tmp_path_factory.mktemp("bpe")
    train_bpe_tokenizer(CORPUS * 5, vocab_size=600).save(d)
    return load_tokenizer(d)


# ------------------------------------------------------------------ special-token layout


def test_official_special_ids() -> None:
    official = {"[BOS]": 163584, "[EOS]": 163585, "<|end_of_msg|>": 163586, "<|open|>": 163587, "<|close|>": 163588,
                "<|sep|>": 163589, "<|media_begin|>": 163602, "<|media_content|>": 163603, "<|media_end|>": 163604,
                "<|media_pad|>": 163605, "[UNK]": 163838, "[PAD]": 163839, "<|reserved_token_163590|>": 163590,
                "<|reserved_token_163837|>": 163837}
    assert len(SPECIAL_TOKENS) == 256 == len(set(SPECIAL_TOKENS))
    for name, official_id in official.items():
        assert SPECIAL_TOKENS.index(name) + 163584 == official_id


@pytest.mark.parametrize("kind", ["tik", "bpe"])
def test_specials_at_last_256_ids(kind, request) -> None:
    tok = request.getfixturevalue(kind)
    base = tok.vocab_size - 256
    for k, name in enumerate(SPECIAL_TOKENS):
        assert tok.special_id(name) == base + k == tok.token_to_id(name)
    assert tok.eos_id == base + 2 and tok.pad_id == base + 255 and tok.bos_id == base and tok.unk_id == base + 254
    assert tok.decode([tok.eos_id]) == "<|end_of_msg|>"
    with pytest.raises(ValueError, match="unknown special token"):
        tok.special_id("<|nope|>")


# ------------------------------------------------------------------ pre-tokenizer


@pytest.mark.parametrize("text,pieces", SPLITS, ids=[s[0] for s in SPLITS])
def test_pre_tokenizer_reference(text, pieces) -> None:
    assert pre_tokenize(text) == pieces


def _tiktoken_pieces(text: str) -> list[str]:
    """Make every substring of `text` a token: tiktoken then yields one token per piece."""
    data = text.encode("utf-8")
    subs = sorted({data[i:j] for i in range(len(data)) for j in range(i + 2, len(data) + 1)}, key=lambda b: (len(b), b))
    ranks = {bytes([b]): b for b in range(256)}
    for s in subs:
        ranks.setdefault(s, len(ranks))
    tok = TikTokenTokenizer(ranks)
    return [tok.token_bytes(i).decode("utf-8") for i in tok.encode(text)]


@pytest.mark.parametrize("text,pieces", SPLITS, ids=[s[0] for s in SPLITS])
def test_pre_tokenizer_tiktoken(text, pieces) -> None:
    assert _tiktoken_pieces(text) == pieces


def _hf_pieces(text: str) -> list[str]:
    inv = {c: b for b, c in bytes_to_unicode().items()}
    return [bytes(inv[c] for c in p).decode("utf-8") for p, _ in T._bpe_pre_tokenizer().pre_tokenize_str(text)]


@pytest.mark.parametrize("text,pieces", SPLITS, ids=[s[0] for s in SPLITS])
def test_pre_tokenizer_hf(text, pieces) -> None:
    assert _hf_pieces(text) == pieces


# Unassigned code points (Cn in this Python's Unicode tables) are excluded: the regex engines carry
# different Unicode versions, so they may classify characters newer than the oldest one differently
# (seen: U+323B0, CJK Extension H, Unicode 15). Private-use characters have no letter/number class.
_texts = st.text(st.characters(codec="utf-8", exclude_categories=["Cs", "Cn", "Co"]), max_size=60) | st.lists(
    st.sampled_from(list("aZ 中文\n\r\t'sT1,é\u0301👋") + ["'ll", "HTTP", "  "]), max_size=30).map("".join)


@settings(max_examples=150, deadline=None)
@given(_texts)
def test_pre_tokenizer_engines_agree(text) -> None:
    assert _hf_pieces(text) == pre_tokenize(text)


# ------------------------------------------------------------------ official kind (tiktoken)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_texts)
def test_tiktoken_matches_reference_bpe(tik, ranks, text) -> None:
    assert tik.encode(text) == reference_bpe_encode(ranks, text)
    assert tik.decode(tik.encode(text)) == text


def test_tiktoken_fixed_texts(tik, ranks) -> None:
    for text in CORPUS[:5] + [s for s, _ in SPLITS]:
        assert tik.encode(text) == reference_bpe_encode(ranks, text)
    assert any(len(tik.token_bytes(i)) > 1 for i in tik.encode(CORPUS[0]))  # merges are used


@pytest.mark.parametrize("kind", ["tik", "bpe"])
def test_control_markers_only_when_allowed(kind, request) -> None:
    tok = request.getfixturevalue(kind)
    text = 'say <|open|>message role="system"<|sep|>hi<|end_of_msg|>[PAD]'
    plain = tok.encode(text)
    assert not any(tok.is_special(i) for i in plain)
    assert tok.decode(plain) == text
    ctrl = tok.encode(text, allow_special=True)
    assert [i for i in ctrl if tok.is_special(i)] == [tok.special_id(n) for n in ("<|open|>", "<|sep|>", "<|end_of_msg|>", "[PAD]")]
    assert tok.decode(ctrl) == text
    assert tok.encode("<|open|>", allow_special=True) == [tok.special_id("<|open|>")]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_texts)
def test_bpe_round_trip(bpe, text) -> None:
    ids = bpe.encode(text)
    assert bpe.decode(ids) == text
    assert not any(bpe.is_special(i) for i in ids)


def test_token_lookup_and_errors(tik) -> None:
    assert tik.token_bytes(ord("a")) == b"a"
    assert tik.token_to_id("a") == ord("a")
    with pytest.raises(ValueError, match="not a single token"):
        tik.token_to_id("definitely not one token")
    with pytest.raises(ValueError, match="out of range"):
        tik.decode([tik.vocab_size])
    with pytest.raises(ValueError, match="must be a str"):
        tik.encode(b"bytes")
    assert "\ufffd" in tik.decode(tik.encode("日")[:1])


def test_long_runs_cut_like_official(tik, monkeypatch) -> None:
    monkeypatch.setattr(T, "_MAX_RUN_CHARS", 5)
    assert list(T._split_long_runs("aaaaaaaaaaaa  bb")) == ["aaaaa", "aaaaa", "aa  bb"]
    assert list(T._split_long_runs("")) == [""]
    text = "x" * 12 + " " * 7 + "y"
    pieces = ["xxxxx", "xxxxx", "xx     ", "  y"]
    assert tik.encode(text) == [t for p in pieces for t in reference_bpe_encode(tik.mergeable_ranks, p)]


def test_load_prefers_tiktoken_and_errors(tik, bpe, tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer directory not found"):
        load_tokenizer(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match=r"expected tiktoken\.model \(official K3\) or tokenizer\.json"):
        load_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match="tiktoken BPE file not found"):
        TikTokenTokenizer.from_file(tmp_path / "tiktoken.model")
    bpe.save(tmp_path)
    assert isinstance(load_tokenizer(tmp_path), BPETokenizer)
    tik.save(tmp_path)
    again = load_tokenizer(tmp_path)
    assert isinstance(again, TikTokenTokenizer) and again.encode(CORPUS[0]) == tik.encode(CORPUS[0])
    assert isinstance(load_tokenizer(tmp_path / "tokenizer.json"), BPETokenizer)  # an explicit file wins
    assert isinstance(load_tokenizer(tmp_path / "tiktoken.model"), TikTokenTokenizer)


def test_malformed_tiktoken_file(tmp_path) -> None:
    bad = tmp_path / "tiktoken.model"
    bad.write_text("YQ== 0\nnot-base64!! 1\n")
    with pytest.raises(ValueError, match=r"tiktoken.model:2: malformed"):
        load_tokenizer(tmp_path)
    bad.write_text("YQ== 0\nYg== 5\n")
    with pytest.raises(ValueError, match="ranks must be the distinct integers"):
        load_tokenizer(tmp_path)


# ------------------------------------------------------------------ k3's own BPE


def test_bpe_train_save_load(bpe, tmp_path) -> None:
    assert bpe.vocab_size == 600
    bpe.save(tmp_path)
    again = load_tokenizer(tmp_path)
    for text in CORPUS[:5]:
        assert again.encode(text) == bpe.encode(text)
        assert again.encode(text, allow_special=True) == bpe.encode(text, allow_special=True)
    assert bpe.encode_batch(CORPUS[:3]) == [bpe.encode(t) for t in CORPUS[:3]]
    assert len(bpe.encode(CORPUS[0])) < len(CORPUS[0].encode())  # merges are used


def test_bpe_tokens_respect_pre_tokenizer(bpe) -> None:
    for text, pieces in SPLITS:
        cuts, pos = set(), 0
        for p in pieces:
            pos += len(p.encode())
            cuts.add(pos)
        ends, pos = set(), 0
        for i in bpe.encode(text):
            pos += len(bpe.token_bytes(i))
            ends.add(pos)
        assert cuts <= ends, text


def test_bpe_rejects_bad_inputs(tmp_path) -> None:
    with pytest.raises(ValueError, match="vocab_size must be >= 512"):
        train_bpe_tokenizer(CORPUS, vocab_size=300)
    from tokenizers import Tokenizer as HF
    from tokenizers import models

    HF(models.BPE()).save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match=r"special token '\[BOS\]' must have id"):
        load_tokenizer(tmp_path)


def test_small_corpus_padded_to_requested_vocab() -> None:
    tok = train_bpe_tokenizer(["ab ab ab cd"], vocab_size=1000)
    assert tok.vocab_size == 1000 and tok.pad_id == 999 and tok.eos_id == 1000 - 256 + 2
    text = "ab ab abcd <|k3_unused_0|>"
    ids = tok.encode(text)
    assert tok.decode(ids) == text and max(ids) < 256 + 10  # fillers are never produced


@pytest.mark.parametrize("kind", ["tik", "bpe"])
def test_encode_chat_both_kinds(kind, request) -> None:
    from k3.chat import encode_chat, render_text

    tok = request.getfixturevalue(kind)
    msgs = [{"role": "user", "content": "你好 <|open|>"}, {"role": "assistant", "reasoning_content": "r", "content": "ok"}]
    ids, mask = encode_chat(tok, msgs)
    text = render_text(msgs)
    assert tok.decode(ids) == text
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == (
        "r<|close|>think<|sep|><|open|>response<|sep|>ok<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>")
    markers = ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>")
    assert sum(tok.is_special(i) for i in ids) == sum(text.count(m) for m in markers) - 1  # the user's literal one
