"""MLA decode attention: the paged Triton kernel vs the gather + dense path, as the serving decode step
runs them (one GatedMLA layer's attention, weight absorption included, captured in a CUDA graph).

gather: `StaticDecodeCache.mla_append` + `GatedMLA._absorbed` — the rows' page tables padded to the
        power-of-two page bucket, every latent row of the bucket gathered into a dense tensor, masked
        fp32 attention (the reference path).
paged:  `StaticDecodeCache.mla_write` + `GatedMLA._absorbed_paged` — `k3.ops.mla_decode.paged_mla_decode`
        reads only each row's valid pages in place.
kernel: `paged_mla_decode` alone (no absorption einsums).

Rows: B in --batches, context in --contexts; `full` = every row at the context length, `mixed` =
lengths uniform in [1, context] (the bucket is the same, the useful bytes halve). GB/s = bytes of the
latent rows the lengths require (sum(lens) * (kv_lora + rope) * 2) / time, for every path, so the
gather path's figure is an effective one; %peak against 4.3 TB/s. Times: triton.testing.do_bench
median of graph replays (L2 flushed between runs). k3-small MLA geometry by default.

    PYTHONPATH=$PWD python bench/mla_decode.py            # H200: about a minute
    PYTHONPATH=$PWD python bench/mla_decode.py --preset k3 --batches 1,8 --contexts 8192
    python bench/mla_decode.py --device cpu --preset k3-tiny --batches 2 --contexts 40 --page-size 16  # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

if not torch.cuda.is_available():  # the CPU smoke run: Triton's interpreter, set before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from k3.config import get_preset  # noqa: E402
from k3.model.mla import GatedMLA  # noqa: E402
from k3.ops.mla_decode import default_num_splits, paged_mla_decode  # noqa: E402
from k3.serve.cache_manager import BlockPool, CacheLayout, StaticDecodeCache  # noqa: E402
from k3.serve.model_runner import bucket_sizes  # noqa: E402

PEAK_BW = 4.3e12


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="k3-small")
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--contexts", default="1024,8192,32768")
    p.add_argument("--lengths", default="full,mixed", help="comma list of: full, mixed")
    p.add_argument("--page-size", type=int, default=256)
    p.add_argument("--splits", type=int, default=None, help="force num_splits (default: the heuristic)")
    p.add_argument("--rep-ms", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run (interpreter, eager timing)")
    return p.parse_args(argv)


class Case:
    """One decode step's MLA inputs over a one-layer block pool: B rows of the given lengths (the new
    token included), page tables padded to the runner's page bucket, block 0 = padding."""

    def __init__(self, attn: GatedMLA, layout: CacheLayout, lens: list[int], gen: torch.Generator) -> None:
        page, dev = layout.page_size, attn.kv_b_proj.weight.device
        need = [layout.pages_for(n) for n in lens]
        width = next(b for b in bucket_sizes(max(need)) if b >= max(need))
        self.pool = BlockPool(layout, 1 + sum(need), dev)
        self.pool.pages[1:].normal_()  # on the device, from the seeded global generator
        blocks = iter(torch.randperm(sum(need), generator=gen).add(1).tolist())
        tables = [[next(blocks) for _ in range(n)] + [0] * (width - n) for n in need]
        self.tables = torch.tensor(tables, device=dev)
        self.past = torch.tensor(lens, device=dev) - 1  # the token being decoded is the last one
        self.valid = torch.ones(len(lens), dtype=torch.bool, device=dev)
        self.slots = torch.zeros(len(lens), layout.slot_blocks, dtype=torch.long, device=dev)
        heads, qk = attn.num_heads, attn.nope + attn.rope
        self.q = torch.randn(len(lens), 1, heads, qk, generator=gen).to(dev, layout.dtype)
        self.lat = torch.randn(len(lens), 1, layout.latent_dim, generator=gen).to(dev, layout.dtype)
        self.lens, self.width, self.page = lens, width, page

    def cache(self, paged: bool) -> StaticDecodeCache:
        return StaticDecodeCache(self.pool, self.past, self.tables, self.slots, self.valid, paged_mla=paged)


def gather_step(attn: GatedMLA, case: Case) -> torch.Tensor:
    cache = case.cache(False)
    buf = cache.mla_append(attn.layer_idx, case.lat, None)
    kpos = torch.arange(buf.shape[1], device=buf.device)
    mask = kpos[None, None, :] <= case.past[:, None, None]
    return attn._absorbed(case.q, buf, mask)


