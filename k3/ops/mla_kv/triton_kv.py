"""MLA's key / value expansion as Triton kernels: one program per block of BT tokens, heads in a loop.

Forward: k[t, h] = [kv[t, h, :nope] | k_pe[t]] (k_pe loaded once per program, stored H times).
Backward: kv's gradient [dk[t, h, :nope] | dv[t, h]] per head, written contiguous for the
up-projection's GEMMs, and k_pe's gradient sum_h dk[t, h, nope:] accumulated in fp32 while the heads
stream by. Each gradient element is read once and each output written once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3.ops.triton_utils import cvt

TILE = (32, 4)  # tokens, warps per program


@triton.jit
def _mla_kv_fwd(KV, KPE, K, T, s_kv_b, s_kv_t, s_pe_b, s_pe_t, H: tl.constexpr, NOPE: tl.constexpr,
                VD: tl.constexpr, ROPE: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr, BT: tl.constexpr):
    b = tl.program_id(1).to(tl.int64)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    mt = t < T
    t = t.to(tl.int64)
    cn, cr = tl.arange(0, BN), tl.arange(0, BR)
    mn, mr = mt[:, None] & (cn < NOPE)[None, :], mt[:, None] & (cr < ROPE)[None, :]
    pe = tl.load(KPE + b * s_pe_b + t[:, None] * s_pe_t + cr[None, :], mask=mr, other=0.0)
    src = KV + b * s_kv_b + t[:, None] * s_kv_t
    dst = K + (b * T + t)[:, None] * (H * (NOPE + ROPE))
    for h in range(H):
        x = tl.load(src + h * (NOPE + VD) + cn[None, :], mask=mn, other=0.0)
        tl.store(dst + h * (NOPE + ROPE) + cn[None, :], x, mask=mn)
        tl.store(dst + h * (NOPE + ROPE) + NOPE + cr[None, :], pe, mask=mr)


@triton.jit
def _mla_kv_bwd(DK, DV, DKV, DPE, T, s_dk_b, s_dk_t, s_dk_h, s_dv_b, s_dv_t, s_dv_h, H: tl.constexpr,
                NOPE: tl.constexpr, VD: tl.constexpr, ROPE: tl.constexpr, BN: tl.constexpr, BV: tl.constexpr,
                BR: tl.constexpr, BT: tl.constexpr, HAS_DK: tl.constexpr, HAS_DV: tl.constexpr):
    b = tl.program_id(1).to(tl.int64)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    mt = t < T
    t = t.to(tl.int64)
    cn, cv, cr = tl.arange(0, BN), tl.arange(0, BV), tl.arange(0, BR)
    mn, mv, mr = (mt[:, None] & (cn < NOPE)[None, :], mt[:, None] & (cv < VD)[None, :],
                  mt[:, None] & (cr < ROPE)[None, :])
    row = (b * T + t)[:, None]
    dkv = DKV + row * (H * (NOPE + VD))
    acc = tl.zeros([BT, BR], tl.float32)
    for h in range(H):
        gk = tl.zeros([BT, BN], tl.float32)
        gv = tl.zeros([BT, BV], tl.float32)
        if HAS_DK:
            src = DK + b * s_dk_b + t[:, None] * s_dk_t + h * s_dk_h
            gk = tl.load(src + cn[None, :], mask=mn, other=0.0).to(tl.float32)
            acc += tl.load(src + NOPE + cr[None, :], mask=mr, other=0.0).to(tl.float32)
        if HAS_DV:
            gv = tl.load(DV + b * s_dv_b + t[:, None] * s_dv_t + h * s_dv_h + cv[None, :], mask=mv,
                         other=0.0).to(tl.float32)
        tl.store(dkv + h * (NOPE + VD) + cn[None, :], cvt(gk, DKV.dtype.element_ty), mask=mn)
        tl.store(dkv + h * (NOPE + VD) + NOPE + cv[None, :], cvt(gv, DKV.dtype.element_ty), mask=mv)
    tl.store(DPE + row * ROPE + cr[None, :], cvt(acc, DPE.dtype.element_ty), mask=mr)


def _tile() -> tuple[int, int]:
    """TILE, read at call time (a module constant beside the kernels; tests and bench sweeps set it)."""
    return TILE


def _strides(g: torch.Tensor | None, like: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """A [B, T, H, D] gradient (None: `like`, never read) with its last dim contiguous, and its b / t / h strides."""
    if g is None:
        g = like
    elif g.stride(-1) != 1:
        g = g.contiguous()
    return g, g.stride(0), g.stride(1), g.stride(2)


class MLAExpandKV(torch.autograd.Function):
    """kv [B, T, H*(nope+v)] (last dim contiguous), k_pe [B, T, rope] -> k [B, T, H, nope+rope]
    contiguous, v [B, T, H, v] a view of kv. See `k3.ops.mla_kv.mla_expand_kv`."""

    @staticmethod
    def forward(ctx, kv, k_pe, num_heads, nope, v_dim):  # noqa: ANN001 - autograd signature
        B, T, _ = kv.shape
        rope = k_pe.shape[-1]
        k = torch.empty(B, T, num_heads, nope + rope, device=kv.device, dtype=kv.dtype)
        bt, warps = _tile()
        _mla_kv_fwd[(triton.cdiv(T, bt), B)](
            kv, k_pe, k, T, kv.stride(0), kv.stride(1), k_pe.stride(0), k_pe.stride(1), H=num_heads, NOPE=nope,
            VD=v_dim, ROPE=rope, BN=triton.next_power_of_2(nope), BR=triton.next_power_of_2(rope), BT=bt,
            num_warps=warps)
        ctx.dims = (B, T, num_heads, nope, v_dim, rope)
        ctx.dtypes = (kv.dtype, k_pe.dtype)
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no zero tensor
        v = kv.unflatten(-1, (num_heads, nope + v_dim))[..., nope:]
        return k, v

    @staticmethod
    def backward(ctx, dk, dv):  # noqa: ANN001
        if dk is None and dv is None:
            return None, None, None, None, None
        B, T, H, nope, v_dim, rope = ctx.dims
        ref = dk if dk is not None else dv
        dkv = torch.empty(B, T, H * (nope + v_dim), device=ref.device, dtype=ctx.dtypes[0])
        dpe = torch.empty(B, T, rope, device=ref.device, dtype=ctx.dtypes[1])
        gk, *sk = _strides(dk, ref)
        gv, *sv = _strides(dv, ref)
        bt, warps = _tile()
        _mla_kv_bwd[(triton.cdiv(T, bt), B)](
            gk, gv, dkv, dpe, T, *sk, *sv, H=H, NOPE=nope, VD=v_dim, ROPE=rope, BN=triton.next_power_of_2(nope),
            BV=triton.next_power_of_2(v_dim), BR=triton.next_power_of_2(rope), BT=bt,
            HAS_DK=dk is not None, HAS_DV=dv is not None, num_warps=warps)
        return dkv, dpe, None, None, None
