"""Issue #31's acceptance shapes, k3 against fla in one process: times, per-kernel profile, roofline fractions.

Shapes (bf16, D = K = V = 128):
  h96      B1 T8192 H96
  k3small  B1 T65536 H8, 8 packed documents of 8192 (k3-small's micro-batch)
Modes:
  fwd      training forward (inputs require grad: k3 stores its intermediates for the backward)
  nograd   forward under torch.no_grad
  fwdbwd   forward + backward (the inputs' .grad reset to None before each run: no accumulation kernel)
  prefill  inference mode, gate in the kernel (A_log, dt_bias), sigmoid beta, final state
Pre-gated modes use fla's calling convention: g = logsigmoid(randn) clamped to the declared bound -5,
beta = sigmoid(randn), q / k L2-normalised in the kernel (fla with safe_gate=True, lower_bound=-5).

For each (shape, mode): k3 and fla medians (`triton.testing.do_bench`), the ratio fla / k3 against the
issue's target (fwd / nograd / prefill 2.0x, fwdbwd 1.6x), and with --profile the device time of every
kernel of one call (torch.profiler, CUDA activity), for k3's kernels with a cost model (`k3_costs`:
compulsory DRAM bytes and tensor FLOPs per (chunk, head) tile) -> achieved GB/s, TFLOP/s and the
fraction of the roofline: max(bytes / HBM, bf16 FLOPs / 790 T + tf32 FLOPs / 395 T) / measured time.
fla's kernels get their times only (their cost model is not ours to write).

fla autotunes every kernel at its first call (minutes at these shapes, mostly compiling its candidate
configurations); `--fla-precompile N` compiles them first in N parallel processes (`fla_precompile`), so
that the timed process only benchmarks them.  `--fla-tuned FILE` replays the
configurations fla chose in an earlier process (`--fla-dump FILE` writes them, and the script prints them
as one `FLA_TUNED_JSON` line), so a later run on the same GPU model times fla's own choice without the
warm-up.

Usage:  PYTHONPATH=$PWD:/tmp/fla_site python bench/kda_profile.py [--shapes h96,k3small]
            [--modes fwd,nograd,fwdbwd,prefill] [--profile] [--fla-tuned FILE] [--no-fla]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench._harness import BF16_ROOF  # noqa: E402

SHAPES = {"h96": ([8192], 96), "k3small": ([8192] * 8, 8)}
TARGET = {"fwd": 2.0, "nograd": 2.0, "fwdbwd": 1.6, "prefill": 2.0}
TF32_ROOF = BF16_ROOF / 2  # tf32 tensor-core rate: half of bf16 on Hopper
D = 128


def log(*a):
    print(*a, flush=True)


def hbm_rate() -> tuple[float, str]:
    """Nominal HBM bandwidth of this GPU (bytes/s) and its name: H100 SXM 3.35 TB/s, H200 4.3 TB/s."""
    name = torch.cuda.get_device_name()
    return (4.3e12 if "H200" in name else 3.35e12), name


# ---------------------------------------------------------------------------------------------------
# cost model of k3's kernels (per call; compulsory bytes: every input read once, every output and
# scratch written once and scratch read back once; tf32x3 counts three tf32 products)

def k3_costs(n_tok: int, NC: int, H: int, K: int, V: int, *, training: bool, l2: bool, nvb_f: int,
             nvb_b: int, nk: int) -> dict[str, tuple[float, float, float]]:
    """{kernel: (bytes, bf16 FLOPs, tf32 FLOPs)} of one call.  NC chunks of 64 (padded), nvb_f / nvb_b
    value blocks of the forward / backward state scans (their key-side tiles are read once per block),
    nk key chunks of the backward key kernel."""
    n = NC * H  # (chunk, head) tiles
    b, f, R = 2, 4, 64
    c = {}
    c["_kda_fwd_keys"] = (n * (R * K * b + R * K * f + K * f), 0, 0)
    c["_kda_fwd_ap"] = (n * (2 * R * K * b + R * K * f + R * b + R * R * (b + f) + 2 * R * K * b + 256 * f),
                        0, n * 4 * 2 * R * K * 32)
    inv = 4 * 2 * R ** 3  # Td merge + N = Td L + three Horner products (64 x 64 x 64 each, tf32)
    c["_kda_fwd_finish"] = (n * (R * R * f * (2 if training else 1) + R * K * (b + f) + R * V * b + 256 * f
                                 + R * K * b + R * V * b), 0, n * (inv + 2 * R * R * (K + V)))
    c["_kda_fwd_state"] = (n * (nvb_f * (3 * R * K * b + R * R * b) + R * V * b + K * f + R * V * b
                                + ((K * V + R * V) * b if training else 0)), n * 2 * R * V * (3 * K + R), 0)
    c["_kda_bwd_state"] = (n * (R * V * b + nvb_b * (R * R * b + 3 * R * K * b + R * R * f) + K * f
                                + (K * V + 2 * R * V) * b), n * 2 * R * V * (R + 3 * K), n * 2 * R * R * V)
    c["_kda_bwd_values"] = (n * ((4 + l2) * R * V * b + (2 * R * K * b if l2 else 0) + 2 * R * R * f + 256 * f),
                            n * 4 * R * R * V, 0)
    c["_kda_bwd_keys"] = (n * (3 * R * K * b + 2 * R * R * f + 2 * K * V * b + 3 * R * V * b + 2 * 2 * R * K * f
                               + 3 * R * K * b + nk * 128 * f), n * 3 * 2 * R * K * V,
                          n * 3 * (32768 * K + 2 * R * R * K))
    c["_kda_bwd_finish"] = (n * (256 * f + nk * 128 * f + R * b + ((R * K * (b + f) + R * K * b) if l2 and nk > 1
                                                                  else 0)), 0, 0)
    return c


# ---------------------------------------------------------------------------------------------------
# fla's autotuned configurations: dump / replay

def _fla_autotuners():
    from triton.runtime.autotuner import Autotuner

    found = {}
    for mname, mod in list(sys.modules.items()):
        if not mname.startswith("fla.") or mod is None:
            continue
        for attr, obj in list(vars(mod).items()):
            seen = 0
            while obj is not None and seen < 4:
                if isinstance(obj, Autotuner):
                    found[f"{mname}.{attr}"] = obj
                    break
                obj, seen = getattr(obj, "fn", None), seen + 1
    return found


def fla_tuned_dump() -> dict:
    out = {}
    for name, at in _fla_autotuners().items():
        rows = []
        for key, cfg in at.cache.items():
            rows.append([list(key), dict(kwargs=cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                                         num_ctas=cfg.num_ctas, maxnreg=getattr(cfg, "maxnreg", None))])
        if rows:
            out[name] = rows
    return out


def fla_precompile(shapes: list[str], modes: list[str], workers: int) -> None:
    """Compile fla's autotune candidates in `workers` parallel processes, each autotuning a disjoint slice of
    every autotuner's configurations on the same inputs (filling Triton's on-disk compile cache; their
    choices, made on a shared GPU, are discarded), so that this process's own autotune finds every
    candidate compiled and only benchmarks them, alone on the GPU."""
    import subprocess

    t0 = time.time()
    cmd = [sys.executable, os.path.abspath(__file__), "--shapes", ",".join(shapes), "--modes", ",".join(modes)]
    procs = [subprocess.Popen(cmd + ["--fla-worker", f"{w}/{workers}"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL) for w in range(workers)]
    codes = [p.wait() for p in procs]
    log(f"fla: candidates compiled by {workers} processes in {time.time() - t0:.0f} s (exit codes {codes})")


def fla_worker(spec: str, shapes: list[str], modes: list[str], fck) -> None:
    w, n = (int(t) for t in spec.split("/"))
    for at in _fla_autotuners().values():
        at.configs = at.configs[w::n] or at.configs[:1]
    for shape in shapes:
        lengths, H = SHAPES[shape]
        for mode in modes:
            x = make_inputs(lengths, H, mode == "prefill")
            if mode in ("fwd", "fwdbwd"):
                for t in ("q", "k", "v", "g", "beta"):
                    x[t].requires_grad_()
            try:
                make_fns(x, mode, fck)["fla"]()
                torch.cuda.synchronize()
            except Exception:  # noqa: BLE001 - a worker only warms the compile cache
                pass
            del x
            torch.cuda.empty_cache()


def fla_tuned_load(path: str) -> int:
    """Put the configurations of an earlier run into fla's autotuner caches; returns how many."""
    import triton

    with open(path) as fh:
        saved = json.load(fh)
    tuners, count = _fla_autotuners(), 0
    for name, rows in saved.items():
        at = tuners.get(name)
        if at is None:
            continue
        for key, c in rows:
            kw = dict(num_warps=c["num_warps"], num_stages=c["num_stages"], num_ctas=c["num_ctas"])
            if c.get("maxnreg") is not None:
                kw["maxnreg"] = c["maxnreg"]
            at.cache[tuple(key)] = triton.Config(c["kwargs"], **kw)
            count += 1
    return count


