"""MXFP4 grouped GEMM (k3.ops.mxfp4_gemm, weights dequantised in registers) vs bf16 torch._grouped_mm.

For each expert shape (k3-small: 64 experts top-8, w13 [1024, 512], w2 [512, 512]; kimi-k3: 896 experts
top-16, w13 [6144, 3584], w2 [3584, 3072]) and each token count (decode batches 1..64, prefill), tokens
are routed uniformly at random to top-k distinct experts, and both GEMMs run on the same expert-sorted
rows: bf16 `torch._grouped_mm(x, w^T)` with the bf16 weights, and `mxfp4_grouped_mm` with the packed
weights (every expert allocated, so weight reads come from HBM, not L2). One matrix is resident at a
time (kimi-k3 w13 in bf16 is 39 GB). Outputs are checked against each other (bf16 rounding only: the
bf16 weights are the decoded MXFP4 weights).

Prints a markdown table: ms per GEMM, speed-up of MXFP4 over bf16, and the expert-memory ratio
(bf16 bytes / packed + scale bytes = 16 / 4.25); then the forward time of a model (`--model`, default
k3-small, random weights) on [B, 1] tokens with bf16 vs packed MXFP4 experts.

Usage: python bench/mxfp4_gemm.py [--shapes k3-small,kimi-k3] [--batches 1,2,4,8,16,32,64]
       [--prefill 8192] [--reps 50]
       python bench/mxfp4_gemm.py --smoke     # CPU: tiny shapes, reference path, correctness only
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


def timed(fn, reps: int, dev: str) -> float:
    """Median ms of `fn` over reps (CUDA events on GPU, perf_counter on CPU)."""
    fn()
    times = []
    for _ in range(reps):
        if dev == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def bench_matrix(name: str, mat: str, E: int, k: int, N: int, K: int, token_counts: list[tuple[str, int]],
                 reps: int, dev: str, gen: torch.Generator) -> list[str]:
    packed = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, device=dev)
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
        new = lambda: mxfp4_grouped_mm(x, packed, scale, offs)  # noqa: E731
        y_ref, y_new = ref().float(), new().float()
        err = ((y_new - y_ref).abs().max() / y_ref.abs().max().clamp_min(1e-30)).item()
        if err > 2e-2:
            raise AssertionError(f"{name} {mat} {label}: MXFP4 GEMM differs from bf16 by {err:.2e} (relative)")
        t_ref, t_new = timed(ref, reps, dev), timed(new, reps, dev)
        gbs = (packed.numel() + scale.numel()) * (int((offs.diff(prepend=offs.new_zeros(1)) > 0).sum()) / E) / t_new / 1e6
        rows.append(f"| {name} | {mat} [{N}, {K}] | {label} | {S} | {t_ref:.4f} | {t_new:.4f} | "
                    f"{t_ref / t_new:.2f}x | {gbs:.0f} | {ratio:.2f}x | {err:.1e} |")
        print(rows[-1], flush=True)
    return rows


def model_step(preset: str, batches: list[int], reps: int, dev: str) -> None:
    """Forward time of `preset` (random weights, bf16) on [B, 1] tokens, experts bf16 vs packed MXFP4: the
    per-token work of a decode step without the cache (attention over one token), so the difference is
    the routed experts'."""
    from k3.config import get_preset
    from k3.model.causal_lm import K3ForCausalLM
    from k3.model.moe import pack_routed_experts

    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    model = K3ForCausalLM(get_preset(preset)).init_weights(seed=0).to(dtype).to(dev).eval()
    ids = {b: torch.randint(0, 1000, (b, 1), device=dev) for b in batches}
    with torch.no_grad():
        t_bf16 = {b: timed(lambda: model(ids[b]).logits, reps, dev) for b in batches}
        ref = {b: model(ids[b]).logits.float() for b in batches}
        pack_routed_experts(model)  # PTQ of the random weights: logits differ by the rounding only
        t_fp4 = {b: timed(lambda: model(ids[b]).logits, reps, dev) for b in batches}
        agree = {b: float((model(ids[b]).logits.float().argmax(-1) == ref[b].argmax(-1)).float().mean())
                 for b in batches}
    print(f"\n{preset} forward of [B, 1] tokens (ms):\n| batch | bf16 experts | MXFP4 experts | speed-up | "
          "argmax agreement |\n|---|---|---|---|---|")
    for b in batches:
        print(f"| {b} | {t_bf16[b]:.3f} | {t_fp4[b]:.3f} | {t_bf16[b] / t_fp4[b]:.2f}x | {agree[b]:.2f} |", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="k3-small,kimi-k3")
    ap.add_argument("--batches", default="1,2,4,8,16,32,64", help="decode batch sizes (tokens)")
    ap.add_argument("--prefill", default="8192", help="prefill token counts")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, reference path")
    ap.add_argument("--model", default="k3-small", help="preset for the model forward timing ('' = skip)")
    args = ap.parse_args(argv)
    dev = "cpu" if args.smoke else "cuda"
    if dev == "cuda" and not torch.cuda.is_available():
        print("error: needs CUDA (or --smoke)", file=sys.stderr)
        return 2
    shapes = ["smoke"] if args.smoke else args.shapes.split(",")
    token_counts = [(f"decode {b}", int(b)) for b in args.batches.split(",") if b]
    token_counts += [(f"prefill {p}", int(p)) for p in args.prefill.split(",") if p]
    reps = 2 if args.smoke else args.reps
    gen = torch.Generator().manual_seed(0)
    print(f"device: {torch.cuda.get_device_name() if dev == 'cuda' else 'cpu (smoke)'}")
    print("| shape | matrix | tokens | rows | bf16 ms | mxfp4 ms | speed-up | mxfp4 GB/s (active experts) "
          "| memory ratio | max rel. diff |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in shapes:
        if name not in SHAPES:
            print(f"error: unknown shape {name!r}; known: {sorted(SHAPES)}", file=sys.stderr)
            return 2
        E, k, mats = SHAPES[name]
        for mat, (N, K) in mats.items():
            bench_matrix(name, mat, E, k, N, K, token_counts, reps, dev, gen)
            if dev == "cuda":  # the matrix's tensors died with bench_matrix's frame
                torch.cuda.empty_cache()
    if args.model:
        model_step("k3-tiny" if args.smoke else args.model, [int(b) for b in args.batches.split(",") if b],
                   reps, dev)
    return 0


if __name__ == "__main__":
    sys.exit(main())
