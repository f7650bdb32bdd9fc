"""Triton building blocks shared by the chunked KDA kernels (forward, backward).

Conventions used by every chunked KDA kernel:
  * chunk size 64 = 4 sub-blocks of 16 rows; the key dimension is processed in column chunks of
    BK (decay, cumulative decay and the factorised exponentials are per channel, so key chunks are
    independent; only the L2 norm needs whole rows: a pre-pass);
  * token-major tensors [T_total, H, D] (inputs, outputs) are addressed with block pointers whose
    row count is the number of tokens left in the sequence, so rows past its end read as zero and
    are never written;
  * intermediates handed from one kernel to the next (W, U, P, qg, kg, T, Vn, dR) are chunk-major
    and padded: [NC, H, 64, D], tile = chunk * H + head, rows past a sequence's end hold zeros
    (they are computed from zero-masked inputs), so the sequential kernels load whole contiguous
    tiles with no masks (pipelinable, no per-row bounds);
  * G is the within-chunk inclusive cumulative log-decay (a scan, or a dot with the 0/1 lower
    triangle);
  * mid[i] = G at row 16 i + 7 (the middle of sub-block i) is the reference of the factorised
    exponentials  exp(G_t - G_s) = exp(G_t - mid_i) * exp(mid_i - G_s)  for row block i.  With a
    per-step log-decay >= -5 both factors stay within exp(+-40) for s, t inside block i, and for
    s in an earlier block the column factor is <= 1, so every intra-chunk product is one dot.
"""

from __future__ import annotations


import triton
import triton.language as tl

from k3.ops.triton_utils import INTERPRETED
from k3.ops.triton_utils import cvt as _cvt


def _has_block_ptr() -> bool:
    major, minor = (int(x) for x in triton.__version__.split(".")[:2])
    return (major, minor) < (3, 7)


# Block pointers (Triton <= 3.6, e.g. the GPU image) keep no per-element address registers, which
# the sequential kernels need; newer Triton removed them, so there (CPU interpreter in CI) tiles
# are addressed with plain pointer arithmetic and masks.  Both paths compute the same tiles.
USE_BLOCK_PTR = tl.constexpr(_has_block_ptr())


# Under Triton's CPU interpreter (CI) the GPU's arithmetic is emulated where the interpreter differs:
# its bf16 dot is wrong, so half-operand dots run as fp32 dots of the same (already rounded) half
# values; tf32 dots truncate their operands to tf32 first (see _dot); and fp32 -> bf16 conversions,
# which the interpreter truncates, round to nearest even (see _cvt).  CI then sees the precision of
# the GPU kernels.


@triton.jit
def _exp(x):
    """e^x as one MUFU.EX2 (ex2.approx.ftz of x log2 e).  Triton's tl.exp adds a range check and
    rescaling for results below 2^-126 (four more instructions per element); here such results
    flush to zero, which no caller can tell from the true value."""
    return _exp2(x * 1.4426950408889634)


@triton.jit
def _expw(x, ACC: tl.constexpr):
    """e^x for wide arguments (cumulative decays down to about -320).  ex2.approx reads x log2 e
    rounded to fp32, whose error (ulp(461) / 2 = 3e-5) becomes the result's relative error; with
    ACC (fp32 inputs) the rounding residual is recovered by an fma and applied to first order."""
    if ACC:
        y = x * 1.4426950408889634
        r = tl.fma(x, 1.4426950408889634, -y) + x * 1.925963033500011e-08
        return _exp2(y) * (1.0 + r * 0.6931471805599453)
    else:
        return _exp(x)


@triton.jit
def _exp2(y):
    if INTERPRETED:
        return tl.exp2(y)
    else:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [y], dtype=tl.float32,
                                         is_pure=True, pack=1)


