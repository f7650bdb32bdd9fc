"""Shared by the Triton-region benchmarks (bench/situ.py, bench/attn_res.py, ...): command-line flags, the
CPU smoke mode (Triton interpreter), tile sweeps and the fwd / fwd+bwd tables; timing, rooflines and
errors come from bench/_harness.py."""

from __future__ import annotations

import argparse
import importlib
import os
from typing import Callable

import torch

from bench._harness import HBM, do_bench_ms
from bench._harness import device_name as _device_name


def parse(doc: str, argv=None, tiny_help: str = "small shapes",  # noqa: ANN001
          extra: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    """--tokens, --sweep, --device, --tiny (and what `extra` adds); a CPU device switches Triton to its
    interpreter."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if extra is not None:
        extra(ap)
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--sweep", action="store_true", help="also time Triton program tiles")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help=f"{tiny_help} (smoke run; on the CPU with TRITON_INTERPRET=1)")
    args = ap.parse_args(argv)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    return args


def timer(device: str) -> Callable:
    """fn, grad_to_none=None -> median ms (`bench._harness.do_bench_ms` on `device`)."""
    return lambda fn, grad_to_none=None: do_bench_ms(fn, device, grad_to_none)


def device_name(device: str) -> str:
    return _device_name(device) + (" (interpreter)" if device == "cpu" else "")


def sweep(module: str, names: tuple[str, ...], tiles: list[tuple[int, ...]], step: Callable, leaves: list,
          nbytes: int, bench: Callable, offset: int = 0) -> None:
    """Time `step` (a forward+backward) for each program tile, set as fields offset.. of the TILE constant of
    kernel module `module` (the kernels read it per call; restored afterwards); prints a table with GB/s for
    `nbytes` moved per step."""
    mod = importlib.import_module(module)
    default = mod.TILE
    print("\n| " + " | ".join(names) + " | fwd+bwd ms | GB/s |\n|" + "---:|" * (len(names) + 2))
    for tile in tiles:
        mod.TILE = default[:offset] + tuple(tile) + default[offset + len(tile):]
        try:
            ms = bench(step, grad_to_none=leaves)
            print("| " + " | ".join(map(str, tile)) + f" | {ms:.3f} | {nbytes / ms / 1e6:,.0f} |", flush=True)
        finally:
            mod.TILE = default
    print()


def report(label: str, res: dict[str, tuple[float, float]], fwd_bytes: int, bwd_bytes: int) -> None:
    """One table row per implementation: res = {impl: (fwd ms, fwd+bwd ms)}; GB/s for the minimal bytes,
    fraction of HBM, and the speed ratio to the "inductor" row of the same shape."""
    base = res["inductor"][1]
    for impl, (fwd, both) in res.items():
        gf, gb = fwd_bytes / fwd / 1e6, (fwd_bytes + bwd_bytes) / both / 1e6
        print(f"| {label} | {impl} | {fwd:.3f} | {gf:,.0f} | {gf * 1e9 / HBM:.2f} | {both:.3f} | "
              f"{gb:,.0f} | {gb * 1e9 / HBM:.2f} | {base / both:.2f} |", flush=True)


def start(doc: str, argv, tiny_help: str,  # noqa: ANN001, ANN201
          extra: Callable[[argparse.ArgumentParser], None] | None = None):
    """Flags (see `parse`), timer, and the compiled torch regions (Kernels with every region on "torch", so
    the rows that go through Kernels time the torch regions, never the Triton kernels)."""
    args = parse(doc, argv, tiny_help, extra)  # first: it picks the Triton interpreter, read when k3's kernels are defined
    from k3.kernel_config import TORCH
    from k3.model.fused import Kernels

    compiled = Kernels(compiled=True, backend="inductor" if args.device == "cuda" else "aot_eager", config=TORCH)
    return args, timer(args.device), compiled


def header(title: str, first_col: str, device: str) -> None:
    print(f"# {title}, {device_name(device)}, torch {torch.__version__}")
    print(f"| {first_col} | impl | fwd ms | fwd GB/s | fwd roof | fwd+bwd ms | fwd+bwd GB/s | fwd+bwd roof "
          "| inductor / impl |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")


def time_impls(impls: dict[str, Callable], inputs: tuple, go: torch.Tensor, leaves: list, bench: Callable
               ) -> dict[str, tuple[float, float]]:
    """{impl: (forward ms, forward+backward ms)} of each impl(*inputs), backward with `go`."""
    res = {}
    for impl, fn in impls.items():
        fwd = bench(lambda fn=fn: fn(*inputs))
        both = bench(lambda fn=fn: fn(*inputs).backward(go), grad_to_none=leaves)
        res[impl] = (fwd, both)
    return res
