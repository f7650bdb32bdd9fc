"""Registers, spills and shared memory of k3's Triton kernels compiled for the H200 (sm_90), without a GPU.

Two steps. First a child process runs small calls of the chosen ops under the Triton interpreter
(TRITON_INTERPRET=1, CPU tensors with k3-small's feature sizes, few rows) and records every kernel
launch: argument types, integer specialisations (== 1, divisible by 16), constexpr values, warps,
stages, register cap. Then each distinct launch is compiled ahead of time for cuda:90 with Triton's
own toolchain (pointer arguments 16-byte aligned, as the JIT specialises them at launch) and the
cubin's resource usage is read with the cuobjdump shipped in Triton's wheel. Per kernel it prints
registers per thread, spilled bytes per thread (the cubin's stack frame; the device's `n_spills` is
this / 4), shared memory, how many programs fit on one SM (registers: 64K; shared memory: 227 KB; at most
64 warps and 32 programs), and the static SASS instruction count (the loops' bodies are what to compare).

Tiles that launchers pick from row or program counts (e.g. the KDA state scans' value block) follow
the small calls' counts, not k3-small's 64K-token micro-batch. The numbers depend on the Triton
version: use the device's (Triton 3.6 on the H200 of the device tool), installed aside with
`pip install --no-deps --target /tmp/t36 triton==3.6.0` and given as --triton-path (the recording
run keeps the installed Triton's interpreter, the one CI tests with). Checked against the device on 2026-12-01: the KDA key kernel at BK 32 / 64
and register caps 168 / 128 gave the same registers and spills as the H200 reported.

Usage: python bench/kernel_resources.py [--ops kda,shortconv,situ,attnres,moe,ce] [--triton-path /tmp/t36]
       [--sass DIR]                                                 # each kernel's SASS into DIR
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
REGS_PER_SM, SMEM_PER_SM, MAX_WARPS_PER_SM, MAX_PROGRAMS_PER_SM = 65536, 227 * 1024, 64, 32  # sm_90
OPTIONS = ("num_warps", "num_stages", "maxnreg")


# ---- step 1 (child process, interpreter): small calls of each op, launches recorded --------------
def _drivers():
    """op name -> a function making a small forward + backward of it (CPU, bf16, k3-small's widths)."""
    import torch
    import torch.nn.functional as F

    bf = torch.bfloat16

    def leaf(*shape, scale=1.0):
        return (torch.randn(*shape) * scale).to(bf).requires_grad_()

    def kda():
        from k3.ops.kda.chunk import chunk_kda

        T, H, D = 128, 8, 128
        q, k, v, f = leaf(1, T, H, D), leaf(1, T, H, D), leaf(1, T, H, D), leaf(1, T, H, D)
        beta = torch.randn(1, T, H, requires_grad=True)
        A_log, dt_bias = torch.zeros(H, requires_grad=True), torch.zeros(H * D, requires_grad=True)
        cu = torch.tensor([0, 50, T], dtype=torch.int32)
        o = chunk_kda(q, k, v, f, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0, cu_seqlens=cu,
                      use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)[0]
        o.float().sum().backward()

    def shortconv():
        from k3.ops.short_conv import short_conv_silu

        # as the model calls it: the fused KDA projection's 4,232-wide rows, two documents, passthrough columns
        x, w = leaf(1, 128, 4232), torch.randn(3 * 1024, 1, 4, requires_grad=True)
        cu = torch.tensor([0, 50, 128], dtype=torch.int32)
        outs = short_conv_silu(x, w, streams=3, cu_seqlens=cu, passthrough=(1024, 128, 8))
        sum(t.float().sum() for t in outs).backward()

    def situ():
        from k3.ops.situ import situ_glu

        situ_glu(leaf(128, 2 * 512), 3.0, 6.0).float().sum().backward()

    def attnres():
        from k3.ops.attn_res import attn_res_mix

        cands, wn, wp = [leaf(128, 1024) for _ in range(4)], torch.ones(1024), torch.zeros(1, 1024)
        attn_res_mix(cands, wn, wp, 1e-5).float().sum().backward()

    def moe():
        from k3.ops.moe_combine import moe_combine, moe_dispatch
        from k3.ops.moe_route import sort_slots_triton, topk_route

        N, E, k, d = 128, 64, 8, 1024
        idx = topk_route(torch.randn(N, E), k)
        _, inv, _ = sort_slots_triton(idx, E)
        y = moe_dispatch(leaf(N, d), inv, k)
        moe_combine(y, F.softmax(torch.randn(N, k), -1).requires_grad_(), inv).float().sum().backward()

    def ce():
        from k3.ops.cross_entropy import linear_cross_entropy

        linear_cross_entropy(leaf(128, 1024), leaf(32768, 1024, scale=0.02), torch.randint(0, 32768, (128,))).backward()

    return {"kda": kda, "shortconv": shortconv, "situ": situ, "attnres": attnres, "moe": moe, "ce": ce}


def _describe(fn, args: tuple, kwargs: dict) -> dict:
    """One launch: [(parameter, kind, value)] with kind "constexpr", a pointer type ("*bf16", with
    value = 16-byte aligned) or a scalar type ("i32", "i64", "fp32", "i1"; value = the int itself for
    the JIT's specialisations), and the launch options."""
    import torch

    names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
             torch.int32: "i32", torch.int64: "i64", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1"}
    options = {k: kwargs.pop(k) for k in OPTIONS if k in kwargs}
    params = inspect.signature(fn).parameters
    bound = dict(zip(params, args)) | kwargs
    out = []
    for name, p in params.items():
        v = bound.get(name, p.default)
        if "constexpr" in str(p.annotation) or v is None:
            out.append((name, "constexpr", v))
        elif isinstance(v, torch.Tensor):
            out.append((name, "*" + names[v.dtype], v.data_ptr() % 16 == 0))
        elif isinstance(v, bool):
            out.append((name, "i1", int(v)))
        elif isinstance(v, int):
            out.append((name, "i32" if -2 ** 31 <= v < 2 ** 31 else "i64", v))
        else:
            out.append((name, "fp32", float(v)))
    return {"module": fn.__module__, "name": fn.__name__, "params": out, "options": options}


def record(ops: list[str]) -> list[dict]:
    """Launches of the ops' small calls (run under the interpreter in this process)."""
    from triton.runtime.interpreter import InterpretedFunction

    launches, run = [], InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):  # noqa: ANN001, ANN202
        launches.append(_describe(self.fn, args, dict(kwargs)))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run
    drivers = _drivers()
    for op in ops:
        drivers[op]()
    return launches


