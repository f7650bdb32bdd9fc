"""Tokenise documents into one flat token stream, cache it on disk, and cut it into rows.

Stream layout: document k contributes `tokenizer.encode(text) + [eos_id]`, documents are
concatenated in corpus order, and `doc_starts[k]` is the stream offset of document k's first
token. On disk (`cache_dir/packed/<corpus fp>-<tokenizer fp>/`):
    tokens.bin       raw little-endian uint16 (vocab <= 65536) or uint32 token ids, read as a memmap
    doc_starts.npy   int64 [num_docs] ascending, doc_starts[0] == 0
    meta.json        dtype, sizes, eos_id, vocab_size and both full fingerprints
A directory is written under a temporary name and renamed into place, so a cache entry is
either complete or absent.

Rows (`PackedRows`): row r covers stream positions [r*T, r*T + T] (T + 1 tokens; consecutive
rows share one token). Inputs x = the first T, targets y = the last T, with y = -100 where the
target crosses into the next document (the target of every document's final eos).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Sequence

import numpy as np

from k3.data.corpus import Document, corpus_fingerprint, iter_documents, split_documents

IGNORE_INDEX = -100
CACHE_ENV = "K3_CACHE_DIR"
_FORMAT_VERSION = 1
_CHUNK_CHARS = 2_000_000  # text per encode_batch call: big enough to keep every core busy


def default_cache_dir() -> Path:
    """$K3_CACHE_DIR if set, else ~/.cache/k3."""
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "k3"


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab_size <= 65536), else uint32."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 identifying a tokenizer's encoding: its `fingerprint` attribute/method if it has
    one, else a hash of the files `tokenizer.save(dir)` writes plus class, vocab_size, eos_id."""
    own = getattr(tokenizer, "fingerprint", None)
    if own is not None:
        return str(own() if callable(own) else own)
    if not callable(getattr(tokenizer, "save", None)):
        raise ValueError(f"tokenizer: {type(tokenizer).__name__} has neither `fingerprint` nor `save(dir)`; cannot key the cache")
    h = hashlib.sha256(f"{type(tokenizer).__name__}|{tokenizer.vocab_size}|{tokenizer.eos_id}".encode())
    with tempfile.TemporaryDirectory(prefix="k3-tokfp-") as tmp:
        tokenizer.save(tmp)
        for path in sorted(Path(tmp).rglob("*")):
            if path.is_file():
                h.update(path.relative_to(tmp).as_posix().encode() + b"\x00" + path.read_bytes())
    return h.hexdigest()


class Row(NamedTuple):
    """One packed row. x, y: [T] int64 (y = -100 at document ends); doc_starts: [k] int64,
    ascending offsets in [0, T) of the documents that begin inside the row."""

    x: np.ndarray
    y: np.ndarray
    doc_starts: np.ndarray


