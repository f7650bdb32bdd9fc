"""SiTU-GLU as Triton kernels on gate|up packed in one tensor (the GEMM output [M, 2I]).

Elementwise and meant to be memory-bound, but the compiled SiTU region took about twice its bytes'
time at full bandwidth (docs/dev_log.md). The suspected cause is instruction count: libdevice tanh (twice), a precise sigmoid and two divisions
are ~100 instructions per output (bench/situ.py times both). Here tanh and sigmoid are built from
one hardware exponential and one reciprocal each:

    sigmoid(a) = 1 / (1 + 2^(-a log2 e))
    tanh(x)    = sign(x) (1 - 2 / (2^(2|x| log2 e) + 1))      for |x| >= 0.625
    tanh(x)    = x P(x^2), P a degree-5 fit (relative error 4e-9)   for |x| < 0.625

(the exponential form loses relative accuracy as x -> 0, the polynomial avoids that), within
~3 fp32 ulps of float64 (tests/ops/test_situ.py): the bf16 outputs match the torch maths except
for values within those ulps of a bf16 rounding boundary. The beta divisions are multiplications
by the reciprocals.

Forward: h = act(a, b) in the output dtype. Backward: ga = go * tb_lin * d/da[beta tanh(a/beta)
sigmoid(a)], gb = go * left * (1 - tanh(b/beta_lin)^2), written side by side into one [M, 2I]
tensor (the GEMM's gradient, no concatenation). Nothing is saved but the GEMM output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3.ops.triton_utils import cvt

TILE = (8, 256, 4)  # rows, columns, warps per program: the fastest of bench/situ.py --sweep
LOG2E = tl.constexpr(1.4426950408889634)
# tanh(x) / x = sum_k P_k (x^2)^k on |x| < 0.625 (least-squares fit, relative error 4.2e-9)
P0, P1, P2 = tl.constexpr(0.9999999963023853), tl.constexpr(-0.333332634245224), tl.constexpr(0.13331186801259237)
P3, P4, P5 = tl.constexpr(-0.05372531476796413), tl.constexpr(0.020603416439383283), tl.constexpr(-0.005672723598983697)


@triton.jit
def _tanh(x):
    ax = tl.abs(x)
    big = 1.0 - 2.0 / (tl.exp2(ax * (2.0 * LOG2E)) + 1.0)
    u = x * x
    p = ((((P5 * u + P4) * u + P3) * u + P2) * u + P1) * u + P0
    return tl.where(ax < 0.625, x * p, tl.where(x < 0, -big, big))


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp2(x * -LOG2E))


@triton.jit
def _tile(M, I, BM: tl.constexpr, BI: tl.constexpr):
    """This program's rows [BM, 1] (int64) and columns [1, BI] of the [M, I] output, and their mask."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BI + tl.arange(0, BI)
    mask = (rows < M)[:, None] & (cols < I)[None, :]
    return rows.to(tl.int64)[:, None], cols[None, :], mask


@triton.jit
def _situ_fwd(AB, H, M, I, s_ab, inv_beta, beta, inv_beta_lin, beta_lin, BM: tl.constexpr, BI: tl.constexpr):
    r, c, mask = _tile(M, I, BM, BI)
    o_ab, o_h = r * s_ab + c, r * I + c
    a = tl.load(AB + o_ab, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(AB + o_ab + I, mask=mask, other=0.0).to(tl.float32)
    act = beta * _tanh(a * inv_beta) * _sigmoid(a) * (beta_lin * _tanh(b * inv_beta_lin))
    tl.store(H + o_h, cvt(act, H.dtype.element_ty), mask=mask)


@triton.jit
def _situ_bwd(AB, GO, GAB, M, I, s_ab, inv_beta, beta, inv_beta_lin, beta_lin, BM: tl.constexpr, BI: tl.constexpr):
    r, c, mask = _tile(M, I, BM, BI)
    o_ab, o_h, o_g = r * s_ab + c, r * I + c, r * (2 * I) + c
    a = tl.load(AB + o_ab, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(AB + o_ab + I, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(GO + o_h, mask=mask, other=0.0).to(tl.float32)
    ta, sa, tb = _tanh(a * inv_beta), _sigmoid(a), _tanh(b * inv_beta_lin)
    left = beta * ta * sa
    d_left = (1.0 - ta * ta) * sa + left * (1.0 - sa)
    tl.store(GAB + o_g, cvt(g * (beta_lin * tb) * d_left, GAB.dtype.element_ty), mask=mask)
    tl.store(GAB + o_g + I, cvt(g * left * (1.0 - tb * tb), GAB.dtype.element_ty), mask=mask)


def tile() -> tuple[int, ...]:
    """TILE, read at call time (a module constant beside the kernels; tests and bench sweeps set it)."""
    return TILE


def _launch(kernel, M: int, I: int, *args) -> None:  # noqa: ANN001
    bm, bi, warps = tile()
    bi = min(bi, triton.next_power_of_2(I))
    kernel[(triton.cdiv(M, bm), triton.cdiv(I, bi))](*args, BM=bm, BI=bi, num_warps=warps)


def situ_fwd(ab: torch.Tensor, beta: float, beta_lin: float) -> torch.Tensor:
    """ab [M, 2I] (last dim contiguous) -> h [M, I] in ab's dtype."""
    M, I = ab.shape[0], ab.shape[1] // 2
    h = ab.new_empty(M, I)
    _launch(_situ_fwd, M, I, ab, h, M, I, ab.stride(0), 1.0 / beta, beta, 1.0 / beta_lin, beta_lin)
    return h


def situ_bwd(ab: torch.Tensor, go: torch.Tensor, beta: float, beta_lin: float) -> torch.Tensor:
    """ab [M, 2I], go [M, I] contiguous -> gradient [M, 2I] contiguous in ab's dtype."""
    M, I = go.shape
    gab = ab.new_empty(M, 2 * I)
    _launch(_situ_bwd, M, I, ab, go, gab, M, I, ab.stride(0), 1.0 / beta, beta, 1.0 / beta_lin, beta_lin)
    return gab


class SiTUGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ab, beta, beta_lin):  # noqa: ANN001 - autograd signature
        ctx.save_for_backward(ab)
        ctx.betas = (beta, beta_lin)
        return situ_fwd(ab, beta, beta_lin)

    @staticmethod
    def backward(ctx, go):  # noqa: ANN001
        (ab,) = ctx.saved_tensors
        return situ_bwd(ab, go.contiguous(), *ctx.betas), None, None
