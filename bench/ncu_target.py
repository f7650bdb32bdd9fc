"""A small, repeatable GPU workload for Nsight Compute (`ncu`): one op at k3-small's training shapes.

    ncu --clock-control none -k regex:_kda_bwd_keys -s 2 -c 1 --set full -o keys python bench/ncu_target.py kda
    (bash bench/gpu_all.sh ncu runs this and prints the reports as text)

Ops: "kda" = chunk_kda forward + backward as the model calls it (gate, qk-L2 norm and beta's sigmoid in
the kernels) on one 65,536-token micro-batch of 8 documents, 8 heads of 128 (k3-small's KDA layer);
"conv" = the short conv + SiLU (k3.ops.short_conv) forward + backward of the same layer: x [1, T, 3 x 1024]
sliced from the fused input projection's [1, T, 4232] output as the model does (--row-width 0: contiguous).
--reps forward/backward passes (the first compiles, so skip its launches with ncu's -s).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def kda(T: int, H: int, docs: int, reps: int) -> None:
    from k3.ops.kda.chunk import chunk_kda

    dev, bf = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=dev, generator=g).to(bf).requires_grad_()

    D = 128
    q, k, v, f = (leaf(1, T, H, D) for _ in range(4))
    beta = torch.randn(1, T, H, device=dev, generator=g, requires_grad=True)
    A_log = torch.zeros(H, device=dev, requires_grad=True)
    dt_bias = torch.zeros(H * D, device=dev, requires_grad=True)
    cu = torch.linspace(0, T, docs + 1, device=dev).to(torch.int32)
    do = torch.randn(1, T, H, D, device=dev, generator=g).to(bf)
    for _ in range(reps):
        o = chunk_kda(q, k, v, f, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0, cu_seqlens=cu,
                      use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)[0]
        o.backward(do)
    torch.cuda.synchronize()


def conv(T: int, docs: int, reps: int, row_width: int) -> None:
    from k3.ops.short_conv import short_conv_silu

    dev, bf, SC = torch.device("cuda"), torch.bfloat16, 3 * 1024
    g = torch.Generator(device=dev).manual_seed(0)
    wide = torch.randn(1, T, max(row_width, SC), device=dev, generator=g).to(bf)
    x = wide[..., :SC].requires_grad_()
    w = (torch.randn(SC, 1, 4, device=dev, generator=g) * 0.5).requires_grad_()
    cu = torch.linspace(0, T, docs + 1, device=dev).to(torch.int32)
    do = [torch.randn(1, T, SC // 3, device=dev, generator=g).to(bf) for _ in range(3)]
    for _ in range(reps):
        torch.autograd.backward(short_conv_silu(x, w, streams=3, cu_seqlens=cu), do)
    torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("op", choices=["kda", "conv"])
    ap.add_argument("--T", type=int, default=65536)
    ap.add_argument("--H", type=int, default=8)
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--row-width", type=int, default=4232, help="conv: x's row stride (0: contiguous)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/ncu_target.py needs a CUDA device")
    if args.op == "kda":
        kda(args.T, args.H, args.docs, args.reps)
    else:
        conv(args.T, args.docs, args.reps, args.row_width)


if __name__ == "__main__":
    main()
