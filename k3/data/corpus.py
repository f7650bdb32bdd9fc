"""Pre-training corpora: where documents come from and how they are split.

A corpus is a stream of `Document(id, text)`. Sources (`iter_documents`):
    None              the default corpus: the running interpreter's standard-library sources
    a folder          every text/code file below it (by extension, binaries skipped); `.jsonl` and
                      `.parquet` files inside it contribute one document per record/row instead
    a `.jsonl` file   one document per line, from its `text` field
    a `.parquet` file one document per row, from its `text` column (needs pyarrow)

Document ids are stable across machines and runs (paths relative to the source root, plus a line
or row number for record files); `split_documents` hashes them to split train/validation.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

# Extensions read as whole-file documents when a folder is the source.
TEXT_EXTENSIONS = frozenset(
    ".py .pyi .pyx .pxd .txt .md .markdown .rst .tex .c .h .cc .cpp .cxx .hpp .hh .cu .cuh .m .mm "
    ".js .mjs .cjs .ts .tsx .jsx .json .toml .yaml .yml .ini .cfg .conf .html .htm .css .scss .xml "
    ".sh .bash .zsh .fish .ps1 .bat .rs .go .java .kt .kts .scala .swift .cs .fs .rb .pl .pm .php "
    ".lua .sql .r .jl .hs .ml .mli .ex .exs .erl .el .clj .vim .proto .cmake .mk .dart .zig .nim "
    ".v .sv .vhd .asm .s .f90 .f .for .ipynb .csv .tsv".split()
)
# Extension-less files that are text by convention.
TEXT_FILENAMES = frozenset("Makefile Dockerfile README LICENSE COPYING NOTICE CMakeLists.txt".split())
RECORD_EXTENSIONS = frozenset({".jsonl", ".parquet"})

# Directories never descended into in the default corpus: third-party packages, caches and the
# test suites (CPython's `test` package alone is ~17 MB of deliberately odd files: bad encodings,
# syntax-error fixtures, huge generated tables; leaving it out keeps the corpus ~13 MB of
# ordinary library code on CPython 3.11).
_DEFAULT_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})
_BINARY_SNIFF_BYTES = 8192


@dataclass(frozen=True)
class Document:
    """One training document. id: stable, unique within its corpus. text: non-empty str."""

    id: str
    text: str


def stdlib_dir() -> Path:
    """The running interpreter's standard-library directory (`sysconfig` "stdlib" path)."""
    return Path(sysconfig.get_paths()["stdlib"])


def default_corpus_files() -> list[Path]:
    """All `*.py` files of the interpreter's standard library, sorted by relative path.

    Skips site-packages/dist-packages, __pycache__ and the test suites (`test`, `tests`,
    `idle_test` directories) and files that cannot be read as UTF-8. On CPython 3.11 that is
    ~1,800 files, ~13 MB.
    """
    root = stdlib_dir()
    if not root.is_dir():
        raise FileNotFoundError(f"standard-library directory not found: {root} (sysconfig 'stdlib' path)")
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _DEFAULT_SKIP_DIRS and not d.startswith(".")]
        files.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    files.sort(key=lambda p: p.relative_to(root).as_posix())
    return [f for f in files if _read_text_file(f) is not None]


def _read_text_file(path: Path) -> str | None:
    """Text of a UTF-8 file, or None for unreadable, binary (NUL byte) or non-UTF-8 files."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if b"\x00" in data[:_BINARY_SNIFF_BYTES]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _is_text_file_name(path: Path) -> bool:
    return path.suffix.lower() in TEXT_EXTENSIONS or path.name in TEXT_FILENAMES


def _rel_id(path: Path, root: Path) -> str:
    return path.relative_to(root).as_posix() if path != root else path.name


def _iter_default() -> Iterator[Document]:
    root = stdlib_dir()
    for path in default_corpus_files():
        text = _read_text_file(path)
        if text and text.strip():
            yield Document(_rel_id(path, root), text)


def _iter_folder(root: Path) -> Iterator[Document]:
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"]
        paths.extend(Path(dirpath) / f for f in filenames if not f.startswith("."))
    paths.sort(key=lambda p: p.relative_to(root).as_posix())
    for path in paths:
        suffix = path.suffix.lower()
        if suffix == ".jsonl":
            yield from _iter_jsonl(path, _rel_id(path, root))
        elif suffix == ".parquet":
            yield from _iter_parquet(path, _rel_id(path, root))
        elif _is_text_file_name(path):
            text = _read_text_file(path)
            if text and text.strip():
                yield Document(_rel_id(path, root), text)


def _iter_jsonl(path: Path, name: str) -> Iterator[Document]:
    """One document per non-blank line; errors name the file and the 1-based line."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{path}:{lineno}: invalid JSON line: {e}") from None
            if not isinstance(record, dict) or "text" not in record:
                raise ValueError(f"{path}:{lineno}: record has no 'text' field (each line must be a JSON object with a string 'text')")
            text = record["text"]
            if not isinstance(text, str):
                raise ValueError(f"{path}:{lineno}: field 'text' must be a string, got {type(text).__name__}")
            if text.strip():
                yield Document(f"{name}:{lineno}", text)


