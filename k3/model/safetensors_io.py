"""File level of sharded safetensors checkpoints, independent of tensor names: the index, shard
headers, sharded atomic writes. The official K3 names live in `k3.model.checkpoint` only."""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Iterator

import torch

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_SHARD_RE = re.compile(r"^model-\d+-of-\d+\.safetensors$")


class CheckpointError(ValueError):
    """A checkpoint does not match the model (every offending tensor or file is named)."""


# ---------------------------------------------------------------------------------------------
# reading


def read_weight_map(path: str) -> dict[str, str]:
    """tensor name -> absolute shard path, from the index, the single-file checkpoint in a
    directory, or a .safetensors file."""
    if os.path.isfile(path):
        return {n: path for n in header(path)}
    idx = os.path.join(path, INDEX_FILE)
    if os.path.isfile(idx):
        try:
            with open(idx) as f:
                wm = json.load(f)["weight_map"]
            if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
                raise TypeError("weight_map must map names to file names")
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{idx}: not a valid safetensors index ({e!r})") from None
        return {n: os.path.join(path, fn) for n, fn in wm.items()}
    single = os.path.join(path, SINGLE_FILE)
    if os.path.isfile(single):
        return {n: single for n in header(single)}
    raise CheckpointError(f"{path}: no {INDEX_FILE} and no {SINGLE_FILE} (not a checkpoint directory)")


def open_shard(fn: str):
    """A safetensors `safe_open` handle on CPU; CheckpointError for a missing or corrupt file."""
    from safetensors import safe_open

    if not os.path.isfile(fn):
        raise CheckpointError(f"{fn}: shard file listed in the index does not exist")
    try:
        return safe_open(fn, framework="pt", device="cpu")
    except Exception as e:  # safetensors raises its own error type for corrupt/truncated files
        raise CheckpointError(f"{fn}: corrupt or truncated safetensors file ({e})") from None


def header(fn: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, dtype string) without reading tensor data."""
    with open_shard(fn) as f:
        out = {}
        for n in f.keys():
            s = f.get_slice(n)
            out[n] = (tuple(s.get_shape()), s.get_dtype())
        return out


def target_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """A torch dtype from a dtype or its usual names ("bfloat16", "bf16", "float32", ...)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    names = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32,
             "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16}
    if dtype not in names:
        raise ValueError(f"dtype={dtype!r}: must be a torch dtype or one of {sorted(names)}")
    return names[dtype]


# ---------------------------------------------------------------------------------------------
# writing


def write_shard(tensors: dict[str, torch.Tensor], fn: str) -> None:
    from safetensors.torch import save_file

    save_file(tensors, fn, metadata={"format": "pt"})
    with open(fn, "rb") as f:
        os.fsync(f.fileno())


def write_shards(items: Iterator[tuple[str, torch.Tensor]], tmp: str, max_bytes: int) -> list[str]:
    """Greedy sharding in iteration order (a tensor larger than max_bytes gets a shard of its own);
    writes `model-0000i-of-0000n.safetensors` and the index into the directory `tmp`."""
    raw: list[str] = []
    weight_of: dict[str, int] = {}
    cur: dict[str, torch.Tensor] = {}
    cur_bytes = total = 0

    def flush() -> None:
        nonlocal cur, cur_bytes
        fn = os.path.join(tmp, f"part-{len(raw):06d}.safetensors")
        write_shard(cur, fn)
        raw.append(fn)
        cur, cur_bytes = {}, 0

    for name, t in items:
        nb = t.numel() * t.element_size()
        if cur and cur_bytes + nb > max_bytes:
            flush()
        cur[name] = t
        weight_of[name] = len(raw)
        cur_bytes += nb
        total += nb
    if cur or not raw:
        flush()
    n = len(raw)
    names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for fn, final in zip(raw, names):
        os.replace(fn, os.path.join(tmp, final))
    index = {"metadata": {"total_size": total}, "weight_map": {k: names[i] for k, i in weight_of.items()}}
    with open(os.path.join(tmp, INDEX_FILE), "w") as f:
        json.dump(index, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    return names


def commit(tmp: str, path: str, exists: bool, files: list[str]) -> None:
    """Move a checkpoint written into `tmp` (shards `files`, config.json, the index) to `path`.

    A new `path` appears at once (one rename). Over an existing checkpoint, the old completeness
    markers (index / single file) go first and the new index comes last, so no index ever points
    at a mix of old and new shards; stale shards are then removed."""
    if not exists:
        os.rename(tmp, path)
        return
    for marker in (INDEX_FILE, SINGLE_FILE):
        if os.path.exists(os.path.join(path, marker)):
            os.remove(os.path.join(path, marker))
    for fn in files + ["config.json"]:
        os.replace(os.path.join(tmp, fn), os.path.join(path, fn))
    os.replace(os.path.join(tmp, INDEX_FILE), os.path.join(path, INDEX_FILE))
    for fn in os.listdir(path):
        if _SHARD_RE.match(fn) and fn not in files:
            os.remove(os.path.join(path, fn))
    shutil.rmtree(tmp, ignore_errors=True)
