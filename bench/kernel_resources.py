"""Registers, spills and shared memory of a k3 Triton kernel compiled for the H200 (sm_90), without a GPU.

Compiles the kernel ahead of time with Triton's own toolchain (`triton.compile` for target cuda:90,
pointer arguments specialised as 16-byte aligned, as the JIT does at launch) and reads the cubin's
resource usage with the cuobjdump shipped in Triton's wheel. Per configuration it prints registers
per thread, spilled bytes per thread (the cubin's stack frame: the device's `n_spills` is this / 4),
shared memory, and how many programs fit on one SM by registers (64K per SM) and by shared memory
(227 KB). The numbers depend on the Triton version: use the device's (Triton 3.6 on the H200 of the
device tool), e.g. installed aside with `pip install --no-deps --target /tmp/t36 triton==3.6.0` and
given as --triton-path. Checked against the device on 2026-12-01: the KDA key kernel at BK 32 / 64
and register caps 168 / 128 gave the same registers and spills here as on the H200.

Usage: python bench/kernel_resources.py [--triton-path /tmp/t36] [--configs 32:4,64:4,32:4:168]
       (KDA split-backward key kernel `_kda_bwd_keys` at k3-small's H 8, K = V = 128; BK:warps[:maxnreg])
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

REGS_PER_SM, SMEM_PER_SM = 65536, 227 * 1024

# argument types of the KDA key kernel for bf16 inputs (k3/ops/kda/triton_bwd_split.py)
KEYS_PTRS = {**{n: "*bf16" for n in ("q", "k", "g", "beta", "Hs", "DH", "VN", "DR", "do", "dq", "dk", "dg")},
             **{n: "*fp32" for n in ("A_log", "dt_bias", "DPA", "ROWS", "WS", "PART", "dA_part", "ddt_part")},
             "cu_seqlens": "*i32", "chunk_info": "*i32", "scale": "fp32", "lower_bound": "fp32"}


def compile_kda_keys(bk: int, warps: int, maxnreg: int | None, *, hand: bool = True, cumdot: bool = True):
    """triton's CompiledKernel of `_kda_bwd_keys` for sm_90 (k3-small's specialisation: pre-gated g,
    qk L2 norm and beta in the kernel as the model calls it)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from k3.ops.kda.triton_bwd_split import _kda_bwd_keys as fn

    const = dict(H=8, K=128, V=128, BK=bk, BV=64, GATE=False, L2=True, BSIG=False, AP_PREC="tf32x3",
                 S_PREC="half", CUMDOT=cumdot, HAND=hand)
    names = fn.arg_names
    sig = {n: KEYS_PTRS.get(n, "constexpr") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n].startswith("*")}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
    opts = {"num_warps": warps, "num_stages": 1} | ({"maxnreg": maxnreg} if maxnreg else {})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


def resources(kernel) -> dict[str, int]:  # noqa: ANN001 - a triton CompiledKernel
    """{"regs", "stack", "smem"} of a compiled kernel, from cuobjdump --dump-resource-usage."""
    import triton.backends.nvidia as nv

    tool = os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        out = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True, check=True).stdout
    fields = dict(tok.split(":", 1) for line in out.splitlines() if "REG:" in line for tok in line.split() if ":" in tok)
    return {"regs": int(fields["REG"]), "stack": int(fields["STACK"]), "smem": int(kernel.metadata.shared)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--triton-path", default="", help="a folder holding the device's Triton (put first on sys.path)")
    ap.add_argument("--configs", default="32:4,64:4,16:4,32:4:168,16:4:168,32:4:128",
                    help="comma-separated BK:warps[:maxnreg] of the KDA key kernel")
    args = ap.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU even where tests run the interpreter
    if args.triton_path:
        sys.path.insert(0, args.triton_path)
    import triton

    print(f"# `_kda_bwd_keys` resources on sm_90, Triton {triton.__version__} (no GPU needed)")
    print("| BK | warps | maxnreg | registers | spilled B / thread | shared KB | programs / SM (regs, smem) |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for cfg in args.configs.split(","):
        bk, warps, *cap = (int(x) for x in cfg.split(":"))
        r = resources(compile_kda_keys(bk, warps, cap[0] if cap else None))
        by_regs = REGS_PER_SM // (r["regs"] * 32 * warps)
        by_smem = SMEM_PER_SM // max(r["smem"], 1)
        print(f"| {bk} | {warps} | {cap[0] if cap else '-'} | {r['regs']} | {r['stack']} | {r['smem'] / 1024:.0f} | "
              f"{min(by_regs, by_smem)} ({by_regs}, {by_smem}) |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
