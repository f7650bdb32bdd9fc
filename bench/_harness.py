"""What the benchmark scripts share: the GPU's rooflines, timing, synchronisation, relative error, the
fraction of a roofline, and markdown tables.

Scripts import it as `from bench._harness import ...` (they put the repository root on sys.path). It
imports nothing from k3, and Triton only inside `do_bench_ms` (so CPU smoke runs need no GPU).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

HBM = 4.3e12  # bytes/s: a measured H200 copy (device-to-device), the memory roofline of the tables
BF16_ROOF = 790e12  # FLOP/s: the bf16 dense-GEMM rate the MFU columns divide by
BF16_PEAK = 989e12  # FLOP/s: the H100 / H200 bf16 dense peak (the second MFU column)


def sync(device: torch.device | str) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def do_bench_ms(fn: Callable[[], object], device: torch.device | str, grad_to_none: list | None = None,
                warmup: int = 25, rep: int = 100) -> float:
    """Median ms of fn(): triton's do_bench on CUDA (L2 flushed between runs, `grad_to_none` reset); on the
    CPU (smoke runs: the script runs, its times mean nothing) the mean of three wall-clock calls."""
    if torch.device(device).type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none)
    t0 = time.perf_counter()
    for _ in range(3):
        fn()
    return (time.perf_counter() - t0) / 3 * 1e3


def median(xs: Sequence[float]) -> float:
    """The middle value (the upper one of an even count)."""
    return sorted(xs)[len(xs) // 2]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius error ||a - b|| / ||b|| in float64 (b the reference; 0 / 0 guarded)."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def roof_fraction(ms: float, nbytes: float = 0.0, flops: float = 0.0, hbm: float = HBM,
                  flop_rate: float = BF16_ROOF) -> float:
    """How close a run of `ms` is to the roofline: (the larger of the minimal-byte time at `hbm` and the FLOP
    time at `flop_rate`) / ms."""
    return max(nbytes / hbm, flops / flop_rate) / (ms * 1e-3)


def device_name(device: torch.device | str) -> str:
    return torch.cuda.get_device_name() if torch.device(device).type == "cuda" else "cpu"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]], right: Sequence[bool] | None = None
                   ) -> str:
    """A markdown table; `right`: per column, right-aligned (numbers) or not (default: all but the first)."""
    right = list(right) if right is not None else [False] + [True] * (len(header) - 1)
    lines = ["| " + " | ".join(map(str, header)) + " |",
             "|" + "|".join("---:" if r else "---" for r in right) + "|"]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    return "\n".join(lines)


__all__ = ["HBM", "BF16_ROOF", "BF16_PEAK", "sync", "do_bench_ms", "median", "rel_err", "roof_fraction",
           "device_name", "markdown_table"]
