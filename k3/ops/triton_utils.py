"""Helpers shared by k3's Triton kernels.

Under Triton's CPU interpreter (how CI runs the kernels) fp32 -> bf16 conversions truncate, where
the GPU rounds to nearest even; `cvt` rounds under the interpreter too, so CI sees the GPU's bits.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


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