def paged_step(attn: GatedMLA, case: Case, splits: int | None) -> torch.Tensor:
    pages, tables, lens = case.cache(True).mla_write(attn.layer_idx, case.lat)
    if splits is None:
        return attn._absorbed_paged(case.q, pages, tables, lens)
    q_nope, q_pe = case.q[:, 0].split([attn.nope, attn.rope], dim=-1)
    w_uk, w_uv = attn._absorb_weights()
    q_lat = torch.einsum("nhd,hdr->nhr", q_nope.float(), w_uk.float())
    o = paged_mla_decode(q_lat, q_pe, pages, tables, lens, attn.scale, splits)
    return torch.einsum("nhr,hvr->nhv", o, w_uv.float()).to(case.q.dtype)[:, None]


def kernel_only(attn: GatedMLA, case: Case, splits: int | None):
    pages, tables, lens = case.cache(True).mla_write(attn.layer_idx, case.lat)
    q_lat = torch.randn(case.q.shape[0], attn.num_heads, attn.kv_lora_rank, device=case.q.device)
    q_pe = case.q[:, 0, :, attn.nope:]
    return lambda: paged_mla_decode(q_lat, q_pe, pages, tables, lens, attn.scale, splits)


def graph_time(fn, rep_ms: int) -> tuple[float, torch.Tensor]:
    """Median ms of a CUDA-graph replay of fn (warm-up run first: compilation, workspaces); on CPU the
    median of three eager runs."""
    import triton.testing

    out = fn()
    if not out.is_cuda:
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            out = fn()
            times.append(1e3 * (time.perf_counter() - t0))
        return sorted(times)[1], out
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    ms = triton.testing.do_bench(graph.replay, warmup=10, rep=rep_ms, return_mode="median")
    return ms, out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: pass --device cpu for a smoke run")
    cfg = get_preset(args.preset).text_config
    mla_layer = next(i for i in range(cfg.num_hidden_layers) if cfg.is_mla(i))
    torch.manual_seed(args.seed)
    attn = GatedMLA(cfg, mla_layer).to(dev, torch.bfloat16).eval()
    layout = CacheLayout(mla_layers=(mla_layer,), kda_layers=(), page_size=args.page_size,
                         latent_dim=cfg.kv_lora_rank + cfg.qk_rope_head_dim, kda_heads=1, kda_head_dim=1,
                         conv_width=2, dtype=torch.bfloat16)
    row_bytes = layout.latent_dim * 2
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (Triton interpreter)"
    print(f"# {name} | {args.preset}: {attn.num_heads} heads, latent {cfg.kv_lora_rank} "
          f"+ rope {cfg.qk_rope_head_dim}, bf16, page {args.page_size} | torch {torch.__version__}", flush=True)
    head = ["B", "context", "lengths", "bucket tokens", "splits", "gather ms", "paged ms", "kernel ms",
            "paged GB/s", "kernel GB/s", "kernel %peak", "gather GB/s", "speed-up", "max |diff|"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    t_start = time.perf_counter()
    gen = torch.Generator().manual_seed(args.seed)
    for ctx in (int(c) for c in args.contexts.split(",")):
        for B in (int(b) for b in args.batches.split(",")):
            for kind in args.lengths.split(","):
                lens = [ctx] * B if kind == "full" else torch.randint(1, ctx + 1, (B,), generator=gen).tolist()
                case = Case(attn, layout, lens, gen)
                with torch.inference_mode():
                    t_g, o_g = graph_time(lambda: gather_step(attn, case), args.rep_ms)
                    t_p, o_p = graph_time(lambda: paged_step(attn, case, args.splits), args.rep_ms)
                    t_k, _ = graph_time(kernel_only(attn, case, args.splits), args.rep_ms)
                nbytes = sum(lens) * row_bytes
                splits = args.splits or default_num_splits(B, attn.num_heads, case.width * case.page, dev)
                row = {"B": B, "context": ctx, "lengths": kind, "bucket_tokens": case.width * case.page,
                       "splits": splits, "gather_ms": round(t_g, 4), "paged_ms": round(t_p, 4),
                       "kernel_ms": round(t_k, 4), "paged_GBs": round(nbytes / t_p / 1e6, 1),
                       "kernel_GBs": round(nbytes / t_k / 1e6, 1), "kernel_pct_peak": round(100 * nbytes / t_k / 1e-3
                                                                                            / PEAK_BW, 1),
                       "gather_GBs": round(nbytes / t_g / 1e6, 1), "speedup": round(t_g / t_p, 2),
                       "max_abs_diff": float((o_g.float() - o_p.float()).abs().max())}
                print(json.dumps(row), flush=True)
                lines.append("| " + " | ".join(str(v) if not isinstance(v, float) or k != "max_abs_diff"
                                               else f"{v:.1e}" for k, v in row.items()) + " |")
                del case
                torch.cuda.empty_cache()
    print("\n".join(lines))
    print(f"# total {time.perf_counter() - t_start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
