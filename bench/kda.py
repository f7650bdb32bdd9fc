"""KDA kernel benchmark: k3's Triton kernels vs fla on identical inputs (one H200 run does all).

Sections (default: all, in this order):
  ceil     measured ceilings: 2 GiB D2D copy, bf16 8192^3 matmul
  check    correctness spot-check: k3 bf16 (fwd, final state, grads) vs float64 reference; k3 vs fla;
           decode vs reference
  decode   B5: T = 1, K = V = 128, fp32 state, H in {96, 24}, B in {1, 8, 32, 64, 128, 256}, CUDA graph
  train    benchmarks.md B2: fla registry shapes, pre-gated g = logsigmoid(randn), qk-l2norm in kernel,
           fla with safe_gate=True, lower_bound=-5 (k3 with the declared bound -5); fwd and fwd+bwd
  prefill  B3: T = 8192, H in {96, 64}: fixed / varlen [1300, 547, 2048, 963, 271, 3063] / 8 x 1024;
           in-kernel gate (A_log = dt_bias = 0, lower_bound -5), qk-l2norm, beta-sigmoid, final state,
           inference mode
  long     B4: B = 1, H in {16, 24}, T up to 256K, prefill configuration
  issue31  issue #31's acceptance table (bench/kda_profile.py): B1 T8192 H96 D128 and k3-small's micro-batch
           (T65536 H8, 8 packed docs of 8192); training forward, no-grad forward, forward + backward
           (pre-gated, bound -5, qk-l2norm in kernel) and prefill (in-kernel gate, inference mode), k3 vs fla
  profile  the same with the per-kernel device times and roofline fractions (bench/kda_profile.py --profile)
fla's first call autotunes its kernels: on the H200 image (Triton 3.6) the B2 primary shape did not
finish warming within 4 minutes, so give each section its own process / call when time is limited
(k3's rows are printed as soon as they are measured).
Timing: triton.testing.do_bench(warmup=25, rep=100) median.  Roofline: 790 TFLOP/s bf16, 4.3 TB/s
(benchmarks.md); "roof" = (max of FLOP time and minimal-byte time at those rates) / measured time.

Usage:  python bench/kda.py [--sections train,decode] [--quick] [--train-shapes 1x8192x96x128] [--out results.md]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench._harness import BF16_ROOF as PEAK_TF  # noqa: E402
from bench._harness import HBM as PEAK_BW  # noqa: E402
from bench._harness import rel_err  # noqa: E402

ROWS: list[dict] = []


def log(*a):
    print(*a, flush=True)


def bench(fn, warmup=25, rep=100) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup, rep=rep, quantiles=[0.5, 0.2, 0.8])[0]


def try_fla():
    try:
        from fla.ops.kda import chunk_kda as fck
        from fla.ops.kda import fused_recurrent_kda as frk
        import fla

        return fck, frk, getattr(fla, "__version__", "?")
    except Exception as e:  # baseline only: report and continue with k3 alone
        log(f"fla unavailable: {e!r}")
        return None, None, None


def kda_flops(n_tok: int, H: int, d: int, C: int = 64) -> float:
    """benchmarks.md §3 (Kimi Linear §6.3): per head 6 T d^2 + 3 T C d + T C^2."""
    return H * (6 * n_tok * d * d + 3 * n_tok * C * d + n_tok * C * C)


def add_row(section, config, k3_ms, fla_ms, flops=None, nbytes=None, note=""):
    roof = max(flops / PEAK_TF if flops else 0.0, nbytes / PEAK_BW if nbytes else 0.0)
    row = dict(section=section, config=config, k3_ms=k3_ms, fla_ms=fla_ms,
               ratio=(fla_ms / k3_ms) if (k3_ms and fla_ms) else None,
               tflops=(flops / k3_ms / 1e9) if (flops and k3_ms) else None,
               gbs=(nbytes / k3_ms / 1e6) if (nbytes and k3_ms) else None,
               roof=(roof * 1e3 / k3_ms) if (roof and k3_ms) else None, note=note)
    ROWS.append(row)
    f = lambda x, p=3: "-" if x is None else f"{x:.{p}f}"  # noqa: E731
    log(f"  {section:8s} {config:42s} k3 {f(k3_ms)} ms  fla {f(fla_ms)} ms  x{f(row['ratio'], 2)}  "
        f"{f(row['tflops'], 1)} TF/s  {f(row['gbs'], 0)} GB/s  roof {f(row['roof'], 2)} {note}")


def table() -> str:
    f = lambda x, p=3: "—" if x is None else f"{x:.{p}f}"  # noqa: E731
    out = ["| section | config | k3 ms | fla ms | fla/k3 | k3 TFLOP/s | k3 GB/s | roofline frac | note |",
           "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in ROWS:
        out.append(f"| {r['section']} | {r['config']} | {f(r['k3_ms'])} | {f(r['fla_ms'])} | {f(r['ratio'], 2)} | "
                   f"{f(r['tflops'], 1)} | {f(r['gbs'], 0)} | {f(r['roof'], 2)} | {r['note']} |")
    return "\n".join(out)


rel = rel_err


def capture_graph(fn) -> torch.cuda.CUDAGraph:
    """fn captured as a CUDA graph (after one run on a side stream, as capture requires)."""
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(graph):
        fn()
    return graph


def kernel_profile(fn, label, iters=3, top=8):
    """Per-kernel device time (us per call) of fn, from the torch profiler (bench/kda_profile.py's)."""
    from bench.kda_profile import kernel_times

    rows = [(t, name) for name, t, _ in kernel_times(fn, iters)]
    log(f"  kernels of {label}: " + "; ".join(f"{n[:48]} {t:.0f}us" for t, n in rows[:top]))


# ------------------------------------------------------------------------------------------------

def sec_ceil():
    log("== ceilings")
    x = torch.empty(2 ** 30, dtype=torch.bfloat16, device="cuda").normal_()
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x))
    bw = 2 * x.numel() * 2 / (ms * 1e-3)
    log(f"  2 GiB copy: {ms:.3f} ms = {bw / 1e9:.0f} GB/s (read + write)")
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    ms2 = bench(lambda: a @ b)
    log(f"  bf16 8192^3 matmul: {ms2:.3f} ms = {2 * 8192 ** 3 / ms2 / 1e9:.0f} TFLOP/s")
    torch.cuda.empty_cache()
    return bw


