"""KDA's short convolution (depthwise causal conv + SiLU) as Triton kernels, forward and backward.

Memory-bound: the forward (one launch) reads x once per tap (the W shifted tiles hit in cache) and
writes SiLU(y) straight into S separate [B, T, C] tensors (q, k, v: the layout the KDA kernel takes);
the backward reads the S stream gradients through S pointers as well, so autograd never stacks them
into one [S, B, T, C] tensor (a full-size copy per layer). The fused backward (one launch) recomputes
y of the W output rows each input row feeds (no saved activations besides x), writes dx and
per-block partial sums of dw (summed afterwards in a fixed order: deterministic).
The default split backward computes dz = dL/d(conv output) once per row into a scratch (x's dtype
for bf16/fp16 x, else fp32: env K3_CONV_DZ), then dx and dw from shifted reads of it: W + 1 tile
loads per row instead of W * (W + 1) (1.5x faster than the fused one, env K3_CONV_BWD=fused, on the
H200).
Replaces a transpose + fp32 cuDNN depthwise conv1d + document-edge fix-up + SiLU epilogue, whose
depthwise kernels alone took ~1.3 ms per KDA layer forward+backward at 16K tokens x 3072 channels
on an H200.  Packed documents: row t only sees inputs s >= starts[t] (its document's first row).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from k3.ops.triton_utils import INTERPRETED, cvt, env_tile

# (rows, channels, warps) per program. Backward: the split kernels with 64-row blocks measured fastest
# (H200, 65,536 tokens x 3,072 channels bf16, fwd+bwd: split 64/128/4 1.88 ms, split 32/128/4 2.26 ms,
# fused 32/128/4 2.86 ms; bench/short_conv.py --sweep; split 64/128/4 with the dz scratch in bf16:
# 1.59 ms, now the default).
# BWD1 (onepass, opt-in): its fastest tile in the same sweep, 64/128/4 2.12 ms (64/128/8: 3.64 ms).
TILES = {"FWD": (32, 128, 4), "BWD": (64, 128, 4), "BWD1": (64, 128, 4)}


def _tiles(direction: str) -> tuple[int, ...]:
    """(rows, channels, warps) per program; env K3_CONV_{FWD,BWD,BWD1}_{BT,BC,WARPS} override the
    defaults (read per call: bench/short_conv.py --sweep times the combinations)."""
    return env_tile(f"K3_CONV_{direction}", ("BT", "BC", "WARPS"), TILES[direction])


@triton.jit
def _sigmoid(y):
    return 1.0 / (1.0 + tl.exp(-y))


@triton.jit
def _conv_rows(w, starts, xb, rows, m_rows, o_c, m_c, sxt,
               W: tl.constexpr, HAS_STARTS: tl.constexpr):
    """y [BT, BC] fp32 at `rows` (masked m_rows): sum_j w[c, j] x[rows - (W-1) + j, c] within the document."""
    if HAS_STARTS:
        st = tl.load(starts + rows, mask=m_rows, other=0)
    else:
        st = tl.zeros_like(rows)
    y = tl.zeros([rows.shape[0], o_c.shape[0]], dtype=tl.float32)
    for j in tl.static_range(W):
        src = rows - (W - 1) + j
        m = m_rows & (src >= st)
        xv = tl.load(xb + src.to(tl.int64)[:, None] * sxt + o_c[None, :], mask=m[:, None] & m_c[None, :], other=0.0)
        wj = tl.load(w + o_c * W + j, mask=m_c, other=0.0)
        y += xv.to(tl.float32) * wj[None, :]
    return y


@triton.jit
def _reads(starts, o_s, e: tl.constexpr, m_s, T, HAS_STARTS: tl.constexpr):
    """Whether output row t = s + e reads input row s (through tap W-1-e): t exists and s lies in t's
    document."""
    t = o_s + e
    m_out = m_s & (t < T)
    if HAS_STARTS:
        m_out = m_out & (o_s >= tl.load(starts + t, mask=m_out, other=0))
    return m_out


@triton.jit
def _silu_grad(dy, y):
    """dL/dy of SiLU(y) given dL/dSiLU = dy (fp32)."""
    sg = _sigmoid(y)
    return dy * sg * (1.0 + y * (1.0 - sg))


@triton.jit
def _dw_partials(dw_part, xb, starts, dz, rows, m_rows, o_c, m_c, sxt, block,
                 SC: tl.constexpr, W: tl.constexpr, HAS_STARTS: tl.constexpr):
    """dw_part[block, j, c] = sum over this block's output rows t of dz[t, c] x[t - (W-1) + j, c] (same document)."""
    if HAS_STARTS:
        st = tl.load(starts + rows, mask=m_rows, other=0)
    else:
        st = tl.zeros_like(rows)
    part = dw_part + (block.to(tl.int64) * W) * SC
    for j in tl.static_range(W):
        src = rows - (W - 1) + j
        m = m_rows & (src >= st)
        xv = tl.load(xb + src.to(tl.int64)[:, None] * sxt + o_c[None, :], mask=m[:, None] & m_c[None, :],
                     other=0.0).to(tl.float32)
        tl.store(part + j * SC + o_c, tl.sum(dz * xv, axis=0), mask=m_c)


