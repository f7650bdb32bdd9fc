"""Tokenizers: the official K3 tiktoken tokenizer and k3's own byte-level BPE, one interface.

Both kinds place the same 256 named special tokens at the last 256 ids of their vocab, in the
official order, so `id - (vocab_size - 256) == official_id - 163584` for every special.
`load_tokenizer(dir)` picks the kind from the files in `dir`:
    tiktoken.model  -> TikTokenTokenizer (official K3 file: 163,584 ranks -> vocab 163,840)
    tokenizer.json  -> BPETokenizer (k3's own, trained with `train_bpe_tokenizer`)
"""

from __future__ import annotations

import base64
import os
import re
from abc import ABC, abstractmethod
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

OFFICIAL_SPECIAL_BASE = 163584
NUM_SPECIAL_TOKENS = 256
TIKTOKEN_FILE = "tiktoken.model"
BPE_FILE = "tokenizer.json"

_NAMED_SPECIALS = {
    0: "[BOS]",
    1: "[EOS]",  # not the stop token
    2: "<|end_of_msg|>",  # the stop token (config.eos_token_id)
    3: "<|open|>",
    4: "<|close|>",
    5: "<|sep|>",
    18: "<|media_begin|>",
    19: "<|media_content|>",
    20: "<|media_end|>",
    21: "<|media_pad|>",
    254: "[UNK]",
    255: "[PAD]",
}
# official order; unnamed slots are called after their official id
SPECIAL_TOKENS: tuple[str, ...] = tuple(
    _NAMED_SPECIALS.get(k, f"<|reserved_token_{OFFICIAL_SPECIAL_BASE + k}|>") for k in range(NUM_SPECIAL_TOKENS)
)

# K3 pre-tokenizer: Han runs are their own pieces and are excluded from the cased-word rules.
_NOT_HAN = "&&[^\\p{Han}]"
_UPPER = "[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}" + _NOT_HAN + "]"
_LOWER = "[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}" + _NOT_HAN + "]"
_CONTRACTION = "(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_LEAD = "[^\\r\\n\\p{L}\\p{N}]?"
K3_PAT_STR = "|".join(
    [
        "[\\p{Han}]+",
        _LEAD + _UPPER + "*" + _LOWER + "+" + _CONTRACTION,
        _LEAD + _UPPER + "+" + _LOWER + "*" + _CONTRACTION,
        "\\p{N}{1,3}",
        " ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*",
        "\\s*[\\r\\n]+",
        "\\s+(?!\\S)",
        "\\s+",
    ]
)