@triton.jit
def _ld(ptr, row64, nr, col0, H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr):
    """[64, BD] tile (storage dtype) of one chunk of a [T, H, D] tensor: rows = tokens of the chunk
    (row64 = first_token * H + head, int64), cols [col0, col0 + BD); rows >= nr (past the sequence
    end) read as zero."""
    if USE_BLOCK_PTR:
        p = tl.make_block_ptr(ptr + row64 * D, (nr, D), (H * D, 1), (0, col0), (64, BD), (1, 0))
        return tl.load(p, boundary_check=(0,), padding_option="zero")
    else:
        o_t = tl.arange(0, 64)
        offs = o_t[:, None] * (H * D) + col0 + tl.arange(0, BD)[None, :]
        return tl.load(ptr + row64 * D + offs, mask=(o_t < nr)[:, None], other=0.0)


@triton.jit
def _st(ptr, row64, nr, col0, x, H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr):
    """Store a [64, BD] chunk tile (rows >= nr are not written)."""
    if USE_BLOCK_PTR:
        p = tl.make_block_ptr(ptr + row64 * D, (nr, D), (H * D, 1), (0, col0), (64, BD), (1, 0))
        tl.store(p, _cvt(x, ptr.dtype.element_ty), boundary_check=(0,))
    else:
        o_t = tl.arange(0, 64)
        offs = o_t[:, None] * (H * D) + col0 + tl.arange(0, BD)[None, :]
        tl.store(ptr + row64 * D + offs, _cvt(x, ptr.dtype.element_ty), mask=(o_t < nr)[:, None])


@triton.jit
def _ldc(ptr, tile, col0, D: tl.constexpr, BD: tl.constexpr):
    """[64, BD] tile, columns [col0, col0 + BD), of a chunk-major padded [NC, H, 64, D] buffer
    (tile = chunk * H + head, int64): one contiguous block, no masks."""
    offs = tl.arange(0, 64)[:, None] * D + col0 + tl.arange(0, BD)[None, :]
    return tl.load(ptr + tile * (64 * D) + offs)


@triton.jit
def _stc(ptr, tile, col0, x, D: tl.constexpr, BD: tl.constexpr):
    """Store a [64, BD] tile into a chunk-major padded buffer (all 64 rows)."""
    offs = tl.arange(0, 64)[:, None] * D + col0 + tl.arange(0, BD)[None, :]
    tl.store(ptr + tile * (64 * D) + offs, _cvt(x, ptr.dtype.element_ty))


