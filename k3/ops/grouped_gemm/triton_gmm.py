"""The routed experts' weight-gradient GEMM in Triton.

Rows of the [S, *] operands are sorted by expert; `offs` [E] int32 holds each expert's end row (the
cumulative counts, as torch._grouped_mm takes them). `_gmm_wgrad`: C_e (+)= a[rows_e]^T @ b[rows_e] in
fp32, written (or added) straight into fp32 outputs, so the weight gradient lands in the master weight's
`.grad` with no bf16 round trip and no separate accumulation pass. The M rows of C may be split over two
outputs (w1's and w3's gradients of a packed gate|up GEMM): rows < M1 go to C1, the rest to C2.

(The forward and input-gradient GEMMs stay torch._grouped_mm, which was faster at k3-small's shapes:
docs/dev_log.md.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3.ops.grouped_gemm.reference import check_offs
from k3.ops.triton_utils import INTERPRETED

# Weight-gradient GEMM program: (rows of C, columns of C, reduction step), warps, pipeline stages --
# the standard Hopper tile for bf16 GEMMs (bench/grouped_gemm.py; tests set smaller tiles).
WGRAD_TILE = (128, 128, 64)
WGRAD_WARPS, WGRAD_STAGES = 8, 4


@triton.jit
def _gmm_wgrad(A, B, C1, C2, offs_ptr, M, N, M1, stride_am, stride_bm,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ACCUMULATE: tl.constexpr,
               IEEE: tl.constexpr):
    """C_e[m, n] (+)= sum over rows r of expert e of A[r, m] * B[r, n], fp32. C1 [E, M1, N] takes rows
    m < M1, C2 [E, M - M1, N] the rest (C2 unused when M1 == M). Grid: (cdiv(M, BM) * cdiv(N, BN), E)."""
    pid = tl.program_id(0)
    e = tl.program_id(1)
    n_tiles = tl.cdiv(N, BN)
    pm, pn = pid // n_tiles, pid % n_tiles
    r1 = tl.load(offs_ptr + e)
    r0 = tl.load(offs_ptr + e - 1, mask=e > 0, other=0)
    ms = pm * BM + tl.arange(0, BM)
    ns = pn * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], tl.float32)
    a_ptrs = A + (r0 + ks).to(tl.int64)[:, None] * stride_am + ms[None, :]
    b_ptrs = B + (r0 + ks).to(tl.int64)[:, None] * stride_bm + ns[None, :]
    for k0 in range(r0, r1, BK):
        kmask = (k0 + ks) < r1
        a = tl.load(a_ptrs, mask=kmask[:, None] & (ms < M)[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=kmask[:, None] & (ns < N)[None, :], other=0.0)
        if IEEE or INTERPRETED:  # fp32 operands exactly; the interpreter's half-precision dot is wrong
            acc = tl.dot(tl.trans(a).to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(tl.trans(a), b, acc)
        a_ptrs += BK * stride_am
        b_ptrs += BK * stride_bm
    # the tile lies wholly in C1 or wholly in C2 (BM divides M1)
    if pm * BM < M1:
        c_ptrs = C1 + e.to(tl.int64) * M1 * N + ms[:, None] * N + ns[None, :]
        cmask = (ms < M1)[:, None] & (ns < N)[None, :]
    else:
        c_ptrs = C2 + e.to(tl.int64) * (M - M1) * N + (ms - M1)[:, None] * N + ns[None, :]
        cmask = (ms < M)[:, None] & (ns < N)[None, :]
    if ACCUMULATE:
        acc += tl.load(c_ptrs, mask=cmask, other=0.0)
    tl.store(c_ptrs, acc, mask=cmask)


def gmm_wgrad(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, outs: tuple[torch.Tensor, ...],
              accumulate: bool) -> None:
    """Per expert e: C_e (+)= a[rows_e]^T @ b[rows_e] in fp32, C = outs concatenated along dim 1.

    Args:
        a: [S, M], b: [S, N]: bf16 / fp16 / fp32, one dtype, rows sorted by expert, unit column stride.
        offs: [E] int32 cumulative row counts.
        outs: one [E, M, N] or two [E, M1, N], [E, M - M1, N] contiguous fp32 tensors (e.g. w1.grad and
            w3.grad of a packed gate|up GEMM), written in place.
        accumulate: add to outs (True) or overwrite them (False).
    """
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[0] or a.dtype != b.dtype:
        raise ValueError(f"gmm_wgrad takes a [S, M] and b [S, N] of one dtype, got {list(a.shape)} {a.dtype}, "
                         f"{list(b.shape)} {b.dtype}")
    if len(outs) not in (1, 2):
        raise ValueError(f"gmm_wgrad writes one or two outputs, got {len(outs)}")
    E = outs[0].shape[0]
    check_offs(offs, E)
    M, N = a.shape[1], b.shape[1]
    M1 = outs[0].shape[1]
    shapes = [list(o.shape) for o in outs]
    want = [[E, M, N]] if len(outs) == 1 else [[E, M1, N], [E, M - M1, N]]
    if shapes != want or any(o.dtype != torch.float32 or not o.is_contiguous() for o in outs):
        raise ValueError(f"gmm_wgrad outputs must be contiguous fp32 {want}, got {shapes} "
                         f"{[o.dtype for o in outs]}")
    a = a if a.stride(1) == 1 else a.contiguous()
    b = b if b.stride(1) == 1 else b.contiguous()
    bm, bn, bk = WGRAD_TILE
    bm, bn = min(bm, max(16, triton.next_power_of_2(M))), min(bn, max(16, triton.next_power_of_2(N)))
    while len(outs) == 2 and M1 % bm and bm > 16:  # a row tile must not straddle the two outputs
        bm //= 2
    if len(outs) == 2 and M1 % bm:
        raise ValueError(f"gmm_wgrad: the split row {M1} must be a multiple of 16")
    warps, stages = WGRAD_WARPS, WGRAD_STAGES
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn), E)
    _gmm_wgrad[grid](a, b, outs[0], outs[-1], offs, M, N, M1, a.stride(0), b.stride(0),
                     BM=bm, BN=bn, BK=bk, ACCUMULATE=accumulate, IEEE=a.dtype == torch.float32, num_warps=warps, num_stages=stages)