# ---- step 2 (this process): ahead-of-time compile for sm_90, resources from the cubin -------------
def compile_launch(launch: dict):
    """triton's CompiledKernel for one recorded launch, specialised as the JIT would at that launch."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(launch["module"]), launch["name"])
    sig, constexprs, attrs = {}, {}, {}
    for i, (name, kind, value) in enumerate(launch["params"]):
        if kind == "constexpr" or (kind in ("i32", "i64") and value == 1):  # the JIT specialises 1
            sig[name], constexprs[(i,)] = "constexpr", value
            continue
        sig[name] = kind
        if (kind.startswith("*") and value) or (kind in ("i32", "i64") and value % 16 == 0):
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    opts = {"num_warps": 4, "num_stages": 3} | {k: v for k, v in launch["options"].items() if v is not None}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


def _cuobjdump(kernel, flag: str) -> str:  # noqa: ANN001 - a triton CompiledKernel
    """`cuobjdump <flag>` of the kernel's cubin (the cuobjdump shipped in Triton's wheel)."""
    import triton.backends.nvidia as nv

    tool = os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        return subprocess.run([tool, flag, path], capture_output=True, text=True, check=True).stdout


def resources(kernel) -> dict[str, int]:  # noqa: ANN001 - a triton CompiledKernel
    """{"regs", "stack", "smem"} of a compiled kernel, from cuobjdump --dump-resource-usage."""
    out = _cuobjdump(kernel, "--dump-resource-usage")
    fields = dict(tok.split(":", 1) for line in out.splitlines() if "REG:" in line for tok in line.split() if ":" in tok)
    return {"regs": int(fields["REG"]), "stack": int(fields["STACK"]), "smem": int(kernel.metadata.shared)}


def sass(kernel) -> str:  # noqa: ANN001 - a triton CompiledKernel
    """The kernel's SASS (cuobjdump -sass of its cubin)."""
    return _cuobjdump(kernel, "-sass")


