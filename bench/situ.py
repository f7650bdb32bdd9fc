"""SiTU-GLU on gate|up packed in one GEMM output, forward and forward+backward, on one GPU: k3's
Triton kernels (`k3.ops.situ`) against the compiled (Inductor) regions the model uses by default
and the eager PyTorch maths, on k3-small's training shapes at 65,536 tokens per micro-batch.

Prints ms, achieved GB/s (minimal bytes: forward reads [M, 2I] and writes [M, I]; backward reads
[M, 2I] and the [M, I] output gradient and writes [M, 2I]) and the fraction of 4.3 TB/s, and the
ratio to the Inductor region from the same run. Correctness first: the Triton output against the
float64 maths and the bf16 torch maths on the first shape.

Usage: python bench/situ.py [--tokens 65536] [--sweep]
       python bench/situ.py --tiny --device cpu     # smoke run under the Triton interpreter
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench._regions import header, report, start, sweep, time_impls  # noqa: E402

BETA, BETA_LIN = 4.0, 25.0


def shapes(tokens: int) -> list[tuple[str, int, int]]:
    """(name, rows M, I) of k3-small's SiTU-GLUs: routed experts (top-8), dense layer 0, shared expert."""
    return [("routed experts", tokens * 8, 512), ("dense layer 0", tokens, 4096), ("shared expert", tokens, 512)]


def check(ab: torch.Tensor) -> None:
    from k3.ops.situ import situ_glu
    from k3.ops.situ.reference import situ_glu_reference

    h = situ_glu(ab, BETA, BETA_LIN)
    a, b = ab.chunk(2, dim=-1)
    exact = situ_glu_reference(a.double(), b.double(), BETA, BETA_LIN)
    bf16 = situ_glu_reference(a, b, BETA, BETA_LIN)
    diff = (h.float() - bf16.float()).abs()
    print(f"check ({list(ab.shape)} bf16): max |h - float64| / max |float64| "
          f"{((h.double() - exact).abs().max() / exact.abs().max()).item():.2e}; outputs differing from the torch "
          f"maths (fp32, cast): {(diff > 0).float().mean().item():.2e} of them, at most {diff.max().item():.3g}")
    if (diff > torch.finfo(torch.bfloat16).eps * bf16.float().abs()).any():
        raise SystemExit("SiTU check FAILED: more than one bf16 ulp from the torch maths")


def main(argv=None) -> int:
    args, bench, compiled = start(__doc__, argv, "64 tokens")
    if args.tiny:
        args.tokens = 64
    from k3.model.fused import EAGER
    from k3.ops.situ import situ_glu

    impls = {"k3 triton": lambda ab: situ_glu(ab, BETA, BETA_LIN),
             "inductor": lambda ab: compiled.glu_packed(ab, "situ", BETA, BETA_LIN),
             "eager torch": lambda ab: EAGER.glu_packed(ab, "situ", BETA, BETA_LIN)}
    header("SiTU-GLU, bf16", "shape", args.device)
    for i, (name, M, I) in enumerate(shapes(args.tokens)):
        torch.manual_seed(0)
        ab = (torch.randn(M, 2 * I, device=args.device) * 3).to(torch.bfloat16).requires_grad_()
        go = torch.randn(M, I, device=args.device, dtype=torch.bfloat16)
        if i == 0:
            check(ab.detach())
        fwd_bytes, bwd_bytes = M * 3 * I * 2, M * 5 * I * 2
        res = time_impls(impls, (ab,), go, [ab], bench)
        report(f"{name} [{M}, {2 * I}]", res, fwd_bytes, bwd_bytes)
        if args.sweep and i == 0:
            fn = impls["k3 triton"]
            sweep("k3.ops.situ.triton_situ", ("BM", "BI", "WARPS"), [(16, 256, 8), (8, 256, 4), (16, 512, 8), (32, 256, 8),
                                                    (4, 512, 4), (32, 128, 4), (64, 256, 16)],
                  lambda: fn(ab).backward(go), [ab], fwd_bytes + bwd_bytes, bench)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
