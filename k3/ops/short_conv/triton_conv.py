"""KDA's short convolution (depthwise causal conv + SiLU) as Triton kernels, forward and backward.

Memory-bound, so the kernels are built around bytes. The window kernels (W <= 4) walk each
program's strip of rows in order, one [BLOCK_C] row vector at a time, and keeps the last W-1 rows in
registers (a sliding window, W <= 4): every input row is read once (plus 3 halo rows per strip) and
no tile is re-read shifted. Forward: x in, SiLU(y) out, straight into S separate [B, T, C] tensors (q,
k, v: the layout the KDA kernel takes). Backward, one pass: dz = dL/d(conv output) of row t is formed
from x's window and the stream gradient and immediately scattered into fp32 accumulators of dx rows
t-3..t (row t-3 is then complete and stored) and of dw (registers; one [W, BLOCK_C] partial per
strip, summed afterwards in a fixed order: deterministic). Bytes: read x and the stream gradients,
write dx -- against the tiled kernels' extra dz scratch round trip and W shifted tile reads.
The backward reads the S stream gradients through S pointers, so autograd never stacks them.

The tiled kernels ([BT, BC] blocks, the W shifted tiles re-read from cache; backward = a dz scratch
pass in x's dtype (fp32 for fp32 x), then dx and dw) serve W > 4. Packed documents: row t only sees
inputs s >= starts[t] (its document's first row).

Passthrough columns (a fused projection's other outputs, returned as views of x): both backwards write
x's whole gradient, their gradients copied by extra programs of the dx launch (`_pass_rows`; more than
MAX_PASS groups: torch copies before it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3.ops.triton_utils import cvt

# Program tiles, the fastest of bench/short_conv.py --sweep (tests set smaller ones). "window"
# kernels: (strip rows, a multiple of 4: the kernels step 4 rows at a time; channels; warps); "tiles"
# kernels: (rows, channels, warps).
WINDOW = {"FWDW": (64, 512, 4), "BWDW": (128, 512, 4)}
TILES = {"FWD": (32, 128, 4), "BWD": (64, 128, 4)}
MAX_WINDOW = 4  # the window kernels' taps (KDA's W is 4; a smaller W is zero-padded on the left)


def _window_tiles(direction: str) -> tuple[int, ...]:
    """(strip rows, channels, warps) of the window kernels ("FWDW" / "BWDW"), read at call time."""
    return WINDOW[direction]


def _tiles(direction: str) -> tuple[int, ...]:
    """(rows, channels, warps) per program of the tiled kernels ("FWD" / "BWD"), read at call time."""
    return TILES[direction]


@triton.jit
def _sigmoid(y):
    # the approximate division (2 ulp): the IEEE one is ~8 instructions per element in these streaming loops
    return tl.fdiv(tl.full(y.shape, 1.0, tl.float32), 1.0 + tl.exp(-y), ieee_rounding=False)


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
def _pass_group(src, s_row, dx, r0, end, i_b, T, OFF: tl.constexpr, DXW: tl.constexpr, ROWS: tl.constexpr,
                N: tl.constexpr, NB: tl.constexpr, RB: tl.constexpr, LIVE: tl.constexpr):
    """dx[i_b, t, OFF:OFF+N] = src[i_b, t, :N] (cast to dx's dtype) for rows r0 <= t < end (at most ROWS of
    them), src's rows s_row elements apart over the flattened B*T rows (last dim contiguous); zeros when not
    LIVE (the group's gradient is None). [RB, NB] tiles: a group a few columns wide (KDA's beta: 8) still
    moves whole tiles of rows per load, not a narrow strided copy per row."""
    for c in tl.static_range(0, N, NB):
        o_n = c + tl.arange(0, NB)
        m_n = o_n < N
        for r in range(0, ROWS, RB):
            t = r0 + r + tl.arange(0, RB)
            m = (t < end)[:, None] & m_n[None, :]
            row = i_b.to(tl.int64) * T + t.to(tl.int64)
            if LIVE:
                v = cvt(tl.load(src + row[:, None] * s_row + o_n[None, :], mask=m), dx.dtype.element_ty)
            else:
                v = tl.zeros([RB, NB], dtype=dx.dtype.element_ty)
            tl.store(dx + row[:, None] * DXW + OFF + o_n[None, :], v, mask=m)


@triton.jit
def _pass_rows(dx, T, g0, g1, g2, gt0, gt1, gt2, SC: tl.constexpr, DXW: tl.constexpr, ROWS: tl.constexpr,
               GV0: tl.constexpr, GV1: tl.constexpr, GV2: tl.constexpr, P0: tl.constexpr, P1: tl.constexpr,
               P2: tl.constexpr, PB0: tl.constexpr, PB1: tl.constexpr, PB2: tl.constexpr, PR0: tl.constexpr,
               PR1: tl.constexpr, PR2: tl.constexpr, PLIVE: tl.constexpr):
    """A passthrough program of the backwards: rows [i_t*ROWS, (i_t+1)*ROWS) of batch row i_b of the up to 3
    passthrough gradients g0..g2 (widths P0..P2, 0 = no group; [PR, PB] tiles; bit j of PLIVE clear: g_j is
    None, zeros) into dx [B, T, DXW]'s columns SC + P0 + ... after the conv channels. g_j's rows are
    gt_j * GV_j elements apart (GV_j: the stride's power-of-two factor, so loads vectorise: see _strides)."""
    i_t, i_b = tl.program_id(0), tl.program_id(2)
    r0 = i_t * ROWS
    end = tl.minimum(r0 + ROWS, T)
    _pass_group(g0, gt0 * GV0, dx, r0, end, i_b, T, SC, DXW, ROWS, P0, PB0, PR0, (PLIVE & 1) != 0)
    if P1 > 0:
        _pass_group(g1, gt1 * GV1, dx, r0, end, i_b, T, SC + P0, DXW, ROWS, P1, PB1, PR1, (PLIVE & 2) != 0)
    if P2 > 0:
        _pass_group(g2, gt2 * GV2, dx, r0, end, i_b, T, SC + P0 + P1, DXW, ROWS, P2, PB2, PR2, (PLIVE & 4) != 0)


@triton.jit
def _tiles_bwd_block(x, w, starts, dz, dx, dw_part, B, T, sxb_v, sxt_v,
                     SC: tl.constexpr, DXW: tl.constexpr, W: tl.constexpr, HAS_STARTS: tl.constexpr,
                     VB: tl.constexpr, VT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """The tiled backward's second pass for one [BLOCK_T, BLOCK_C] block (see `_short_conv_bwd`)."""
    i_t, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    sxt = sxt_v * VT  # a known multiple of VT: vectorised row loads (see _strides)
    o_s = i_t * BLOCK_T + tl.arange(0, BLOCK_T)  # input rows of this program
    o_c = i_c * BLOCK_C + tl.arange(0, BLOCK_C)
    m_s, m_c = o_s < T, o_c < SC
    xb = x + i_b.to(tl.int64) * sxb_v * VB
    dzb = dz + i_b.to(tl.int64) * T * SC + o_c[None, :]
    dxs = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for e in tl.static_range(W):
        t = o_s + e
        m_out = _reads(starts, o_s, e, m_s, T, HAS_STARTS)
        d = tl.load(dzb + t.to(tl.int64)[:, None] * SC, mask=m_out[:, None] & m_c[None, :], other=0.0).to(tl.float32)
        dxs += d * tl.load(w + o_c * W + (W - 1 - e), mask=m_c, other=0.0)[None, :]
        if e == 0:
            _dw_partials(dw_part, xb, starts, d, o_s, m_s, o_c, m_c, sxt, i_b * tl.num_programs(0) + i_t,
                         SC, W, HAS_STARTS)
    tl.store(dx + (i_b.to(tl.int64) * T + o_s.to(tl.int64))[:, None] * DXW + o_c[None, :],
             dxs.to(dx.dtype.element_ty), mask=m_s[:, None] & m_c[None, :])


@triton.jit
def _short_conv_bwd(x, w, starts, dz, dx, dw_part, B, T, sxb_v, sxt_v,
                    g0, g1, g2, gt0, gt1, gt2,
                    SC: tl.constexpr, DXW: tl.constexpr, W: tl.constexpr, HAS_STARTS: tl.constexpr,
                    VB: tl.constexpr, VT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                    GV0: tl.constexpr, GV1: tl.constexpr, GV2: tl.constexpr, P0: tl.constexpr, P1: tl.constexpr,
                    P2: tl.constexpr, PB0: tl.constexpr, PB1: tl.constexpr, PB2: tl.constexpr, PR0: tl.constexpr,
                    PR1: tl.constexpr, PR2: tl.constexpr, PLIVE: tl.constexpr):
    """The tiled backward's second pass: dx[s] = sum_e w[W-1-e] dz[s+e] over the output rows s+e in s's
    document, from dz [B, T, SC] of the DZ pass of _short_conv_fwd, and this block's dw partials. dx: rows
    DXW apart (the conv channels lead wider rows when columns pass through). With passthrough columns
    (P0 > 0) the grid has one more program per row block along axis 1, past the conv channels' blocks,
    which copies the passthrough gradients g0..g2 into dx's columns after the conv's (`_pass_rows`)."""
    if P0 == 0:
        _tiles_bwd_block(x, w, starts, dz, dx, dw_part, B, T, sxb_v, sxt_v, SC, DXW, W, HAS_STARTS, VB, VT,
                         BLOCK_T, BLOCK_C)
    else:
        if tl.program_id(1) < (SC + BLOCK_C - 1) // BLOCK_C:
            _tiles_bwd_block(x, w, starts, dz, dx, dw_part, B, T, sxb_v, sxt_v, SC, DXW, W, HAS_STARTS, VB, VT,
                             BLOCK_T, BLOCK_C)
        else:
            _pass_rows(dx, T, g0, g1, g2, gt0, gt1, gt2, SC, DXW, BLOCK_T, GV0, GV1, GV2, P0, P1, P2, PB0, PB1, PB2,
                       PR0, PR1, PR2, PLIVE)


@triton.jit
def _row_mask(m_c, t, end, begin=0):
    """m_c [BLOCK_C] and begin <= row t < end. (The row test is made a vector like m_c: the interpreter
    cannot combine a scalar mask with a vector one; compiled, it stays one uniform test.)"""
    tv = tl.zeros_like(m_c.to(tl.int32)) + t
    return m_c & (tv >= begin) & (tv < end)


@triton.jit
def _clip_window(a, b, c, t, st):
    """Rows t-3, t-2, t-1 of a window, each zeroed unless it lies in row t's document (first row st).
    Zeroing x's window at a document's first rows is exact for all later rows too: they shift out."""
    return tl.where(t - 3 >= st, a, 0.0), tl.where(t - 2 >= st, b, 0.0), tl.where(t - 1 >= st, c, 0.0)


@triton.jit
def _first_row(starts, t, T, HAS_STARTS: tl.constexpr):
    """The first row of row t's document (0 without documents); rows past T read the last row's."""
    if HAS_STARTS:
        return tl.load(starts + tl.minimum(t, T - 1))
    else:
        return 0


@triton.jit
def _rows4(ptr, t, stride, end, mask):
    """Rows t..t+3 of a [rows, BLOCK_C] operand (row stride `stride`) in its own dtype, rows >= end (and < 0)
    reading as zeros. All four loads are issued together, ahead of the stores of the rows before them:
    the compiler may not move a load past a store that could alias it, and one row's loads alone do
    not keep enough bytes in flight."""
    a = tl.load(ptr + t.to(tl.int64) * stride, mask=_row_mask(mask, t, end), other=0.0)
    b = tl.load(ptr + (t + 1).to(tl.int64) * stride, mask=_row_mask(mask, t + 1, end), other=0.0)
    c = tl.load(ptr + (t + 2).to(tl.int64) * stride, mask=_row_mask(mask, t + 2, end), other=0.0)
    d = tl.load(ptr + (t + 3).to(tl.int64) * stride, mask=_row_mask(mask, t + 3, end), other=0.0)
    return a, b, c, d


@triton.jit
def _window_program(x, w4, p0, p1, p2, p3, T, sxb_v, sxt_v, SC: tl.constexpr, C: tl.constexpr, S: tl.constexpr,
                    LIVE: tl.constexpr, VB: tl.constexpr, VT: tl.constexpr, BLOCK_C: tl.constexpr):
    """A window program's channels o_c (mask m_c), x's pointers at its batch row 0 and row stride, its
    channels' pointers into the S stream tensors p0..p3 [B, T, C] at row 0 and whether each is live, and
    the four taps w0..w3 [BLOCK_C] fp32."""
    i_c, i_b = tl.program_id(1), tl.program_id(2)
    o_c = i_c * BLOCK_C + tl.arange(0, BLOCK_C)
    m_c = o_c < SC
    cols, live = _stream_cols(p0, p1, p2, p3, o_c, C, S, LIVE)
    w0 = tl.load(w4 + o_c * 4, mask=m_c, other=0.0)
    w1 = tl.load(w4 + o_c * 4 + 1, mask=m_c, other=0.0)
    w2 = tl.load(w4 + o_c * 4 + 2, mask=m_c, other=0.0)
    w3 = tl.load(w4 + o_c * 4 + 3, mask=m_c, other=0.0)
    return (o_c, m_c, x + i_b.to(tl.int64) * sxb_v * VB + o_c, sxt_v * VT, cols + i_b.to(tl.int64) * T * C, live,
            w0, w1, w2, w3)


@triton.jit
def _fwd_row(t, xt, xa, xm, xz, w0, w1, w2, w3, starts, T, yb, C: tl.constexpr, m_c, HAS_STARTS: tl.constexpr):
    """Output row t from the window xa, xm, xz (rows t-3..t-1, fp32) and xt: SiLU(y) stored; returns the
    next window."""
    xt = xt.to(tl.float32)
    st = _first_row(starts, t, T, HAS_STARTS)
    if t - 3 < st:  # t is among its document's first 3 rows: zero the window rows before it
        xa, xm, xz = _clip_window(xa, xm, xz, t, st)
    y = w0 * xa + w1 * xm + w2 * xz + w3 * xt
    tl.store(yb + t.to(tl.int64) * C, (y * _sigmoid(y)).to(yb.dtype.element_ty), mask=_row_mask(m_c, t, T))
    return xm, xz, xt


@triton.jit
def _conv_fwd_window(x, w4, starts, y0, y1, y2, y3, T, sxb_v, sxt_v,
                     SC: tl.constexpr, C: tl.constexpr, S: tl.constexpr, LIVE: tl.constexpr,
                     HAS_STARTS: tl.constexpr, VB: tl.constexpr, VT: tl.constexpr,
                     R: tl.constexpr, BLOCK_C: tl.constexpr):
    """y0..y{S-1} [B, T, C] = SiLU(sum_j w4[c, j] x[t-3+j, c] over taps in t's document) for this program's
    rows [i_t*R, (i_t+1)*R) and channels, walking the rows in order, 4 per step (the next 4 loaded while
    these are computed), with x[t-3..t-1] kept in registers. w4 [SC, 4] fp32 (tap 3 = the current row)."""
    i_t = tl.program_id(0)
    o_c, m_c, xb, sxt, yb, live, w0, w1, w2, w3 = _window_program(x, w4, y0, y1, y2, y3, T, sxb_v, sxt_v, SC, C,
                                                                 S, LIVE, VB, VT, BLOCK_C)
    r0 = i_t * R
    end = tl.minimum(r0 + R, T)
    _, xa, xm, xz = _rows4(xb, r0 - 4, sxt, end, m_c)  # the window: rows r0-3, r0-2, r0-1
    xa, xm, xz = xa.to(tl.float32), xm.to(tl.float32), xz.to(tl.float32)
    n0, n1, n2, n3 = _rows4(xb, r0, sxt, end, m_c)
    for step in range(R // 4):
        t = r0 + step * 4
        c0, c1, c2, c3 = n0, n1, n2, n3
        n0, n1, n2, n3 = _rows4(xb, t + 4, sxt, end, m_c)
        xa, xm, xz = _fwd_row(t, c0, xa, xm, xz, w0, w1, w2, w3, starts, T, yb, C, m_c, HAS_STARTS)
        xa, xm, xz = _fwd_row(t + 1, c1, xa, xm, xz, w0, w1, w2, w3, starts, T, yb, C, m_c, HAS_STARTS)
        xa, xm, xz = _fwd_row(t + 2, c2, xa, xm, xz, w0, w1, w2, w3, starts, T, yb, C, m_c, HAS_STARTS)
        xa, xm, xz = _fwd_row(t + 3, c3, xa, xm, xz, w0, w1, w2, w3, starts, T, yb, C, m_c, HAS_STARTS)


@triton.jit
def _bwd_row(t, xt, dy, xa, xm, xz, ga, gm, gz, dw0, dw1, dw2, dw3, w0, w1, w2, w3, starts, T, dxb,
             DXW: tl.constexpr, r0, R: tl.constexpr, m_c, HAS_STARTS: tl.constexpr):
    """Row t of the backward: y from the window and xt, dz = dy * SiLU'(y); tap j's share w_j dz goes to
    the dx accumulator of row t-3+j (ga, gm, gz: rows t-3..t-1) unless that row lies in an earlier
    document; row t-3 is then complete and stored (when it is the strip's); dw_j += dz x[t-3+j] for the
    strip's own rows. Returns the next window, accumulators and dw."""
    xt = xt.to(tl.float32)
    st = _first_row(starts, t, T, HAS_STARTS)
    if t - 3 < st:  # t is among its document's first 3 rows: zero the window rows before it
        xa, xm, xz = _clip_window(xa, xm, xz, t, st)
    dz = _silu_grad(dy.to(tl.float32), w0 * xa + w1 * xm + w2 * xz + w3 * xt)  # 0 past T (dy = 0 there)
    s0 = w0 * dz
    s1 = w1 * dz
    s2 = w2 * dz
    if t - 3 < st:
        s0, s1, s2 = _clip_window(s0, s1, s2, t, st)
    tl.store(dxb + (t - 3).to(tl.int64) * DXW, (ga + s0).to(dxb.dtype.element_ty),
             mask=_row_mask(m_c, t - 3, tl.minimum(r0 + R, T), r0))
    if t < r0 + R:  # the strip's own rows' dw (the 3 after it are the next strip's)
        dw0 += dz * xa
        dw1 += dz * xm
        dw2 += dz * xz
        dw3 += dz * xt
    return xm, xz, xt, gm + s1, gz + s2, w3 * dz, dw0, dw1, dw2, dw3


@triton.jit
def _window_bwd_strip(x, w4, starts, d0, d1, d2, d3, dx, dw_part, T, sxb_v, sxt_v,
                      SC: tl.constexpr, DXW: tl.constexpr, C: tl.constexpr, S: tl.constexpr, LIVE: tl.constexpr,
                      HAS_STARTS: tl.constexpr, VB: tl.constexpr, VT: tl.constexpr,
                      R: tl.constexpr, BLOCK_C: tl.constexpr):
    """One conv program of `_conv_bwd_window`: its strip of rows and block of channels."""
    i_t, i_b = tl.program_id(0), tl.program_id(2)
    o_c, m_c, xb, sxt, db, live, w0, w1, w2, w3 = _window_program(x, w4, d0, d1, d2, d3, T, sxb_v, sxt_v, SC, C,
                                                                 S, LIVE, VB, VT, BLOCK_C)
    dxb = dx + i_b.to(tl.int64) * T * DXW + o_c
    r0 = i_t * R
    end = tl.minimum(r0 + R + 3, T)  # the last row whose dz this strip needs, + 1
    _, xa, xm, xz = _rows4(xb, r0 - 4, sxt, end, m_c)
    xa, xm, xz = xa.to(tl.float32), xm.to(tl.float32), xz.to(tl.float32)
    ga = tl.zeros([BLOCK_C], dtype=tl.float32)  # dx accumulators of rows t-3, t-2, t-1
    gm = tl.zeros([BLOCK_C], dtype=tl.float32)
    gz = tl.zeros([BLOCK_C], dtype=tl.float32)
    dw0 = tl.zeros([BLOCK_C], dtype=tl.float32)
    dw1 = tl.zeros([BLOCK_C], dtype=tl.float32)
    dw2 = tl.zeros([BLOCK_C], dtype=tl.float32)
    dw3 = tl.zeros([BLOCK_C], dtype=tl.float32)
    n0, n1, n2, n3 = _rows4(xb, r0, sxt, end, m_c)
    e0, e1, e2, e3 = _rows4(db, r0, C, end, m_c & live)
    for step in range((R + 3 + 3) // 4):
        t = r0 + step * 4
        c0, c1, c2, c3, f0, f1, f2, f3 = n0, n1, n2, n3, e0, e1, e2, e3
        n0, n1, n2, n3 = _rows4(xb, t + 4, sxt, end, m_c)
        e0, e1, e2, e3 = _rows4(db, t + 4, C, end, m_c & live)
        xa, xm, xz, ga, gm, gz, dw0, dw1, dw2, dw3 = _bwd_row(
            t, c0, f0, xa, xm, xz, ga, gm, gz, dw0, dw1, dw2, dw3, w0, w1, w2, w3, starts, T, dxb, DXW, r0, R, m_c,
            HAS_STARTS)
        xa, xm, xz, ga, gm, gz, dw0, dw1, dw2, dw3 = _bwd_row(
            t + 1, c1, f1, xa, xm, xz, ga, gm, gz, dw0, dw1, dw2, dw3, w0, w1, w2, w3, starts, T, dxb, DXW, r0, R,
            m_c, HAS_STARTS)
        xa, xm, xz, ga, gm, gz, dw0, dw1, dw2, dw3 = _bwd_row(
            t + 2, c2, f2, xa, xm, xz, ga, gm, gz, dw0, dw1, dw2, dw3, w0, w1, w2, w3, starts, T, dxb, DXW, r0, R,
            m_c, HAS_STARTS)
        xa, xm, xz, ga, gm, gz, dw0, dw1, dw2, dw3 = _bwd_row(
            t + 3, c3, f3, xa, xm, xz, ga, gm, gz, dw0, dw1, dw2, dw3, w0, w1, w2, w3, starts, T, dxb, DXW, r0, R,
            m_c, HAS_STARTS)
    part = dw_part + ((i_b * tl.num_programs(0) + i_t).to(tl.int64) * 4) * SC + o_c
    tl.store(part, dw0, mask=m_c)
    tl.store(part + SC, dw1, mask=m_c)
    tl.store(part + 2 * SC, dw2, mask=m_c)
    tl.store(part + 3 * SC, dw3, mask=m_c)


@triton.jit
def _conv_bwd_window(x, w4, starts, d0, d1, d2, d3, dx, dw_part, T, sxb_v, sxt_v,
                     g0, g1, g2, gt0, gt1, gt2,
                     SC: tl.constexpr, DXW: tl.constexpr, C: tl.constexpr, S: tl.constexpr, LIVE: tl.constexpr,
                     HAS_STARTS: tl.constexpr, VB: tl.constexpr, VT: tl.constexpr,
                     R: tl.constexpr, BLOCK_C: tl.constexpr,
                     GV0: tl.constexpr, GV1: tl.constexpr, GV2: tl.constexpr, P0: tl.constexpr, P1: tl.constexpr,
                     P2: tl.constexpr, PB0: tl.constexpr, PB1: tl.constexpr, PB2: tl.constexpr, PR0: tl.constexpr,
                     PR1: tl.constexpr, PR2: tl.constexpr, PLIVE: tl.constexpr):
    """One pass over this program's rows [r0, r0+R) and the 3 after them (whose dz reach its last dx rows),
    4 rows per step (the next 4 rows of x and of the stream gradients d0..d{S-1} [B, T, C] loaded while
    these are computed; bit s of LIVE clear: stream s's gradient is None, zeros): see `_bwd_row`. The
    strip's dw partials are stored as dw_part[program, j, c] at the end. dx: rows DXW apart (the conv
    channels lead wider rows when columns pass through).

    With passthrough columns (P0 > 0) the grid has one more program per strip along axis 1, past the conv
    channels' blocks: it copies rows [r0, r0+R) of the passthrough gradients g0..g2 into dx's columns after
    the conv's (`_pass_rows`), so they cost no launches of their own. The branch is on the program id
    only and the copy needs few registers: the conv programs keep theirs (bench/kernel_resources.py, sm_90,
    k3-small's layer: 139 with the branch, 141 without; the loop's loads and stores unchanged)."""
    if P0 == 0:
        _window_bwd_strip(x, w4, starts, d0, d1, d2, d3, dx, dw_part, T, sxb_v, sxt_v, SC, DXW, C, S, LIVE,
                          HAS_STARTS, VB, VT, R, BLOCK_C)
    else:
        if tl.program_id(1) < (SC + BLOCK_C - 1) // BLOCK_C:
            _window_bwd_strip(x, w4, starts, d0, d1, d2, d3, dx, dw_part, T, sxb_v, sxt_v, SC, DXW, C, S, LIVE,
                              HAS_STARTS, VB, VT, R, BLOCK_C)
        else:
            _pass_rows(dx, T, g0, g1, g2, gt0, gt1, gt2, SC, DXW, R, GV0, GV1, GV2, P0, P1, P2, PB0, PB1, PB2,
                       PR0, PR1, PR2, PLIVE)


def _mode(W: int) -> str:
    """"window" (the sliding-window kernels, W <= MAX_WINDOW) or "tiles" (the tiled forward and split
    backward, any W)."""
    return "window" if W <= MAX_WINDOW else "tiles"


def _dz_dtype(x: torch.Tensor) -> torch.dtype:
    """The tiled backward's dz scratch: x's dtype for bf16 / fp16 x (half the scratch bytes, at one more
    rounding of dz before dx and dw), fp32 for fp32 x."""
    return x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.float32


def _pow2_split(stride: int) -> tuple[int, int]:
    """stride as (quotient, its power-of-two factor <= 16): see `_strides`."""
    f = 16
    while stride % f:
        f //= 2
    return stride // f, f


def _strides(x: torch.Tensor) -> dict:
    """x's batch and row strides as (quotient, power-of-two factor <= 16) pairs. Triton only knows an
    integer argument's alignment when it is divisible by 16; the rows of a fused projection (k3-small:
    4,232 elements) are 16-byte aligned but not a multiple of 16 elements, and without the factor every
    load of the kernel ran element by element, at about half the speed)."""
    out = {}
    for name, v, stride in (("sxb_v", "VB", x.stride(0)), ("sxt_v", "VT", x.stride(1))):
        out[name], out[v] = _pow2_split(stride)
    return out


def _grid(B: int, T: int, SC: int, bt: int, bc: int) -> tuple[int, int, int]:
    return triton.cdiv(T, bt), triton.cdiv(SC, bc), B


MAX_STREAMS = 4  # the kernels take this many stream pointers (k3 uses 1 and 3)


def _stream_args(ts: list, fill: torch.Tensor) -> tuple[list, int]:
    """The kernels' MAX_STREAMS stream pointers (`fill` where there is no tensor: never dereferenced) and
    the LIVE bits of the streams that have one."""
    live = sum(1 << s for s, t in enumerate(ts) if t is not None)
    return [t if t is not None else fill for t in ts] + [fill] * (MAX_STREAMS - len(ts)), live


MAX_PASS = 3  # passthrough groups the backward kernels copy themselves (KDA has 3: g, f_a, beta)
PASS_TILE = 8192  # elements per copy tile of a passthrough program (64 per thread at 4 warps: bytes in flight)
PASS_BC = 512  # widest copy tile (a wider group is copied in column blocks)


def _pass_mode(groups: int) -> str:
    """How the backward fills the passthrough columns of x's gradient: "kernel" (extra programs of the conv
    backward's launch, `_pass_rows`) for up to MAX_PASS groups (the kernels have MAX_PASS pointers), else
    "torch" (one torch copy_ / zero_ per group before the launch)."""
    return "kernel" if groups <= MAX_PASS else "torch"


def _pass_torch(dx: torch.Tensor, grads: tuple, columns: list[tuple[int, int]]) -> None:
    """dx [B, T, width][..., off:off+n] = each passthrough gradient [B, T, n] (any dtype and strides; None:
    zeros) for (off, n) in columns, one torch copy per group (more than MAX_PASS groups)."""
    for g, (off, n) in zip(grads, columns):
        if g is not None:
            dx[..., off:off + n].copy_(g)
        else:
            dx[..., off:off + n].zero_()


def _pass_args(grads: tuple, columns: list[tuple[int, int]], dx: torch.Tensor, rows: int) -> dict:
    """The backward kernels' passthrough arguments (see `_pass_rows`) for gradients [B, T, n_j] (None: the
    group's columns become zeros; any dtype, cast to dx's on store) of the column groups (off_j, n_j),
    programs of `rows` rows; no groups: P0 = 0, no passthrough programs. A gradient is read in place when
    its last dim is contiguous and its B*T rows are evenly spaced (a contiguous tensor, a slice of a wider
    one, a broadcast over rows); otherwise it is made contiguous first."""
    B, T = dx.shape[:2]
    out, live = {}, 0
    for j in range(MAX_PASS):
        g, n = (grads[j], columns[j][1]) if j < len(columns) else (None, 0)
        if g is not None:
            if (g.stride(-1) != 1 and n > 1) or (B > 1 and T > 1 and g.stride(0) != T * g.stride(1)):
                g = g.contiguous()
            live |= 1 << j
        row_stride = (g.stride(1) if T > 1 else g.stride(0)) if g is not None else 0
        nb = min(triton.next_power_of_2(max(n, 1)), PASS_BC)
        out[f"g{j}"] = g if g is not None else dx  # dx: never dereferenced (LIVE bit clear or no group)
        out[f"gt{j}"], out[f"GV{j}"] = _pow2_split(row_stride)
        out[f"P{j}"], out[f"PB{j}"], out[f"PR{j}"] = n, nb, min(max(PASS_TILE // nb, 1), rows)
    out["PLIVE"] = live
    return out


def _pad_taps(weight: torch.Tensor) -> torch.Tensor:
    """[SC, W] -> [SC, 4] with W <= 4: zero taps in front (a shorter causal conv is a width-4 one whose
    oldest taps are zero)."""
    W = weight.shape[1]
    return weight if W == MAX_WINDOW else torch.nn.functional.pad(weight, (MAX_WINDOW - W, 0)).contiguous()


class ShortConvSiLU(torch.autograd.Function):
    """x [B, T, S*C + P] (last dim contiguous), weight [S*C, W] fp32, starts [T] int32 or None, S <= 4,
    passthrough widths summing to P -> SiLU(causal depthwise conv) of the first S*C channels as S separate
    contiguous [B, T, C] tensors in x's dtype (stream s: channels [s*C, (s+1)*C)), then the passthrough
    column groups as views of x. The backward takes the gradients as they come, None for an unused
    output, and returns x's gradient as one [B, T, S*C + P] tensor."""

    @staticmethod
    def forward(ctx, x, weight, starts, streams, passthrough):  # noqa: ANN001 - autograd signature
        B, T, width = x.shape
        SC, W = weight.shape
        C = SC // streams
        xc = x[..., :SC]
        outs = [torch.empty(B, T, C, device=x.device, dtype=x.dtype) for _ in range(streams)]
        ys, live = _stream_args(outs, outs[0])
        st = starts if starts is not None else weight
        common = dict(SC=SC, C=C, S=streams, LIVE=live, HAS_STARTS=starts is not None)
        if _mode(W) == "window":
            r, bc, warps = _window_tiles("FWDW")
            _conv_fwd_window[(triton.cdiv(T, r), triton.cdiv(SC, bc), B)](
                xc, _pad_taps(weight), st, *ys, T, **_strides(xc), **common, R=r, BLOCK_C=bc, num_warps=warps)
        else:
            bt, bc, warps = _tiles("FWD")
            _short_conv_fwd[_grid(B, T, SC, bt, bc)](xc, weight, st, *ys, weight, B, T, **_strides(xc), **common,
                                                     W=W, DZ=False, BLOCK_T=bt, BLOCK_C=bc, num_warps=warps)
        ctx.save_for_backward(xc, weight, starts)
        ctx.streams = streams
        ctx.columns = [(SC + sum(passthrough[:i]), n) for i, n in enumerate(passthrough)]  # (offset, width)
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no zero tensor
        return tuple(outs) + tuple(x.narrow(-1, o, n) for o, n in ctx.columns)

    @staticmethod
    def backward(ctx, *grads):  # noqa: ANN001
        x, weight, starts = ctx.saved_tensors
        B, T, SC = x.shape
        W = weight.shape[1]
        S = ctx.streams
        douts, dpass = grads[:S], grads[S:]
        width = SC + sum(n for _, n in ctx.columns)
        # Gradients from the KDA kernels come contiguous (no copy); a broadcast one (e.g. of a sum) does not.
        ds, live = _stream_args([d.contiguous() if d is not None else None for d in douts], x)
        dx_full = torch.empty(B, T, width, device=x.device, dtype=x.dtype)
        # The passthrough columns of dx_full: extra programs of the conv backward's launch copy
        # them (one launch; torch's copies of the narrow groups into the wide rows, each a launch of its own,
        # ran at a fraction of the bandwidth).
        by_kernel = bool(ctx.columns) and _pass_mode(len(ctx.columns)) == "kernel"
        if not by_kernel:
            _pass_torch(dx_full, dpass, ctx.columns)
        st = starts if starts is not None else weight
        common = dict(SC=SC, HAS_STARTS=starts is not None, **_strides(x))
        if _mode(W) == "window":
            r, bc, warps = _window_tiles("BWDW")
            pa = _pass_args(dpass if by_kernel else (), ctx.columns if by_kernel else [], dx_full, r)
            grid = (triton.cdiv(T, r), triton.cdiv(SC, bc) + (1 if pa["P0"] else 0), B)  # + a passthrough program
            dw_part = torch.empty(B * grid[0], MAX_WINDOW, SC, device=x.device, dtype=torch.float32)
            _conv_bwd_window[grid](x, _pad_taps(weight), st, *ds, dx_full, dw_part, T, **common, DXW=width,
                                   C=SC // S, S=S, LIVE=live, R=r, BLOCK_C=bc, **pa, num_warps=warps)
            return dx_full, dw_part.sum(0).t()[:, MAX_WINDOW - W:].contiguous(), None, None, None
        bt, bc, warps = _tiles("BWD")
        pa = _pass_args(dpass if by_kernel else (), ctx.columns if by_kernel else [], dx_full, bt)
        grid = _grid(B, T, SC, bt, bc)
        dw_part = torch.empty(B * grid[0], W, SC, device=x.device, dtype=torch.float32)
        dz = torch.empty(B, T, SC, device=x.device, dtype=_dz_dtype(x))
        _short_conv_fwd[grid](x, weight, st, *ds, dz, B, T, **common, C=SC // S, S=S, LIVE=live, W=W, DZ=True,
                              BLOCK_T=bt, BLOCK_C=bc, num_warps=warps)
        _short_conv_bwd[grid[0], grid[1] + (1 if pa["P0"] else 0), B](
            x, weight, st, dz, dx_full, dw_part, B, T, **common, DXW=width, W=W, BLOCK_T=bt, BLOCK_C=bc, **pa,
            num_warps=warps)
        return dx_full, dw_part.sum(0).t().contiguous(), None, None, None
