"""The routed experts' weight-gradient GEMMs: k3's Triton kernel (k3.ops.grouped_gemm, fp32 accumulation
into the master gradients inside the GEMM) against torch._grouped_mm + the fp32 gradient add, k3-small's
experts (65,536 tokens per micro-batch, top-8 of 64 experts, L = I = 512):

  dw13   d_ab^T xs per expert -> [E, 2I, L]  (into w1.grad and w3.grad)
  dw2    dy^T h per expert -> [E, L, I]      (into w2.grad)

Each k3 row is a tile config (the WGRAD_* constants of k3/ops/grouped_gemm/triton_gmm.py), checked against torch's result (whose bf16 output rounding
is most of the difference). Prints ms, TFLOP/s, roof fraction and the speed against torch in the same run.

Usage: python bench/grouped_gemm.py [--tokens 65536] [--configs all|default]
"""

from __future__ import annotations

import argparse

import torch

from bench.grouped_mm import add_shape_args, counts

ROOF = 790e12
WGRAD_CONFIGS = [  # BM, BN, BK, warps, stages (first: the default)
    (128, 128, 64, 8, 4), (128, 128, 64, 4, 4), (128, 128, 64, 8, 5), (128, 128, 64, 4, 5),
    (128, 128, 32, 4, 6), (64, 256, 64, 8, 4), (128, 64, 64, 4, 4), (256, 128, 64, 8, 3),
]


def set_tile(cfg: tuple[int, int, int, int, int]) -> None:
    """(BM, BN, BK, warps, stages) into the weight-gradient kernel's module constants (read per call)."""
    from k3.ops.grouped_gemm import triton_gmm

    triton_gmm.WGRAD_TILE, (triton_gmm.WGRAD_WARPS, triton_gmm.WGRAD_STAGES) = cfg[:3], cfg[3:]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_args(ap)
    ap.add_argument("--configs", default="all", choices=["all", "default"])
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/grouped_gemm.py needs a CUDA device")
    from triton.testing import do_bench

    from k3.ops.grouped_gemm.triton_gmm import gmm_wgrad

    gen = torch.Generator(device="cuda").manual_seed(0)
    S, E, L, I = args.tokens * args.top_k, args.experts, args.latent, args.inter
    c = counts(S, E, args.spread, torch.Generator().manual_seed(0))
    offs = torch.cumsum(c, 0).to(device="cuda", dtype=torch.int32)
    bf = torch.bfloat16

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(bf)

    xs, h, d_ab, dy = rnd(S, L), rnd(S, I), rnd(S, 2 * I), rnd(S, L)
    g1, g3, g2 = (torch.zeros(E, I, L, device="cuda") for _ in range(3))
    gm = torch._grouped_mm
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; {S} slots over {E} experts "
          f"(counts {int(c.min())}-{int(c.max())}), L {L}, I {I}")
    print("| GEMM | path | config | ms | TFLOP/s | roof | torch / this | max rel diff |")
    print("|---|---|---|---:|---:|---:|---:|---:|")

    def row(name: str, path: str, cfg: str, ms: float, flops: float, base: float, diff: float) -> None:
        print(f"| {name} | {path} | {cfg} | {ms:.3f} | {flops / ms / 1e9:.0f} | {flops / ms / 1e9 * 1e12 / ROOF:.2f} "
              f"| {base / ms:.2f} | {diff:.1e} |", flush=True)

    wg = {
        "dw13": (d_ab, xs, (g1, g3), 2.0 * S * 2 * I * L),
        "dw2": (dy, h, (g2,), 2.0 * S * L * I),
    }
    wg_cfgs = WGRAD_CONFIGS if args.configs == "all" else WGRAD_CONFIGS[:1]
    for name, (a, b, outs, flops) in wg.items():
        def torch_path() -> None:  # as k3.model.step_weights adds each master's slice
            g = gm(a.t(), b, offs=offs)
            off = 0
            for o in outs:
                o.add_(g.narrow(1, off, o.shape[1]))
                off += o.shape[1]

        ref = gm(a.t(), b, offs=offs).float()
        base = do_bench(torch_path, warmup=25, rep=100)
        row(name, "torch._grouped_mm + add_", "", base, flops, base, 0.0)
        for cfg in wg_cfgs:
            set_tile(cfg)
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
