"""The routed experts' grouped GEMMs (`torch._grouped_mm`) in the layouts the training step could use, on one GPU.

k3-small's experts (64, top-8, latent width L 512, intermediate I 512) at 65,536 tokens per micro-batch:
524,288 expert-sorted slots, split over the experts by counts drawn around the mean (as Quantile Balancing
leaves them). The step runs five grouped GEMMs per MoE layer, ~560 TFLOP/s on average on an H200 against
640-775 for the dense ones (docs/benchmarks.md, twelfth session), so this times each of them as the model
runs it today ("current") against other operand layouts (a transposed copy first, the other product
order), with the copy included in the time:

  fwd13   xs [S, L] @ w13^T      -> ab [S, 2I]    (w13 [E, 2I, L]: B is K-major)
  fwd2    h [S, I] @ w2^T        -> y [S, L]
  dx13    d_ab [S, 2I] @ w13     -> d_xs [S, L]   (B N-major)
  dw13    d_ab^T @ xs per expert -> [E, 2I, L]    (A = d_ab^T, a transposed view: M-major)
  dw2     h^T @ dy per expert    -> [E, I, L]^T   (as autograd computes the weight gradient of w2^T)

(A weight gradient with A copied K-major first is not a variant: its groups then start at arbitrary
offsets inside rows, and torch._grouped_mm requires each group's bytes along a contiguous dimension to
be a multiple of 16 -- counts that are multiples of 8 -- which the routed counts are not: a device-side
assert on the H200, 2026-12-01.)

Prints ms, TFLOP/s, the fraction of the 790 TFLOP/s bf16 roof and the speed against "current" of the
same GEMM; results of every variant are checked against "current" (bf16 GEMMs: identical inputs, so the
relative difference is summation order only).

Usage: python bench/grouped_mm.py [--tokens 65536] [--experts 64] [--spread 0.1]
"""

from __future__ import annotations

import argparse
from typing import Callable

import torch

ROOF = 790e12


def counts(S: int, E: int, spread: float, gen: torch.Generator) -> torch.Tensor:
    """E non-negative counts summing to S, each around S / E with relative spread `spread`."""
    w = (1 + spread * torch.randn(E, generator=gen)).clamp_min(0.05)
    c = torch.floor(w / w.sum() * S).long()
    c[: S - int(c.sum())] += 1
    return c


def variants(S: int, L: int, I: int, E: int, offs: torch.Tensor, gen: torch.Generator
             ) -> dict[str, tuple[float, dict[str, Callable[[], torch.Tensor]]]]:
    """{gemm: (FLOPs, {variant: fn})}."""
    dev, bf = "cuda", torch.bfloat16

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device=dev, generator=gen) * scale).to(bf)

    xs, h = rnd(S, L), rnd(S, I)
    w13, w2 = rnd(E, 2 * I, L, scale=0.02), rnd(E, L, I, scale=0.02)
    d_ab, dy = rnd(S, 2 * I), rnd(S, L)
    w13_nmajor = w13.transpose(-2, -1).contiguous()  # [E, L, 2I]
    w2_nmajor = w2.transpose(-2, -1).contiguous()
    gm = torch._grouped_mm
    return {
        "fwd13": (2.0 * S * L * 2 * I, {
            "current": lambda: gm(xs, w13.transpose(-2, -1), offs=offs),
            "B N-major (stored so)": lambda: gm(xs, w13_nmajor, offs=offs),
        }),
        "fwd2": (2.0 * S * I * L, {
            "current": lambda: gm(h, w2.transpose(-2, -1), offs=offs),
            "B N-major (stored so)": lambda: gm(h, w2_nmajor, offs=offs),
        }),
        "dx13": (2.0 * S * 2 * I * L, {
            "current": lambda: gm(d_ab, w13, offs=offs),
            "B K-major (stored so)": lambda: gm(d_ab, w13_nmajor.transpose(-2, -1), offs=offs),
        }),
        "dw13": (2.0 * S * 2 * I * L, {
            "current": lambda: gm(d_ab.t(), xs, offs=offs),
            "transposed product": lambda: gm(xs.t(), d_ab, offs=offs).transpose(-2, -1),
        }),
        "dw2": (2.0 * S * I * L, {
            "current": lambda: gm(h.t(), dy, offs=offs),
            "transposed product": lambda: gm(dy.t(), h, offs=offs).transpose(-2, -1),
        }),
    }


def add_shape_args(ap: argparse.ArgumentParser) -> None:
    """The experts' problem size (k3-small's by default), shared with bench/grouped_gemm.py."""
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--latent", type=int, default=512)
    ap.add_argument("--inter", type=int, default=512)
    ap.add_argument("--spread", type=float, default=0.1, help="relative spread of the per-expert counts")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_args(ap)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/grouped_mm.py needs a CUDA device (torch._grouped_mm is CUDA-only)")
    from triton.testing import do_bench

    gen = torch.Generator(device="cuda").manual_seed(0)
    S, E = args.tokens * args.top_k, args.experts
    c = counts(S, E, args.spread, torch.Generator().manual_seed(0))
    offs = torch.cumsum(c, 0).to(device="cuda", dtype=torch.int32)
    print(f"# grouped GEMMs of the routed experts: {torch.cuda.get_device_name()}, torch {torch.__version__}; "
          f"{S} slots over {E} experts (counts {int(c.min())}-{int(c.max())}), L {args.latent}, I {args.inter}")
    print("| GEMM | variant | ms | TFLOP/s | roof | current / variant | max rel diff |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for gemm, (flops, fns) in variants(S, args.latent, args.inter, E, offs, gen).items():
        ref = fns["current"]()
        base = None
        for name, fn in fns.items():
            out = fn()
            diff = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            ms = do_bench(fn, warmup=25, rep=100)
            base = base or ms
            print(f"| {gemm} | {name} | {ms:.3f} | {flops / ms / 1e9:.0f} | {flops / ms / 1e9 * 1e12 / ROOF:.2f} | "
                  f"{base / ms:.2f} | {diff:.1e} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
