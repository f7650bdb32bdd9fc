"""Shared by the Triton-region benchmarks (bench/situ.py, bench/attn_res.py): command-line flags, the
timer, and the CPU smoke mode (Triton interpreter)."""

from __future__ import annotations

import argparse
import os
import time
from typing import Callable

import torch


def parse(doc: str, argv=None, tiny_help: str = "small shapes") -> argparse.Namespace:  # noqa: ANN001
    """--tokens, --sweep, --device, --tiny; a CPU device switches Triton to its interpreter."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--sweep", action="store_true", help="also time Triton program tiles")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help=f"{tiny_help} (smoke run; on the CPU with TRITON_INTERPRET=1)")
    args = ap.parse_args(argv)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    return args


def timer(device: str) -> Callable:
    """triton's do_bench (median ms) on CUDA; on the CPU (smoke runs) the mean of three wall-clock runs."""
    if device == "cuda":
        from triton.testing import do_bench

        return lambda fn, grad_to_none=None: do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none)

    def cpu(fn, grad_to_none=None):  # noqa: ANN001
        t0 = time.perf_counter()
        for _ in range(3):
            fn()
        return (time.perf_counter() - t0) / 3 * 1e3

    return cpu


def device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)"


def sweep(prefix: str, names: tuple[str, ...], tiles: list[tuple[int, ...]], step: Callable, leaves: list,
          nbytes: int, bench: Callable) -> None:
    """Time `step` (a forward+backward) for each program tile, set through env {prefix}_{name} (the kernels
    read their tile knobs per call); prints a table with GB/s for `nbytes` moved per step."""
    print("\n| " + " | ".join(names) + " | fwd+bwd ms | GB/s |\n|" + "---:|" * (len(names) + 2))
    for tile in tiles:
        env = {f"{prefix}_{n}": str(v) for n, v in zip(names, tile)}
        os.environ.update(env)
        try:
            ms = bench(step, grad_to_none=leaves)
            print("| " + " | ".join(map(str, tile)) + f" | {ms:.3f} | {nbytes / ms / 1e6:,.0f} |", flush=True)
        finally:
            for key in env:
                os.environ.pop(key)
    print()
