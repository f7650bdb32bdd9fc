"""Which backend a kernel call takes, and the integer / on-off knobs that tune kernels.

Importable without Triton (the model imports it to choose between its Triton and PyTorch paths);
the Triton helpers themselves live in `k3.ops.triton_utils`.
"""

from __future__ import annotations

import os

import torch


def triton_runs_on(x: torch.Tensor) -> bool:
    """Whether a Triton kernel can take x: a CUDA tensor, or any tensor under TRITON_INTERPRET=1 (read per
    call; the CPU tests' way to run the kernels)."""
    return x.is_cuda or os.environ.get("TRITON_INTERPRET", "0") == "1"


def env_int(var: str, default: int, *, pow2: bool = False) -> int:
    """Env `var` as a positive integer knob (a tile, a warp count, a pipeline depth), read per call so a
    benchmark can sweep it in one process: unset -> default; a value that is not a positive integer (or,
    with pow2, not a power of two) raises, naming the variable."""
    raw = os.environ.get(var)
    if raw is None:
        return default
    try:
        v = int(raw)
    except ValueError:
        raise ValueError(f"{var} must be an integer, got {raw!r}") from None
    if v < 1 or (pow2 and v & (v - 1)):
        raise ValueError(f"{var} must be a positive {'power of two' if pow2 else 'integer'}, got {v}")
    return v


def env_int_opt(var: str, *, pow2: bool = False) -> int | None:
    """An optional integer knob: None when env `var` is unset or empty, else `env_int`'s strict value."""
    return env_int(var, 1, pow2=pow2) if os.environ.get(var) else None


def env_tile(prefix: str, names: tuple[str, ...], defaults: tuple[int, ...]) -> tuple[int, ...]:
    """Program-tile sizes: `defaults`, each overridden by env `{prefix}_{name}` (read per call, so a
    benchmark can sweep them in one process); every value must be a power of two."""
    return tuple(env_int(f"{prefix}_{name}", default, pow2=True) for name, default in zip(names, defaults))


def env_flag(var: str, default: bool) -> bool:
    """Env `var` as a switch, read per call: unset -> default, "1" / "0" -> on / off; anything else raises
    (a mistyped value must not silently pick a kernel variant)."""
    value = os.environ.get(var)
    if value is None:
        return default
    if value not in ("0", "1"):
        raise ValueError(f"{var} must be '0' or '1', got {value!r}")
    return value == "1"
