"""MoE router scores sigmoid(x_f32 W_f32^T), forward and forward+backward, on one GPU: k3's split bf16 GEMMs
(`k3.ops.router`: W split exactly into three bf16 parts, fp32 output) against the compiled (Inductor) fp32
region the model used before (cast x to fp32, cuBLAS fp32 GEMM with TF32 off) and eager PyTorch, on
k3-small's router at 65,536 tokens (d 1,024, 64 experts) and kimi-k3's (d 7,168, 896 experts).

Prints ms, achieved GB/s (minimal bytes: forward reads x bf16 and W fp32 and writes the [N, E] fp32 scores;
backward reads the score gradient, x and W and writes dx bf16 and dW fp32) with the fraction of 4.3 TB/s
(the product is memory-bound: 2E flops per byte of x), and the ratio to the Inductor row of the same run.
Correctness first: logits, dx and dW of the split path and of the fp32 GEMM against float64.

Usage: python bench/router.py [--tokens 65536]
       python bench/router.py --tiny --device cpu     # smoke run (fp32-emulated products on the CPU)
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench._harness import rel_err  # noqa: E402
from bench._regions import header, report, start, time_impls  # noqa: E402


def shapes(tokens: int) -> list[tuple[str, int, int, int]]:
    """(name, N, d, E)."""
    return [("k3-small", tokens, 1024, 64), ("kimi-k3", min(tokens, 16384), 7168, 896)]


_rel = rel_err


def check(x: torch.Tensor, w: torch.Tensor) -> None:
    from k3.ops.router import router_logits, router_logits_reference

    g = torch.randn(x.shape[0], w.shape[0], device=x.device)
    out = {}
    for name, fn in (("split bf16", router_logits), ("fp32 GEMM", router_logits_reference)):
        xl, wl = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        y = fn(xl, wl)
        y.backward(g)
        out[name] = (y, xl.grad, wl.grad)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y64 = x64 @ w64.t()
    y64.backward(g.double())
    for name, (y, dx, dw) in out.items():
        print(f"check {name} vs float64: logits {_rel(y, y64):.2e}, dx {_rel(dx, x64.grad):.2e}, "
              f"dW {_rel(dw, w64.grad):.2e}")
    if _rel(out["split bf16"][0], y64) > 4 * max(_rel(out["fp32 GEMM"][0], y64), 1e-6):
        raise SystemExit("router check FAILED: split logits less accurate than the fp32 GEMM")


def main(argv=None) -> int:
    args, bench, compiled = start(__doc__, argv, "256 tokens")
    if args.tiny:
        args.tokens = 256
    from k3.model.fused import EAGER
    from k3.ops.router import router_logits

    impls = {"k3 split": lambda x, w: torch.sigmoid(router_logits(x, w)),
             "inductor": compiled.router_scores,
             "eager torch": EAGER.router_scores}
    header("MoE router scores (fp32), x bf16", "shape", args.device)
    for i, (name, N, d, E) in enumerate(shapes(args.tokens)):
        if args.tiny:
            d, E = min(d, 256), min(E, 32)
        x = torch.randn(N, d, device=args.device).to(torch.bfloat16).requires_grad_()
        w = (torch.randn(E, d, device=args.device) * 0.02).requires_grad_()
        if i == 0:
            check(x, w)
        go = torch.randn(N, E, device=args.device)
        res = time_impls(impls, (x, w), go, [x, w], bench)
        fwd_bytes = 2 * N * d + 4 * E * d + 4 * N * E
        bwd_bytes = 4 * N * E + 2 * N * d + 4 * E * d + 2 * N * d + 4 * E * d
        report(f"{name} [{N}, {d}] x [{E}, {d}]", res, fwd_bytes, bwd_bytes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
