"""k3's Triton grouped GEMMs (k3.ops.grouped_gemm) against torch._grouped_mm, k3-small's routed experts.

The six expert GEMMs of a training micro-batch (65,536 tokens, top-8 of 64 experts, L = I = 512):

  fwd13  xs [S, L] @ w13^T -> [S, 2I]        fwd2  h [S, I] @ w2^T -> [S, L]
  dx13   d_ab [S, 2I] @ w13 -> [S, L]        dh    dy [S, L] @ w2 -> [S, I]
  dw13   d_ab^T xs per expert -> [E, 2I, L]  dw2   dy^T h per expert -> [E, L, I]

torch's weight gradients are timed as the model pays them today: the bf16 GEMM plus its addition into
the fp32 master gradient (`.grad += g`); k3's accumulate in fp32 inside the GEMM. Each k3 row is a tile
config (env K3_GMM_* / K3_GMMW_*), checked against torch's result. Prints ms, TFLOP/s, roof fraction and
the speed against torch in the same run.

Usage: python bench/grouped_gemm.py [--tokens 65536] [--configs all|default]
"""

from __future__ import annotations

import argparse
import os

import torch

ROOF = 790e12
ROW_CONFIGS = [  # BM, BN, BK, warps, stages, group
    (128, 128, 64, 8, 4, 8), (128, 256, 64, 8, 3, 8), (128, 128, 64, 4, 4, 8), (64, 256, 64, 4, 4, 8),
    (128, 256, 64, 8, 4, 8), (256, 128, 64, 8, 3, 8), (128, 128, 128, 8, 3, 8),
]
WGRAD_CONFIGS = [  # BM, BN, BK, warps, stages
    (128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (128, 128, 64, 4, 4), (256, 128, 64, 8, 3),
    (128, 128, 128, 8, 3), (64, 128, 64, 4, 4),
]


def counts(S: int, E: int, spread: float, gen: torch.Generator) -> torch.Tensor:
    w = (1 + spread * torch.randn(E, generator=gen)).clamp_min(0.05)
    c = torch.floor(w / w.sum() * S).long()
    c[: S - int(c.sum())] += 1
    return c


def set_env(prefix: str, names: tuple[str, ...], values: tuple[int, ...]) -> None:
    for n, v in zip(names, values):
        os.environ[f"{prefix}_{n}"] = str(v)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--latent", type=int, default=512)
    ap.add_argument("--inter", type=int, default=512)
    ap.add_argument("--spread", type=float, default=0.1)
    ap.add_argument("--configs", default="all", choices=["all", "default"])
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/grouped_gemm.py needs a CUDA device")
    from triton.testing import do_bench

    from k3.ops.grouped_gemm import gmm, gmm_wgrad

    gen = torch.Generator(device="cuda").manual_seed(0)
    S, E, L, I = args.tokens * args.top_k, args.experts, args.latent, args.inter
    c = counts(S, E, args.spread, torch.Generator().manual_seed(0))
    offs = torch.cumsum(c, 0).to(device="cuda", dtype=torch.int32)
    bf = torch.bfloat16

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(bf)

    xs, h, d_ab, dy = rnd(S, L), rnd(S, I), rnd(S, 2 * I), rnd(S, L)
    w13, w2 = rnd(E, 2 * I, L, scale=0.02), rnd(E, L, I, scale=0.02)
    g1, g3, g2 = (torch.zeros(E, I, L, device="cuda") for _ in range(3))
    gm = torch._grouped_mm
    rows = {
        "fwd13": (xs, w13.transpose(-2, -1), 2.0 * S * L * 2 * I),
        "fwd2": (h, w2.transpose(-2, -1), 2.0 * S * I * L),
        "dx13": (d_ab, w13, 2.0 * S * 2 * I * L),
        "dh": (dy, w2, 2.0 * S * L * I),
    }
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; {S} slots over {E} experts "
          f"(counts {int(c.min())}-{int(c.max())}), L {L}, I {I}")
    print("| GEMM | path | config | ms | TFLOP/s | roof | torch / this | max rel diff |")
    print("|---|---|---|---:|---:|---:|---:|---:|")

    def row(name: str, path: str, cfg: str, ms: float, flops: float, base: float, diff: float) -> None:
        print(f"| {name} | {path} | {cfg} | {ms:.3f} | {flops / ms / 1e9:.0f} | {flops / ms / 1e9 * 1e12 / ROOF:.2f} "
              f"| {base / ms:.2f} | {diff:.1e} |", flush=True)

    row_cfgs = ROW_CONFIGS if args.configs == "all" else ROW_CONFIGS[:1]
    for name, (a, b, flops) in rows.items():
        ref = gm(a, b, offs=offs)
        base = do_bench(lambda: gm(a, b, offs=offs), warmup=25, rep=100)
        row(name, "torch._grouped_mm", "", base, flops, base, 0.0)
        for cfg in row_cfgs:
            set_env("K3_GMM", ("BM", "BN", "BK", "WARPS", "STAGES", "GROUP"), cfg)
            try:
                out = gmm(a, b, offs)
                diff = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                ms = do_bench(lambda: gmm(a, b, offs), warmup=25, rep=100)
            except Exception as exc:  # noqa: BLE001 - a config may not fit shared memory
                print(f"| {name} | k3 | {cfg} | failed: {type(exc).__name__} | | | | |")
                continue
            row(name, "k3", str(cfg), ms, flops, base, diff)

    wg = {
        "dw13": (d_ab, xs, (g1, g3), 2.0 * S * 2 * I * L),
        "dw2": (dy, h, (g2,), 2.0 * S * L * I),
    }
    wg_cfgs = WGRAD_CONFIGS if args.configs == "all" else WGRAD_CONFIGS[:1]
    for name, (a, b, outs, flops) in wg.items():
        full = torch.cat(outs, 1) if len(outs) == 2 else outs[0]

        def torch_path() -> None:
            g = gm(a.t(), b, offs=offs)
            full.add_(g)

        ref = gm(a.t(), b, offs=offs).float()
        base = do_bench(torch_path, warmup=25, rep=100)
        row(name, "torch._grouped_mm + add_", "", base, flops, base, 0.0)
        for cfg in wg_cfgs:
            set_env("K3_GMMW", ("BM", "BN", "BK", "WARPS", "STAGES"), cfg)
            try:
                gmm_wgrad(a, b, offs, outs, False)
                got = torch.cat(outs, 1) if len(outs) == 2 else outs[0]
                diff = ((got - ref).abs().max() / ref.abs().max()).item()
                ms = do_bench(lambda: gmm_wgrad(a, b, offs, outs, True), warmup=25, rep=100)
            except Exception as exc:  # noqa: BLE001
                print(f"| {name} | k3 | {cfg} | failed: {type(exc).__name__}: {str(exc)[:80]} | | | | |")
                continue
            row(name, "k3 (fp32 accumulate)", str(cfg), ms, flops, base, diff)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
