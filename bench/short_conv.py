"""KDA's short convolution (depthwise causal conv, width 4, + SiLU) on one GPU: k3's Triton kernels
(`k3.ops.short_conv`) against the plain PyTorch path (transpose, fp32 cuDNN depthwise conv1d, SiLU,
split into streams) on identical packed inputs.

Prints ms, achieved GB/s (minimal bytes: read x and weight, write the output; backward: read x and
dout, write dx) and the fraction of 4.3 TB/s, and the ratio to the PyTorch path from the same run.
Correctness first: forward and both gradients against the float64 loops on a smaller input.

--sweep also times the sliding-window kernels (the default, env K3_CONV=window) with other program tiles
(env K3_CONV_{FWDW,BWDW}_{R,BC,WARPS}: strip rows, channels, warps) and the tiled
kernels (K3_CONV=tiles, env K3_CONV_BWD_{BT,BC,WARPS}) with their split backward's dz scratch in fp32 and
in x's dtype (env K3_CONV_DZ), all read per call by k3/ops/short_conv/triton_conv.py, on the same inputs.

Usage: python bench/short_conv.py [--tokens 16384] [--channels 3072] [--docs 8] [--sweep]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

HBM = 4.3e12  # bytes/s, measured H200 copy bandwidth (benchmarks.md)


def torch_path(x: torch.Tensor, w: torch.Tensor, streams: int) -> torch.Tensor:
    """The PyTorch baseline: [1, T, S*C] -> [S, 1, T, C] (documents ignored: a lower bound on its cost;
    its gradient comes as one [S, 1, T, C] tensor, so no stack of the stream gradients is timed)."""
    T, SC = x.shape[1:]
    W = w.shape[-1]
    y = F.conv1d(x.transpose(1, 2).float(), w, padding=W - 1, groups=SC)[..., :T]
    z = F.silu(y).to(x.dtype)  # [1, SC, T]
    return z.reshape(streams, SC // streams, T).transpose(1, 2).unsqueeze(1).contiguous()


def backward(out: torch.Tensor | tuple[torch.Tensor, ...], do: torch.Tensor) -> None:
    """do [S, B, T, C] into one [S, B, T, C] output or S [B, T, C] ones (k3's: do[s] is no copy)."""
    if isinstance(out, tuple):
        torch.autograd.backward(out, list(do.unbind(0)))
    else:
        out.backward(do)


def check(streams: int) -> None:
    from k3.ops.short_conv import short_conv_silu
    from k3.ops.short_conv.reference import short_conv_silu_reference

    torch.manual_seed(0)
    T, C = 3000, 256
    cu = torch.tensor([0, 1, 700, 701, 2048, 3000], device="cuda", dtype=torch.int32)
    x = torch.randn(1, T, streams * C, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(streams * C, 1, 4, device="cuda") * 0.5).requires_grad_()
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = short_conv_silu_reference(xr, wr, cu).reshape(1, T, streams, C).permute(2, 0, 1, 3)
    do = torch.randn_like(ref)
    ref.backward(do)
    rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()  # noqa: E731
    for mode, dz in (("window", "-"), ("tiles", "fp32"), ("tiles", "half")):  # env K3_CONV / K3_CONV_DZ
        os.environ.update(K3_CONV=mode, K3_CONV_DZ="auto" if dz == "-" else dz)
        x.grad = w.grad = None
        out = short_conv_silu(x, w, streams=streams, cu_seqlens=cu)
        backward(out, do.to(x.dtype))
        e = (rel(torch.stack(out), ref), rel(x.grad, xr.grad), rel(w.grad, wr.grad))
        print(f"check (bf16 vs float64, T {T}, 5 documents, {mode} kernels, dz scratch {dz}): out {e[0]:.2e}, "
              f"dx {e[1]:.2e}, dw {e[2]:.2e}")
        if max(e) > 1e-2:
            raise SystemExit("short conv check FAILED")
    os.environ.pop("K3_CONV_DZ")
    os.environ.pop("K3_CONV")


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
    args = ap.parse_args(argv)
    from triton.testing import do_bench

    from k3.ops.short_conv import document_starts, short_conv_silu

    check(args.streams)
    T, SC = args.tokens, args.channels
    width = max(args.row_width, SC)
    full = torch.randn(1, T, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    # a leaf of its own (also when sliced), so no slice-backward copy into a wider gradient is timed
    x = (full[..., :SC] if width > SC else full).detach().requires_grad_()
    w = (torch.randn(SC, 1, 4, device="cuda") * 0.5).requires_grad_()
    cu = torch.linspace(0, T, args.docs + 1, device="cuda").round().to(torch.int32)
    starts = document_starts(cu, T)
    do = torch.randn(args.streams, 1, T, SC // args.streams, device="cuda", dtype=torch.bfloat16)
    impls = {"k3 window (default)": (lambda: short_conv_silu(x, w, streams=args.streams, starts=starts), {}),
             "k3 tiles": (lambda: short_conv_silu(x, w, streams=args.streams, starts=starts), {"K3_CONV": "tiles"}),
             "torch cudnn": (lambda: torch_path(x, w, args.streams), {})}
    nbytes = T * SC * 2 * 2  # read x, write out (bf16); the backward reads x and dout, writes dx: 1.5x
    res = {}
    for name, (fn, env) in impls.items():
        os.environ.update(env)
        fwd = do_bench(fn, warmup=25, rep=100)
        both = do_bench(lambda fn=fn: backward(fn(), do), warmup=25, rep=100, grad_to_none=[x, w])
        res[name] = (fwd, both)
        for k in env:
            os.environ.pop(k)
    layout = f"rows of a {width}-wide tensor" if width > SC else "contiguous"
    print(f"\nshort conv W 4 + SiLU, 1 x {T} tokens x {SC} channels bf16 ({layout}), {args.docs} documents, "
          f"{torch.cuda.get_device_name()}")
    print("| impl | fwd ms | fwd GB/s | fwd roof | fwd+bwd ms | fwd+bwd GB/s | fwd+bwd roof | torch / impl (fwd+bwd) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    base = res["torch cudnn"][1]
    for name, (fwd, both) in res.items():
        gf, gb = nbytes / fwd / 1e6, 2.5 * nbytes / both / 1e6
        print(f"| {name} | {fwd:.3f} | {gf:,.0f} | {gf * 1e9 / HBM:.2f} | {both:.3f} | {gb:,.0f} | "
              f"{gb * 1e9 / HBM:.2f} | {base / both:.2f} |")
    if args.sweep:
        sweep(impls["k3 window (default)"][0], x, w, do, nbytes)
    return 0


def _timed(env: dict, fn, nbytes: float) -> tuple[str, str]:
    """(ms, GB/s) of fn() moving `nbytes` under the env settings `env` (restored afterwards); a tile that
    fails is reported in the ms column."""
    from triton.testing import do_bench

    os.environ.update(env)
    try:
        ms = do_bench(fn, warmup=25, rep=100)
        return f"{ms:.3f}", f"{nbytes / ms / 1e6:,.0f}"
    except Exception as ex:  # a tile that does not compile: report and go on
        return f"{type(ex).__name__}: {str(ex)[:80]}", ""
    finally:
        for k in env:
            os.environ.pop(k)


def sweep(fn, x, w, do, nbytes: int) -> None:
    """The window kernels' forward tiles (forward ms) and backward tiles (fwd+bwd ms, default forward), then
    the tiled kernels' backward tiles and dz scratch (fwd+bwd ms, tiled forward)."""
    def both():
        x.grad = w.grad = None
        backward(fn(), do)

    print("\n| kernels | pass | R / BT | BC | warps | dz | ms | GB/s |\n|---|---|---:|---:|---:|---|---:|---:|")
    row = "| {} | {} | {} | {} | {} | {} | {} | {} |"
    for r, bc, wp in [(64, 512, 4), (32, 512, 4), (128, 512, 4), (256, 512, 4), (64, 1024, 4), (64, 1024, 8),
                      (64, 256, 2), (64, 256, 1), (128, 256, 2), (64, 512, 8), (64, 128, 1)]:
        env = {"K3_CONV_FWDW_R": str(r), "K3_CONV_FWDW_BC": str(bc), "K3_CONV_FWDW_WARPS": str(wp)}
        print(row.format("window", "fwd", r, bc, wp, "-", *_timed(env, fn, nbytes)), flush=True)
    for r, bc, wp in [(128, 512, 4), (64, 512, 4), (256, 512, 4), (512, 512, 4), (128, 1024, 4), (128, 1024, 8),
                      (128, 256, 2), (128, 256, 1), (256, 256, 2), (128, 512, 8), (128, 128, 1), (64, 256, 2)]:
        env = {"K3_CONV_BWDW_R": str(r), "K3_CONV_BWDW_BC": str(bc), "K3_CONV_BWDW_WARPS": str(wp)}
        print(row.format("window", "fwd+bwd", r, bc, wp, "-", *_timed(env, both, 2.5 * nbytes)), flush=True)
    for dz, (bt, bc, wp) in [("half", (64, 128, 4)), ("fp32", (64, 128, 4)), ("half", (32, 128, 4)), ("half", (64, 64, 4))]:
        env = {"K3_CONV": "tiles", "K3_CONV_DZ": dz, "K3_CONV_BWD_BT": str(bt), "K3_CONV_BWD_BC": str(bc),
               "K3_CONV_BWD_WARPS": str(wp)}
        print(row.format("tiles", "fwd+bwd", bt, bc, wp, dz, *_timed(env, both, 2.5 * nbytes)), flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
