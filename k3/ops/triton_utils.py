"""Helpers shared by k3's Triton kernels.

Under Triton's CPU interpreter (how CI runs the kernels) fp32 -> bf16 conversions truncate, where
the GPU rounds to nearest even; `cvt` rounds under the interpreter too, so CI sees the GPU's bits.
`env_tile` reads a kernel's program-tile knobs, `env_flag` its on/off switches.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


def env_tile(prefix: str, names: tuple[str, ...], defaults: tuple[int, ...]) -> tuple[int, ...]:
    """Program-tile sizes: `defaults`, each overridden by env `{prefix}_{name}` (read per call, so a
    benchmark can sweep them in one process); every value must be a power of two."""
    out = []
    for name, default in zip(names, defaults):
        v = int(os.environ.get(f"{prefix}_{name}", default))
        if v < 1 or v & (v - 1):
            raise ValueError(f"{prefix}_{name} must be a power of two, got {v}")
        out.append(v)
    return tuple(out)


def env_flag(var: str, default: bool) -> bool:
    """Env `var` as a switch, read per call: unset -> default, "1" / "0" -> on / off; anything else raises
    (a mistyped value must not silently pick a kernel variant)."""
    value = os.environ.get(var)
    if value is None:
        return default
    if value not in ("0", "1"):
        raise ValueError(f"{var} must be '0' or '1', got {value!r}")
    return value == "1"


@triton.jit
def cvt(x, dt: tl.constexpr):
    """x converted to dt, rounding to nearest even (as the GPU does) also under the interpreter."""
    if INTERPRETED:
        if dt == tl.bfloat16:
            u = x.to(tl.float32).to(tl.uint32, bitcast=True)
            u = u + 0x7FFF + ((u >> 16) & 1)
            return u.to(tl.float32, bitcast=True).to(dt)
        else:
            return x.to(dt)
    else:
        return x.to(dt)