class TokenStream:
    """A flat token stream with document boundaries.

    tokens: [N] uint16/uint32 (usually a read-only memmap); doc_starts: [D] int64, ascending,
    doc_starts[0] == 0, all < N. Every document ends with eos_id.
    """

    def __init__(self, tokens: np.ndarray, doc_starts: np.ndarray, *, eos_id: int, vocab_size: int,
                 fingerprint: str = "", path: Path | None = None) -> None:
        doc_starts = np.asarray(doc_starts, dtype=np.int64)
        if tokens.ndim != 1 or len(tokens) == 0:
            raise ValueError(f"tokens must be a non-empty 1-D array, got shape {tokens.shape}")
        if doc_starts.ndim != 1 or len(doc_starts) == 0 or doc_starts[0] != 0:
            raise ValueError("doc_starts must be a non-empty 1-D array starting at 0")
        if np.any(np.diff(doc_starts) <= 0) or doc_starts[-1] >= len(tokens):
            raise ValueError(f"doc_starts must be strictly ascending and < {len(tokens)} (the stream length)")
        if not 0 <= eos_id < vocab_size:
            raise ValueError(f"eos_id {eos_id} outside vocab [0, {vocab_size})")
        self.tokens = tokens
        self.doc_starts = doc_starts
        self.eos_id = int(eos_id)
        self.vocab_size = int(vocab_size)
        self.fingerprint = fingerprint
        self.path = path

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_docs(self) -> int:
        return len(self.doc_starts)

    def __len__(self) -> int:
        return self.num_tokens

    def rows(self, seq_len: int) -> "PackedRows":
        return PackedRows(self, seq_len)

    def __repr__(self) -> str:
        return f"TokenStream(num_tokens={self.num_tokens}, num_docs={self.num_docs}, vocab_size={self.vocab_size})"

    @classmethod
    def from_token_lists(cls, docs_tokens: Sequence[Sequence[int]], *, eos_id: int, vocab_size: int) -> "TokenStream":
        """In-memory stream of already tokenised documents (eos appended to each)."""
        lengths = [len(t) + 1 for t in docs_tokens]
        if not lengths:
            raise ValueError("docs_tokens: no documents")
        flat = np.fromiter(itertools.chain.from_iterable(itertools.chain(t, (eos_id,)) for t in docs_tokens),
                           dtype=np.int64, count=sum(lengths))
        _check_ids(flat, vocab_size)
        starts = np.concatenate([[0], np.cumsum(lengths[:-1])]).astype(np.int64)
        return cls(flat.astype(token_dtype(vocab_size)), starts, eos_id=eos_id, vocab_size=vocab_size)

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "TokenStream":
        """Open a cached stream directory (tokens memory-mapped read-only)."""
        directory = Path(directory)
        meta = json.loads((directory / "meta.json").read_text())
        if meta.get("format") != _FORMAT_VERSION:
            raise ValueError(f"{directory}: unsupported packed-stream format {meta.get('format')!r}")
        tokens = np.memmap(directory / "tokens.bin", dtype=np.dtype(meta["dtype"]), mode="r", shape=(meta["num_tokens"],))
        starts = np.load(directory / "doc_starts.npy")
        return cls(tokens, starts, eos_id=meta["eos_id"], vocab_size=meta["vocab_size"],
                   fingerprint=meta["fingerprint"], path=directory)


def _check_ids(ids: np.ndarray, vocab_size: int) -> None:
    if len(ids) and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"tokenizer produced ids outside [0, {vocab_size}): min {ids.min()}, max {ids.max()}")


class PackedRows:
    """Fixed-length rows of a stream: row r = stream[r*T : r*T + T + 1] (see module docstring).

    len = (N - 1) // T; the tail that does not fill a row is never used at this T.
    """

    def __init__(self, stream: TokenStream, seq_len: int) -> None:
        if not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
        self.stream = stream
        self.seq_len = seq_len
        self.num_rows = (stream.num_tokens - 1) // seq_len
        if self.num_rows == 0:
            raise ValueError(f"seq_len={seq_len}: the stream has {stream.num_tokens} tokens, fewer than one row "
                             f"needs (seq_len + 1)")

    def __len__(self) -> int:
        return self.num_rows

    def __getitem__(self, r: int) -> Row:
        if not 0 <= r < self.num_rows:
            raise IndexError(f"row {r} out of range [0, {self.num_rows})")
        T = self.seq_len
        start = int(r) * T
        seg = np.asarray(self.stream.tokens[start:start + T + 1], dtype=np.int64)
        x, y = seg[:-1], seg[1:].copy()
        ds = self.stream.doc_starts
        # starts in (start, start + T] make the target just before them an eos -> next doc
        inner = ds[np.searchsorted(ds, start, "left"):np.searchsorted(ds, start + T, "right")] - start
        y[inner[inner >= 1] - 1] = IGNORE_INDEX
        return Row(x, y, inner[inner < T])


