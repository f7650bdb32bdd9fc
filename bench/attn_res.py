"""Block-AttnRes aggregation, forward and forward+backward, on one GPU: k3's Triton kernels
(`k3.ops.attn_res`) against the compiled (Inductor) regions the model uses by default and the eager
PyTorch maths: k3-small's mixes (2-4 candidates of [65536, 1024] bf16) and K3's widest (9 candidates
of [8192, 7168]).

Prints ms, achieved GB/s (minimal bytes: forward reads n candidates and writes the mix; backward
reads the output gradient and n candidates and writes n gradients) and the fraction of 4.3 TB/s, and
the ratio to the Inductor region from the same run. Correctness first: Triton vs float64 on the
first shape. A second table times the mix followed by the layer's RMSNorm (what the model runs):
the Triton mix then the compiled norm against the Inductor regions.

Usage: python bench/attn_res.py [--tokens 65536] [--sweep]
       python bench/attn_res.py --tiny --device cpu     # smoke run under the Triton interpreter
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench._regions import header, report, start, sweep, time_impls  # noqa: E402

EPS = 1e-5


def inputs(n: int, M: int, D: int, device: str, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    cands = [(torch.randn(M, D, device=device, generator=g) * (1 + i)).to(torch.bfloat16).requires_grad_()
             for i in range(n)]
    w_norm = torch.rand(D, device=device, generator=g) + 0.5
    w_proj = torch.randn(1, D, device=device, generator=g) * 0.3
    return cands, w_norm.requires_grad_(), w_proj.requires_grad_()


def check(cands, w_norm, w_proj) -> None:
    from k3.ops.attn_res import attn_res_mix
    from k3.ops.attn_res.reference import attn_res_reference

    out = attn_res_mix(cands, w_norm, w_proj, EPS)
    ref = attn_res_reference([c.detach().double() for c in cands], w_norm.detach().double(),
                             w_proj.detach().double(), EPS)
    err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
    print(f"check ({len(cands)} x {list(cands[0].shape)} bf16): max |out - float64| / max |float64| {err:.2e}")
    if err > 2 ** -7:
        raise SystemExit("AttnRes check FAILED")


def partial_sums(args, bench) -> None:  # noqa: ANN001
    """The backward's weight-gradient partials (one fp32 [D] row per 2-row program) summed over programs:
    k3.ops.triton_utils.column_sum (the default) against torch's dim-0 reduction."""
    from k3.ops.triton_utils import column_sum

    P, D = (args.tokens // 2, 1024) if not args.tiny else (300, 96)
    parts = torch.randn(P, D, device=args.device)
    gb = P * D * 4 / 1e9
    print(f"\n| partials [{P}, {D}] fp32 summed over rows | ms | GB/s | roof |\n|---|---:|---:|---:|")
    for name, fn in (("column_sum (Triton, two passes)", lambda: column_sum(parts)), ("torch sum(0)", lambda: parts.sum(0))):
        ms = bench(fn)
        print(f"| {name} | {ms:.4f} | {gb / ms * 1e3:,.0f} | {gb / ms * 1e3 / 4300:.2f} |")
    err = (column_sum(parts).double() - parts.double().sum(0)).abs().max().item()
    print(f"check: column_sum vs float64 max abs error {err:.2e}")


def main(argv=None) -> int:
    args, bench, compiled = start(__doc__, argv, "small shapes")
    from k3.model.fused import EAGER
    from k3.ops.attn_res import attn_res_mix

    impls = {"k3 triton": lambda c, wn, wp: attn_res_mix(c, wn, wp, EPS),
             "inductor": lambda c, wn, wp: compiled.attn_res(c, wn, wp, EPS),
             "eager torch": lambda c, wn, wp: EAGER.attn_res(c, wn, wp, EPS)}
    shapes = [(2, args.tokens, 1024), (3, args.tokens, 1024), (4, args.tokens, 1024), (9, 8192, 7168)]
    if args.tiny:
        shapes = [(2, 33, 96), (4, 17, 300)]
    header("Block-AttnRes mix, bf16", "candidates x [M, D]", args.device)
    for k, (n, M, D) in enumerate(shapes):
        cands, w_norm, w_proj = inputs(n, M, D, args.device)
        go = torch.randn(M, D, device=args.device, dtype=torch.bfloat16)
        if k == 0:
            check(cands, w_norm, w_proj)
        fwd_bytes, bwd_bytes = (n + 1) * M * D * 2, (2 * n + 1) * M * D * 2
        leaves = [*cands, w_norm, w_proj]
        res = time_impls(impls, (cands, w_norm, w_proj), go, leaves, bench)
        report(f"{n} x [{M}, {D}]", res, fwd_bytes, bwd_bytes)
        if args.sweep and n == 4:
            fn = impls["k3 triton"]
            sweep("k3.ops.attn_res.triton_attn_res", ("BM", "BD", "WARPS"), [(8, 256, 4), (4, 256, 4), (16, 256, 8), (8, 512, 8),
                                                       (4, 1024, 8), (2, 1024, 4), (16, 128, 4), (32, 128, 8)],
                  lambda: fn(cands, w_norm, w_proj).backward(go), leaves, fwd_bytes + bwd_bytes, bench)
    partial_sums(args, bench)
    header("Block-AttnRes mix + RMSNorm, bf16", "candidates x [M, D]", args.device)
    for n, M, D in shapes[:-1] if not args.tiny else shapes:
        cands, w_norm, w_proj = inputs(n, M, D, args.device)
        ln = (torch.rand(D, device=args.device) + 0.5).requires_grad_()
        go = torch.randn(M, D, device=args.device, dtype=torch.bfloat16)
        norm = {"k3 triton, then norm": lambda c, wn, wp: compiled.rms_norm(attn_res_mix(c, wn, wp, EPS), ln, EPS),
                "inductor": lambda c, wn, wp: compiled.rms_norm(compiled.attn_res(c, wn, wp, EPS), ln, EPS)}
        # minimal bytes of the mix + norm (the mix written once, read once by the norm)
        fwd_bytes, bwd_bytes = (n + 2) * M * D * 2, (2 * n + 2) * M * D * 2
        leaves = [*cands, w_norm, w_proj, ln]
        report(f"{n} x [{M}, {D}]", time_impls(norm, (cands, w_norm, w_proj), go, leaves, bench), fwd_bytes, bwd_bytes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
