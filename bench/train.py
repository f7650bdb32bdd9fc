"""Training throughput and MFU of a K3 preset (default k3-small) on one GPU.

One run prints, for each sequence length: tokens/s, model TFLOP/s, MFU against the measured H200
bf16 roofline (790 TFLOP/s) and against the 989 TFLOP/s datasheet peak, step time, and Muon's share of it; with the Triton KDA kernels and,
as the in-run baseline, with the chunked PyTorch KDA backend.

    python bench/train.py                       # k3-small, T = 4096 and 8192, on CUDA
    python bench/train.py --compile             # the same with the compiled elementwise regions
    python bench/train.py --accum 1,4           # also 4 micro-batches of --tokens per optimizer step
    python bench/train.py --tiny --device cpu   # smoke run of the same code path

FLOPs per token (training = 3 x forward), counted from the config with the spec's k3 MFU convention
(shared/spec benchmarks.md section 3; k3/train/flops.py, which `k3 train` logs with too):
    matmuls  2 * (active parameters without the input embedding)
    MLA      per layer 2 * H * (qk_dim + v_dim) * T / 2          (causal average over the context;
                                                                  per document with --doc-mean)
    KDA      per layer H * (6 * K^2 + 3 * C * K + C^2), C = 64     (chunked kernels, K = V)
Variants (--embed-dtype, --situ, --attnres, --combine, --route, --ce, --mlakv) run in one process after the default, with a
speed-vs-default column; --doc-mean packs documents of random lengths as a real corpus does.
(Before 2026-12-01 06:30 UTC the KDA term was 2 * H * (4 * K * V + C * (K + V)): 0.54% more FLOPs per
token for k3-small at T 8192, so the MFU values measured earlier are that much higher.)
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch

from k3.config import get_preset
from k3.model.causal_lm import K3ForCausalLM
from k3.kernel_config import KernelConfig
from k3.model.compile import compile_model, set_kernel_config
from k3.optim import HeadGeometry, PerHeadMuon, build_param_groups
from k3.train import flops as train_flops

ROOFLINE_BF16 = 790e12  # measured H200 bf16 matmul ceiling
PEAK_BF16 = train_flops.PEAK_BF16["H200"]  # dense bf16 datasheet peak (torchtitan / Megatron MFU convention)


def flops_per_token(model: K3ForCausalLM, seq_len: int, doc_lens: list[int] | None = None) -> float:
    """Training FLOPs per token (k3.train.flops); with doc_lens MLA attends within each document."""
    return train_flops.flops_per_token(model.config.text_config, model.num_parameters()[1], seq_len, doc_lens)


def _median(xs: list[float]) -> float:
    """The middle value (the upper one of an even count), as every timing of this script reports."""
    return sorted(xs)[len(xs) // 2]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def document_offsets(rows: int, seq_len: int, mean_len: int, seed: int = 0) -> torch.Tensor:
    """cu_seqlens of packed rows holding documents of random lengths (exponential, mean `mean_len`, at
    least 1 token), cut at every row end as the trainer packs them."""
    g = torch.Generator().manual_seed(seed)
    cuts = [0]
    for r in range(rows):
        pos, end = r * seq_len, (r + 1) * seq_len
        while pos < end:
            n = max(1, int(torch.empty(1).exponential_(1.0 / mean_len, generator=g)))
            pos = min(end, pos + n)
            cuts.append(pos)
    return torch.tensor(cuts, dtype=torch.int32)


# (flag, KernelConfig field, table column) of the regions with a Triton and a torch version
REGIONS = (("--situ", "situ", "SiTU"), ("--attnres", "attn_res", "AttnRes"), ("--combine", "moe_combine", "combine"),
           ("--dispatch", "moe_dispatch", "dispatch"), ("--route", "moe_route", "routing"),
           ("--ce", "cross_entropy", "loss"), ("--mlakv", "mla_kv", "MLA k/v"))


def bench(model, opt, seq_len: int, tokens: int, steps: int, device, backend: str, accum: int = 1,
          embed: str = "bf16", regions: dict[str, str] | None = None, doc_mean: int = 0,
          step_weights: bool = True) -> dict:
    """One optimizer step = `accum` forward/backward passes of `tokens` tokens each; embed: the dtype
    the token embeddings enter the residual stream in under autocast ("bf16" = k3's default,
    "fp32" = `K3Model.fp32_embeddings`, k3 before 2026-12-01); regions: KernelConfig field of REGIONS ->
    "triton" / "torch" (unset: torch); doc_mean > 0: documents of random lengths (that mean) in
    the rows."""
    model.set_kda_backend(backend)
    model.model.fp32_embeddings = embed == "fp32"
    regions = {var: (regions or {}).get(var, "torch") for _, var, _ in REGIONS}
    set_kernel_config(model, KernelConfig(**regions))
    B = max(1, tokens // seq_len)
    vocab = model.config.text_config.vocab_size
    ids = torch.randint(0, vocab, (1, B * seq_len + 1), device=device)
    cu = torch.arange(0, B * seq_len + 1, seq_len, dtype=torch.int32)  # host offsets, as the trainer passes
    if doc_mean:
        cu = document_offsets(B, seq_len, doc_mean)
    doc_lens = (cu[1:] - cu[:-1]).tolist()
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    step_t, opt_t = [], []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    cuda = device.type == "cuda"
    mb_ms: list[list[float]] = []  # device time of each micro-batch (CUDA events), per timed step
    for i in range(steps + 2):  # two warm-up steps
        sync(device)
        t0 = time.perf_counter()
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(accum + 1)] if cuda else []
        with model.step_weights() if step_weights else contextlib.nullcontext():  # as `k3 train` on one GPU
            for j in range(accum):
                if marks:
                    marks[j].record()
                with amp:
                    loss = model(ids[:, :-1], labels=ids[:, 1:], cu_seqlens=cu, return_logits=False).loss
                (loss / accum).backward()
            if marks:
                marks[accum].record()
        sync(device)
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        t2 = time.perf_counter()
        if i >= 2:
            step_t.append(t2 - t0)
            opt_t.append(t2 - t1)
            if marks:
                mb_ms.append([a.elapsed_time(b) for a, b in zip(marks, marks[1:])])
    step, muon = _median(step_t), _median(opt_t)
    if mb_ms:  # where a step's time goes: first micro-batch (expert weight copies, fresh .grad), the rest, the rest of the step
        rest = sorted(x for m in mb_ms for x in m[1:]) or [float("nan")]
        print(f"# T {seq_len} x {accum}: micro-batch ms (device events, median) first {_median([m[0] for m in mb_ms]):.1f}, "
              f"others {_median(rest):.1f} (min {rest[0]:.1f}, max {rest[-1]:.1f}); step {step * 1e3:.1f} "
              f"= micro-batches {_median([sum(m) for m in mb_ms]):.1f} + optimizer {muon * 1e3:.1f} + the rest",
              flush=True)
    tok_s = accum * B * seq_len / step
    tflops = tok_s * flops_per_token(model, seq_len, doc_lens) / 1e12
    return {"backend": backend, "embed": embed, "regions": regions, "docs": len(doc_lens), "T": seq_len, "B": B, "accum": accum, "step_ms": step * 1e3, "tok_s": tok_s,
            "tflops": tflops, "mfu": tflops * 1e12 / ROOFLINE_BF16, "mfu_peak": tflops * 1e12 / PEAK_BF16, "opt_share": muon / step,
            "peak_gb": torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else float("nan")}


def _variants(embed: str, regions: dict[str, str]) -> list[tuple[str, dict[str, str]]]:
    """The (embeddings dtype, {KernelConfig field: implementation}) combinations to time: the first of each
    comma-separated list (the default), then each listed alternative alone, then all the regions'
    alternatives together when several regions have one (not the full product: each run costs
    warm-up steps). regions: flag of REGIONS -> its list."""
    lists = {"--embed-dtype": embed.split(",")} | {flag: regions[flag].split(",") for flag, _, _ in REGIONS}
    for flag, values in lists.items():
        allowed = ("bf16", "fp32") if flag == "--embed-dtype" else ("triton", "torch")
        bad = [v for v in values if v not in allowed]
        if bad:
            raise SystemExit(f"{flag}: expected one of {allowed}, got {bad}")
    env = {flag: var for flag, var, _ in REGIONS}
    first = {env[f]: v[0] for f, v in lists.items() if f in env}
    out = [(e, first) for e in lists["--embed-dtype"]]
    alts = [(env[f], x) for f, v in lists.items() if f in env for x in v[1:]]
    out += [(lists["--embed-dtype"][0], first | {var: x}) for var, x in alts]
    if len({var for var, _ in alts}) > 1:
        out.append((lists["--embed-dtype"][0], first | dict(alts)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="k3-small")
    ap.add_argument("--tiny", action="store_true", help="k3-tiny, short sequences (smoke test)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seq-lens", default=None, help="comma-separated (default 4096,8192; tiny 64,128)")
    ap.add_argument("--tokens", default=None,
                    help="comma-separated tokens per micro-batch (default 16384; tiny 256)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--backends", default=None, help="comma-separated KDA backends (default triton,torch on CUDA)")
    ap.add_argument("--accum", default="1", help="comma-separated micro-batches (of --tokens each) per optimizer step")
    ap.add_argument("--embed-dtype", default="bf16",
                    help="comma-separated dtypes of the embeddings in the residual stream under autocast: bf16 (default), fp32")
    for flag, var, col in REGIONS:
        ap.add_argument(flag, default=None,
                        help=f"comma-separated {col} implementations (KernelConfig.{var}): triton, torch (the "
                             "torch regions); default: the model's own choice on this device (\"auto\")")
    ap.add_argument("--doc-mean", type=int, default=0,
                    help="documents of random lengths with this mean (tokens) packed in the rows, as real corpora "
                         "give (MLA then attends per document; FLOPs counted per document); 0 = one per row")
    ap.add_argument("--compile", action="store_true", help="torch.compile the per-layer elementwise regions")
    ap.add_argument("--no-step-weights", action="store_true",
                    help="autograd's per-micro-batch weight casts instead of K3ForCausalLM.step_weights()")
    ap.add_argument("--lr", type=float, default=1e-3,
                    help="optimizer learning rate (0: the weights, so the routing, stay as initialised)")
    ap.add_argument("--compile-backend", default="inductor", help="torch.compile backend (with --compile)")
    args = ap.parse_args()
    device = torch.device(args.device)
    preset = "k3-tiny" if args.tiny else args.preset
    seq_lens = [int(s) for s in (args.seq_lens or ("64,128" if args.tiny else "4096,8192")).split(",")]
    token_list = [int(t) for t in (args.tokens or ("256" if args.tiny else "16384")).split(",")]
    backends = (args.backends or ("triton,torch" if device.type == "cuda" else "torch")).split(",")
    torch.manual_seed(0)
    model = K3ForCausalLM(get_preset(preset)).init_weights(seed=0).to(device)
    if args.compile:
        compile_model(model, backend=args.compile_backend, dynamic=False)  # as `k3 train`: one compile per shape
    geom = HeadGeometry.from_config(model.config.text_config)
    opt = PerHeadMuon(build_param_groups(model, geom, lr=args.lr, weight_decay=0.1))
    total, active = model.num_parameters()
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"# {preset}: {total / 1e9:.3f}B total, {active / 1e9:.3f}B active; {name}; torch {torch.__version__}; "
          f"{'/'.join(map(str, token_list))} tokens per micro-batch; median of {args.steps} steps; "
          f"{'compiled regions (' + args.compile_backend + ')' if args.compile else 'eager'}")
    cols = " | ".join(col for _, _, col in REGIONS)
    print(f"| KDA backend | embeddings | {cols} | documents | T | B | micro-batches | step ms | tokens/s | TFLOP/s "
          "| MFU (790) | MFU (989) | optimizer share | peak GB | speed vs default |")
    print("|---|---|" + "---|" * len(REGIONS) + "---:|" * 12)
    # the model's own choice per device ("auto"): Triton for every region when training on CUDA
    own = {var: "triton" if device.type == "cuda" else "torch" for _, var, _ in REGIONS}
    variants = _variants(args.embed_dtype, {flag: getattr(args, flag[2:]) or own[var] for flag, var, _ in REGIONS})
    runs = [(T, tokens, be, int(a), *v) for T in seq_lens for tokens in token_list for be in backends
            for a in args.accum.split(",") for v in variants]
    base: dict[tuple, float] = {}  # step time of the default variant of each (T, backend, accum)
    for T, tokens, be, accum, res, regions in runs:
        impls = " | ".join(regions[var] for _, var, _ in REGIONS)
        try:
            r = bench(model, opt, T, tokens, args.steps, device, be, accum, res, regions, args.doc_mean,
                      not args.no_step_weights)
        except Exception as e:  # noqa: BLE001 - one failing variant (e.g. a kernel that does not compile) must not cost the others
            opt.zero_grad(set_to_none=True)
            print(f"| {be} | {res} | {impls} | | {T} | | {accum} | FAILED: {type(e).__name__}: "
                  f"{str(e).splitlines()[0][:120] if str(e) else ''} | | | | | | | |", flush=True)
            continue
        ref = base.setdefault((T, tokens, be, accum), r["step_ms"])  # the first variant of a group is the default
        print(f"| {r['backend']} | {r['embed']} | {impls} | {r['docs']} | {r['T']} | {r['B']} | "
              f"{r['accum']} | {r['step_ms']:.1f} | {r['tok_s']:,.0f} | {r['tflops']:.1f} | {r['mfu']:.1%} | "
              f"{r['mfu_peak']:.1%} | {r['opt_share']:.1%} | {r['peak_gb']:.1f} | {ref / r['step_ms']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
