"""MXFP4 grouped GEMM (weights dequantised in registers) against the decode-then-GEMM spec.

Without CUDA the Triton kernel runs under TRITON_INTERPRET=1 on small shapes (CI); on a GPU the same
tests plus real expert sizes (k3-small, kimi-k3 slices) marked `gpu`.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from k3.ops.mxfp4_gemm import (Mxfp4GemmConfig, from_kernel_order, mxfp4_dequant, mxfp4_grouped_mm,  # noqa: E402
                               to_kernel_order, uses_dequant)
from k3.ops.mxfp4_gemm.triton_mxfp4 import Mxfp4Tiles  # noqa: E402
from k3.ops.mxfp4_gemm.reference import mxfp4_gmm_reference  # noqa: E402
from k3.quant.mxfp4 import decode_mxfp4  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = Mxfp4Tiles(bm=16, bn=16, bk=64, warps=4, stages=1)


def _weights(E: int, N: int, K: int, gen: torch.Generator):
    packed = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, generator=gen)
    scale = torch.randint(118, 130, (E, N, K // 32), dtype=torch.uint8, generator=gen)
    return packed.to(DEV), scale.to(DEV)


def _offs(counts: list[int]) -> torch.Tensor:
    return torch.cumsum(torch.tensor(counts), 0).to(DEV, torch.int32)


def _spec64(x, packed, scale, counts):
    """float64 per-expert sums of the exactly decoded weights."""
    out = torch.zeros(x.shape[0], packed.shape[1], dtype=torch.float64)
    start = 0
    for e, c in enumerate(counts):
        w = decode_mxfp4(packed[e].cpu(), scale[e].cpu(), dtype=torch.float32).double()
        out[start:start + c] = x[start:start + c].cpu().double() @ w.t()
        start += c
    return out


@pytest.mark.parametrize("counts,N,K,tiles", [
    ([3, 0, 20, 1, 0], 40, 64, SMALL),        # empty experts, N not a tile multiple, two K tiles
    ([0, 0, 37], 16, 96, SMALL),               # leading empty experts, rows over three M tiles; BK fits K
    ([1, 1, 1, 1], 32, 32, Mxfp4Tiles(16, 32, 32, 4, 1)),  # decode-like: one row per expert
    ([5, 9, 0, 2], 48, 128, None),             # default tile choice (decode tiles)
    ([1, 0, 2, 1], 64, 256, Mxfp4Tiles(16, 16, 32, 4, 1, split_k=3)),  # split K (8 K tiles in 3 ranges)
    ([0, 130, 0, 7], 24, 64, Mxfp4Tiles(128, 16, 64, 4, 1)),  # prefill-size row tiles, rows over two of them
    # narrower MMAs for last tiles: 0..64 rows -> 64, 65..80 -> 64 + 16, 81..96 -> 64 + 32, else 128
    ([150, 70, 0, 85, 100, 20, 80, 96, 97], 24, 64, Mxfp4Tiles(128, 16, 64, 4, 1, split_rows=True)),
])
def test_kernel_fp32_against_spec(counts, N, K, tiles):
    """fp32 activations: the kernel equals the float64 spec to fp32 rounding, the reference too."""
    g = torch.Generator().manual_seed(0)
    E, S = len(counts), sum(counts)
    packed, scale = _weights(E, N, K, g)
    x = torch.randn(S, K, generator=g).to(DEV)
    offs = _offs(counts)
    want = _spec64(x, packed, scale, counts)
    y = mxfp4_grouped_mm(x, packed, scale, offs, tiles=tiles, use_triton=True)
    ref = mxfp4_grouped_mm(x, packed, scale, offs, use_triton=False)
    tol = 1e-5 * want.abs().max().item()
    assert y.shape == (S, N) and y.dtype == torch.float32
    assert (y.cpu().double() - want).abs().max().item() <= tol
    assert (ref.cpu().double() - want).abs().max().item() <= tol


@pytest.mark.parametrize("counts,tiles,ko", [
    ([4, 0, 17], SMALL, False),
    # every split_rows branch (64, 64 + 16, 64 + 32, 128 rows), kernel-order bytes (the GPU's asm decode)
    ([150, 70, 0, 85, 20, 97], Mxfp4Tiles(128, 64, 64, 4, 2, perm=4, split_rows=True), True),
])
def test_kernel_bf16_matches_reference(counts, tiles, ko):
    """bf16 activations: bf16-rounded outputs of the same fp32 sums (at most one bf16 ulp apart)."""
    g = torch.Generator().manual_seed(1)
    N, K = 64, 128
    packed, scale = _weights(len(counts), N, K, g)
    x = torch.randn(sum(counts), K, generator=g).to(DEV, torch.bfloat16)
    offs = _offs(counts)
    y = mxfp4_grouped_mm(x, to_kernel_order(packed) if ko else packed, scale, offs, tiles=tiles,
                         use_triton=True, kernel_order=ko)
    want = _spec64(x, packed, scale, counts)
    assert y.dtype == torch.bfloat16
    assert torch.allclose(y.cpu().double(), want, rtol=2 ** -7, atol=1e-3 * want.abs().max().item())


def test_kernel_fp16_and_scale_range():
    """Half-precision activations over the decoder's exact scale range (bf16: E8M0 bytes 34..160, weights
    2^-94 .. 6 * 2^33; fp16: weights within fp16's range): every weight and every product with an
    activation is exact, so the half-precision kernel's fp32 sums equal the fp32 kernel's on the same
    (upcast) activations, which are within fp32 rounding of the float64 spec."""
    g = torch.Generator().manual_seed(3)
    counts, N, K = [2, 3], 32, 64
    packed = torch.randint(0, 256, (2, N, K // 2), dtype=torch.uint8, generator=g).to(DEV)
    offs = _offs(counts)
    for dtype, lo, hi in ((torch.float16, 118, 134), (torch.bfloat16, 34, 161)):
        scale = torch.randint(lo, hi, (2, N, K // 32), dtype=torch.uint8, generator=g).to(DEV)
        x = torch.randn(sum(counts), K, generator=g).to(DEV, dtype)
        y32 = mxfp4_grouped_mm(x.float(), packed, scale, offs, tiles=SMALL, use_triton=True)
        want = _spec64(x, packed, scale, counts)
        assert ((y32.cpu().double() - want).abs() <= 1e-5 * want.abs().amax(1, keepdim=True)).all()
        y = mxfp4_grouped_mm(x, packed, scale, offs, tiles=SMALL, use_triton=True).cpu()
        want16 = y32.cpu().to(dtype)
        assert y.dtype == dtype
        if DEV == "cpu":  # the interpreter sums in the same order: the same bits
            assert torch.equal(y, want16), dtype
        else:  # tensor cores sum in another order: at most one ulp of the output dtype apart
            assert torch.allclose(y.float(), want16.float(), rtol=torch.finfo(dtype).eps, atol=0), dtype


@pytest.mark.parametrize("perm,bk", [(0, 64), (3, 32), (3, 128), (4, 64), (4, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_k_orders_decode_exactly(perm, bk, dtype):
    """One-hot rows pick single weights: y[r, n] = W[n, k] exactly for every K order of the operands
    (bf16: the GPU's asm decode where it runs), over the whole exact scale range (E8M0 bytes 34..160)."""
    g = torch.Generator().manual_seed(4)
    E, N, K = 2, 16, 128
    packed = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, generator=g).to(DEV)
    scale = torch.randint(34, 161, (E, N, K // 32), dtype=torch.uint8, generator=g).to(DEV)
    x = torch.eye(K).repeat(E, 1).to(DEV, dtype)  # expert e gets the K one-hot rows
    offs = _offs([K] * E)
    y = mxfp4_grouped_mm(x, to_kernel_order(packed) if perm == 4 else packed, scale, offs, use_triton=True,
                         tiles=Mxfp4Tiles(16, 16, bk, 4, 1, perm=perm), kernel_order=perm == 4).cpu()
    for e in range(E):
        w = decode_mxfp4(packed[e].cpu(), scale[e].cpu(), dtype=torch.float32)
        assert torch.equal(y[e * K:(e + 1) * K].float(), w.t()), e


@pytest.mark.parametrize("kernel_order", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequant_exact(kernel_order, dtype):
    """The Triton decode into a scratch equals decode_mxfp4 bit for bit over the exact scale range (E8M0
    bytes 34..160), both byte orders; rows not a multiple of the kernel's row block."""
    g = torch.Generator().manual_seed(5)
    packed = torch.randint(0, 256, (3, 7, 64), dtype=torch.uint8, generator=g).to(DEV)
    scale = torch.randint(34, 161, (3, 7, 4), dtype=torch.uint8, generator=g).to(DEV)
    want = decode_mxfp4(packed.cpu(), scale.cpu(), dtype=dtype)
    got = mxfp4_dequant(to_kernel_order(packed) if kernel_order else packed, scale, kernel_order=kernel_order,
                        dtype=dtype, use_triton=True)
    assert got.dtype == dtype and torch.equal(got.cpu(), want)
    ref = mxfp4_dequant(to_kernel_order(packed) if kernel_order else packed, scale, kernel_order=kernel_order,
                        dtype=dtype, use_triton=False)
    assert torch.equal(ref.cpu(), want)
    with pytest.raises(ValueError, match="scale"):
        mxfp4_dequant(packed, scale[..., :2].contiguous())


def test_dequant_route():
    """Many rows per expert in bf16: decode into a scratch + torch._grouped_mm, the same bits as
    torch._grouped_mm on the decoded weights; the rule reads host values only."""
    assert uses_dequant(65536, 64, 1024, 512, torch.bfloat16)  # k3-small prefill 8192: 1024 rows per expert
    assert not uses_dequant(131072, 896, 6144, 3584, torch.bfloat16)  # kimi-k3 prefill: 146 rows per expert
    assert not uses_dequant(896 * 1024, 896, 6144, 3584, torch.bfloat16)  # a 39 GB scratch: over the limit
    assert not uses_dequant(65536, 64, 1024, 512, torch.float32)
    assert not uses_dequant(65536, 64, 1020, 512, torch.bfloat16)  # N not a multiple of 8
    assert not uses_dequant(65536, 64, 1024, 512, torch.bfloat16, Mxfp4GemmConfig(dequant_rows_per_expert=0))
    with pytest.raises(ValueError):
        Mxfp4GemmConfig(dequant_rows_per_expert=-1)
    g = torch.Generator().manual_seed(6)
    counts, N, K = [3, 0, 9], 24, 128
    packed, scale = _weights(3, N, K, g)
    x = torch.randn(sum(counts), K, generator=g).to(DEV, torch.bfloat16)
    offs = _offs(counts)
    cfg = Mxfp4GemmConfig(dequant_rows_per_expert=1)
    assert uses_dequant(x.shape[0], 3, N, K, x.dtype, cfg)
    y = mxfp4_grouped_mm(x, to_kernel_order(packed), scale, offs, kernel_order=True, use_triton=True, config=cfg)
    w = decode_mxfp4(packed, scale, dtype=torch.bfloat16)
    assert torch.equal(y, torch._grouped_mm(x, w.transpose(-2, -1), offs=offs))


def test_pick_tiles():
    """Decode tiles at a few rows per expert (narrower N tiles while the grid is small), larger row
    tiles with more rows."""
    from k3.ops.mxfp4_gemm.triton_mxfp4 import DECODE_TILES, MID_TILES, PREFILL_TILES, pick_tiles

    assert pick_tiles(16, 896, 6144, 3584) == DECODE_TILES  # kimi-k3 batch 1: 16 experts x 96 N tiles
    assert pick_tiles(8, 64, 1024, 512).bn == 64  # k3-small w13 batch 1: 8 experts x 16 N tiles of 64
    assert pick_tiles(8, 64, 512, 512).bn == 64  # k3-small w2 batch 1: not below 64 (wgmma's M)
    assert pick_tiles(8, 64, 512, 512).split_k == 1
    assert pick_tiles(64 * 40, 64, 1024, 512) == MID_TILES
    assert pick_tiles(65536, 64, 1024, 512) == PREFILL_TILES
    with pytest.raises(ValueError, match="bk"):
        Mxfp4Tiles(16, 16, 48, 4, 1)
    with pytest.raises(ValueError, match="split_rows"):
        Mxfp4Tiles(64, 16, 64, 4, 1, split_rows=True)


def test_bad_inputs():
    g = torch.Generator().manual_seed(0)
    packed, scale = _weights(2, 16, 64, g)
    x = torch.randn(4, 64).to(DEV)
    offs = _offs([2, 2])
    with pytest.raises(ValueError, match="packed"):
        mxfp4_grouped_mm(x[:, :32], packed, scale, offs)
    with pytest.raises(ValueError, match="scale"):
        mxfp4_grouped_mm(x, packed, scale[:, :, :1].contiguous(), offs)
    with pytest.raises(ValueError, match="offs"):
        mxfp4_grouped_mm(x, packed, scale, offs.long())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("E,N,K,tokens,top_k", [(64, 1024, 512, 8, 8), (64, 512, 512, 4096, 8),
                                                (32, 6144, 3584, 16, 16), (32, 3584, 3072, 2048, 16)])
def test_gpu_real_sizes(E, N, K, tokens, top_k):
    """k3-small and (a slice of) kimi-k3 expert shapes, decode and prefill tile choices, bf16; at prefill
    both paths (decode + torch._grouped_mm where the rule takes it, and the fused kernel)."""
    g = torch.Generator().manual_seed(2)
    packed, scale = _weights(E, N, K, g)
    idx = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(tokens)]).flatten()
    counts = torch.bincount(idx, minlength=E).tolist()
    x = (torch.randn(sum(counts), K, generator=g) * 0.1).to(DEV, torch.bfloat16)
    offs = _offs(counts)
    ref = mxfp4_gmm_reference(x, packed, scale, offs)
    for cfg in (Mxfp4GemmConfig(), Mxfp4GemmConfig(dequant_rows_per_expert=0)):
        for ko in (False, True):
            y = mxfp4_grouped_mm(x, to_kernel_order(packed) if ko else packed, scale, offs, kernel_order=ko,
                                 config=cfg)
            assert torch.allclose(y.float(), ref.float(), rtol=2 ** -7,
                                  atol=1e-2 * ref.float().abs().max().item()), (cfg, ko)


def test_bench_smoke_cpu():
    """bench/mxfp4_gemm.py --smoke keeps working (tiny shapes, checks both GEMMs agree)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, str(root / "bench" / "mxfp4_gemm.py"), "--smoke", "--batches", "1,4",
                        "--prefill", "64", "--model", ""], capture_output=True, text=True, timeout=300, cwd=root)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "| smoke | w13 [64, 64] | decode 4 | 8 |" in r.stdout and "| 3.76x |" in r.stdout