def sass_count(text: str) -> int:
    """Static SASS instructions (lines "/*0a30*/  OP ..."), NOPs left out."""
    return sum(1 for line in text.splitlines() if line.lstrip().startswith("/*") and "*/" in line
               and line.split("*/", 1)[1].strip() and " NOP" not in line)


def _key_constexprs(launch: dict) -> str:
    """The launch's compile-time tile parameters (upper-case constexprs) for the table."""
    out = []
    for n, kind, v in launch["params"]:
        if kind != "constexpr" or not n.isupper() or n in ("H", "K", "V", "D"):
            continue
        if isinstance(v, bool):
            out += [n] if v else []  # switches that are on
        elif isinstance(v, (int, str)):
            out.append(f"{n}={v}")
    return " ".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", default="kda", help="comma-separated: kda, shortconv, situ, attnres, moe, ce")
    ap.add_argument("--triton-path", default="", help="a folder holding the device's Triton (first on sys.path)")
    ap.add_argument("--sass", default="", help="also write each kernel's SASS to this folder")
    ap.add_argument("--record", action="store_true", help=argparse.SUPPRESS)  # step 1, in the child
    args = ap.parse_args(argv)
    sys.path.insert(0, ROOT)
    if args.triton_path and not args.record:
        sys.path.insert(0, args.triton_path)
    ops = args.ops.split(",")
    if args.record:
        json.dump(record(ops), sys.stdout)
        return 0
    unknown = [op for op in ops if op not in ("kda", "shortconv", "situ", "attnres", "moe", "ce")]
    if unknown:
        raise SystemExit(f"unknown ops {unknown}")
    # the recording run uses the installed Triton's interpreter (what CI tests with); the launches it
    # records are k3's own choices, so only the compile below needs the device's Triton
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    child = subprocess.run([sys.executable, os.path.abspath(__file__), "--record", "--ops", args.ops],
                           capture_output=True, text=True, env=env)
    if child.returncode:
        raise SystemExit(f"recording run failed:\n{child.stderr[-3000:]}")
    os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU here
    import triton

    print(f"# Triton kernels on sm_90 (Triton {triton.__version__}, no GPU), ops {args.ops}")
    print("| kernel | tiles | warps | stages | maxnreg | registers | spilled B / thread | shared KB | programs / SM "
          "| SASS instructions |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    seen = set()
    for launch in json.loads(child.stdout):
        key = json.dumps(launch, sort_keys=True, default=str)
        if key in seen:
            continue
        seen.add(key)
        kernel = compile_launch(launch)
        r, code = resources(kernel), sass(kernel)
        if args.sass:
            os.makedirs(args.sass, exist_ok=True)
            with open(os.path.join(args.sass, f"{launch['name']}_{len(seen)}.sass"), "w") as f:
                f.write(code)
        o = launch["options"]
        warps = o.get("num_warps") or 4
        fits = min(REGS_PER_SM // (max(r["regs"], 1) * 32 * warps), SMEM_PER_SM // max(r["smem"], 1),
                   MAX_WARPS_PER_SM // warps, MAX_PROGRAMS_PER_SM)
        print(f"| {launch['name']} | {_key_constexprs(launch)} | {warps} | {o.get('num_stages') or 3} | "
              f"{o.get('maxnreg') or '-'} | {r['regs']} | {r['stack']} | {r['smem'] / 1024:.0f} | {fits} | "
              f"{sass_count(code)} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