@triton.jit
def _stream_cols(y0, y1, y2, y3, o_c, C: tl.constexpr, S: tl.constexpr, LIVE: tl.constexpr):
    """Columns o_c of the [.., S*C] row live in S separate contiguous [B, T, C] tensors y0..y{S-1}:
    per column, the pointer to its element in row 0 of stream s = c // C, and whether that stream is
    live (bit s of LIVE; a dead one, an unused output whose gradient is None, reads as zeros). Per
    column, not per program: a channel block straddles two streams when C is not a multiple of it."""
    sid = o_c // C
    base = tl.where(sid == 1, y1, y0)
    if S > 2:
        base = tl.where(sid == 2, y2, base)
    if S > 3:
        base = tl.where(sid == 3, y3, base)
    live = (((tl.zeros_like(sid) + LIVE) >> sid) & 1) != 0
    return base + (o_c - sid * C), live


@triton.jit
def _short_conv_fwd(x, w, starts, y0, y1, y2, y3, dz, B, T, sxb_v, sxt_v,
                    SC: tl.constexpr, C: tl.constexpr, S: tl.constexpr, LIVE: tl.constexpr, W: tl.constexpr,
                    HAS_STARTS: tl.constexpr, VB: tl.constexpr, VT: tl.constexpr, DZ: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """y = conv(x) per row. Forward: y0..y{S-1} [B, T, C] = SiLU(y) of stream s. DZ (split backward,
    pass 1): y0..y{S-1} are the stream gradients dout (bit s of LIVE clear: None, zeros), and
    dz [B, T, SC] (fp32 or x's dtype, `_dz_dtype`) = dout * SiLU'(y)."""
    i_t, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    sxt = sxt_v * VT  # a known multiple of VT: vectorised row loads (see _strides)
    o_t = i_t * BLOCK_T + tl.arange(0, BLOCK_T)
    o_c = i_c * BLOCK_C + tl.arange(0, BLOCK_C)
    m_t, m_c = o_t < T, o_c < SC
    m = m_t[:, None] & m_c[None, :]
    y = _conv_rows(w, starts, x + i_b.to(tl.int64) * sxb_v * VB, o_t, m_t, o_c, m_c, sxt, W, HAS_STARTS)
    cols, live = _stream_cols(y0, y1, y2, y3, o_c, C, S, LIVE)
    ptr = cols[None, :] + (i_b.to(tl.int64) * T + o_t.to(tl.int64))[:, None] * C
    if DZ:
        dy = tl.load(ptr, mask=m & live[None, :], other=0.0).to(tl.float32)
        tl.store(dz + (i_b.to(tl.int64) * T + o_t.to(tl.int64))[:, None] * SC + o_c[None, :],
                 cvt(_silu_grad(dy, y), dz.dtype.element_ty), mask=m)
    else:
        tl.store(ptr, (y * _sigmoid(y)).to(y0.dtype.element_ty), mask=m)


@triton.jit
def _short_conv_bwd(x, w, starts, d0, d1, d2, d3, dz, dx, dw_part, B, T, sxb_v, sxt_v,
                    SC: tl.constexpr, C: tl.constexpr, S: tl.constexpr, LIVE: tl.constexpr, W: tl.constexpr,
                    HAS_STARTS: tl.constexpr, VB: tl.constexpr, VT: tl.constexpr, SPLIT: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """dx[s] = sum_e w[W-1-e] dz[s+e] over the output rows s+e in s's document, and this block's dw partials.
    SPLIT: dz [B, T, SC] comes from the DZ pass of _short_conv_fwd; else each dz[s+e] is recomputed from x
    and the stream gradients d0..d{S-1} [B, T, C] (y of W output rows per input row: no scratch, W times
    the conv work; bit s of LIVE clear: stream s's gradient is None, zeros)."""
    i_t, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    sxt = sxt_v * VT  # a known multiple of VT: vectorised row loads (see _strides)
    o_s = i_t * BLOCK_T + tl.arange(0, BLOCK_T)  # input rows of this program
    o_c = i_c * BLOCK_C + tl.arange(0, BLOCK_C)
    m_s, m_c = o_s < T, o_c < SC
    xb = x + i_b.to(tl.int64) * sxb_v * VB
    cols, live = _stream_cols(d0, d1, d2, d3, o_c, C, S, LIVE)
    dob = cols[None, :] + i_b.to(tl.int64) * T * C
    dzb = dz + i_b.to(tl.int64) * T * SC + o_c[None, :]
    dxs = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for e in tl.static_range(W):
        t = o_s + e
        m_out = _reads(starts, o_s, e, m_s, T, HAS_STARTS)
        m = m_out[:, None] & m_c[None, :]
        if SPLIT:
            d = tl.load(dzb + t.to(tl.int64)[:, None] * SC, mask=m, other=0.0).to(tl.float32)
        else:
            y = _conv_rows(w, starts, xb, t, m_out, o_c, m_c, sxt, W, HAS_STARTS)
            dy = tl.load(dob + t.to(tl.int64)[:, None] * C, mask=m & live[None, :], other=0.0).to(tl.float32)
            d = _silu_grad(dy, y)
        dxs += d * tl.load(w + o_c * W + (W - 1 - e), mask=m_c, other=0.0)[None, :]
        if e == 0:
            _dw_partials(dw_part, xb, starts, d, o_s, m_s, o_c, m_c, sxt, i_b * tl.num_programs(0) + i_t,
                         SC, W, HAS_STARTS)
    tl.store(dx + (i_b.to(tl.int64) * T + o_s.to(tl.int64))[:, None] * SC + o_c[None, :],
             dxs.to(dx.dtype.element_ty), mask=m_s[:, None] & m_c[None, :])


@triton.jit
def _shift_rows(S, d, HALF: tl.constexpr):
    """S @ d for a 0/1 selection matrix S (at most one 1 per row): row r of d moved to where S puts it.
    Exact: each output is one product by 1 (16-bit d: its own MMA, fp32 accumulation; fp32 d: an
    "ieee" dot, as tf32 would round it). The interpreter's 16-bit dots are wrong (Triton 3.9 on CPU
    tensors), so there the 16-bit values go through the fp32 dot: the same exact result."""
    if HALF and not INTERPRETED:
        return tl.dot(S.to(d.dtype), d)
    elif HALF:
        return tl.dot(S.to(tl.float32), d.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(S.to(tl.float32), d, input_precision="ieee")


@triton.jit
def _short_conv_bwd1(x, w, starts, d0, d1, d2, d3, dx, dw_part, B, T, sxb_v, sxt_v,
                     SC: tl.constexpr, C: tl.constexpr, S: tl.constexpr, LIVE: tl.constexpr, W: tl.constexpr,
                     HAS_STARTS: tl.constexpr, VB: tl.constexpr, VT: tl.constexpr, HALF_DZ: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, HALO: tl.constexpr):
    """The one-pass backward: dz = dL/d(conv output) of this block's rows and of the W-1 rows after it
    (the halo, recomputed), rounded to x's dtype with HALF_DZ (else fp32) as the split path's scratch
    is (`_dz_dtype`), kept in registers; dw partials from it; dx[s] = sum_e w[W-1-e] dz[s+e] with the row shift by e done as
    an exact selection dot (registers cannot be shifted), so x and the stream gradients are read once
    and only dx is written: no dz scratch round trip, one launch."""
    i_t, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    sxt = sxt_v * VT
    t0 = i_t * BLOCK_T
    r = tl.arange(0, BLOCK_T)
    h = tl.arange(0, HALO)
    o_s = t0 + r
    o_h = t0 + BLOCK_T + h
    o_c = i_c * BLOCK_C + tl.arange(0, BLOCK_C)
    m_s, m_c = o_s < T, o_c < SC
    m_h = (h < W - 1) & (o_h < T)
    xb = x + i_b.to(tl.int64) * sxb_v * VB
    cols, live = _stream_cols(d0, d1, d2, d3, o_c, C, S, LIVE)
    dob = cols[None, :] + i_b.to(tl.int64) * T * C
    # dz of the block's rows and of the halo rows, rounded like the split path's scratch
    y = _conv_rows(w, starts, xb, o_s, m_s, o_c, m_c, sxt, W, HAS_STARTS)
    dy = tl.load(dob + o_s.to(tl.int64)[:, None] * C, mask=m_s[:, None] & (m_c & live)[None, :], other=0.0)
    dz = _silu_grad(dy.to(tl.float32), y)
    yh = _conv_rows(w, starts, xb, o_h, m_h, o_c, m_c, sxt, W, HAS_STARTS)
    dyh = tl.load(dob + o_h.to(tl.int64)[:, None] * C, mask=m_h[:, None] & (m_c & live)[None, :], other=0.0)
    dzh = _silu_grad(dyh.to(tl.float32), yh)
    if HALF_DZ:
        dz = cvt(dz, x.dtype.element_ty)
        dzh = cvt(dzh, x.dtype.element_ty)
    _dw_partials(dw_part, xb, starts, dz.to(tl.float32), o_s, m_s, o_c, m_c, sxt, i_b * tl.num_programs(0) + i_t,
                 SC, W, HAS_STARTS)
    dxs = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for e in tl.static_range(W):
        m_out = _reads(starts, o_s, e, m_s, T, HAS_STARTS)
        d = _shift_rows(r[:, None] + e == r[None, :], dz, HALF_DZ) \
            + _shift_rows(r[:, None] + e == BLOCK_T + h[None, :], dzh, HALF_DZ)
        d = tl.where(m_out[:, None], d, 0.0)
        dxs += d * tl.load(w + o_c * W + (W - 1 - e), mask=m_c, other=0.0)[None, :]
    tl.store(dx + (i_b.to(tl.int64) * T + o_s.to(tl.int64))[:, None] * SC + o_c[None, :],
             dxs.to(dx.dtype.element_ty), mask=m_s[:, None] & m_c[None, :])


def _bwd_mode() -> str:
    """Env K3_CONV_BWD: "split" (default), "fused" or "onepass" (`_short_conv_bwd1`: about half the split
    path's bytes, yet 2.12 vs 1.59 ms fwd+bwd on an H200 at k3-small's shape, so not the default)."""
    mode = os.environ.get("K3_CONV_BWD", "split")
    if mode not in ("fused", "split", "onepass"):
        raise ValueError(f"K3_CONV_BWD must be 'fused', 'split' or 'onepass', got {mode!r}")
    return mode


def _dz_dtype(x: torch.Tensor) -> torch.dtype:
    """The split backward's dz scratch, env K3_CONV_DZ: "auto" (default) = x's dtype for bf16/fp16 x, fp32
    for fp32 x; "half" = x's dtype; "fp32". In bf16 half the scratch bytes (its write and the W shifted
    reads) at one more rounding of dz before dx and dw (H200, 65,536 x 3,072 bf16: fwd+bwd 1.88 -> 1.59
    ms; vs float64 dx 2.3e-3 -> 2.9e-3, dw 1.7e-3 -> 2.3e-3 relative)."""
    mode = os.environ.get("K3_CONV_DZ", "auto")
    if mode not in ("auto", "fp32", "half"):
        raise ValueError(f"K3_CONV_DZ must be 'auto', 'fp32' or 'half', got {mode!r}")
    if mode == "half" or (mode == "auto" and x.dtype in (torch.bfloat16, torch.float16)):
        return x.dtype
    return torch.float32


def _strides(x: torch.Tensor) -> dict:
    """x's batch and row strides as (quotient, power-of-two factor <= 16) pairs. Triton only knows an
    integer argument's alignment when it is divisible by 16; the rows of a fused projection (k3-small:
    4,232 elements) are 16-byte aligned but not a multiple of 16 elements, and without the factor every
    load of the kernel ran element by element (0.55 vs 0.30 ms per forward at 65K x 3,072)."""
    out = {}
    for name, v, stride in (("sxb_v", "VB", x.stride(0)), ("sxt_v", "VT", x.stride(1))):
        f = 16
        while stride % f:
            f //= 2
        out[name], out[v] = stride // f, f
    return out


def _grid(B: int, T: int, SC: int, bt: int, bc: int) -> tuple[int, int, int]:
    return triton.cdiv(T, bt), triton.cdiv(SC, bc), B


MAX_STREAMS = 4  # the kernels take this many stream pointers (k3 uses 1 and 3)


def _stream_args(ts: list, fill: torch.Tensor) -> tuple[list, int]:
    """The kernels' MAX_STREAMS stream pointers (`fill` where there is no tensor: never dereferenced) and
    the LIVE bits of the streams that have one."""
    live = sum(1 << s for s, t in enumerate(ts) if t is not None)
    return [t if t is not None else fill for t in ts] + [fill] * (MAX_STREAMS - len(ts)), live


class ShortConvSiLU(torch.autograd.Function):
    """x [B, T, S*C] (last dim contiguous), weight [S*C, W] fp32, starts [T] int32 or None, S <= 4
    -> SiLU(causal depthwise conv) as S separate contiguous [B, T, C] tensors in x's dtype (stream s:
    channels [s*C, (s+1)*C)). The backward takes the S stream gradients as they come, None for an
    unused output."""

    @staticmethod
    def forward(ctx, x, weight, starts, streams):  # noqa: ANN001 - autograd signature
        B, T, SC = x.shape
        W = weight.shape[1]
        C = SC // streams
        outs = [torch.empty(B, T, C, device=x.device, dtype=x.dtype) for _ in range(streams)]
        ys, live = _stream_args(outs, outs[0])
        st = starts if starts is not None else weight
        bt, bc, warps = _tiles("FWD")
        _short_conv_fwd[_grid(B, T, SC, bt, bc)](x, weight, st, *ys, weight, B, T, **_strides(x),
                                                 SC=SC, C=C, S=streams, LIVE=live, W=W,
                                                 HAS_STARTS=starts is not None, DZ=False,
                                                 BLOCK_T=bt, BLOCK_C=bc, num_warps=warps)
        ctx.save_for_backward(x, weight, starts)
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no zero tensor
        return tuple(outs)

    @staticmethod
    def backward(ctx, *douts):  # noqa: ANN001
        x, weight, starts = ctx.saved_tensors
        B, T, SC = x.shape
        W = weight.shape[1]
        S = len(douts)
        C = SC // S
        # Gradients from the KDA kernels come contiguous (no copy); a broadcast one (e.g. of a sum) does not.
        ds, live = _stream_args([d.contiguous() if d is not None else None for d in douts], x)
        dx = torch.empty(B, T, SC, device=x.device, dtype=x.dtype)
        st = starts if starts is not None else weight
        has = starts is not None
        mode = _bwd_mode()
        strides = _strides(x)
        bt, bc, warps = _tiles("BWD1" if mode == "onepass" else "BWD")
        grid = _grid(B, T, SC, bt, bc)
        dw_part = torch.empty(B * grid[0], W, SC, device=x.device, dtype=torch.float32)
        if mode == "onepass":
            if bt < 16 or bc < 16:
                raise ValueError(f"K3_CONV_BWD=onepass: tile {bt} x {bc} is below the dots' 16 x 16")
            _short_conv_bwd1[grid](x, weight, st, *ds, dx, dw_part, B, T, **strides, SC=SC, C=C, S=S, LIVE=live,
                                   W=W, HAS_STARTS=has, HALF_DZ=_dz_dtype(x) != torch.float32, BLOCK_T=bt,
                                   BLOCK_C=bc, HALO=max(16, triton.next_power_of_2(W - 1)), num_warps=warps)
            return dx, dw_part.sum(0).t().contiguous(), None, None
        split = mode == "split"
        dz = dx  # not read by the fused kernel (SPLIT=False), which recomputes dz
        if split:
            dz = torch.empty(B, T, SC, device=x.device, dtype=_dz_dtype(x))
            _short_conv_fwd[grid](x, weight, st, *ds, dz, B, T, **strides, SC=SC, C=C, S=S, LIVE=live, W=W,
                                  HAS_STARTS=has, DZ=True, BLOCK_T=bt, BLOCK_C=bc, num_warps=warps)
        _short_conv_bwd[grid](x, weight, st, *ds, dz, dx, dw_part, B, T, **strides, SC=SC, C=C, S=S, LIVE=live,
                              W=W, HAS_STARTS=has, SPLIT=split, BLOCK_T=bt, BLOCK_C=bc, num_warps=warps)
        dw = dw_part.sum(0).t().contiguous()
        return dx, dw, None, None