# the official encoder cuts long inputs like this before calling tiktoken (its Rust regex
# backtracks badly on huge runs); the cuts change token boundaries, so k3 cuts identically
_MAX_ENCODE_CHARS = 400_000
_MAX_RUN_CHARS = 25_000


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2 byte-level alphabet: each byte -> a printable unicode character."""
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(ord("¡"), ord("¬") + 1)) | set(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


class Tokenizer(ABC):
    """Common interface of both tokenizer kinds.

    Ordinary tokens have ids [0, base_size); specials [base_size, vocab_size).
    """

    kind: str = ""

    def __init__(self, base_size: int) -> None:
        self.base_size = base_size
        self.special_tokens: dict[str, int] = {name: base_size + k for k, name in enumerate(SPECIAL_TOKENS)}
        self._special_names = {i: name for name, i in self.special_tokens.items()}

    # ---- kind-specific
    @abstractmethod
    def _encode_ordinary(self, text: str) -> list[int]: ...

    @abstractmethod
    def _ordinary_bytes(self, token_id: int) -> bytes: ...

    @abstractmethod
    def _ordinary_id(self, token: bytes) -> int | None: ...

    @abstractmethod
    def save(self, directory: str | os.PathLike) -> None:
        """Write the tokenizer files into `directory` (created if missing)."""

    # ---- shared
    @property
    def vocab_size(self) -> int:
        return self.base_size + NUM_SPECIAL_TOKENS

    @property
    def eos_id(self) -> int:
        """`<|end_of_msg|>`: the stop token (163586 in the official vocab)."""
        return self.special_tokens["<|end_of_msg|>"]

    @property
    def pad_id(self) -> int:
        return self.special_tokens["[PAD]"]

    @property
    def bos_id(self) -> int:
        """`[BOS]` (K3 prompts are not prefixed with it)."""
        return self.special_tokens["[BOS]"]

    @property
    def unk_id(self) -> int:
        return self.special_tokens["[UNK]"]

    def special_id(self, name: str) -> int:
        """Id of a special token by name, e.g. `special_id("<|open|>")`."""
        try:
            return self.special_tokens[name]
        except KeyError:
            raise ValueError(f"unknown special token {name!r}") from None

    def token_to_id(self, token: str) -> int:
        """Id of a special token name or of a string that is exactly one ordinary token."""
        if token in self.special_tokens:
            return self.special_tokens[token]
        tid = self._ordinary_id(token.encode("utf-8"))
        if tid is None:
            raise ValueError(f"{token!r} is not a single token of this vocabulary")
        return tid

    def is_special(self, token_id: int) -> bool:
        return self.base_size <= token_id < self.vocab_size

    def token_bytes(self, token_id: int) -> bytes:
        """Raw bytes of one token (a special token's bytes are its name)."""
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} out of range [0, {self.vocab_size})")
        if token_id >= self.base_size:
            return self._special_names[token_id].encode("utf-8")
        return self._ordinary_bytes(token_id)

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        """Text -> ids. With allow_special, special-token names in `text` become special ids;
        otherwise they are encoded as ordinary text (never as control tokens)."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        if not allow_special:
            return self._encode_ordinary(text)
        ids: list[int] = []
        pos = 0
        for m in _special_regex().finditer(text):
            ids.extend(self._encode_ordinary(text[pos : m.start()]))
            ids.append(self.special_tokens[m.group()])
            pos = m.end()
        ids.extend(self._encode_ordinary(text[pos:]))
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """Ids -> text; special tokens appear as their names, invalid UTF-8 as U+FFFD."""
        return b"".join(self.token_bytes(int(i)) for i in ids).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size})"


@lru_cache(maxsize=1)
def _special_regex() -> re.Pattern:
    return re.compile("|".join(re.escape(n) for n in sorted(SPECIAL_TOKENS, key=len, reverse=True)))


# ------------------------------------------------------------------------------ tiktoken


def read_tiktoken_ranks(path: str | os.PathLike) -> dict[bytes, int]:
    """Parse a tiktoken BPE file (`base64(token) rank` per line); ranks must be 0..n-1."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"tiktoken BPE file not found: {path}")
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(path.read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            token_b64, rank = line.split()
            ranks[base64.b64decode(token_b64, validate=True)] = int(rank)
        except ValueError as e:
            raise ValueError(f"{path}:{lineno}: malformed tiktoken line {line[:60]!r}") from e
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks must be the distinct integers 0..{len(ranks) - 1}")
    return ranks


def _split_long_runs(text: str) -> Iterator[str]:
    """Cut `text` so no piece has more than _MAX_RUN_CHARS consecutive (non-)whitespace chars."""
    if not text:
        yield text
        return
    start, run, in_space = 0, 0, text[0].isspace()
    for i, ch in enumerate(text):
        space = ch.isspace()
        if space != in_space:
            in_space, run = space, 1
            continue
        run += 1
        if run > _MAX_RUN_CHARS:
            yield text[start:i]
            start, run = i, 1
    yield text[start:]


class TikTokenTokenizer(Tokenizer):
    """The official K3 tokenizer: tiktoken BPE + K3 pre-tokenizer + 256 reserved specials."""

    kind = "tiktoken"

    def __init__(self, mergeable_ranks: dict[bytes, int], source: str | os.PathLike | None = None) -> None:
        import tiktoken

        if sorted(mergeable_ranks.values()) != list(range(len(mergeable_ranks))):
            raise ValueError("mergeable_ranks: ranks must be the distinct integers 0..n-1")
        super().__init__(len(mergeable_ranks))
        self.mergeable_ranks = mergeable_ranks
        self.source = source
        self._enc = tiktoken.Encoding(
            name=Path(source).name if source else "k3",
            pat_str=K3_PAT_STR,
            mergeable_ranks=mergeable_ranks,
            special_tokens=self.special_tokens,
        )

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "TikTokenTokenizer":
        return cls(read_tiktoken_ranks(path), source=path)

    def _pieces(self, text: str) -> Iterator[str]:
        for i in range(0, len(text), _MAX_ENCODE_CHARS):
            yield from _split_long_runs(text[i : i + _MAX_ENCODE_CHARS])

    def _encode_ordinary(self, text: str) -> list[int]:
        if len(text) <= _MAX_RUN_CHARS:
            return self._enc.encode_ordinary(text)
        return [t for piece in self._pieces(text) for t in self._enc.encode_ordinary(piece)]

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        if not allow_special:
            return self._encode_ordinary(text)
        return [t for piece in self._pieces(text) for t in self._enc.encode(piece, allowed_special="all")]

    def _ordinary_bytes(self, token_id: int) -> bytes:
        return self._enc.decode_single_token_bytes(token_id)

    def _ordinary_id(self, token: bytes) -> int | None:
        return self.mergeable_ranks.get(token)

    def save(self, directory: str | os.PathLike) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        lines = sorted(self.mergeable_ranks.items(), key=lambda kv: kv[1])
        text = "".join(f"{base64.b64encode(tok).decode()} {rank}\n" for tok, rank in lines)
        (directory / TIKTOKEN_FILE).write_text(text)


# ------------------------------------------------------------------------------ plain references


@lru_cache(maxsize=1)
def _reference_splitter() -> Any:
    import regex  # installed with tiktoken; V1 syntax is needed for the `&&` class intersections

    return regex.compile("(?V1)" + K3_PAT_STR)


def pre_tokenize(text: str) -> list[str]:
    """K3 pre-tokenizer splits, computed with the `regex` module (reference for tests)."""
    return _reference_splitter().findall(text)


def reference_bpe_encode(ranks: dict[bytes, int], text: str) -> list[int]:
    """Plain-Python tiktoken-style BPE: split, then repeatedly merge the lowest-rank adjacent
    pair (leftmost on ties). Slow; the reference for TikTokenTokenizer's ordinary encoding."""
    ids: list[int] = []
    for piece in pre_tokenize(text):
        parts = [bytes([b]) for b in piece.encode("utf-8")]
        while len(parts) > 1:
            candidates = [(ranks[pair], i) for i, pair in enumerate(map(bytes.__add__, parts, parts[1:])) if pair in ranks]
            if not candidates:
                break
            _, i = min(candidates)
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        ids.extend(ranks[p] for p in parts)
    return ids


def train_tiktoken_ranks(texts: Iterable[str], num_merges: int) -> dict[bytes, int]:
    """Plain-Python byte-level BPE trainer -> a tiktoken rank table (256 bytes + merges).

    Quadratic and slow: meant for tests and toy vocabularies (e.g. a synthetic `tiktoken.model`).
    Ties between equally frequent pairs break on the smaller byte string, so it is deterministic.
    """
    from collections import Counter

    words = Counter(p.encode("utf-8") for t in texts for p in pre_tokenize(t))
    seqs = {w: [bytes([b]) for b in w] for w in words}
    ranks = {bytes([b]): b for b in range(256)}
    for _ in range(num_merges):
        pairs: Counter = Counter()
        for w, seq in seqs.items():
            for a, b in zip(seq, seq[1:]):
                pairs[(a, b)] += words[w]
        if not pairs:
            break
        (a, b), _ = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))
        ranks.setdefault(a + b, len(ranks))
        for w, seq in seqs.items():
            i = 0
            while i < len(seq) - 1:
                if seq[i] == a and seq[i + 1] == b:
                    seq[i : i + 2] = [a + b]
                i += 1
    return ranks