def sec_check(fck, frk, precision_variant):
    from k3.ops.kda import kda_gate, l2norm
    from k3.ops.kda.chunk import chunk_kda
    from k3.ops.kda.recurrent import fused_recurrent_kda
    from k3.ops.kda.reference import kda_reference

    log("== correctness spot-check (relative Frobenius error)")
    torch.manual_seed(0)
    B, T, H, D = 1, 2048, 4, 128
    mk = lambda *s, dt=torch.bfloat16: torch.randn(*s, device="cuda", dtype=dt).requires_grad_()  # noqa: E731
    q, k, v, f = mk(B, T, H, D), mk(B, T, H, D), mk(B, T, H, D), mk(B, T, H, D)
    b = mk(B, T, H)
    A_log = (torch.randn(H, device="cuda") * 0.5).requires_grad_()
    dt_bias = (torch.randn(H * D, device="cuda") * 0.5).requires_grad_()
    h0 = (torch.randn(B, H, D, D, device="cuda") * 0.1).requires_grad_()
    ins = [q, k, v, f, b, A_log, dt_bias, h0]
    d = [x.detach().double().requires_grad_() for x in ins]
    g = kda_gate(d[3], d[5], d[6], -5.0).double()
    ro, rs = kda_reference(l2norm(d[0]), l2norm(d[1]), d[2], g, torch.sigmoid(d[4]), initial_state=d[7],
                           output_final_state=True, dtype=torch.float64)
    do, ds = torch.randn_like(ro), torch.randn_like(rs)
    rg = torch.autograd.grad((ro * do).sum() + (rs * ds).sum(), d)
    names = ["q", "k", "v", "f", "beta", "A_log", "dt_bias", "h0"]

    def k3_errors():
        o, s = chunk_kda(q, k, v, f, b, initial_state=h0, output_final_state=True, A_log=A_log, dt_bias=dt_bias,
                         lower_bound=-5.0, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)
        gr = torch.autograd.grad((o.double() * do).sum() + (s.double() * ds).sum(), ins)
        e = {"o": rel(o, ro), "final": rel(s, rs)}
        e.update({f"d{n}": rel(x, y) for n, x, y in zip(names, gr, rg)})
        return e

    errs = k3_errors()
    log("  k3 bf16 fused vs fp64 ref (B1 T2048 H4 D128): " + ", ".join(f"{n} {e:.2e}" for n, e in errs.items()))
    if precision_variant:
        from k3.ops.kda import chunk

        default = chunk.HALF_PRECISIONS
        chunk.HALF_PRECISIONS = ("tf32x3", "tf32x3") + default[2:]  # module constant, restored below
        try:
            e2 = k3_errors()
        finally:
            chunk.HALF_PRECISIONS = default
        log("  k3 same, tf32x3 solve and A/P dots:          " + ", ".join(f"{n} {e:.2e}" for n, e in e2.items()))
    bad = {n: e for n, e in errs.items() if not e < 2e-2}
    if fck is not None:
        fo, fs = fck(q, k, v, f, b, A_log=A_log, dt_bias=dt_bias, initial_state=h0, output_final_state=True,
                     use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                     safe_gate=True, lower_bound=-5.0)
        fgr = torch.autograd.grad((fo.double() * do).sum() + (fs.double() * ds).sum(), ins)
        ferrs = {"o": rel(fo, ro), "final": rel(fs, rs)}
        ferrs.update({f"d{n}": rel(x, y) for n, x, y in zip(names, fgr, rg)})
        log("  fla bf16 same inputs vs fp64 ref:            " + ", ".join(f"{n} {e:.2e}" for n, e in ferrs.items()))
    # decode
    Bd = 8
    qd, kd, vd = (torch.randn(Bd, 1, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    gd = F.logsigmoid(torch.randn(Bd, 1, H, D, device="cuda")).clamp_min(-5)
    bd = torch.rand(Bd, 1, H, device="cuda", dtype=torch.bfloat16)
    pool = torch.randn(Bd, H, D, D, device="cuda") * 0.01
    st = pool.clone()
    od, _ = fused_recurrent_kda(qd, kd, vd, gd, bd, pool, torch.arange(Bd, device="cuda"), use_qk_l2norm_in_kernel=True)
    rod, rsd = kda_reference(l2norm(qd.double()), l2norm(kd.double()), vd.double(), gd.double(), bd.double(),
                             initial_state=st.double(), output_final_state=True, dtype=torch.float64)
    log(f"  k3 decode vs fp64 ref: o {rel(od, rod):.2e}, state {rel(pool, rsd):.2e}")
    if not rel(pool, rsd) < 1e-4:
        bad["decode"] = rel(pool, rsd)
    if bad:
        log(f"  CHECK FAILED (numbers below are for a kernel that is off): {bad}")
    else:
        log("  check passed")


TRAIN_SHAPES = [(1, 8192, 96, 128), (2, 16384, 16, 128), (4, 2048, 16, 128), (4, 4096, 64, 128),
                (8, 2048, 32, 256), (8, 1024, 8, 64)]


def sec_train(fck, shapes, variants=False):
    from k3.ops.kda.chunk import chunk_kda

    log("== training (B2): pre-gated g = logsigmoid(randn), qk-l2norm in kernel, bound -5")
    for (B, T, H, D) in shapes:
        torch.manual_seed(0)
        mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16).requires_grad_()  # noqa: E731
        q, k, v = mk(B, T, H, D), mk(B, T, H, D), mk(B, T, H, D)
        g = F.logsigmoid(torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16)).requires_grad_()
        beta = torch.sigmoid(torch.randn(B, T, H, device="cuda", dtype=torch.bfloat16)).requires_grad_()
        do = torch.randn_like(v)
        impls = {"k3": lambda: chunk_kda(q, k, v, g, beta, lower_bound=-5.0, use_qk_l2norm_in_kernel=True)[0]}
        if fck is not None:
            impls["fla"] = lambda: fck(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, safe_gate=True,
                                       lower_bound=-5)[0]
        res = {}
        for name, fn in impls.items():
            try:
                t0 = time.time()
                for _ in range(5):
                    fn().backward(do)
                torch.cuda.synchronize()
                log(f"  {name} warm-up (compile/autotune) {time.time() - t0:.0f} s")
                with torch.no_grad():
                    inf = bench(fn)
                res[name] = (bench(fn), bench(lambda: fn().backward(do)), inf)
                log(f"  {name} B{B} T{T} H{H} D{D}: fwd {res[name][0]:.3f} ms, fwd (no grad) {inf:.3f} ms, "
                    f"fwd+bwd {res[name][1]:.3f} ms")
            except (ValueError, RuntimeError) as e:
                log(f"  {name} B{B} T{T} H{H} D{D}: {type(e).__name__}: {str(e)[:120]}")
                res[name] = (None, None, None)
            q.grad = k.grad = v.grad = g.grad = beta.grad = None
            torch.cuda.empty_cache()
        if (B, T, H, D) == TRAIN_SHAPES[0] and res["k3"][0] is not None:
            kernel_profile(impls["k3"], "k3 fwd")
            kernel_profile(lambda: impls["k3"]().backward(do), "k3 fwd+bwd")
            if "fla" in impls:
                kernel_profile(impls["fla"], "fla fwd")
                kernel_profile(lambda: impls["fla"]().backward(do), "fla fwd+bwd")
            from k3.ops.kda import chunk

            for bv in ([16, 64] if variants else []):
                chunk.STATE_BV = bv  # the state scans' value block (module constant), restored below
                try:
                    impls["k3"]().backward(do)
                    fwd_ms = bench(impls["k3"])
                    both_ms = bench(lambda: impls["k3"]().backward(do))
                finally:
                    chunk.STATE_BV = None
                log(f"  k3 variant BV={bv}: fwd {fwd_ms:.3f} ms, fwd+bwd {both_ms:.3f} ms")
        n = B * T
        cfg = f"B{B} T{T} H{H} D{D}"
        fl = kda_flops(n, H, D)
        by = n * H * (4 * D * 2 + 2) + n * H * D * 2
        k3r, flr = res["k3"], res.get("fla", (None, None, None))
        add_row("train", cfg + " fwd", k3r[0], flr[0], fl, by)
        add_row("train", cfg + " fwd (no grad)", k3r[2], flr[2], fl, by)
        add_row("train", cfg + " fwd+bwd", k3r[1], flr[1], 3 * fl, 3 * by)
        torch.cuda.empty_cache()


