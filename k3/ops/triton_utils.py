"""Helpers shared by k3's Triton kernels.

Under Triton's CPU interpreter (how CI runs the kernels) fp32 -> bf16 conversions truncate, where
the GPU rounds to nearest even; `cvt` rounds under the interpreter too, so CI sees the GPU's bits.
`triton_runs_on` / `use_triton` live in the Triton-free `k3.ops.backend` (importable without Triton).
"""

from __future__ import annotations

import os

import torch
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
            # the bf16 is the high half, taken as bits: no float conversion by the interpreter, which
            # mangles zeros and denormals (0.0 came out as 1.2e-38, denormals flushed)
            return (u >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            return x.to(dt)
    else:
        return x.to(dt)


@triton.jit
def _column_sum(X, Y, P, D, rows_per, BR: tl.constexpr, BD: tl.constexpr):
    """Y[s, c] = sum of X[r, c] over rows r in [s * rows_per, (s + 1) * rows_per), in row order."""
    c = tl.program_id(0) * BD + tl.arange(0, BD)
    s = tl.program_id(1)
    r0 = s * rows_per
    r1 = tl.minimum(r0 + rows_per, P)
    acc = tl.zeros([BR, BD], tl.float32)
    for r in range(r0, r1, BR):
        rows = r + tl.arange(0, BR)
        m = (rows < r1)[:, None] & (c < D)[None, :]
        acc += tl.load(X + rows.to(tl.int64)[:, None] * D + c[None, :], mask=m, other=0.0)
    tl.store(Y + s.to(tl.int64) * D + c, tl.sum(acc, 0), mask=c < D)


def column_sum(parts: torch.Tensor) -> torch.Tensor:
    """parts [P, D] fp32 (contiguous; e.g. per-program partial weight gradients) -> [D] fp32, summed in a
    fixed order (deterministic: no atomics). Two passes of one kernel: slices of rows in parallel, then
    their sums; torch's dim-0 reduction of such tall partials ran at about half the HBM bandwidth."""
    if parts.dim() != 2 or parts.dtype != torch.float32:
        raise ValueError(f"column_sum takes [P, D] fp32 partials, got {list(parts.shape)} {parts.dtype}")
    x = parts.contiguous()
    while x.shape[0] > 1:
        P, D = x.shape
        bd = min(128, triton.next_power_of_2(D))
        slices = min(triton.cdiv(P, 64), max(1, 1024 // triton.cdiv(D, bd)))  # ~1K programs, >= 64 rows each
        rows_per = triton.cdiv(P, slices)
        y = torch.empty(triton.cdiv(P, rows_per), D, device=x.device, dtype=torch.float32)
        _column_sum[(triton.cdiv(D, bd), y.shape[0])](x, y, P, D, rows_per, BR=8, BD=bd, num_warps=4)
        x = y
    return x[0] if x.shape[0] == 1 else x.new_zeros(x.shape[1])
