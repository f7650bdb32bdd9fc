"""Triton grouped GEMMs over expert-sorted rows (the routed experts' training GEMMs).

Rows of the [S, *] operands are sorted by expert; `offs` [E] int32 holds each expert's end row (the
cumulative counts, as torch._grouped_mm takes them). Two kernels:

* `_gmm_rows`: out[r] = a[r] @ B_e for the rows r of expert e, B_e [K, N] read through strides from a
  stacked [E, ., .] weight (so w^T and w are both plain views: forward and input-gradient GEMMs).
  Programs walk (expert, row tile, column tile); a row tile never crosses an expert boundary (each
  expert's rows are cut into cdiv(count, BM) tiles), so no row is computed against a wrong weight.
* `_gmm_wgrad`: C_e (+)= a[rows_e]^T @ b[rows_e] in fp32, written (or added) straight into fp32 outputs:
  the weight gradient lands in the master weight's `.grad` with no bf16 round trip and no separate
  accumulation pass. The M rows of C may be split over two outputs (w1's and w3's gradients of a
  packed gate|up GEMM): rows < M1 go to c1, the rest to c2.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _expert_of_tile(offs_ptr, tile, E: tl.constexpr, EP: tl.constexpr, BM: tl.constexpr):
    """(expert, first row, end row) of row tile `tile` when every expert's rows are cut into BM-row
    tiles in expert order; expert == E when the tile is past the last one."""
    e_ids = tl.arange(0, EP)
    ends = tl.load(offs_ptr + e_ids, mask=e_ids < E, other=0)
    starts = tl.load(offs_ptr + e_ids - 1, mask=(e_ids > 0) & (e_ids < E), other=0)
    ends = tl.where(e_ids < E, ends, starts)
    tiles = (ends - starts + BM - 1) // BM
    cum = tl.cumsum(tiles, 0)
    e = tl.sum((cum <= tile).to(tl.int32), 0)
    before = tl.sum(tl.where(e_ids < e, tiles, 0), 0)
    start = tl.sum(tl.where(e_ids == e, starts, 0), 0)
    end = tl.sum(tl.where(e_ids == e, ends, 0), 0)
    return e, start + (tile - before) * BM, end


@triton.jit
def _gmm_rows(A, B, C, offs_ptr, N, K, stride_am, stride_be, stride_bk, stride_bn, stride_cm,
              E: tl.constexpr, EP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
              GROUP: tl.constexpr):
    """C[r, n] = sum_k A[r, k] * B[e(r), k, n] (B through its strides), fp32 accumulation, C in C's dtype.
    Grid: (row tiles upper bound) * cdiv(N, BN); A's K stride and C's N stride are 1."""
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BN)
    # GROUP consecutive row tiles share a column tile before moving on: B tiles stay in L2
    per_group = GROUP * n_tiles
    g = pid // per_group
    tile = g * GROUP + (pid % per_group) % GROUP
    pn = (pid % per_group) // GROUP
    e, r0, r1 = _expert_of_tile(offs_ptr, tile, E, EP, BM)
    if e >= E:
        return
    rows = r0 + tl.arange(0, BM)
    cols = pn * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    rmask = rows < r1
    a_ptrs = A + rows.to(tl.int64)[:, None] * stride_am + ks[None, :]
    b_ptrs = B + e.to(tl.int64) * stride_be + ks[:, None] * stride_bk + cols[None, :] * stride_bn
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        kmask = (k0 + ks) < K
        a = tl.load(a_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=kmask[:, None] & (cols < N)[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BK
        b_ptrs += BK * stride_bk
    c_ptrs = C + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :]
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=rmask[:, None] & (cols < N)[None, :])


@triton.jit
def _gmm_wgrad(A, B, C1, C2, offs_ptr, M, N, M1, stride_am, stride_bm,
               E: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
               ACCUMULATE: tl.constexpr):
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