def _prefill_inputs(lengths, H, D=128):
    T = sum(lengths)
    q, k, v, f = (torch.randn(1, T, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    beta = torch.randn(1, T, H, device="cuda", dtype=torch.bfloat16)
    A_log = torch.zeros(H, device="cuda")
    dt_bias = torch.zeros(H * D, device="cuda")
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), device="cuda", dtype=torch.int64)
    return q, k, v, f, beta, A_log, dt_bias, (cu if len(lengths) > 1 else None)


def _prefill_row(section, cfg, lengths, H, fck, D=128):
    from k3.ops.kda.chunk import chunk_kda

    q, k, v, f, beta, A_log, dt_bias, cu = _prefill_inputs(lengths, H, D)
    kw = dict(A_log=A_log, dt_bias=dt_bias, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
              lower_bound=-5.0, output_final_state=True, cu_seqlens=cu)
    k3 = lambda: chunk_kda(q, k, v, f, beta, **kw)  # noqa: E731
    fl = None
    if fck is not None:
        fl = lambda: fck(q, k, v, f, beta, use_gate_in_kernel=True, safe_gate=True, **kw)  # noqa: E731
    times = {}
    with torch.inference_mode():
        for name, fn in (("k3", k3), ("fla", fl)):
            if fn is None:
                times[name] = None
                continue
            t0 = time.time()
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            times[name] = bench(fn)
            log(f"  {name} {section} {cfg}: {times[name]:.3f} ms (warm-up {time.time() - t0:.0f} s)")
    n = sum(lengths)
    N = len(lengths)
    by = n * H * (4 * D * 2 + 2) + n * H * D * 2 + N * H * D * D * 4
    add_row(section, cfg, times["k3"], times["fla"], kda_flops(n, H, D), by,
            note=f"{n / times['k3'] / 1e3:.2f} M tok/s" if times["k3"] else "")
    torch.cuda.empty_cache()


