"""Paged MLA decode attention (flash-decoding) in Triton, reading the latent pages in place.

One query token per row, weight-absorbed MLA (see reference.py for the maths). The sequence of each
row is cut into `num_splits` equal spans; program (row, head block, split) walks only the tokens of
its span that the row really has (lens[b]), looks their pages up in the row's page table, and keeps
an online softmax in fp32. A second, tiny kernel merges the splits by their log-sum-exp.

CUDA-graph safety: the launch reads no tensor value on the host and every shape (the partial
buffers, both grids) follows from the argument shapes and `num_splits`, which the caller fixes per
bucket (`default_num_splits` only looks at shapes). The amount of work inside follows the device
lengths: a row of 3 tokens in a 32K-token bucket reads 3 latent rows. A row with lens[b] == 0 reads
nothing and gets zeros, so padding rows need no valid page.

Precision: scores and softmax in fp32. For fp32 caches the dots are exact fp32 (`ieee`); for bf16 /
fp16 caches q and p are rounded to the cache dtype for the tensor-core dots (fp32 accumulation),
as flash attention does: about 3 significant digits per product, see the tests' tolerances.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from k3.ops.backend import triton_runs_on
from k3.ops.kda.triton_common import INTERPRETED, _cvt

__all__ = ["paged_mla_decode", "default_num_splits"]

MAX_SPLITS = 64
MIN_SPLIT_TOKENS = 256  # the heuristic never cuts a bucket into spans shorter than this
_LOG2E = 1.4426950408889634
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b with fp32 accumulation. Under the CPU interpreter, whose half-precision dot is wrong,
    half operands (already rounded like the GPU rounds them) are multiplied as fp32."""
    if IEEE or INTERPRETED:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _split_kernel(
    q_lat, q_pe, cache, tables, lens, o_part, lse_part,
    scale_log2, num_heads, num_splits, max_len,
    s_qn, s_qh, s_pn, s_ph, s_cb, s_cs, s_tn, s_tp,
    R: tl.constexpr, ROPE: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    b = tl.program_id(0)
    hb = tl.program_id(1)
    sp = tl.program_id(2)
    length = tl.minimum(tl.maximum(tl.load(lens + b).to(tl.int32), 0), max_len)
    chunk = tl.cdiv(tl.cdiv(length, num_splits), BLOCK_N) * BLOCK_N  # spans start on block edges
    start = sp * chunk
    end = tl.minimum(start + chunk, length)

    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, BLOCK_R)
    offs_e = tl.arange(0, BLOCK_E)
    m_h, m_r, m_e = offs_h < num_heads, offs_r < R, offs_e < ROPE
    b64 = b.to(tl.int64)
    q = tl.load(q_lat + b64 * s_qn + offs_h[:, None] * s_qh + offs_r[None, :],
                mask=m_h[:, None] & m_r[None, :], other=0.0)
    qp = tl.load(q_pe + b64 * s_pn + offs_h[:, None] * s_ph + offs_e[None, :],
                 mask=m_h[:, None] & m_e[None, :], other=0.0)
    if IEEE:
        q, qp = q.to(tl.float32), qp.to(tl.float32)
    else:
        q, qp = _cvt(q, cache.dtype.element_ty), _cvt(qp, cache.dtype.element_ty)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    for t0 in range(start, end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        m_t = t < end
        blk = tl.load(tables + b64 * s_tn + (t // PAGE) * s_tp, mask=m_t, other=0).to(tl.int64)
        row = blk * s_cb + (t % PAGE) * s_cs
        # masks constant along the row when the tile is exactly r / rope wide: 16-byte vector loads
        if BLOCK_R == R:
            c = tl.load(cache + row[:, None] + offs_r[None, :], mask=m_t[:, None], other=0.0)
        else:
            c = tl.load(cache + row[:, None] + offs_r[None, :], mask=m_t[:, None] & m_r[None, :], other=0.0)
        if BLOCK_E == ROPE:
            kp = tl.load(cache + row[:, None] + R + offs_e[None, :], mask=m_t[:, None], other=0.0)
        else:
            kp = tl.load(cache + row[:, None] + R + offs_e[None, :], mask=m_t[:, None] & m_e[None, :], other=0.0)
        s = _dot(q, tl.trans(c), IEEE) + _dot(qp, tl.trans(kp), IEEE)
        s = tl.where(m_t[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + _dot(p, c, IEEE)
        else:
            acc = acc * alpha[:, None] + _dot(_cvt(p, c.dtype), c, IEEE)
        m_i = m_new

    # an empty span keeps l_i == 0 and m_i == -inf; a non-empty one has l_i >= 1 (its maximum term)
    o = acc / tl.maximum(l_i, 1.0)[:, None]
    lse = tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, 1.0)), float("-inf"))
    base = (b64 * num_splits + sp) * num_heads + offs_h
    tl.store(o_part + base[:, None] * R + offs_r[None, :], o, mask=m_h[:, None] & m_r[None, :])
    tl.store(lse_part + base, lse, mask=m_h)


@triton.jit
def _combine_kernel(o_part, lse_part, out, num_heads, num_splits,
                    R: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    b = pid // num_heads
    h = pid % num_heads
    offs_s = tl.arange(0, BLOCK_S)
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)  # a slice of r: a small register tile
    m_s, m_r = offs_s < num_splits, offs_r < R
    idx = (b * num_splits + offs_s) * num_heads + h
    lse = tl.load(lse_part + idx, mask=m_s, other=float("-inf"))
    top = tl.max(lse, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)  # a zero-length row: every weight is 0
    w = tl.exp2(lse - top)
    den = tl.sum(w, axis=0)
    o = tl.load(o_part + idx[:, None] * R + offs_r[None, :], mask=m_s[:, None] & m_r[None, :], other=0.0)
    res = tl.sum(o * w[:, None], axis=0) / tl.where(den > 0, den, 1.0)
    tl.store(out + pid * R + offs_r, res, mask=m_r)


def default_num_splits(batch: int, num_heads: int, max_len: int, device: torch.device | str) -> int:
    """Splits per row for a bucket of `batch` rows and up to `max_len` tokens: about two programs
    per SM, never spans under MIN_SPLIT_TOKENS tokens. Depends on shapes only (graph-safe)."""
    device = torch.device(device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    programs = max(1, batch) * _head_blocks(num_heads)
    want = -(-2 * sms // programs)
    by_len = -(-max(1, max_len) // MIN_SPLIT_TOKENS)
    return max(1, min(want, by_len, MAX_SPLITS))


def _block_h(num_heads: int) -> int:
    return min(32, max(16, triton.next_power_of_2(num_heads)))


def _head_blocks(num_heads: int) -> int:
    return -(-num_heads // _block_h(num_heads))


def _check(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, page_tables: torch.Tensor,
           lens: torch.Tensor, scale: float, num_splits: int | None) -> None:
    """Shapes, dtypes and devices only: no tensor value is read (graph-safe)."""
    if q_lat.dim() != 3 or q_lat.shape[1] < 1 or q_lat.shape[2] < 1:
        raise ValueError(f"q_lat must be [N, H, r] with H, r >= 1, got {tuple(q_lat.shape)}")
    n, h, r = q_lat.shape
    if q_pe.dim() != 3 or tuple(q_pe.shape[:2]) != (n, h):
        raise ValueError(f"q_pe must be [N, H, rope] = [{n}, {h}, rope], got {tuple(q_pe.shape)}")
    if cache.dim() != 3 or cache.shape[2] != r + q_pe.shape[2]:
        raise ValueError(f"cache must be [num_blocks, page_size, r + rope] = [*, *, {r + q_pe.shape[2]}], "
                         f"got {tuple(cache.shape)}")
    for name, t in (("q_lat", q_lat), ("q_pe", q_pe), ("cache", cache)):
        if t.dtype not in _FLOATS:
            raise ValueError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")
    if page_tables.dim() != 2 or page_tables.shape[0] != n or page_tables.shape[1] < 1:
        raise ValueError(f"page_tables must be [N, P] = [{n}, P >= 1], got {tuple(page_tables.shape)}")
    if lens.dim() != 1 or lens.shape[0] != n:
        raise ValueError(f"lens must be [N] = [{n}], got {tuple(lens.shape)}")
    for name, t in (("page_tables", page_tables), ("lens", lens)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    for name, t in (("q_pe", q_pe), ("cache", cache), ("page_tables", page_tables), ("lens", lens)):
        if t.device != q_lat.device:
            raise ValueError(f"{name} is on {t.device}, q_lat on {q_lat.device}: all inputs need one device")
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    if q_lat.device.type == "cpu" and not triton_runs_on(q_lat):
        raise ValueError("paged_mla_decode on CPU tensors needs TRITON_INTERPRET=1 (set before importing triton)")
    if num_splits is not None and (not isinstance(num_splits, int) or not 1 <= num_splits <= 1024):
        raise ValueError(f"num_splits must be an integer in [1, 1024] or None, got {num_splits!r}")


def paged_mla_decode(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, page_tables: torch.Tensor,
                     lens: torch.Tensor, scale: float, num_splits: int | None = None) -> torch.Tensor:
    """Absorbed-MLA decode attention over paged latents; the fast path of `mla_decode_reference`.

    q_lat: [N, H, r] float (the no-position query times W_uk; fp32 is fine for a bf16 cache);
    q_pe: [N, H, rope] float; cache: [num_blocks, page_size, r + rope] fp32 / bf16 / fp16, each token
    row [latent | k_pe] and contiguous (block and row strides are free, e.g. one layer of the pool
    `pages[:, layer]`); page_tables: [N, P] int32/int64 block ids; lens: [N] int32/int64 tokens to
    attend per row (clamped to [0, P * page_size]; 0 = padding row, output zeros).
    num_splits: spans per row (None: `default_num_splits`); keep it fixed for a CUDA graph.
    Returns [N, H, r] float32 (apply W_uv to get the per-head values).
    """
    _check(q_lat, q_pe, cache, page_tables, lens, scale, num_splits)
    n, h, r = q_lat.shape
    rope, page = q_pe.shape[2], cache.shape[1]
    max_len = page_tables.shape[1] * page
    splits = num_splits or default_num_splits(n, h, max_len, q_lat.device)
    if n == 0:
        return torch.zeros(0, h, r, dtype=torch.float32, device=q_lat.device)
    ieee = cache.dtype == torch.float32
    block_h, block_r = _block_h(h), max(16, triton.next_power_of_2(r))
    # a [BLOCK_N, BLOCK_R] latent tile of at most 32 KiB (shared memory for two pipeline stages + q)
    block_n = max(16, min(64, 32768 // (block_r * (4 if ieee else 2))))
    o_part = torch.empty(n, splits, h, r, dtype=torch.float32, device=q_lat.device)
    lse_part = torch.empty(n, splits, h, dtype=torch.float32, device=q_lat.device)
    _split_kernel[(n, _head_blocks(h), splits)](
        q_lat, q_pe, cache, page_tables, lens, o_part, lse_part,
        float(scale) * _LOG2E, h, splits, max_len,
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1),
        cache.stride(0), cache.stride(1), page_tables.stride(0), page_tables.stride(1),
        R=r, ROPE=rope, PAGE=page, BLOCK_H=block_h, BLOCK_R=block_r,
        BLOCK_E=max(16, triton.next_power_of_2(rope)), BLOCK_N=block_n, IEEE=ieee,
        num_warps=8 if block_h * block_r >= 8192 else 4, num_stages=2,
    )
    if splits == 1:
        return o_part[:, 0]
    out = torch.empty(n, h, r, dtype=torch.float32, device=q_lat.device)
    block_s = max(2, triton.next_power_of_2(splits))
    block_rc = min(block_r, max(16, 4096 // block_s))
    _combine_kernel[(n * h, triton.cdiv(r, block_rc))](o_part, lse_part, out, h, splits, R=r,
                                                        BLOCK_S=block_s, BLOCK_R=block_rc)
    return out