def _iter_parquet(path: Path, name: str) -> Iterator[Document]:
    """One document per row of the `text` column (null or blank rows skipped)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"reading Parquet ({path}) needs pyarrow: pip install pyarrow") from None
    pf = pq.ParquetFile(path)
    if "text" not in pf.schema_arrow.names:
        raise ValueError(f"{path}: Parquet file has no 'text' column (columns: {pf.schema_arrow.names})")
    row = 0
    for batch in pf.iter_batches(columns=["text"]):
        for text in batch.column(0).to_pylist():
            if text is not None and not isinstance(text, str):
                raise ValueError(f"{path}: row {row}: column 'text' must hold strings, got {type(text).__name__}")
            if text and text.strip():
                yield Document(f"{name}:{row}", text)
            row += 1


def iter_documents(source: str | os.PathLike | None = None) -> Iterator[Document]:
    """Documents of `source`, in a deterministic order (sorted relative paths, then file order).

    source: None (default corpus: the interpreter's standard library, see `default_corpus_files`),
        a folder, a `.jsonl` file or a `.parquet` file. Empty/whitespace-only texts are skipped.
    Raises FileNotFoundError for a missing source, ValueError for an unsupported file or a bad
    JSONL line (message names the file and line), ImportError for Parquet without pyarrow.
    """
    if source is None:
        yield from _iter_default()
        return
    path = Path(source)
    if path.is_dir():
        yield from _iter_folder(path)
    elif path.is_file():
        suffix = path.suffix.lower()
        if suffix == ".jsonl":
            yield from _iter_jsonl(path, path.name)
        elif suffix == ".parquet":
            yield from _iter_parquet(path, path.name)
        else:
            raise ValueError(f"source: unsupported file {path} (expected a folder, a .jsonl or a .parquet file)")
    else:
        raise FileNotFoundError(f"source: no such file or folder: {path}")


def _unit_hash(doc_id: str, seed: int) -> float:
    """Stable hash of (seed, id) in [0, 1): sha256, so it is the same in every process."""
    digest = hashlib.sha256(f"{seed}\x00{doc_id}".encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def split_documents(docs: Iterable[Document], val_fraction: float, seed: int = 0) -> tuple[list[Document], list[Document]]:
    """Split documents into (train, val), each in input order.

    A document goes to val when the stable hash of (seed, id) is below `val_fraction`, so the
    split of a document does not depend on the other documents. If that leaves one side empty
    while val_fraction > 0 and there are >= 2 documents, the document with the extreme hash is
    moved across, so both sides are non-empty.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    docs = list(docs)
    ids = [d.id for d in docs]
    if len(set(ids)) != len(ids):
        raise ValueError("docs: document ids must be unique")
    hashes = [_unit_hash(i, seed) for i in ids]
    is_val = [h < val_fraction for h in hashes]
    if val_fraction > 0 and len(docs) >= 2:
        if not any(is_val):
            is_val[min(range(len(docs)), key=hashes.__getitem__)] = True
        elif all(is_val):
            is_val[max(range(len(docs)), key=hashes.__getitem__)] = False
    train = [d for d, v in zip(docs, is_val) if not v]
    val = [d for d, v in zip(docs, is_val) if v]
    return train, val


def corpus_fingerprint(docs: Iterable[Document]) -> str:
    """sha256 hex digest over the ordered (id, text) pairs: equal iff the corpus is identical."""
    h = hashlib.sha256()
    for d in docs:
        i, t = d.id.encode("utf-8"), d.text.encode("utf-8", errors="surrogatepass")
        h.update(len(i).to_bytes(8, "little") + i + len(t).to_bytes(8, "little") + t)
    return h.hexdigest()
