"""Resumable training state, written atomically (temporary file + rename)."""

from __future__ import annotations

import json
import os
import random
from typing import IO, Any, Callable

import numpy as np
import torch

STATE_FILE = "train_state.pt"
CONFIG_FILE = "train_config.json"  # in the run directory: what `k3 train --out DIR --resume` starts from


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _write_atomic(path: str, write: Callable[[IO], None], mode: str) -> str:
    """write(file) into a temporary file beside `path`, fsync, rename over `path`; returns the path."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, mode) as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def save_state(directory: str, state: dict[str, Any]) -> str:
    """torch.save `state` to directory/train_state.pt atomically; returns the path."""
    os.makedirs(directory, exist_ok=True)
    return _write_atomic(os.path.join(directory, STATE_FILE), lambda f: torch.save(state, f), "wb")


def state_path(directory: str) -> str:
    """directory/train_state.pt; FileNotFoundError when there is none (nothing to resume)."""
    path = os.path.join(directory, STATE_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no training checkpoint at {path} (nothing to resume)")
    return path


def load_state(directory: str) -> dict[str, Any]:
    path = state_path(directory)
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # a truncated/corrupt file: say which one
        raise RuntimeError(f"cannot read training checkpoint {path}: {e}") from e


def save_run_config(out_dir: str, config: dict[str, Any]) -> str:
    """The run's training config as JSON in out_dir (atomically); returns the path."""
    return _write_atomic(os.path.join(out_dir, CONFIG_FILE), lambda f: f.write(json.dumps(config, indent=1) + "\n"),
                         "w")


def load_run_config(out_dir: str) -> dict[str, Any] | None:
    """The config a run in out_dir was started with, or None (no run there, or one from before k3 kept it)."""
    path = os.path.join(out_dir, CONFIG_FILE)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)
