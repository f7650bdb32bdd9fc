"""Sweep of k3 KDA kernel variants (environment switches of k3/ops/kda) on one GPU.

For each variant: relative errors of o and every gradient against the float64 recurrence on a
small input with the timing configuration's kernel specialisation (H96 D128 bf16, pre-gated g,
qk-L2 in kernel), then fwd and fwd+bwd times at B1 T8192 H96 D128 (--shape T,H and --docs N: e.g.
k3-small's micro-batch, 65536,8 in 8 documents).  The variant named "default"
also gets the no-grad forward and a per-kernel profile. --gate calls the kernels as the model does (gate
and beta's sigmoid inside).  A decode sweep (tile width / warps) ends
the run.  Prints one line per measurement (flushes), so a run cut short still reports.

Usage: python bench/kda_variants.py [--variants default,st1] [--decode] [--check-T 512] [--shape 65536,8 --docs 8]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

VARIANTS = {
    "default": {},  # split forward intra (scan decay) + split backward since 2026-12-01
    "v1fused": {"K3_KDA_FWD_INTRA": "v1", "K3_KDA_BWD_INTRA": "fused"},  # the defaults before
    "bv128w8": {"K3_KDA_BV": "128", "K3_KDA_WARPS_STATE": "8"},
    "bv64": {"K3_KDA_BV": "64"},
    "bv32": {"K3_KDA_BV": "32"},
    "bv16": {"K3_KDA_BV": "16"},
    "bv64w8": {"K3_KDA_BV": "64", "K3_KDA_WARPS_STATE": "8"},
    "bwdw8": {"K3_KDA_BWD_INTRA": "fused", "K3_KDA_WARPS_BWD": "8"},
    "bwdw8r": {"K3_KDA_BWD_INTRA": "fused", "K3_KDA_WARPS_BWD": "8", "K3_KDA_AP_PREC_BWD": "tf32r"},
    "intranocd": {"K3_KDA_FWD_INTRA": "v1", "K3_KDA_CUMDOT": "0"},
    "intraw8": {"K3_KDA_FWD_INTRA": "v1", "K3_KDA_WARPS_INTRA": "8", "K3_KDA_CUMDOT": "0"},
    "bwdw8bk32": {"K3_KDA_BWD_INTRA": "fused", "K3_KDA_WARPS_BWD": "8", "K3_KDA_BK_BWD": "32"},
    "bwdw8cd": {"K3_KDA_BWD_INTRA": "fused", "K3_KDA_WARPS_BWD": "8", "K3_KDA_CUMDOT_BWD": "1"},
    # split backward intra (k3/ops/kda/triton_bwd_split.py): default BK 32 / 4 warps
    "bwdsplit": {"K3_KDA_BWD_INTRA": "split"},
    "bwdsplit16": {"K3_KDA_BWD_INTRA": "split", "K3_KDA_BK_BWDSPLIT": "16"},
    "bwdsplit64": {"K3_KDA_BWD_INTRA": "split", "K3_KDA_BK_BWDSPLIT": "64"},
    "bwdsplitw8": {"K3_KDA_BWD_INTRA": "split", "K3_KDA_WARPS_BWDSPLIT": "8"},
    "bwdsplit64w8": {"K3_KDA_BWD_INTRA": "split", "K3_KDA_BK_BWDSPLIT": "64", "K3_KDA_WARPS_BWDSPLIT": "8"},
    "bwdsplitcd": {"K3_KDA_BWD_INTRA": "split", "K3_KDA_CUMDOT_BWDSPLIT": "1"},
    "bwdsplitr": {"K3_KDA_BWD_INTRA": "split", "K3_KDA_AP_PREC_BWD": "tf32r"},
    "keysreg128": {"K3_KDA_MAXNREG_BWDSPLIT": "128"},  # 4 programs of 4 warps per SM
    "keysreg168": {"K3_KDA_MAXNREG_BWDSPLIT": "168"},  # 3
    "bk64reg168": {"K3_KDA_BK_BWDSPLIT": "64", "K3_KDA_MAXNREG_BWDSPLIT": "168"},
    # offline (bench/kernel_resources.py, Triton 3.6): BK 16 spills 168 B at cap 168 (BK 32: 336 B), 392 B at 128
    "bk16reg168": {"K3_KDA_BK_BWDSPLIT": "16", "K3_KDA_MAXNREG_BWDSPLIT": "168"},
    "bk16reg128": {"K3_KDA_BK_BWDSPLIT": "16", "K3_KDA_MAXNREG_BWDSPLIT": "128"},
    # key kernel's A/P loop (2026-12-01, twelfth session): column results in their own scratch (COLWS: no
    # barriers in the loop), then software pipelining of the A/P loop (AP) / the state loop (S)
    "bk16": {"K3_KDA_BK_BWDSPLIT": "16"},
    "colws": {"K3_KDA_COLWS": "1"},
    "colwsap2": {"K3_KDA_COLWS": "1", "K3_KDA_AP_STAGES": "2"},
    "colwss2": {"K3_KDA_COLWS": "1", "K3_KDA_S_STAGES_BWDSPLIT": "2"},
    "colwsap2s2": {"K3_KDA_COLWS": "1", "K3_KDA_AP_STAGES": "2", "K3_KDA_S_STAGES_BWDSPLIT": "2"},
    "colwsap2r168": {"K3_KDA_COLWS": "1", "K3_KDA_AP_STAGES": "2", "K3_KDA_MAXNREG_BWDSPLIT": "168"},
    "colwsap3": {"K3_KDA_COLWS": "1", "K3_KDA_AP_STAGES": "3"},
    "oldloops": {"K3_KDA_COLWS": "0", "K3_KDA_AP_STAGES": "1", "K3_KDA_S_STAGES_BWDSPLIT": "1"},  # before 2026-12-01 pm
    "ap1s2": {"K3_KDA_AP_STAGES": "1"},  # offline (Triton 3.6, model's gate): 8 B of spills vs 128 B for AP 2 / S 2
    "ap2s1": {"K3_KDA_S_STAGES_BWDSPLIT": "1"},
    # both new kernels together
    "v2split": {  # v2 forward + split backward (the defaults of the morning of 2026-12-01)
       "K3_KDA_FWD_INTRA": "v2", "K3_KDA_BWD_INTRA": "split"},
    "v2splitw8": {"K3_KDA_FWD_INTRA": "v2", "K3_KDA_BWD_INTRA": "split", "K3_KDA_WARPS_BWDSPLIT": "8"},
    # forward intra kernel v2 (k3/ops/kda/triton_fwd_v2.py); 4 warps only (its N = 16 tf32 dots
    # would become N = 8 wgmma with 8 warps: triton-lang/triton#10629)
    "fwdv2": {"K3_KDA_FWD_INTRA": "v2"},
    "fwdv2bk16": {"K3_KDA_FWD_INTRA": "v2", "K3_KDA_BK_FWD": "16"},
    "fwdv2nocd": {"K3_KDA_FWD_INTRA": "v2", "K3_KDA_CUMDOT": "0"},
    "fwdv2nradd": {"K3_KDA_FWD_INTRA": "v2", "K3_KDA_V2_RADD": "0"},
    "fwdv2r168": {"K3_KDA_FWD_INTRA": "v2", "K3_KDA_MAXNREG_INTRA": "168"},
    "fwdv2r168bk16": {"K3_KDA_FWD_INTRA": "v2", "K3_KDA_MAXNREG_INTRA": "168", "K3_KDA_BK_FWD": "16"},
    # split forward intra (k3/ops/kda/triton_fwd_split.py): rows / keys / A-P / finish launches;
    # default BK 32, 4 warps (keys, A-P), NS 1 (W / U in one finish program per chunk and head)
    "fwdsplit": {"K3_KDA_FWD_INTRA": "split"},
    "fwdsplitns2": {"K3_KDA_FWD_INTRA": "split", "K3_KDA_NS_FWDSPLIT": "2"},
    "fwdsplitbk16": {"K3_KDA_FWD_INTRA": "split", "K3_KDA_BK_FWDSPLIT": "16"},
    "fwdsplitbk64": {"K3_KDA_FWD_INTRA": "split", "K3_KDA_BK_FWDSPLIT": "64"},
    "fwdsplitw8": {"K3_KDA_FWD_INTRA": "split", "K3_KDA_BK_FWDSPLIT": "64", "K3_KDA_WARPS_FWDSPLIT": "8"},
    "fwdsplitcd": {"K3_KDA_FWD_INTRA": "split", "K3_KDA_CUMDOT": "1"},  # dot decay (scan is the default)
}
# (tile width or "auto", warps); "auto" = the library's choice
DECODE = [("auto", "4")]
DECODE_B = (1, 8, 64, 256)


from kda import bench, capture_graph, kernel_profile, log  # bench/kda.py, next to this script


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def inputs(T, H=96, D=128, seed=0):
    """[q, k, v, g, beta] as fla's registry config (pre-gated g, beta in (0, 1)); with CU["gate"] as the
    model calls the kernel: raw gate pre-activations f, raw beta logits, A_log [H], dt_bias [H * D]."""
    torch.manual_seed(seed)
    mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16).requires_grad_()  # noqa: E731
    q, k, v = mk(1, T, H, D), mk(1, T, H, D), mk(1, T, H, D)
    if CU.get("gate"):
        f = mk(1, T, H, D)
        b = torch.randn(1, T, H, device="cuda", requires_grad=True)
        A_log = (torch.randn(H, device="cuda") * 0.1).requires_grad_()
        dt_bias = torch.randn(H * D, device="cuda").requires_grad_()
        return [q, k, v, f, b, A_log, dt_bias]
    g = F.logsigmoid(torch.randn(1, T, H, D, device="cuda")).clamp_min(-5.0).to(torch.bfloat16).requires_grad_()
    beta = torch.sigmoid(torch.randn(1, T, H, device="cuda")).to(torch.bfloat16).requires_grad_()
    return [q, k, v, g, beta]


CU = {}  # "big": cu_seqlens of the timed input (--docs), set by main


def k3_call(x):
    from k3.ops.kda.chunk import chunk_kda

    cu = CU.get("big") if x[0].shape[1] == CU.get("T") else None
    if len(x) == 7:  # the model's call: gate and beta's sigmoid in the kernels
        return chunk_kda(*x[:5], A_log=x[5], dt_bias=x[6], lower_bound=-5.0, use_qk_l2norm_in_kernel=True,
                         use_beta_sigmoid_in_kernel=True, cu_seqlens=cu)[0]
    return chunk_kda(*x, lower_bound=-5.0, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)[0]


def reference(x):
    from k3.ops.kda import l2norm
    from k3.ops.kda.reference import kda_reference

    d = [t.detach().double().requires_grad_() for t in x]
    g, beta = d[3], d[4]
    if len(d) == 7:  # g = -5 sigmoid(e^A_log (f + dt_bias)), beta = sigmoid(b), in float64
        H, D = d[3].shape[-2:]
        g = -5.0 * torch.sigmoid(d[5].exp()[:, None] * (d[3] + d[6].view(H, D)))
        beta = torch.sigmoid(d[4])
    ro, _ = kda_reference(l2norm(d[0]), l2norm(d[1]), d[2], g, beta, dtype=torch.float64)
    do = torch.randn_like(ro)
    rg = torch.autograd.grad((ro * do).sum(), d)
    return ro.detach(), do, [t.detach() for t in rg]


def errors(x, ref) -> dict:
    ro, do, rg = ref
    o = k3_call(x)
    gr = torch.autograd.grad((o.double() * do).sum(), x)
    e = {"o": rel(o, ro)}
    e.update({f"d{n}": rel(a, b) for n, a, b in zip(["q", "k", "v", "g", "b", "A_log", "dt_bias"], gr, rg)})
    return e


def run_variant(name, env, ref, xs, xb, do_big, label):
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        t0 = time.time()
        e = errors(xs, ref)
        worst = max(e.values())
        log(f"[{name}] {env} compile+check {time.time() - t0:.0f} s; errors " +
            ", ".join(f"{n} {v:.2e}" for n, v in e.items()) + ("  OK" if worst < 2e-2 else "  FAILED"))
        fwd = bench(lambda: k3_call(xb))
        both = bench(lambda: k3_call(xb).backward(do_big))
        line = f"[{name}] {label}: fwd {fwd:.3f} ms, fwd+bwd {both:.3f} ms"
        if name == "default" or name.startswith("fwdv2") or name.startswith("fwdsplit"):
            with torch.no_grad():
                line += f", fwd no-grad {bench(lambda: k3_call(xb)):.3f} ms"
        log(line)
        kernel_profile(lambda: k3_call(xb).backward(do_big), f"{name} fwd+bwd")
        log(f"  registers of {name}: {kernel_registers()}")
    except Exception as ex:  # report and go on with the next variant
        log(f"[{name}] {type(ex).__name__}: {str(ex)[:300]}")
        if "illegal" in str(ex) or "CUDA error" in str(ex):
            raise
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for t in xb:
            t.grad = None


def kernel_registers() -> str:
    """Registers / spilled bytes per thread of each compiled split-backward kernel so far (Triton's
    compiled-kernel cache; a variant that changes a kernel's specialisation adds an entry)."""
    from k3.ops.kda import triton_bwd_split as m

    out = []
    for name in ("_kda_bwd_values", "_kda_bwd_keys", "_kda_bwd_finish"):
        seen = []
        for cache in getattr(getattr(m, name), "device_caches", {}).values():
            kernels = cache[0] if isinstance(cache, tuple) else cache
            for ck in getattr(kernels, "values", lambda: [])():
                meta = getattr(ck, "metadata", None)
                seen.append(f"{getattr(ck, 'n_regs', '?')}r/{getattr(ck, 'n_spills', '?')}s"
                            f"/w{getattr(meta, 'num_warps', '?')}")
        out.append(f"{name[9:]} " + (",".join(seen) or "-"))
    return "; ".join(out)


def decode_sweep(Bs=DECODE_B, H=96, D=128):
    from k3.ops.kda.recurrent import fused_recurrent_kda

    src = torch.empty(2 ** 30, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    copy_bw = 2 * src.numel() * 2 / (bench(lambda: dst.copy_(src)) * 1e-3)
    src = dst = None
    log(f"decode: copy bandwidth {copy_bw / 1e9:.0f} GB/s")
    for B in Bs:
        q, k, v = (torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        g = F.logsigmoid(torch.randn(B, 1, H, D, device="cuda")).clamp_min(-5)
        beta = torch.rand(B, 1, H, device="cuda", dtype=torch.bfloat16)
        pool = torch.randn(B, H, D, D, device="cuda") * 0.01
        idx = torch.arange(B, device="cuda", dtype=torch.int32)
        for bv, w in DECODE:
            os.environ["K3_KDA_DEC_WARPS"] = w
            if bv == "auto":
                os.environ.pop("K3_KDA_DEC_BV", None)
            else:
                os.environ["K3_KDA_DEC_BV"] = bv
            def fn(q=q, k=k, v=v, g=g, beta=beta, pool=pool, idx=idx):
                return fused_recurrent_kda(q, k, v, g, beta, pool, idx, use_qk_l2norm_in_kernel=True)

            for _ in range(3):
                fn()
            ms = bench(capture_graph(fn).replay)
            nb = 2 * B * H * D * D * 4
            log(f"decode H{H} B{B} BV{bv} w{w}: {ms * 1e3:.1f} us, {nb / ms / 1e6:.0f} GB/s = "
                f"{nb / ms / 1e6 / (copy_bw / 1e9) * 100:.1f}% of copy")
        os.environ.pop("K3_KDA_DEC_BV", None)
        os.environ.pop("K3_KDA_DEC_WARPS", None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--decode", action="store_true")
    ap.add_argument("--check-T", type=int, default=512)
    ap.add_argument("--shape", default="8192,96", help="T,H of the timed input (B 1, D 128)")
    ap.add_argument("--docs", type=int, default=1, help="equal documents in the timed row (cu_seqlens)")
    ap.add_argument("--gate", action="store_true",
                    help="call the kernels as the model does: gate and beta's sigmoid inside (raw f, b, A_log, dt_bias)")
    args = ap.parse_args(argv)
    CU["gate"] = args.gate
    T, H = (int(x) for x in args.shape.split(","))
    if T % args.docs:
        raise SystemExit(f"--docs {args.docs} does not divide T {T}")
    import triton

    torch.backends.cuda.matmul.allow_tf32 = False
    log(f"GPU {torch.cuda.get_device_name()}; torch {torch.__version__}; triton {triton.__version__}")
    t0 = time.time()
    if args.decode:
        decode_sweep()
    names = [n for n in args.variants.split(",") if n]
    if names:
        xs = inputs(args.check_T, seed=1)
        ref = reference(xs)
        log(f"reference (B1 T{args.check_T} H96 D128 float64) {time.time() - t0:.0f} s")
        xb = inputs(T, H=H)
        if args.docs > 1:
            CU.update(big=torch.arange(0, T + 1, T // args.docs, device="cuda", dtype=torch.int32), T=T)
        do_big = torch.randn_like(xb[2])
        label = f"B1 T{T} H{H} D128" + (f" ({args.docs} documents)" if args.docs > 1 else "")
        for name in names:
            run_variant(name, VARIANTS[name], ref, xs, xb, do_big, label)
            torch.cuda.empty_cache()
    log(f"total {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