# ------------------------------------------------------------------------------ own BPE


def _bpe_pre_tokenizer() -> Any:
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(K3_PAT_STR), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


class BPETokenizer(Tokenizer):
    """k3's own byte-level BPE (HF `tokenizers`), same pre-tokenizer and specials as K3."""

    kind = "bpe"

    def __init__(self, hf_tokenizer: Any) -> None:
        base = hf_tokenizer.get_vocab_size(with_added_tokens=True) - NUM_SPECIAL_TOKENS
        for k, name in enumerate(SPECIAL_TOKENS):
            if hf_tokenizer.token_to_id(name) != base + k:
                raise ValueError(
                    f"tokenizer.json: special token {name!r} must have id {base + k} (the last 256 ids, official order)"
                )
        super().__init__(base)
        # specials are handled by Tokenizer.encode; the HF side must treat their names as text
        hf_tokenizer.encode_special_tokens = True
        self._hf = hf_tokenizer
        decode_byte = {c: b for b, c in bytes_to_unicode().items()}
        self._bytes = [bytes(decode_byte[c] for c in hf_tokenizer.id_to_token(i)) for i in range(base)]
        self._ids = {b: i for i, b in enumerate(self._bytes)}

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "BPETokenizer":
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {path}")
        return cls(HFTokenizer.from_file(str(path)))

    def _encode_ordinary(self, text: str) -> list[int]:
        if not text:
            return []
        return self._hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Ordinary-text encoding of many documents in parallel (data preparation)."""
        return [e.ids for e in self._hf.encode_batch(list(texts), add_special_tokens=False)]

    def _ordinary_bytes(self, token_id: int) -> bytes:
        return self._bytes[token_id]

    def _ordinary_id(self, token: bytes) -> int | None:
        return self._ids.get(token)

    def save(self, directory: str | os.PathLike) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._hf.save(str(directory / BPE_FILE))


def train_bpe_tokenizer(
    texts: Iterable[str],
    vocab_size: int,
    *,
    min_frequency: int = 2,
    show_progress: bool = False,
) -> BPETokenizer:
    """Train k3's byte-level BPE on `texts` (an iterable of documents).

    vocab_size: total vocab including the 256 specials (>= 512); always met exactly: when the
        corpus is too small for `vocab_size - 512` merges, unreachable filler tokens pad the vocab.
    """
    from tokenizers import AddedToken, decoders, models, trainers
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.pre_tokenizers import ByteLevel

    if vocab_size < 2 * NUM_SPECIAL_TOKENS:
        raise ValueError(f"vocab_size must be >= {2 * NUM_SPECIAL_TOKENS} (256 bytes + 256 specials), got {vocab_size}")
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = _bpe_pre_tokenizer()
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - NUM_SPECIAL_TOKENS,
        min_frequency=min_frequency,
        initial_alphabet=ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=show_progress,
    )
    hf.train_from_iterator(texts, trainer=trainer)
    hf = _pad_vocab(hf, vocab_size - NUM_SPECIAL_TOKENS)
    hf.add_special_tokens([AddedToken(n, special=True, normalized=False) for n in SPECIAL_TOKENS])
    return BPETokenizer(hf)


def _pad_vocab(hf: Any, size: int) -> Any:
    """Fill the BPE vocab up to `size` with unreachable tokens (no merge produces them), so the
    specials land at the requested ids even when the corpus is too small for all the merges."""
    import json

    from tokenizers import Tokenizer as HFTokenizer

    data = json.loads(hf.to_str())
    vocab = data["model"]["vocab"]
    for k in range(size - len(vocab)):
        vocab[f"<|k3_unused_{k}|>"] = len(vocab)
    return HFTokenizer.from_str(json.dumps(data))


def load_tokenizer(directory: str | os.PathLike) -> Tokenizer:
    """Load the tokenizer saved in `directory` (or given one of its files): the official tiktoken
    kind if `tiktoken.model` exists, else k3's BPE from `tokenizer.json`."""
    directory = Path(directory)
    if directory.is_file() and directory.name == TIKTOKEN_FILE:
        return TikTokenTokenizer.from_file(directory)
    if directory.is_file() and directory.name == BPE_FILE:
        return BPETokenizer.from_file(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"tokenizer directory not found: {directory}")
    if (directory / TIKTOKEN_FILE).is_file():
        return TikTokenTokenizer.from_file(directory / TIKTOKEN_FILE)
    if (directory / BPE_FILE).is_file():
        return BPETokenizer.from_file(directory / BPE_FILE)
    raise FileNotFoundError(
        f"no tokenizer in {directory}: expected {TIKTOKEN_FILE} (official K3) or {BPE_FILE} (k3 BPE)"
    )