# ---------------------------------------------------------------------------------------------------

def make_inputs(lengths: list[int], H: int, prefill: bool, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    T = sum(lengths)
    mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    x = dict(q=mk(1, T, H, D), k=mk(1, T, H, D), v=mk(1, T, H, D))
    cu_cpu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int64)
    x["cu"], x["cu_cpu"] = (cu_cpu.cuda(), cu_cpu) if len(lengths) > 1 else (None, None)
    if prefill:
        x["g"], x["beta"] = mk(1, T, H, D), mk(1, T, H)
        x["A_log"] = torch.zeros(H, device="cuda")
        x["dt_bias"] = torch.zeros(H * D, device="cuda")
    else:
        x["g"] = F.logsigmoid(torch.randn(1, T, H, D, device="cuda")).clamp_min(-5.0).to(torch.bfloat16)
        x["beta"] = torch.sigmoid(torch.randn(1, T, H, device="cuda")).to(torch.bfloat16)
    return x


def make_fns(x: dict, mode: str, fck) -> dict:
    """{"k3": fn, "fla": fn} computing one call of `mode` on x (fla absent without fck)."""
    from k3.ops.kda.chunk import chunk_kda

    kw = dict(use_qk_l2norm_in_kernel=True, lower_bound=-5.0, cu_seqlens=x["cu"], cu_seqlens_cpu=x["cu_cpu"])
    if mode == "prefill":
        kw.update(A_log=x["A_log"], dt_bias=x["dt_bias"], use_beta_sigmoid_in_kernel=True, output_final_state=True)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    impls = {"k3": lambda: chunk_kda(*args, **kw)}
    if fck is not None:
        extra = dict(use_gate_in_kernel=True) if mode == "prefill" else {}
        impls["fla"] = lambda: fck(*args, safe_gate=True, **extra, **kw)
    if mode == "fwdbwd":
        do = torch.randn_like(x["v"])
        return {n: (lambda fn=fn: fn()[0].backward(do)) for n, fn in impls.items()}
    if mode == "nograd":
        return {n: (lambda fn=fn: _no_grad(fn)) for n, fn in impls.items()}
    if mode == "prefill":
        return {n: (lambda fn=fn: _inference(fn)) for n, fn in impls.items()}
    return impls


