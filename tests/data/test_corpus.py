"""Corpus sources (default stdlib, folders, JSONL, Parquet) and the train/val split."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from k3.data.corpus import (
    Document,
    corpus_fingerprint,
    default_corpus_files,
    iter_documents,
    split_documents,
    stdlib_dir,
)

REPO = Path(__file__).resolve().parents[2]


def _write(path: Path, data: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(data, encoding="utf-8")
    return path


# ------------------------------------------------------------------------------ default corpus


def test_default_corpus_files_are_stdlib_python_sorted():
    files = default_corpus_files()
    root = stdlib_dir()
    rel = [f.relative_to(root).as_posix() for f in files]
    assert len(files) > 100
    assert rel == sorted(rel)
    assert all(r.endswith(".py") for r in rel)
    skipped = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    assert not any(skipped & set(r.split("/")[:-1]) for r in rel)
    assert "os.py" in rel
    size_mb = sum(f.stat().st_size for f in files) / 1e6
    assert 5 < size_mb < 40, size_mb


def test_default_documents_ids_are_relative_paths():
    docs = list(itertools.islice(iter_documents(None), 5))
    assert len(docs) == 5
    for d in docs:
        assert (stdlib_dir() / d.id).read_text(encoding="utf-8") == d.text
        assert d.text.strip()


# ------------------------------------------------------------------------------ folders


def test_folder_reads_text_files_recursively_and_skips_the_rest(tmp_path):
    _write(tmp_path / "b.py", "print('b')\n")
    _write(tmp_path / "a" / "x.md", "# title\n")
    _write(tmp_path / "a" / "y.c", "int main(){}\n")
    _write(tmp_path / "a" / "Makefile", "all:\n\techo hi\n")
    _write(tmp_path / "img.png", b"\x89PNG\r\n\x1a\n\x00\x00")  # not a text extension
    _write(tmp_path / "nul.py", b"x = 1\x00\x00\x00")  # binary despite its extension
    _write(tmp_path / "latin1.txt", "caf\xe9".encode("latin-1"))  # not UTF-8
    _write(tmp_path / "empty.py", "   \n")  # whitespace only
    _write(tmp_path / ".git" / "config.txt", "hidden")
    _write(tmp_path / "__pycache__" / "m.py", "cached")
    docs = list(iter_documents(tmp_path))
    assert [d.id for d in docs] == ["a/Makefile", "a/x.md", "a/y.c", "b.py"]
    assert docs[3].text == "print('b')\n"
    assert list(iter_documents(str(tmp_path))) == docs  # str and Path agree, order is stable


def test_folder_of_jsonl_contributes_records(tmp_path):
    _write(tmp_path / "d1.jsonl", '{"text": "one"}\n\n{"text": "two", "meta": 3}\n')
    _write(tmp_path / "sub" / "d2.jsonl", '{"text": "three"}\n')
    _write(tmp_path / "notes.txt", "plain")
    docs = list(iter_documents(tmp_path))
    assert [(d.id, d.text) for d in docs] == [
        ("d1.jsonl:1", "one"), ("d1.jsonl:3", "two"), ("notes.txt", "plain"), ("sub/d2.jsonl:1", "three")]


# ------------------------------------------------------------------------------ JSONL


def test_jsonl_file(tmp_path):
    p = _write(tmp_path / "data.jsonl", "\n".join(json.dumps({"text": t}) for t in ["a b", "", "c"]) + "\n")
    docs = list(iter_documents(p))
    assert docs == [Document("data.jsonl:1", "a b"), Document("data.jsonl:3", "c")]


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"text": "ok"', "invalid JSON"),
        ('{"body": "x"}', "no 'text' field"),
        ('["text"]', "no 'text' field"),
        ('{"text": 5}', "'text' must be a string"),
    ],
)
def test_jsonl_bad_line_names_file_and_line(tmp_path, line, message):
    p = _write(tmp_path / "bad.jsonl", '{"text": "fine"}\n\n' + line + "\n")
    with pytest.raises(ValueError) as e:
        list(iter_documents(p))
    assert f"{p}:3" in str(e.value) and message in str(e.value)


def test_jsonl_invalid_utf8_line(tmp_path):
    p = _write(tmp_path / "bad.jsonl", b'{"text": "\xff"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: invalid JSON"):
        list(iter_documents(p))


# ------------------------------------------------------------------------------ Parquet / errors


def test_parquet_without_pyarrow_says_how_to_install(tmp_path, monkeypatch):
    # None in sys.modules makes `import pyarrow...` raise ImportError whether or not it is installed
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    p = _write(tmp_path / "d.parquet", b"PAR1")
    with pytest.raises(ImportError, match="pip install pyarrow") as e:
        list(iter_documents(p))
    assert str(p) in str(e.value)
    with pytest.raises(ImportError, match="pip install pyarrow"):
        list(iter_documents(tmp_path))  # also inside a folder


def test_unsupported_and_missing_sources(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        list(iter_documents(tmp_path / "nope"))
    p = _write(tmp_path / "x.py", "x")
    with pytest.raises(ValueError, match="unsupported file"):
        list(iter_documents(p))


# ------------------------------------------------------------------------------ split


def _docs(n: int) -> list[Document]:
    return [Document(f"doc{i}", f"text {i}") for i in range(n)]


def test_split_is_deterministic_and_per_document():
    docs = _docs(400)
    train, val = split_documents(docs, 0.25, seed=3)
    assert (train, val) == split_documents(list(docs), 0.25, seed=3)
    assert sorted(d.id for d in train + val) == sorted(d.id for d in docs)
    assert set(d.id for d in train).isdisjoint(d.id for d in val)
    assert 60 < len(val) < 140
    # a document's side does not depend on the others: split a subset, get the restriction
    sub_train, sub_val = split_documents(docs[::3], 0.25, seed=3)
    assert set(d.id for d in sub_val) == set(d.id for d in val) & set(d.id for d in docs[::3])
    # order inside each side is the input order
    assert [d.id for d in val] == [d.id for d in docs if d in set(val)]
    assert split_documents(docs, 0.25, seed=4)[1] != val
    assert split_documents(docs, 0.0, seed=3) == (docs, [])


def test_split_keeps_both_sides_non_empty():
    for n in (2, 3, 5):
        train, val = split_documents(_docs(n), 0.01, seed=0)
        assert len(val) >= 1 and len(train) >= 1
        train, val = split_documents(_docs(n), 0.99, seed=0)
        assert len(val) >= 1 and len(train) >= 1
    assert split_documents(_docs(1), 0.5, seed=0)[0] + split_documents(_docs(1), 0.5, seed=0)[1] == _docs(1)


def test_split_errors():
    with pytest.raises(ValueError, match="val_fraction"):
        split_documents(_docs(3), 1.0)
    with pytest.raises(ValueError, match="val_fraction"):
        split_documents(_docs(3), -0.1)
    with pytest.raises(ValueError, match="unique"):
        split_documents([Document("a", "x"), Document("a", "y")], 0.5)


def test_split_does_not_depend_on_python_hash_seed():
    code = ("from k3.data.corpus import Document, split_documents;"
            "print([d.id for d in split_documents([Document(str(i), 'x') for i in range(50)], 0.3, 7)[1]])")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO,
                           env={"PYTHONPATH": str(REPO), "PYTHONHASHSEED": s}).stdout for s in ("1", "2")}
    assert len(outs) == 1


def test_corpus_fingerprint():
    a = [Document("x", "ab"), Document("y", "c")]
    assert corpus_fingerprint(a) == corpus_fingerprint(list(a))
    assert corpus_fingerprint(a) != corpus_fingerprint([Document("x", "a"), Document("y", "bc")])
    assert corpus_fingerprint(a) != corpus_fingerprint(a[::-1])
    assert corpus_fingerprint(a) != corpus_fingerprint([Document("x", "ab"), Document("z", "c")])
