"""KDA's short convolution (depthwise causal conv, width 4, + SiLU) on one GPU: k3's Triton kernels
(`k3.ops.short_conv`) against the plain PyTorch path (transpose, fp32 cuDNN depthwise conv1d, SiLU,
split into streams) on identical packed inputs.

Prints ms, achieved GB/s (minimal bytes: read x and weight, write the output; backward: read x and
dout, write dx) and the fraction of 4.3 TB/s, and the ratio to the PyTorch path from the same run.
Correctness first: forward and both gradients against the float64 loops on a smaller input.

--passthrough 1024,128,8 runs the KDA layer's call: x is the whole fused projection (k3-small: 4,232
columns), the groups after the conv channels come back as views and their gradients go into x's gradient
with the conv's (copied inside the conv backward's launch).

--sweep also times the sliding-window kernels with other program tiles (strip rows, channels, warps: the
WINDOW constants of k3/ops/short_conv/triton_conv.py, set for each row and restored), on the same inputs.

--smoke runs every path once on a tiny input on the CPU (the kernels under TRITON_INTERPRET=1): it checks
the script, its times mean nothing.

Usage: python bench/short_conv.py [--tokens 16384] [--channels 3072] [--docs 8] [--passthrough 1024,128,8]
       [--sweep] [--smoke]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench._harness import HBM, do_bench_ms  # noqa: E402


def torch_path(x: torch.Tensor, w: torch.Tensor, streams: int) -> torch.Tensor:
    """The PyTorch baseline: [1, T, S*C] -> [S, 1, T, C] (documents ignored: a lower bound on its cost;
    its gradient comes as one [S, 1, T, C] tensor, so no stack of the stream gradients is timed)."""
    T, SC = x.shape[1:]
    W = w.shape[-1]
    y = F.conv1d(x.transpose(1, 2).float(), w, padding=W - 1, groups=SC)[..., :T]
    z = F.silu(y).to(x.dtype)  # [1, SC, T]
    return z.reshape(streams, SC // streams, T).transpose(1, 2).unsqueeze(1).contiguous()


def backward(outs: tuple[torch.Tensor, ...], grads: list[torch.Tensor]) -> None:
    """grads (one per output, e.g. do[s] of a [S, B, T, C] do: no copy) into outs."""
    torch.autograd.backward(list(outs), grads)


def _bench(fn, device: str, grad_to_none: list | None = None) -> float:
    """ms of fn() (`bench._harness.do_bench_ms`; on the CPU --smoke runs, times nothing)."""
    return do_bench_ms(fn, device, grad_to_none)


def check(streams: int, passthrough: tuple[int, ...], device: str, T: int, C: int) -> None:
    """bf16 forward and gradients of every kernel path against the float64 loops ([1, T, streams*C], 5
    documents), x's passthrough columns (if any) against their gradients exactly."""
    from k3.ops.short_conv import short_conv_silu
    from k3.ops.short_conv.reference import short_conv_silu_reference

    torch.manual_seed(0)
    SC, P = streams * C, sum(passthrough)
    cu = torch.tensor([0, 1, T // 4, T // 4 + 1, 2 * T // 3, T], device=device, dtype=torch.int32)
    x = torch.randn(1, T, SC + P, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(SC, 1, 4, device=device) * 0.5).requires_grad_()
    xr, wr = x[..., :SC].detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = short_conv_silu_reference(xr, wr, cu).reshape(1, T, streams, C).permute(2, 0, 1, 3)
    do = torch.randn_like(ref)
    ref.backward(do)
    dp = [torch.randn(1, T, n, device=device, dtype=x.dtype) for n in passthrough]
    rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()  # noqa: E731
    x.grad = w.grad = None
    out = short_conv_silu(x, w, streams=streams, cu_seqlens=cu, passthrough=passthrough)
    backward(out, [d.to(x.dtype) for d in do.unbind(0)] + dp)
    e = (rel(torch.stack(out[:streams]), ref), rel(x.grad[..., :SC], xr.grad), rel(w.grad, wr.grad))
    exact = torch.equal(x.grad[..., SC:], torch.cat(dp, -1)) if passthrough else True
    print(f"check (bf16 vs float64, T {T}, 5 documents"
          + (f", passthrough {passthrough}: exact {exact}" if passthrough else "")
          + f"): out {e[0]:.2e}, dx {e[1]:.2e}, dw {e[2]:.2e}")
    if max(e) > 1e-2 or not exact:
        raise SystemExit("short conv check FAILED")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--channels", type=int, default=3072, help="S*C (q, k, v streams together)")
    ap.add_argument("--streams", type=int, default=3)
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--sweep", action="store_true", help="also time backward tiles (rows, channels, warps)")
    ap.add_argument("--row-width", type=int, default=0,
                    help="x as the first channels of a wider tensor, as in training (k3-small's fused "
                         "projection: 4232); 0 = contiguous x")
    ap.add_argument("--passthrough", default="",
                    help="comma-separated widths of column groups after the conv channels, passed through with "
                         "their gradients (k3-small's KDA layer: 1024,128,8; x is then the whole projection)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny input, kernels interpreted: the script runs")
    args = ap.parse_args(argv)
    passthrough = tuple(int(n) for n in args.passthrough.split(",") if n)
    device = "cuda"
    if args.smoke:
        if args.sweep:
            raise SystemExit("--smoke times nothing: no --sweep")
        os.environ["TRITON_INTERPRET"] = "1"  # before k3's kernels are imported (triton.jit reads it)
        device, args.tokens, args.channels, args.docs = "cpu", 45, 3 * 16, 3
        passthrough = tuple(min(n, 5) for n in passthrough)
        args.row_width = args.channels + 5 if args.row_width else 0
    if passthrough and args.row_width:
        raise SystemExit("--passthrough: x is the whole projection, its row width S*C + the groups (no --row-width)")

    from k3.ops.short_conv import document_starts, short_conv_silu

    S = args.streams
    check(S, passthrough, device, *((40, 16) if args.smoke else (3000, 256)))
    T, SC = args.tokens, args.channels
    width = max(args.row_width, SC) + sum(passthrough)
    full = torch.randn(1, T, width, device=device, dtype=torch.bfloat16, requires_grad=True)
    # a leaf of its own (also when sliced), so no slice-backward copy into a wider gradient is timed; with
    # passthrough groups x is the whole projection, as the KDA layer passes it
    x = (full[..., :SC] if width > SC and not passthrough else full).detach().requires_grad_()
    w = (torch.randn(SC, 1, 4, device=device) * 0.5).requires_grad_()
    cu = torch.linspace(0, T, args.docs + 1, device=device).round().to(torch.int32)
    starts = document_starts(cu, T)
    do = torch.randn(S, 1, T, SC // S, device=device, dtype=torch.bfloat16)
    dp = [torch.randn(1, T, n, device=device, dtype=torch.bfloat16) for n in passthrough]
    views = [SC + sum(passthrough[:j]) for j in range(len(passthrough))]  # the groups' first columns

    def k3():
        return short_conv_silu(x, w, streams=S, starts=starts, passthrough=passthrough)

    def torch_impl():
        xc = x[..., :SC] if passthrough else x
        return (torch_path(xc, w, S),) + tuple(x.narrow(-1, o, n) for o, n in zip(views, passthrough))

    k3_grads = list(do.unbind(0)) + dp  # S stream gradients, then the passthrough groups'
    impls = {"k3 window": (k3, k3_grads), "torch cudnn": (torch_impl, [do] + dp)}
    nbytes = T * SC * 2 * 2  # read x, write out (bf16); the backward reads x and dout, writes dx: 1.5x
    both_bytes = 2.5 * nbytes + T * sum(passthrough) * 2 * 2  # + read the groups' gradients, write their dx
    res = {}
    for name, (fn, grads) in impls.items():
        fwd = _bench(fn, device)
        both = _bench(lambda fn=fn, grads=grads: backward(fn(), grads), device, grad_to_none=[x, w])
        x.grad = w.grad = None
        res[name] = (fwd, both)
    layout = f"rows of a {width}-wide tensor" if width > SC else "contiguous"
    gpu = torch.cuda.get_device_name() if device == "cuda" else "CPU smoke run (times mean nothing)"
    print(f"\nshort conv W 4 + SiLU, 1 x {T} tokens x {SC} channels bf16 ({layout}"
          + (f", passthrough {passthrough}" if passthrough else "") + f"), {args.docs} documents, {gpu}")
    print("| impl | fwd ms | fwd GB/s | fwd roof | fwd+bwd ms | fwd+bwd GB/s | fwd+bwd roof | torch / impl (fwd+bwd) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    base = res["torch cudnn"][1]
    for name, (fwd, both) in res.items():
        gf, gb = nbytes / fwd / 1e6, both_bytes / both / 1e6
        print(f"| {name} | {fwd:.3f} | {gf:,.0f} | {gf * 1e9 / HBM:.2f} | {both:.3f} | {gb:,.0f} | "
              f"{gb * 1e9 / HBM:.2f} | {base / both:.2f} |")
    if args.sweep:
        sweep(k3, x, w, k3_grads, nbytes, both_bytes)
    return 0


def _timed(direction: str, tile: tuple[int, int, int], fn, nbytes: float) -> tuple[str, str]:
    """(ms, GB/s) of fn() moving `nbytes` with the window kernels' `direction` tile ("FWDW" / "BWDW") set to
    `tile` (restored afterwards); a tile that fails is reported in the ms column."""
    from k3.ops.short_conv import triton_conv

    default = triton_conv.WINDOW[direction]
    triton_conv.WINDOW[direction] = tile
    try:
        ms = _bench(fn, "cuda")
        return f"{ms:.3f}", f"{nbytes / ms / 1e6:,.0f}"
    except Exception as ex:  # a tile that does not compile: report and go on
        return f"{type(ex).__name__}: {str(ex)[:80]}", ""
    finally:
        triton_conv.WINDOW[direction] = default


def sweep(fn, x, w, grads: list[torch.Tensor], nbytes: float, both_bytes: float) -> None:
    """The window kernels' forward tiles (forward ms) and backward tiles (fwd+bwd ms, default forward)."""
    def both():
        x.grad = w.grad = None
        backward(fn(), grads)

    print("\n| kernels | pass | R | BC | warps | ms | GB/s |\n|---|---|---:|---:|---:|---:|---:|")
    row = "| {} | {} | {} | {} | {} | {} | {} |"
    for r, bc, wp in [(64, 512, 4), (32, 512, 4), (128, 512, 4), (256, 512, 4), (64, 1024, 4), (64, 1024, 8),
                      (64, 256, 2), (64, 256, 1), (128, 256, 2), (64, 512, 8), (64, 128, 1)]:
        print(row.format("window", "fwd", r, bc, wp, *_timed("FWDW", (r, bc, wp), fn, nbytes)), flush=True)
    for r, bc, wp in [(128, 512, 4), (64, 512, 4), (256, 512, 4), (512, 512, 4), (128, 1024, 4), (128, 1024, 8),
                      (128, 256, 2), (128, 256, 1), (256, 256, 2), (128, 512, 8), (128, 128, 1), (64, 256, 2)]:
        print(row.format("window", "fwd+bwd", r, bc, wp, *_timed("BWDW", (r, bc, wp), both, both_bytes)), flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