def sec_prefill(fck, heads):
    log("== prefill (B3): in-kernel gate + l2norm + beta-sigmoid, lb -5, final state, inference mode")
    for H in heads:
        _prefill_row("prefill", f"H{H} fixed 1x8192", [8192], H, fck)
        _prefill_row("prefill", f"H{H} varlen [1300,547,2048,963,271,3063]", [1300, 547, 2048, 963, 271, 3063], H, fck)
        _prefill_row("prefill", f"H{H} varlen 8x1024", [1024] * 8, H, fck)


def sec_long(fck, Ts, heads):
    log("== long context (B4): B = 1, prefill configuration")
    for H in heads:
        for T in Ts:
            _prefill_row("long", f"H{H} T{T // 1024}K", [T], H, fck)


def sec_decode(frk, copy_bw, Bs, heads):
    from k3.ops.kda.recurrent import fused_recurrent_kda

    log("== decode (B5): T = 1, K = V = 128, fp32 state, CUDA graph")
    D = 128
    for H in heads:
        for B in Bs:
            torch.manual_seed(0)
            q, k, v = (torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            g = F.logsigmoid(torch.randn(B, 1, H, D, device="cuda")).clamp_min(-5)
            beta = torch.rand(B, 1, H, device="cuda", dtype=torch.bfloat16)
            pool = torch.randn(B, H, D, D, device="cuda") * 0.01
            state = pool.clone()
            idx = torch.arange(B, device="cuda", dtype=torch.int32)
            impls = {"k3": lambda: fused_recurrent_kda(q, k, v, g, beta, pool, idx, use_qk_l2norm_in_kernel=True)}
            if frk is not None:
                impls["fla"] = lambda: frk(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                           use_qk_l2norm_in_kernel=True)
            res = {}
            for name, fn in impls.items():
                for _ in range(3):
                    fn()
                torch.cuda.synchronize()
                eager = bench(fn)
                res[name] = (bench(capture_graph(fn).replay), eager)
            nb = 2 * B * H * D * D * 4
            k3g, k3e = res["k3"]
            flg, fle = res.get("fla", (None, None))
            add_row("decode", f"H{H} B{B} graph", k3g, flg, None, nb,
                    note=f"{k3g * 1e3:.1f} us; {nb / k3g / 1e6 / (copy_bw / 1e9) * 100:.0f}% of copy BW")
            add_row("decode", f"H{H} B{B} eager", k3e, fle, None, nb, note=f"{k3e * 1e3:.1f} us")
            torch.cuda.empty_cache()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default="ceil,check,decode,train,prefill,long")
    ap.add_argument("--quick", action="store_true", help="primary shapes only (B1 T8192 H96, H96 prefill, H96 decode)")
    ap.add_argument("--train-shapes", default=None, help="e.g. 1x8192x96x128,2x16384x16x128 (default: registry)")
    ap.add_argument("--prefill-heads", default="96,64")
    ap.add_argument("--long-T", default="8192,65536,262144")
    ap.add_argument("--long-heads", default="16,24")
    ap.add_argument("--decode-heads", default="96,24")
    ap.add_argument("--precision-variant", action="store_true", help="also check k3 with tf32x3 solve / A-P dots")
    ap.add_argument("--variants", action="store_true", help="also time the state scans' value blocks 16 and 64")
    ap.add_argument("--fla-tuned", default=None, help="issue31 / profile: fla's autotuned configs of an earlier run "
                    "(bench/kda_profile.py)")
    ap.add_argument("--out", default=None, help="also write the markdown table here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        log("bench/kda.py needs a CUDA GPU")
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    import triton

    fck, frk, fla_ver = try_fla()
    now = datetime.datetime.now(datetime.timezone.utc)
    header = (f"date {now:%Y-%m-%d %H:%M UTC}; GPU {torch.cuda.get_device_name()}; "
              f"torch {torch.__version__}; triton {triton.__version__}; CUDA {torch.version.cuda}; fla {fla_ver}; "
              f"python {platform.python_version()}; command: python bench/kda.py {' '.join(argv or sys.argv[1:])}")
    log(header)
    secs = args.sections.split(",")
    t0 = time.time()
    copy_bw = 4.26e12
    if "ceil" in secs:
        copy_bw = sec_ceil()
    ints = lambda x: [int(t) for t in x.split(",") if t]  # noqa: E731
    shapes = TRAIN_SHAPES
    if args.train_shapes:
        shapes = [tuple(int(t) for t in sh.split("x")) for sh in args.train_shapes.split(",")]
    if args.quick:
        shapes, args.prefill_heads, args.decode_heads = TRAIN_SHAPES[:1], "96", "96"
    if "check" in secs:
        sec_check(fck, frk, args.precision_variant)
    if "decode" in secs:
        sec_decode(frk, copy_bw, [1, 8, 32, 64, 128, 256], ints(args.decode_heads))
    if "train" in secs:
        sec_train(fck, shapes, args.variants)
    if "prefill" in secs:
        sec_prefill(fck, ints(args.prefill_heads))
    if "long" in secs:
        sec_long(fck, ints(args.long_T), ints(args.long_heads))
    if "issue31" in secs or "profile" in secs:
        from bench import kda_profile

        if fck is not None and args.fla_tuned:
            log(f"fla: {kda_profile.fla_tuned_load(args.fla_tuned)} tuned configurations replayed")
        res = kda_profile.run(fck, list(kda_profile.SHAPES), ["fwd", "fwdbwd", "prefill", "nograd"], "profile" in secs)
        for r in res:
            add_row("issue31", f"{r['shape']} {r['mode']}", r["k3"], r["fla"], note=f"target {r['target']}x")
    md = table()
    log(f"\n{header}\n\n{md}\n\n(total {time.time() - t0:.0f} s)")
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(header + "\n\n" + md + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