def _no_grad(fn):
    with torch.no_grad():
        return fn()


def _inference(fn):
    with torch.inference_mode():
        return fn()


def kernel_times(fn, iters: int = 5) -> list[tuple[str, float, float]]:
    """[(kernel, us per call, launches per call)] of fn over `iters` calls, largest first."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if t > 0:
            rows.append((e.key, t / iters, e.count / iters))
    return sorted(rows, key=lambda r: -r[1])


def op_floor_ms(n_tok: int, H: int, mode: str, hbm: float) -> float:
    """The op's own roofline: q, k, v, g, beta read and o written once (a backward also reads do and the
    inputs and writes their five gradients), chunked-form FLOPs per head 6 T D^2 + 3 T 64 D + T 64^2
    (benchmarks.md section 3), three times that with the backward."""
    io = n_tok * H * (4 * D * 2 + 2 + D * 2)
    flops = H * (6 * n_tok * D * D + 3 * n_tok * 64 * D + n_tok * 64 * 64)
    if mode == "fwdbwd":
        io, flops = io + n_tok * H * (D * 2 + 2 * (4 * D * 2 + 2)), 3 * flops
    return max(io / hbm, flops / BF16_ROOF) * 1e3


def profile_table(label: str, rows, costs: dict | None, hbm: float) -> None:
    total = sum(t for _, t, _ in rows) or 1e-9
    log(f"  kernels of {label} (device time per call {total / 1e3:.3f} ms):")
    log("    | kernel | us | share | launches | GB/s | TFLOP/s | roofline frac | bound by |")
    log("    |---|---:|---:|---:|---:|---:|---:|---|")
    for name, us, cnt in rows[:14]:
        c = next((v for k, v in (costs or {}).items() if name == k or name.startswith(k + "_") or name == k[1:]), None)
        extra = "| | | | |"
        if c is not None:
            nbytes, f16, f32 = c
            t_mem, t_dot = nbytes / hbm, f16 / BF16_ROOF + f32 / TF32_ROOF
            s = us * 1e-6
            extra = (f"| {nbytes / s / 1e9:.0f} | {(f16 + f32) / s / 1e12:.1f} | {max(t_mem, t_dot) / s:.2f} | "
                     f"{'memory' if t_mem >= t_dot else 'tensor'} |")
        log(f"    | {name[:60]} | {us:.0f} | {us / total:.0%} | {cnt:.0f} {extra}")


def run(fck, shapes, modes, do_profile: bool, dump_path: str | None = None) -> list[dict]:
    from triton.testing import do_bench

    from k3.ops.kda import bwd_intra
    from k3.ops.kda.chunk import _fwd_state_tiles, _state_bv

    hbm, dev = hbm_rate()
    log(f"== issue #31 shapes, k3 vs fla (device {dev}; roofline {BF16_ROOF / 1e12:.0f} TFLOP/s bf16, "
        f"{TF32_ROOF / 1e12:.0f} tf32, HBM {hbm / 1e12:.2f} TB/s)")
    results = []
    for shape in shapes:
        lengths, H = SHAPES[shape]
        T, N = sum(lengths), len(lengths)
        NC = sum((n + 63) // 64 for n in lengths)
        for mode in modes:
            x = make_inputs(lengths, H, mode == "prefill")
            if mode in ("fwd", "fwdbwd"):
                for n in ("q", "k", "v", "g", "beta"):
                    x[n].requires_grad_()
            fns = make_fns(x, mode, fck)
            leaves = [x[n] for n in ("q", "k", "v", "g", "beta")] if mode == "fwdbwd" else None
            times = {}
            for impl, fn in fns.items():
                t0 = time.time()
                try:
                    fn()
                    torch.cuda.synchronize()
                    first = time.time() - t0
                    times[impl] = do_bench(fn, warmup=25, rep=100, grad_to_none=leaves)
                    log(f"  {shape} {mode} {impl}: {times[impl]:.3f} ms (first call {first:.1f} s)")
                except Exception as e:  # noqa: BLE001 - report, go on with the other implementation
                    log(f"  {shape} {mode} {impl}: {type(e).__name__}: {str(e)[:200]}")
                if impl == "fla" and dump_path:
                    with open(dump_path, "w") as fh:
                        json.dump(fla_tuned_dump(), fh, default=str)
            k3t, flt = times.get("k3"), times.get("fla")
            ratio = flt / k3t if k3t and flt else None
            floor = op_floor_ms(T, H, mode, hbm)
            log(f"  {shape} {mode} floor (inputs and outputs once, {BF16_ROOF / 1e12:.0f} TFLOP/s): {floor:.3f} ms; "
                + ", ".join(f"{i} at {floor / t:.2f} of it" for i, t in times.items()))
            res = dict(shape=shape, mode=mode, k3=k3t, fla=flt, ratio=ratio, target=TARGET[mode])
            results.append(res)
            if ratio is not None:
                log(f"  -> {shape} {mode}: fla / k3 = {ratio:.2f}x (target {TARGET[mode]}x: "
                    f"{'met' if ratio >= TARGET[mode] else 'missed'})")
            if do_profile:
                training = mode in ("fwd", "fwdbwd")
                nvb_f = D // _fwd_state_tiles(D, N * H)[0]
                nvb_b = D // _state_bv(D, N * H)
                costs = k3_costs(T, NC, H, D, D, training=training, l2=True, nvb_f=nvb_f, nvb_b=nvb_b,
                                 nk=D // bwd_intra.split_tiles(D)[0])
                if mode != "fwdbwd":
                    costs = {k: v for k, v in costs.items() if "_bwd_" not in k}
                for impl, fn in fns.items():
                    if impl in times:
                        if leaves:
                            for t in leaves:
                                t.grad = None
                        profile_table(f"{impl} {shape} {mode}", kernel_times(fn), costs if impl == "k3" else None, hbm)
            del fns, x
            torch.cuda.empty_cache()
    log("\n| shape | mode | k3 ms | fla ms | fla / k3 | target |")
    log("|---|---|---:|---:|---:|---:|")
    f = lambda v, p=3: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
    for r in results:
        log(f"| {r['shape']} | {r['mode']} | {f(r['k3'])} | {f(r['fla'])} | {f(r['ratio'], 2)} | {r['target']} |")
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="h96,k3small")
    ap.add_argument("--modes", default="fwd,fwdbwd,prefill,nograd")
    ap.add_argument("--profile", action="store_true", help="per-kernel device times and roofline fractions")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--fla-tuned", default=None, help="JSON of fla's autotuned configs from an earlier run")
    ap.add_argument("--fla-dump", default=None, help="write fla's autotuned configs here (after every fla call)")
    ap.add_argument("--fla-precompile", type=int, default=0,
                    help="compile fla's autotune candidates in this many parallel processes first (fla_precompile)")
    ap.add_argument("--fla-worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        log("bench/kda_profile.py needs a CUDA GPU")
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    fck = None
    if not args.no_fla:
        try:
            from fla.ops.kda import chunk_kda as fck
        except Exception as e:  # noqa: BLE001 - the baseline is optional
            log(f"fla unavailable: {e!r}")
    shapes, modes = args.shapes.split(","), args.modes.split(",")
    if args.fla_worker:
        fla_worker(args.fla_worker, shapes, modes, fck)
        return 0
    if fck is not None and args.fla_tuned:
        log(f"fla: {fla_tuned_load(args.fla_tuned)} tuned configurations replayed from {args.fla_tuned}")
    if fck is not None and args.fla_precompile > 1:
        fla_precompile(shapes, modes, args.fla_precompile)
    run(fck, shapes, modes, args.profile, args.fla_dump)
    if fck is not None:
        log("FLA_TUNED_JSON " + json.dumps(fla_tuned_dump(), separators=(",", ":"), default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
