"""The router backward's operand splits in one Triton kernel.

The backward (see `k3.ops.router`) needs, from the fp32 logit gradient g [N, E]: A = [g_hi | g_hi | g_lo]
[N, 3E] bf16 (dx's operand) and the three exact bf16 parts of g^T stacked, [3E, N] (dW's operand). In
torch that is a dozen small launches per layer (casts, subtractions, a transposed copy, stacks and
concatenations, each launch a few microseconds of work);
here one program per block of rows reads g once and writes both operands, with the same roundings
(`cvt`: round to nearest even, also under the interpreter), so the bits equal the torch split's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3.ops.triton_utils import cvt


@triton.jit
def _router_grad_split(G, A, GP, N, E: tl.constexpr, BE: tl.constexpr, BN: tl.constexpr):
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    cols = tl.arange(0, BE)
    m = (rows < N)[:, None] & (cols < E)[None, :]
    g = tl.load(G + rows.to(tl.int64)[:, None] * E + cols[None, :], mask=m, other=0.0)
    hi = cvt(g, tl.bfloat16)
    r = g - hi.to(tl.float32)  # exact: hi is g rounded
    mid = cvt(r, tl.bfloat16)
    lo = cvt(r - mid.to(tl.float32), tl.bfloat16)
    a = A + rows.to(tl.int64)[:, None] * (3 * E) + cols[None, :]
    tl.store(a, hi, mask=m)
    tl.store(a + E, hi, mask=m)
    tl.store(a + 2 * E, mid, mask=m)  # split2's lo = round(g - hi) = split3's mid
    gp = GP + cols.to(tl.int64)[None, :] * N + rows[:, None]  # [3E, N]: part p of g^T at rows p*E + col
    tl.store(gp, hi, mask=m)
    tl.store(gp + E * N, mid, mask=m)
    tl.store(gp + 2 * E * N, lo, mask=m)


def router_grad_split(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """g [N, E] fp32 (contiguous) -> (A [N, 3E] = [hi | hi | lo2], GP [3E, N] = [hi; mid; lo] of g^T), bf16,
    with hi + mid + lo == g exactly (split3) and hi + lo2 ~= g (split2, lo2 == mid)."""
    N, E = g.shape
    a = torch.empty(N, 3 * E, device=g.device, dtype=torch.bfloat16)
    gp = torch.empty(3 * E, N, device=g.device, dtype=torch.bfloat16)
    bn = 64
    _router_grad_split[(triton.cdiv(N, bn),)](g, a, gp, N, E=E, BE=triton.next_power_of_2(E), BN=bn, num_warps=4)
    return a, gp
