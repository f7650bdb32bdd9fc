"""MoE combine (each token's k expert outputs, weighted and summed) and dispatch (each token's row to its
k expert-sorted slots), forward and forward+backward, on one GPU: k3's Triton kernels
(`k3.ops.moe_combine`) against the compiled (Inductor) regions of the model and eager PyTorch, on
k3-small's shape at 65,536 tokens (top-8 of 64 experts, width 512) and kimi-k3's at 8,192 tokens
(top-16 of 896, width 3,584).

Prints ms, achieved GB/s (minimal bytes -- combine: forward reads y [N*k, L] and writes [N, L],
backward reads y and the output gradient and writes y's gradient; dispatch: forward reads [N, L] and
writes [N*k, L], backward the reverse) and the fraction of 4.3 TB/s, and the ratio to the Inductor
region from the same run. Correctness first: the Triton outputs and gradients against the torch
regions on the first shape.

Usage: python bench/moe_combine.py [--tokens 65536] [--sweep]
       python bench/moe_combine.py --tiny --device cpu     # smoke run under the Triton interpreter
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench._regions import header, report, start, sweep, time_impls  # noqa: E402



def shapes(tokens: int) -> list[tuple[str, int, int, int, int]]:
    """(name, tokens N, choices k, experts E, width L)."""
    from k3.config import get_preset

    small, big = get_preset("k3-small").text_config, get_preset("kimi-k3").text_config
    return [("k3-small", tokens, small.num_experts_per_token, small.num_experts, small.routed_expert_hidden_size),
            ("kimi-k3", max(1, tokens // 8), big.num_experts_per_token, big.num_experts, big.routed_expert_hidden_size)]


def check(what: str, fns: dict, inputs: tuple, go: torch.Tensor) -> None:
    outs = {}
    for name in ("k3 triton", "inductor"):
        leaves = [t.detach().requires_grad_() for t in inputs]
        out = fns[name](*leaves)
        out.backward(go)
        outs[name] = [out.float()] + [t.grad.float() for t in leaves]
    errs = [((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
            for a, b in zip(outs["k3 triton"], outs["inductor"])]
    print(f"check {what} ({list(inputs[0].shape)} bf16, vs the torch region): "
          + ", ".join(f"{n} {e:.2e}" for n, e in zip(("out", "grad 1", "grad 2"), errs)))
    if max(errs) > 1e-2:
        raise SystemExit(f"{what} check FAILED")


def main(argv=None) -> int:
    args, bench, compiled = start(__doc__, argv, "64 tokens")
    if args.tiny:
        args.tokens = 64
    from k3.model.fused import EAGER, sort_slots
    from k3.ops.moe_combine import moe_combine, moe_dispatch

    header("MoE combine / dispatch, bf16 rows, fp32 weights", "op, shape N x k x L", args.device)
    for i, (name, N, k, E, L) in enumerate(shapes(args.tokens)):
        torch.manual_seed(0)
        idx = torch.rand(N, E, device=args.device).topk(k, dim=1).indices
        order, inv = sort_slots(idx)
        fns = {"k3 triton": lambda y, w: moe_combine(y, w, inv),
               "inductor": lambda y, w: compiled.combine(y, w, order, inv),
               "eager torch": lambda y, w: EAGER.combine(y, w, order, inv)}
        y = torch.randn(N * k, L, device=args.device, dtype=torch.bfloat16).requires_grad_()
        w = torch.rand(N, k, device=args.device).requires_grad_()
        go = torch.randn(N, L, device=args.device, dtype=torch.bfloat16)
        z = torch.randn(N, L, device=args.device, dtype=torch.bfloat16).requires_grad_()
        dfns = {"k3 triton": lambda z: moe_dispatch(z, inv, k),
                "inductor": lambda z: compiled.dispatch(z, order, inv, k),
                "eager torch": lambda z: EAGER.dispatch(z, order, inv, k)}
        gs = torch.randn(N * k, L, device=args.device, dtype=torch.bfloat16)
        if i == 0:
            check("combine", fns, (y, w), go)
            check("dispatch", dfns, (z,), gs)
        fwd_bytes, bwd_bytes = (N * k + N) * L * 2, (2 * N * k + N) * L * 2
        res = time_impls(fns, (y, w), go, [y, w], bench)
        report(f"combine {name} {N} x {k} x {L}", res, fwd_bytes, bwd_bytes)
        res = time_impls(dfns, (z,), gs, [z], bench)
        report(f"dispatch {name} {N} x {k} x {L}", res, (N * k + N) * L * 2, (N * k + N) * L * 2)
        if args.sweep and i == 0:
            fn = fns["k3 triton"]
            sweep("k3.ops.moe_combine.triton_combine", ("BN", "BL", "WARPS"), [(8, 256, 4), (4, 512, 4), (16, 256, 8), (8, 512, 8),
                                                       (2, 512, 4), (16, 128, 4), (32, 128, 8), (4, 256, 2)],
                  lambda: fn(y, w).backward(go), [y, w], fwd_bytes + bwd_bytes, bench)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
