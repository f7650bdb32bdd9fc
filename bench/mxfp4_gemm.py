"""MXFP4 grouped GEMM (k3.ops.mxfp4_gemm, weights dequantised in registers) vs bf16 torch._grouped_mm.

For each expert shape (k3-small: 64 experts top-8, w13 [1024, 512], w2 [512, 512]; kimi-k3: 896 experts
top-16, w13 [6144, 3584], w2 [3584, 3072]) and each token count (decode batches 1..64, prefill), tokens
are routed uniformly at random to top-k distinct experts, and both GEMMs run on the same expert-sorted
rows: bf16 `torch._grouped_mm(x, w^T)` with the bf16 weights, and `mxfp4_grouped_mm` with the packed
weights (every expert allocated, so weight reads come from HBM, not L2). One matrix is resident at a
time (kimi-k3 w13 in bf16 is 39 GB). Outputs are checked against each other (bf16 rounding only: the
bf16 weights are the decoded MXFP4 weights).

Prints a markdown table: ms per GEMM, speed-up of MXFP4 over bf16 -- with the bytes in the kernel order
(`k3.ops.mxfp4_gemm.to_kernel_order`, how `RoutedExperts` keeps them; K a multiple of 64) and in the
official layout -- and the expert-memory ratio (bf16 bytes / packed + scale bytes = 16 / 4.25); then the forward time of a model (`--model`, default
k3-small, random weights) on [B, 1] tokens with decoded-bf16 vs packed MXFP4 experts (the same weights:
the logits differ by accumulation order and bf16 rounding only).

GPU times are of CUDA graphs replaying `--inner` calls (device time, no Python launch overhead: how the
decode step runs when served with CUDA graphs); `--eager` times single eager calls instead.

`--sweep` also times a small set of candidate tiles (`k3.ops.mxfp4_gemm.triton_mxfp4.Mxfp4Tiles`) per
(shape, matrix, token count) and prints each one's time and the best, to choose `pick_tiles`' defaults.

`--sass` needs no GPU: it compiles the kernel for sm_90 with Triton's bundled ptxas for the default
tiles and prints per configuration the registers, shared memory, whether the MMA is wgmma (HGMMA) and
the instruction mix of the K loop's body (SASS), per decoded weight and thread.

Usage: python bench/mxfp4_gemm.py [--shapes k3-small,kimi-k3] [--batches 1,2,4,8,16,32,64]
       [--prefill 8192] [--reps 50] [--sweep [prefill]] [--eager]
       python bench/mxfp4_gemm.py --smoke     # CPU: tiny shapes, reference path, correctness only
       python bench/mxfp4_gemm.py --sass      # CPU: compile for sm_90, print the K loop's instructions
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from k3.ops.mxfp4_gemm import mxfp4_grouped_mm  # noqa: E402
from k3.quant.mxfp4 import decode_mxfp4  # noqa: E402

# name -> (experts, top_k, {matrix: (N, K)})
SHAPES = {
    "k3-small": (64, 8, {"w13": (1024, 512), "w2": (512, 512)}),
    "kimi-k3": (896, 16, {"w13": (6144, 3584), "w2": (3584, 3072)}),
    "smoke": (8, 2, {"w13": (64, 64), "w2": (64, 32)}),
}


def route(tokens: int, E: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """[E] int32 cumulative counts of `tokens` tokens each sent to k distinct random experts."""
    idx = torch.rand(tokens, E, generator=gen).topk(k, dim=1).indices.flatten()
    return torch.cumsum(torch.bincount(idx, minlength=E), 0).to(torch.int32)


TIMING = {"graphs": True, "inner": 10}


def _graph(fn, inner: int):
    """A CUDA graph of `inner` calls of fn (warmed up on a side stream first), or None if capture fails."""
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(inner):
                fn()
        return g
    except Exception as err:  # noqa: BLE001 -- report and time eagerly instead
        print(f"# CUDA graph capture failed ({type(err).__name__}: {err}); timing eagerly", file=sys.stderr)
        return None


def timed(fn, reps: int, dev: str) -> float:
    """Median ms of one call of `fn` over reps (CUDA events around a graph of TIMING["inner"] calls, or
    around one eager call; perf_counter on CPU)."""
    fn()
    g, inner = None, 1
    if dev == "cuda" and TIMING["graphs"]:
        g = _graph(fn, TIMING["inner"])
        inner = TIMING["inner"] if g is not None else 1
    times = []
    for _ in range(reps):
        if dev == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay() if g is not None else fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / inner)
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def candidates(rows: int, E: int) -> list:
    """The --sweep set for S = rows over E experts: weight-streaming tiles (BM 16) at a few rows per
    expert, larger row tiles otherwise, each with a K order / decode variant (Mxfp4Tiles.perm / asm; the
    first of each list is the previous kernel); at prefill also "dequant" (decode into a bf16 scratch +
    torch._grouped_mm, `Mxfp4GemmConfig`). The default (pick_tiles / the config's rule) is timed
    separately."""
    from k3.ops.mxfp4_gemm.triton_mxfp4 import Mxfp4Tiles as T

    if rows <= 16 * E:
        return [T(16, 128, 128, 4, 3, perm=0, asm=False), T(16, 64, 128, 4, 3), T(16, 64, 256, 4, 3), T(16, 128, 128, 4, 4),
                T(16, 256, 128, 8, 3), T(16, 128, 128, 4, 3, perm=4), T(16, 64, 128, 4, 3, perm=4)]
    if rows <= 64 * E:
        return [T(bm, bn, bk, w, st) for bm, bn, bk, w, st in
                [(32, 128, 128, 4, 3), (64, 128, 128, 4, 3), (64, 64, 128, 4, 4), (64, 256, 64, 8, 3)]]
    return [T(256, 128, 64, 8, 3, perm=4), T(256, 128, 64, 8, 3, perm=4, split_rows=True),
            T(256, 128, 64, 8, 4, perm=4, split_rows=True), T(128, 128, 64, 4, 3, perm=4, split_rows=True),
            "dequant"]


def _dequant_fits(E: int, N: int, K: int, dev: str) -> bool:
    """Whether a bf16 scratch of the whole stack fits beside what the bench holds (kimi-k3: it does not)."""
    return dev != "cuda" or E * N * K * 2 < 0.8 * torch.cuda.mem_get_info()[0]


def dequant_alone(packed_k, scale, reps: int, dev: str) -> None:
    """Time the decode into a bf16 scratch alone (the default and two other row blocks / warps)."""
    from k3.ops.mxfp4_gemm import mxfp4_dequant
    from k3.ops.mxfp4_gemm.triton_mxfp4 import mxfp4_dequant_triton

    gb = (packed_k.numel() * 5 + scale.numel()) / 1e6  # read packed + scale, write 4 bytes per packed byte
    ms = timed(lambda: mxfp4_dequant(packed_k, scale, kernel_order=True), reps, dev)
    print(f"#   dequant alone (default): {ms:.4f} ms ({gb / ms:.0f} GB/s read + written)", flush=True)
    if dev == "cuda":
        for br, w in ((64, 8), (16, 4)):
            ms = timed(lambda: mxfp4_dequant_triton(packed_k, scale, True, block_rows=br, warps=w), reps, dev)
            print(f"#   dequant alone (block_rows {br}, {w} warps): {ms:.4f} ms ({gb / ms:.0f} GB/s)", flush=True)


def sweep(x, packed, packed_k, scale, offs, y_ref, reps: int, dev: str) -> list[tuple[float, object]]:
    """(ms, candidate) of each candidate that runs and agrees with y_ref, fastest first (packed_k: the bytes
    in kernel order for perm-4 candidates and "dequant", None to skip those)."""
    from k3.ops.mxfp4_gemm import Mxfp4GemmConfig, mxfp4_dequant

    E, N = packed.shape[:2]
    K = x.shape[1]
    out = []
    for t in candidates(x.shape[0], E):
        if t == "dequant":
            if packed_k is None or not _dequant_fits(E, N, K, dev):
                print(f"#   dequant: skipped (kernel order needed; a {E * N * K * 2 / 1e9:.1f} GB scratch must fit)")
                continue
            cfg = Mxfp4GemmConfig(dequant_rows_per_expert=1, dequant_max_bytes=1 << 62)
            fn = lambda: mxfp4_grouped_mm(x, packed_k, scale, offs, kernel_order=True, config=cfg)  # noqa: E731
            dequant_alone(packed_k, scale, reps, dev)
        elif t.perm == 4 and packed_k is None:
            continue
        else:
            fn = lambda: mxfp4_grouped_mm(x, packed_k if t.perm == 4 else packed, scale, offs, tiles=t,  # noqa: E731
                                          kernel_order=t.perm == 4)
        try:
            err = rel_err(fn(), y_ref)
        except Exception as e:  # noqa: BLE001 -- a tile that does not compile (resources) is skipped
            print(f"#   {t}: failed ({type(e).__name__}: {str(e)[:120]})", flush=True)
            continue
        if err > 2e-2:
            print(f"#   {t}: WRONG, differs from bf16 by {err:.2e} (relative)", flush=True)
            continue
        out.append((timed(fn, reps, dev), t))
    return sorted(out, key=lambda r: r[0])


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """max |y - ref| / max |ref| over [S, N] outputs, in row chunks (kimi-k3 prefill's fp32 copies would not
    fit beside the weights)."""
    diff, top = 0.0, 0.0
    for i in range(0, max(ref.shape[0], 1), 8192):
        r = ref[i:i + 8192].float()
        diff = max(diff, (y[i:i + 8192].float() - r).abs().max().item() if r.numel() else 0.0)
        top = max(top, r.abs().max().item() if r.numel() else 0.0)
    return diff / max(top, 1e-30)


def bench_matrix(name: str, mat: str, E: int, k: int, N: int, K: int, token_counts: list[tuple[str, int]],
                 reps: int, dev: str, gen: torch.Generator, do_sweep: str | None = None) -> list[str]:
    from k3.ops.mxfp4_gemm import to_kernel_order
    from k3.ops.mxfp4_gemm import uses_dequant
    from k3.ops.mxfp4_gemm.triton_mxfp4 import pick_tiles

    packed = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, device=dev)
    ko = K % 64 == 0  # kernel-order bytes, as RoutedExperts keeps them
    packed_k = to_kernel_order(packed) if ko else packed
    scale = torch.randint(118, 124, (E, N, K // 32), dtype=torch.uint8, device=dev)
    w_bf16 = torch.empty(E, N, K, dtype=torch.bfloat16, device=dev)
    for e in range(E):  # one expert at a time: the fp32 decode of all of them would not fit
        w_bf16[e] = decode_mxfp4(packed[e], scale[e], dtype=torch.bfloat16)
    ratio = w_bf16.numel() * 2 / (packed.numel() + scale.numel())
    rows = []
    for label, tokens in token_counts:
        offs = route(tokens, E, k, gen).to(dev)
        S = int(offs[-1])
        x = (torch.randn(S, K, generator=gen) * 0.5).to(dev, torch.bfloat16)
        wt = w_bf16.transpose(-2, -1)
        if dev == "cuda":
            ref = lambda: torch._grouped_mm(x, wt, offs=offs)  # noqa: E731
        else:
            ref = lambda: mxfp4_grouped_mm(x.float(), packed, scale, offs, use_triton=False)  # noqa: E731
        new = lambda: mxfp4_grouped_mm(x, packed_k, scale, offs, kernel_order=ko)  # noqa: E731
        off = lambda: mxfp4_grouped_mm(x, packed, scale, offs)  # noqa: E731
        y_ref = ref()
        err = max(rel_err(new(), y_ref), rel_err(off(), y_ref))
        if err > 2e-2:
            raise AssertionError(f"{name} {mat} {label}: MXFP4 GEMM differs from bf16 by {err:.2e} (relative)")
        t_ref, t_new, t_off = timed(ref, reps, dev), timed(new, reps, dev), timed(off, reps, dev)
        path = "dequant + grouped_mm" if dev == "cuda" and uses_dequant(S, E, N, K, x.dtype) else "fused"
        active = int((offs.diff(prepend=offs.new_zeros(1)) > 0).sum())
        gbs = (packed.numel() + scale.numel()) * (active / E) / t_new / 1e6
        rows.append(f"| {name} | {mat} [{N}, {K}] | {label} | {S} | {t_ref:.4f} | {t_new:.4f} | "
                    f"{t_ref / t_new:.2f}x | {t_off:.4f} | {t_ref / t_off:.2f}x | {gbs:.0f} | {ratio:.2f}x | "
                    f"{err:.1e} | {path} |")
        print(rows[-1], flush=True)
        if do_sweep == "all" or (do_sweep == "prefill" and label.startswith("prefill")):
            res = sweep(x, packed, packed_k if ko else None, scale, offs, y_ref, reps, dev)
            for ms, t in res:
                print(f"#   {ms:.4f} ms ({t_ref / ms:.2f}x bf16)  {t}", flush=True)
            if res:
                print(f"# best {name} {mat} {label}: {res[0][1]} {res[0][0]:.4f} ms "
                      f"({t_ref / res[0][0]:.2f}x bf16); default {path} {pick_tiles(S, E, N, K)} {t_new:.4f} ms",
                      flush=True)
    return rows


def model_step(preset: str, batches: list[int], reps: int, dev: str) -> None:
    """Forward time of `preset` (random weights, bf16) on [B, 1] tokens with packed MXFP4 experts vs the
    same model with the decoded (dequantised, exact in bf16) experts as ordinary weights: the per-token
    work of a decode step without the cache (attention over one token), so the difference is the routed
    experts'. Both compute with the same weights, so their logits differ by accumulation order and bf16
    rounding only: printed as the max |logit difference| and the argmax agreement."""
    import copy

    from k3.config import get_preset
    from k3.model.causal_lm import K3ForCausalLM
    from k3.model.moe import RoutedExperts, pack_routed_experts

    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    packed = K3ForCausalLM(get_preset(preset)).init_weights(seed=0).to(dtype).to(dev).eval()
    decoded = copy.deepcopy(packed)
    pack_routed_experts(packed)  # PTQ of the random weights
    with torch.no_grad():
        pairs = zip((m for m in packed.modules() if isinstance(m, RoutedExperts)),
                    (m for m in decoded.modules() if isinstance(m, RoutedExperts)))
        for src, dst in pairs:
            for p, w in zip((dst.w1, dst.w3, dst.w2), src.weights()):
                p.copy_(w)
    ids = {b: torch.randint(0, 1000, (b, 1), device=dev) for b in batches}
    TIMING["graphs"] = False  # eager: the model's routing may read the device (no graph capture)
    with torch.no_grad():
        t_dec = {b: timed(lambda: decoded(ids[b]).logits, reps, dev) for b in batches}
        t_fp4 = {b: timed(lambda: packed(ids[b]).logits, reps, dev) for b in batches}
        ref = {b: decoded(ids[b]).logits.float() for b in batches}
        got = {b: packed(ids[b]).logits.float() for b in batches}
    print(f"\n{preset} forward of [B, 1] tokens (ms, eager), same weights: decoded bf16 vs packed MXFP4 experts\n"
          "| batch | bf16 experts | MXFP4 experts | speed-up | max abs logit diff | argmax agreement |\n"
          "|---|---|---|---|---|---|")
    for b in batches:
        diff = (got[b] - ref[b]).abs().max().item()
        agree = float((got[b].argmax(-1) == ref[b].argmax(-1)).float().mean())
        print(f"| {b} | {t_dec[b]:.3f} | {t_fp4[b]:.3f} | {t_dec[b] / t_fp4[b]:.2f}x | {diff:.2e} | {agree:.2f} |",
              flush=True)


def sass_row(label: str, t) -> str:
    """Compile `_mxfp4_gmm` for sm_90 (no GPU needed) with tiles t (bf16 activations) and return the table
    row: registers, shared memory, MMA kind and the K loop's SASS instruction mix (the body between the
    loop's backward branch and its target) per decoded weight and thread."""
    import collections
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from k3.ops.mxfp4_gemm import triton_mxfp4 as tm

    names = ["X", "P", "S", "Y", "offs_ptr", "N", "K", "E", "stride_xm", "stride_ym", "stride_ys", "stride_pe",
             "stride_pn", "stride_se", "stride_sn"]
    types = ["*bf16", "*u8", "*u8", "*bf16", "*i32"] + ["i32"] * 10
    aligned = [i for i, n in enumerate(names) if n not in ("N", "E")]  # pointers, K and strides: multiples of 16
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    consts = dict(EP=1024, BM=t.bm, BN=t.bn, BK=t.bk, W_UP=1.0, Y_UP=float(2 ** tm.SHIFT_BITS), F32_DOT=False,
                  PERM=t.perm, ASM=t.asm, SPLIT_ROWS=t.split_rows)
    sig = dict(zip(names, types)) | {k: "constexpr" for k in consts}
    src = ASTSource(fn=tm._mxfp4_gmm, signature=sig, constexprs=consts,
                    attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": t.warps, "num_stages": t.stages})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        sass = subprocess.run([str(cuobjdump), "-sass", f.name], capture_output=True, text=True).stdout
        usage = subprocess.run([str(cuobjdump), "--dump-resource-usage", f.name], capture_output=True,
                               text=True).stdout
    ins = [(int(m[0], 16), m[1], m[2]) for m in
           re.findall(r"/\*([0-9a-f]{4,})\*/\s*(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)([^;]*);", sass)]
    loops = [(int(j.group(1), 16), a) for a, op, rest in ins if op.startswith("BRA")
             for j in [re.search(r"0x([0-9a-f]+)", rest)] if j and int(j.group(1), 16) < a]
    body = [op.split(".")[0] for a, op, _ in ins if loops and loops[0][0] <= a <= loops[0][1]]
    weights = t.bn * t.bk / (32 * t.warps)  # decoded weights per thread per K tile
    regs = re.search(r"REG:(\d+)", usage)
    mma = "wgmma (HGMMA)" if "HGMMA" in sass else ("mma.sync (HMMA)" if "HMMA" in sass else "none")
    top = ", ".join(f"{op} {n / weights:.2f}" for op, n in collections.Counter(body).most_common(6))
    return (f"| {label} {t} | {regs.group(1) if regs else '?'} | {k.metadata.shared} | {mma} | "
            f"{len(body) / weights:.2f} | {top} |")


def sass_report() -> None:
    """`sass_row` of each default tile shape, bytes in the official layout and in the kernel order."""
    from k3.ops.mxfp4_gemm import triton_mxfp4 as tm

    print("| tiles | registers | smem bytes | MMA | K-loop instructions per weight per thread | top ops |")
    print("|---|---|---|---|---|---|")
    import dataclasses

    for label, t in [("decode", tm.DECODE_TILES), ("mid", tm.MID_TILES), ("prefill", tm.PREFILL_TILES)]:
        print(sass_row(label + ", official layout", t), flush=True)
        print(sass_row(label + ", kernel order", dataclasses.replace(t, perm=4, bk=max(64, t.bk))), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="k3-small,kimi-k3")
    ap.add_argument("--batches", default="1,2,4,8,16,32,64", help="decode batch sizes (tokens)")
    ap.add_argument("--prefill", default="8192", help="prefill token counts")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, reference path")
    ap.add_argument("--model", default="k3-small", help="preset for the model forward timing ('' = skip)")
    ap.add_argument("--sweep", nargs="?", const="all", choices=["all", "prefill"],
                    help="also time candidate tiles and print the best (at every token count, or prefill only)")
    ap.add_argument("--eager", action="store_true", help="time eager calls instead of CUDA graphs")
    ap.add_argument("--inner", type=int, default=10, help="calls per CUDA graph replay")
    ap.add_argument("--sass", action="store_true", help="compile for sm_90 (no GPU) and print the K loop's SASS")
    args = ap.parse_args(argv)
    if args.sass:
        sass_report()
        return 0
    TIMING.update(graphs=not args.eager, inner=max(1, args.inner))
    dev = "cpu" if args.smoke else "cuda"
    if dev == "cuda" and not torch.cuda.is_available():
        print("error: needs CUDA (or --smoke)", file=sys.stderr)
        return 2
    shapes = ["smoke"] if args.smoke else args.shapes.split(",")
    token_counts = [(f"decode {b}", int(b)) for b in args.batches.split(",") if b]
    token_counts += [(f"prefill {p}", int(p)) for p in args.prefill.split(",") if p]
    reps = 2 if args.smoke else args.reps
    gen = torch.Generator().manual_seed(0)
    timing = "eager calls" if args.eager or dev == "cpu" else f"CUDA graphs of {TIMING['inner']} calls"
    print(f"device: {torch.cuda.get_device_name() if dev == 'cuda' else 'cpu (smoke)'}; timing: {timing}")
    print("| shape | matrix | tokens | rows | bf16 ms | mxfp4 ms | speed-up | mxfp4 official layout ms | speed-up "
          "| mxfp4 GB/s (active experts) | memory ratio | max rel. diff | mxfp4 path (kernel order) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in shapes:
        if name not in SHAPES:
            print(f"error: unknown shape {name!r}; known: {sorted(SHAPES)}", file=sys.stderr)
            return 2
        E, k, mats = SHAPES[name]
        for mat, (N, K) in mats.items():
            bench_matrix(name, mat, E, k, N, K, token_counts, reps, dev, gen, args.sweep)
            if dev == "cuda":  # the matrix's tensors died with bench_matrix's frame
                torch.cuda.empty_cache()
    if args.model:
        model_step("k3-tiny" if args.smoke else args.model, [int(b) for b in args.batches.split(",") if b],
                   reps, dev)
    return 0


if __name__ == "__main__":
    sys.exit(main())