# ------------------------------------------------------------------------------ tokenisation


def _encode_many(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Batch-encode with the tokenizer's own parallel path when it has one (BPE kind); else a
    thread pool over `encode` (tiktoken releases the GIL while encoding)."""
    if callable(getattr(tokenizer, "encode_batch", None)):
        return tokenizer.encode_batch(texts)
    workers = min(8, os.cpu_count() or 1)
    if workers == 1 or len(texts) == 1:
        return [tokenizer.encode(t) for t in texts]
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(tokenizer.encode, texts))


def _chunks(docs: Sequence[Document], max_chars: int) -> list[list[Document]]:
    out, cur, size = [], [], 0
    for d in docs:
        cur.append(d)
        size += len(d.text)
        if size >= max_chars:
            out.append(cur)
            cur, size = [], 0
    if cur:
        out.append(cur)
    return out


def _write_stream(docs: Sequence[Document], tokenizer: Any, directory: Path, show_progress: bool) -> tuple[int, np.ndarray]:
    """Tokenise into directory/tokens.bin; returns (num_tokens, doc_starts)."""
    from tqdm import tqdm

    vocab, eos = tokenizer.vocab_size, tokenizer.eos_id
    dtype = token_dtype(vocab)
    starts, total = [], 0
    bar = tqdm(total=sum(len(d.text) for d in docs), unit="char", unit_scale=True, desc="tokenising",
               file=sys.stderr, disable=not show_progress, mininterval=1.0)
    with open(directory / "tokens.bin", "wb") as f, bar:
        for chunk in _chunks(docs, _CHUNK_CHARS):
            ids = _encode_many(tokenizer, [d.text for d in chunk])
            lengths = [len(t) + 1 for t in ids]
            flat = np.fromiter(itertools.chain.from_iterable(itertools.chain(t, (eos,)) for t in ids),
                               dtype=np.int64, count=sum(lengths))
            _check_ids(flat, vocab)
            flat.astype(dtype).tofile(f)
            starts.append(total + np.concatenate([[0], np.cumsum(lengths[:-1])]))
            total += len(flat)
            bar.update(sum(len(d.text) for d in chunk))
    return total, np.concatenate(starts).astype(np.int64)


def pack_documents(docs: Sequence[Document], tokenizer: Any, cache_dir: str | os.PathLike | None = None, *,
                   show_progress: bool = True) -> TokenStream:
    """Tokenise `docs` (each -> tokens + [eos]) into a TokenStream.

    tokenizer: anything with encode(text) -> list[int] (encode_batch(texts) used when present),
        eos_id, vocab_size, and save(dir) or a `fingerprint` for the cache key.
    cache_dir: the stream is stored under cache_dir/packed/ keyed by (corpus fingerprint,
        tokenizer fingerprint); a second call with the same corpus and tokenizer loads it without
        tokenising. None: a per-process temporary directory (removed at exit).
    Progress goes to stderr when show_progress.
    """
    docs = list(docs)
    if not docs:
        raise ValueError("docs: no documents to pack")
    corpus_fp, tok_fp = corpus_fingerprint(docs), tokenizer_fingerprint(tokenizer)
    fingerprint = hashlib.sha256(f"{corpus_fp}|{tok_fp}|{_FORMAT_VERSION}".encode()).hexdigest()
    if cache_dir is None:
        cache_dir = Path(_session_tmp()) / "k3-cache"
    root = Path(cache_dir) / "packed"
    final = root / f"{corpus_fp[:16]}-{tok_fp[:16]}"
    if (final / "meta.json").is_file():
        stream = TokenStream.load(final)
        if stream.fingerprint == fingerprint:
            return stream
        shutil.rmtree(final)  # 64-bit prefix collision or stale format: rebuild
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    try:
        num_tokens, starts = _write_stream(docs, tokenizer, tmp, show_progress)
        np.save(tmp / "doc_starts.npy", starts)
        meta = {"format": _FORMAT_VERSION, "dtype": token_dtype(tokenizer.vocab_size).name, "num_tokens": num_tokens,
                "num_docs": len(docs), "eos_id": int(tokenizer.eos_id), "vocab_size": int(tokenizer.vocab_size),
                "fingerprint": fingerprint, "corpus_fingerprint": corpus_fp, "tokenizer_fingerprint": tok_fp}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        try:
            os.rename(tmp, final)
        except OSError:  # another process finished the same entry first; theirs is identical
            shutil.rmtree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return TokenStream.load(final)


_SESSION_TMP: tempfile.TemporaryDirectory | None = None


def _session_tmp() -> str:
    global _SESSION_TMP
    if _SESSION_TMP is None:
        _SESSION_TMP = tempfile.TemporaryDirectory(prefix="k3-data-")
    return _SESSION_TMP.name


def unigram_entropy(stream: TokenStream) -> float:
    """Entropy (nats/token) of the stream's unigram token distribution: the loss of the best
    context-free predictor, the baseline a trained model's loss is compared with."""
    counts = np.bincount(np.asarray(stream.tokens), minlength=stream.vocab_size).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


# ------------------------------------------------------------------------------ one-call setup


@dataclass
class PreparedData:
    """tokenizer; train / val: TokenStreams of the document split (val None if val_fraction 0)."""

    tokenizer: Any
    train: TokenStream
    val: TokenStream | None
    num_train_docs: int
    num_val_docs: int
    corpus_bytes: int


def prepare_data(source: str | os.PathLike | None = None, *, cache_dir: str | os.PathLike | None = None,
                 tokenizer: Any = None, vocab_size: int = 4096, val_fraction: float = 0.05, split_seed: int = 0,
                 show_progress: bool = True) -> PreparedData:
    """Read `source` (see `iter_documents`), split by document, get a tokenizer and pack both
    splits (cached). tokenizer: a tokenizer object, a directory for `load_tokenizer`, or None to
    train k3's BPE at `vocab_size` on the train split (cached under cache_dir/tokenizers/)."""
    from k3.data.tokenizer import load_tokenizer

    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    docs = list(iter_documents(source))
    if not docs:
        raise ValueError(f"source: {source if source is not None else 'the default corpus'} has no documents")
    train_docs, val_docs = split_documents(docs, val_fraction, split_seed)
    if tokenizer is None:
        tokenizer = _trained_tokenizer(train_docs, vocab_size, cache, show_progress)
    elif isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = load_tokenizer(tokenizer)
    train = pack_documents(train_docs, tokenizer, cache, show_progress=show_progress)
    val = pack_documents(val_docs, tokenizer, cache, show_progress=show_progress) if val_docs else None
    return PreparedData(tokenizer, train, val, len(train_docs), len(val_docs),
                        sum(len(d.text.encode("utf-8")) for d in docs))


def _trained_tokenizer(docs: list[Document], vocab_size: int, cache: Path, show_progress: bool) -> Any:
    from k3.data.tokenizer import load_tokenizer, train_bpe_tokenizer

    directory = cache / "tokenizers" / f"{corpus_fingerprint(docs)[:24]}-v{vocab_size}"
    if directory.is_dir():
        return load_tokenizer(directory)
    if show_progress:
        print(f"training BPE tokenizer (vocab {vocab_size}) on {len(docs)} documents...", file=sys.stderr, flush=True)
    tok = train_bpe_tokenizer((d.text for d in docs), vocab_size)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    tok.save(tmp)
    try:
        os.rename(tmp, directory)
    except OSError:
        shutil.rmtree(tmp)
    return tok


__all__ = [
    "IGNORE_INDEX", "PackedRows", "PreparedData", "Row", "TokenStream", "default_cache_dir", "pack_documents",
    "prepare_data", "token_dtype", "tokenizer_fingerprint", "unigram_entropy",
]