@triton.jit
def _ld_state(ptr, base64, r0, c0, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """[BK, BV] tile at (r0, c0) of the row-major [K, V] state starting at element base64."""
    if USE_BLOCK_PTR:
        p = tl.make_block_ptr(ptr + base64, (r0 + BK, V), (V, 1), (r0, c0), (BK, BV), (1, 0))
        return tl.load(p)
    else:
        offs = (r0 + tl.arange(0, BK))[:, None] * V + c0 + tl.arange(0, BV)[None, :]
        return tl.load(ptr + base64 + offs)


@triton.jit
def _st_state(ptr, base64, r0, c0, x, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    if USE_BLOCK_PTR:
        p = tl.make_block_ptr(ptr + base64, (r0 + BK, V), (V, 1), (r0, c0), (BK, BV), (1, 0))
        tl.store(p, _cvt(x, ptr.dtype.element_ty))
    else:
        offs = (r0 + tl.arange(0, BK))[:, None] * V + c0 + tl.arange(0, BV)[None, :]
        tl.store(ptr + base64 + offs, _cvt(x, ptr.dtype.element_ty))


@triton.jit
def _beta(beta, row64, m_t, H: tl.constexpr, BSIG: tl.constexpr):
    """beta for the 64 rows of a chunk (fp32, 0 past the end), sigmoid applied when BSIG."""
    b = tl.load(beta + row64 + tl.arange(0, 64).to(tl.int64) * H, mask=m_t, other=0.0).to(tl.float32)
    if BSIG:
        b = tl.where(m_t, 1.0 / (1.0 + _exp(-b)), 0.0)
    return b


@triton.jit
def _rnorms(q, k, row64, nr, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, L2: tl.constexpr):
    """1 / ||x|| (eps 1e-6 inside the sqrt) of the q and k rows, or ones without L2."""
    if L2:
        sq = tl.zeros([64], dtype=tl.float32)
        sk = tl.zeros([64], dtype=tl.float32)
        for kc in range(K // BK):
            bq = _ld(q, row64, nr, kc * BK, H, K, BK).to(tl.float32)
            bk = _ld(k, row64, nr, kc * BK, H, K, BK).to(tl.float32)
            sq += tl.sum(bq * bq, axis=1)
            sk += tl.sum(bk * bk, axis=1)
        return tl.rsqrt(sq + 1e-6), tl.rsqrt(sk + 1e-6)
    else:
        return tl.full([64], 1.0, tl.float32), tl.full([64], 1.0, tl.float32)


@triton.jit
def _gate(graw, A_log, dt_bias, i_h, col0, m_t, lower_bound, K: tl.constexpr, BK: tl.constexpr,
          GATE: tl.constexpr):
    """Log-decay chunk [64, BK] from the loaded g (raw f when GATE), 0 on rows past the end."""
    if GATE:
        a = _exp(tl.load(A_log + i_h).to(tl.float32))
        bias = tl.load(dt_bias + i_h * K + col0 + tl.arange(0, BK)).to(tl.float32)
        return tl.where(m_t[:, None], lower_bound / (1.0 + _exp(-a * (graw + bias[None, :]))), 0.0)
    else:
        return graw


@triton.jit
def _sdot(a, b, PREC: tl.constexpr):
    """Dot of operands already in the storage dtype, fp32 accumulation.

    PREC "half": bf16/fp16 operands straight into the tensor cores (the state / value dots of
    half-precision inputs: their operands are stored in that dtype anyway); otherwise fp32 operands
    at "tf32" / "tf32x3"."""
    if PREC == "half":
        if INTERPRETED:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            return tl.dot(a, b)
    else:
        return _dot(a, b, PREC)


@triton.jit
def _tf32_round(x):
    """fp32 -> nearest tf32 value (10-bit mantissa, ties away from zero), kept in fp32."""
    u = x.to(tl.uint32, bitcast=True)
    return ((u + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)


@triton.jit
def _tf32_trunc(x):
    """fp32 -> tf32 by dropping the 13 low mantissa bits (what the tensor cores read)."""
    u = x.to(tl.uint32, bitcast=True)
    return (u & 0xFFFFE000).to(tl.float32, bitcast=True)


@triton.jit
def _dot(a, b, PREC: tl.constexpr):
    """Tensor-core dot of fp32 operands (half operands are widened), fp32 accumulation.

    PREC: "tf32" (the tensor cores read the top 19 bits of each fp32 operand: truncation),
    "tf32r" (operands rounded to the nearest tf32 first: unbiased, the same speed), "tf32x3"
    (three tf32 products, about fp32 accuracy), "ieee".  The CPU interpreter emulates the tf32
    operand rounding, so CI sees the precision of the GPU kernels."""
    a = a.to(tl.float32)
    b = b.to(tl.float32)
    if PREC == "tf32r":
        a = _tf32_round(a)
        b = _tf32_round(b)
    if INTERPRETED:
        if PREC == "tf32" or PREC == "tf32r":
            return tl.dot(_tf32_trunc(a), _tf32_trunc(b), input_precision="ieee")
        else:
            return tl.dot(a, b, input_precision="ieee")
    else:
        if PREC == "tf32r":
            return tl.dot(a, b, input_precision="tf32")
        else:
            return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _chunk(cu_seqlens, chunk_info, i_c, i_h, H: tl.constexpr):
    """(row64, nr, tile) of chunk i_c, head i_h: first token row (int64, token-major), number of
    valid rows (may exceed 64), chunk-major tile index (int64)."""
    i_n = tl.load(chunk_info + 2 * i_c)
    start = tl.load(chunk_info + 2 * i_c + 1)
    nr = tl.load(cu_seqlens + i_n + 1) - start
    return start.to(tl.int64) * H + i_h, nr, i_c.to(tl.int64) * H + i_h
