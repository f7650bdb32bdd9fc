"""MoE routing bookkeeping on one GPU: the top-k expert selection and the expert-sorted slot order
(order, its inverse, per-expert counts), k3's Triton kernels (`k3.ops.moe_route`, kernels.moe_route="triton")
against the torch code the model runs otherwise (`torch.topk(choice + bias, sorted=False)`; stable
argsort, inverse scatter, index_add counts), on k3-small's shape at 65,536 tokens (top-8 of 64
experts), kimi-k3's at 8,192 tokens (top-16 of 896) and top-16 of 384 at 8,192 tokens.

Prints ms per part and for both parts, and the ratio torch / triton. Correctness first on every
shape: the Triton ids equal torch's as sets per row, and the slot sort of torch's ids equals torch's
exactly.

Usage: python bench/moe_route.py [--tokens 65536] [--sweep]
       python bench/moe_route.py --tiny --device cpu     # smoke run under the Triton interpreter
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench._regions import device_name, parse, sweep, timer  # noqa: E402


def shapes(tokens: int) -> list[tuple[str, int, int, int]]:
    """(name, tokens N, experts E, choices k)."""
    from k3.config import get_preset

    small, big = get_preset("k3-small").text_config, get_preset("kimi-k3").text_config
    n = max(1, tokens // 8)
    return [("k3-small", tokens, small.num_experts, small.num_experts_per_token),
            ("kimi-k3", n, big.num_experts, big.num_experts_per_token),
            ("E 384", n, 384, 16)]


def torch_parts(choice: torch.Tensor, bias: torch.Tensor, k: int, E: int) -> tuple:
    """The model's torch code: (top-k fn, slot-sort fn)."""
    from k3.model.fused import route_slots

    def topk() -> torch.Tensor:
        return torch.topk(choice + bias, k, dim=-1, sorted=False).indices

    def slots(idx: torch.Tensor) -> tuple:
        return route_slots(idx, E, "torch")  # the torch code

    return topk, slots


def triton_parts(choice: torch.Tensor, bias: torch.Tensor, k: int, E: int) -> tuple:
    from k3.ops.moe_route import sort_slots_triton, topk_route

    return (lambda: topk_route(choice, k, bias)), (lambda idx: sort_slots_triton(idx, E))


def check(name: str, torch_fns: tuple, triton_fns: tuple) -> None:
    want_idx, got_idx = torch_fns[0](), triton_fns[0]()
    same_sets = torch.equal(want_idx.sort(-1).values, got_idx.sort(-1).values)
    exact = all(torch.equal(a, b) for a, b in zip(torch_fns[1](want_idx), triton_fns[1](want_idx)))
    print(f"check ({name}, {list(want_idx.shape)} ids): top-k sets {'equal' if same_sets else 'DIFFER'}, "
          f"slot sort {'exact' if exact else 'DIFFERS'}")
    if not (same_sets and exact):
        raise SystemExit("route check FAILED")


def time_parts(fns: tuple, bench) -> tuple[float, float, float]:  # noqa: ANN001
    """(top-k ms, slot-sort ms, both ms)."""
    topk, slots = fns
    idx = topk()
    return bench(topk), bench(lambda: slots(idx)), bench(lambda: slots(topk()))


def main(argv=None) -> int:  # noqa: ANN001
    args = parse(__doc__, argv, "64 tokens")
    if args.tiny:
        args.tokens = 64
    bench = timer(args.device)
    print(f"# MoE routing bookkeeping, {device_name(args.device)}, torch {torch.__version__}")
    print("| shape N x E x k | part | torch ms | k3 triton ms | torch / triton |")
    print("|---|---|---:|---:|---:|")
    for name, N, E, k in shapes(args.tokens):
        g = torch.Generator(device=args.device).manual_seed(0)
        choice = torch.rand(N, E, device=args.device, generator=g)  # sigmoid scores are in (0, 1)
        bias = torch.randn(E, device=args.device, generator=g) * 1e-2
        fns = {"torch": torch_parts(choice, bias, k, E), "triton": triton_parts(choice, bias, k, E)}
        check(f"{name} {N} x {E} x {k}", fns["torch"], fns["triton"])
        t, r = time_parts(fns["torch"], bench), time_parts(fns["triton"], bench)
        for part, a, b in zip(("top-k", "slot sort", "both"), t, r):
            print(f"| {name} {N} x {E} x {k} | {part} | {a:.4f} | {b:.4f} | {a / b:.2f} |", flush=True)
        if args.sweep:
            topk, slots = fns["triton"]
            idx = topk()
            sweep("k3.ops.moe_route.triton_route", ("TOPK_TILE", "TOPK_WARPS"), [(t, w) for t in (512, 1024, 2048, 4096, 8192)
                                                          for w in (1, 2, 4, 8)],
                  topk, [], N * E * 4 + N * k * 8, bench)
            sweep("k3.ops.moe_route.triton_route", ("SORT_B", "SORT_WARPS"), [(b, w) for b in (256, 512, 1024, 2048, 4096)
                                                       for w in (2, 4, 8)],
                  lambda: slots(idx), [], N * k * 8 * 4, bench, offset=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
