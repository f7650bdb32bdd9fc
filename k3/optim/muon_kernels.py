"""Triton kernels for Per-Head Muon's stacked step (k3.optim.muon, bf16 / fp16 Newton-Schulz).

Two elementwise passes replace the torch step's five (momentum lerp, Nesterov lerp, cast to bf16,
Frobenius norm, division) and three (cast of the orthogonalised stack to the parameter dtype, weight
decay, update):

* :func:`muon_prep` -- one launch per bucket over its fp32 [blocks, m, n] stacks: momentum update in
  place, Nesterov update written once in the Newton-Schulz dtype, and per-(block, program) partial
  sums of its squares, summed in a fixed order in torch (deterministic, no atomics).
* :func:`plan_flat_update` / :func:`apply_flat_update` -- p <- p * (1 - lr*wd) - lr*scale*o for many
  parameters in one launch, reading the bf16 orthogonalised stack directly. A host-built program table
  (cached by the optimizer; it only depends on shapes and parameter addresses) tells every program
  which parameter chunk it owns.

Rounding follows torch's kernels: lerp is torch's one-rounding fma form (CPU and CUDA), the update's
add is fma(alpha, o, p) as torch's add with alpha (explicit fmas: no reliance on Triton's fp-fusion
default), and a bf16 / fp16 parameter is rounded after the decay as the torch path's separate decay pass
does. Differences from the torch path: the summation order of the Frobenius norm (see
:func:`muon_prep`); torch's CPU add rounds alpha to bf16 for a bf16 parameter (its CUDA add and these
kernels keep it fp32); an fp16 parameter reads the bf16 result directly (the torch path rounds it to
fp16 first, which is exact unless |o| < 2^-14).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3.ops.triton_utils import cvt

__all__ = ["muon_prep", "FlatUpdate", "plan_flat_update", "plan_bucket_update", "apply_flat_update", "update_block"]

_NS_DTYPES = (torch.bfloat16, torch.float16)
_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Elements per program of the two passes (powers of two; tests set smaller ones): large enough that a
# program streams several KB per operand, small enough to fill every SM with k3-small's buckets.
PREP_BLOCK = 4096
UPDATE_BLOCK = 4096
_TABLE_COLS = 3  # per program: parameter element offset (from the anchor), stack element offset, count


@triton.jit
def _lerp(a, b, coef, SMALL: tl.constexpr):
    """torch.lerp(a, b, w) with torch's formula and rounding, coef from :func:`_lerp_coef`: a + w*(b - a)
    for |w| < 0.5, else b + (w - 1)*(b - a), each one fma (torch's CPU kernel uses fmadd; nvcc contracts
    the CUDA one's b - (b - a)*(1 - w) into the same fma)."""
    if SMALL:
        return tl.fma(b - a, coef, a)
    else:
        return tl.fma(b - a, coef, b)


@triton.jit
def _prep_kernel(G, M, U, S, MN, CHUNKS, c_mom, c_nest,
                 SMALL_MOM: tl.constexpr, SMALL_NEST: tl.constexpr, NESTEROV: tl.constexpr,
                 BLOCK: tl.constexpr):
    """Program (block b, chunk j) of a [B, MN] view: M <- lerp(M, G, 1 - mu); U <- lerp(G, M, mu)
    (Nesterov) or M, rounded to U's dtype; S[b * CHUNKS + j] <- sum of the rounded U's squares."""
    pid = tl.program_id(0)
    b = pid // CHUNKS
    i = (pid % CHUNKS) * BLOCK + tl.arange(0, BLOCK)
    mask = i < MN
    offs = b.to(tl.int64) * MN + i
    g = tl.load(G + offs, mask=mask, other=0.0)
    m = _lerp(tl.load(M + offs, mask=mask, other=0.0), g, c_mom, SMALL_MOM)
    tl.store(M + offs, m, mask=mask)
    if NESTEROV:
        u = _lerp(g, m, c_nest, SMALL_NEST)
    else:
        u = m
    ur = cvt(u, U.dtype.element_ty)
    tl.store(U + offs, ur, mask=mask)
    # squares of the rounded values: the norm Newton-Schulz divides by is that of the bf16 block it sees
    # (as the torch path's vector_norm of the cast block); masked lanes are 0
    uf = ur.to(tl.float32)
    tl.store(S + pid, tl.sum(uf * uf, axis=0))


def muon_prep(grad: Tensor, mom: Tensor, momentum: float, nesterov: bool, dtype: torch.dtype,
              block: int | None = None) -> tuple[Tensor, Tensor]:
    """Momentum and Nesterov update of a bucket, and the squared Frobenius norms of its blocks.

    Args:
        grad: fp32 [B, m, n] contiguous gradient stack (read only).
        mom: fp32 [B, m, n] contiguous momentum stack; updated in place: mom <- lerp(mom, grad, 1 - momentum),
            bit-identical to ``mom.lerp_(grad, 1 - momentum)``.
        momentum: mu in [0, 1).
        nesterov: U = lerp(grad, mom, mu) (bit-identical to torch's lerp) if True, else U = mom.
        dtype: the Newton-Schulz dtype, bf16 or fp16 (U is rounded to nearest even).
        block: elements per program (a power of two; default PREP_BLOCK, capped at the block size); tests
            pass small values.
    Returns:
        (U [B, m, n] in ``dtype``, sumsq [B] fp32): sumsq[b] = sum of U[b]'s squares (of the rounded values,
        in fp32) -- per-program partial sums added in a fixed order, so deterministic; it equals torch's
        ``vector_norm(U[b]) ** 2`` up to fp32 summation order.
    """
    if dtype not in _NS_DTYPES:
        raise ValueError(f"muon_prep: dtype must be bf16 or fp16, got {dtype}")
    if grad.dim() != 3 or grad.shape != mom.shape:
        raise ValueError(f"muon_prep: grad and mom must be one [B, m, n] shape, got {list(grad.shape)}, "
                         f"{list(mom.shape)}")
    if grad.dtype != torch.float32 or mom.dtype != torch.float32:
        raise ValueError(f"muon_prep: grad and mom must be fp32, got {grad.dtype}, {mom.dtype}")
    if not (grad.is_contiguous() and mom.is_contiguous()):
        raise ValueError("muon_prep: grad and mom must be contiguous")
    nb, m, n = grad.shape
    mn = m * n
    bs = min(block or PREP_BLOCK, triton.next_power_of_2(mn))
    if bs & (bs - 1):
        raise ValueError(f"muon_prep: block must be a power of two, got {bs}")
    chunks = triton.cdiv(mn, bs)
    u = torch.empty(nb, m, n, device=grad.device, dtype=dtype)
    parts = torch.empty(nb * chunks, device=grad.device, dtype=torch.float32)
    if nb * chunks:
        (c_mom, small_mom), (c_nest, small_nest) = _lerp_coef(1.0 - momentum), _lerp_coef(momentum)
        _prep_kernel[(nb * chunks,)](
            grad, mom, u, parts, mn, chunks, c_mom, c_nest,
            SMALL_MOM=small_mom, SMALL_NEST=small_nest, NESTEROV=bool(nesterov), BLOCK=bs,
            num_warps=8 if bs >= 4096 else 4,
        )
    return u, parts.view(nb, chunks).sum(dim=1)


def _f32(x: float) -> float:
    """x rounded to fp32 (as torch rounds a python scalar for an fp32 kernel), as a python float.

    Scalars go to the kernels pre-rounded: compiled, Triton passes floats as fp32, but the interpreter keeps
    them as python floats and would do the scalar arithmetic in float64."""
    return float(torch.tensor(x, dtype=torch.float32))


def _lerp_coef(w: float) -> tuple[float, bool]:
    """(coefficient, small) for :func:`_lerp`, decided and rounded as torch's lerp kernels do on the fp32
    weight: (w, True) for |w| < 0.5, else (w - 1 in fp32 -- exact, Sterbenz --, False)."""
    w32 = _f32(w)
    return (w32, True) if abs(w32) < 0.5 else (_f32(w32 - 1.0), False)


@triton.jit
def _update_kernel(P0, O, T, decay, alpha, BLOCK: tl.constexpr, VEC: tl.constexpr):
    """Program t, chunk T[t] = (p_off, o_off, count): P0[p_off + i] <- P0[p_off + i] * decay + alpha * O[o_off + i]
    for i < count. P0 is the anchor parameter; the others are reached by their element offset from it."""
    row = T + tl.program_id(0) * 3
    # every offset and count is a multiple of VEC (checked on the host): lets the compiler vectorise
    p_off = tl.multiple_of(tl.load(row), VEC)
    o_off = tl.multiple_of(tl.load(row + 1), VEC)
    count = tl.multiple_of(tl.load(row + 2), VEC)
    i = tl.arange(0, BLOCK)
    mask = i < count
    p = tl.load(P0 + p_off + i, mask=mask, other=0.0)
    o = tl.load(O + o_off + i, mask=mask, other=0.0).to(tl.float32)
    dt = P0.dtype.element_ty
    t = p.to(tl.float32) * decay
    if dt != tl.float32:
        # the torch path decays in a pass of its own, which rounds to the parameter dtype
        t = cvt(t, dt).to(tl.float32)
    # torch's add(p, o, alpha) is one fma (CPU fmadd; contracted on CUDA)
    tl.store(P0 + p_off + i, cvt(tl.fma(o, alpha, t), dt), mask=mask)


def update_block(block: int | None = None) -> int:
    """Elements per update program: ``block`` if given, else UPDATE_BLOCK; a power of two."""
    bs = block or UPDATE_BLOCK
    if bs < 1 or bs & (bs - 1):
        raise ValueError(f"update block must be a power of two, got {bs}")
    return bs


class FlatUpdate:
    """One :func:`apply_flat_update` launch: parameters of one dtype, each contiguous and equal
    element-for-element to a contiguous range of the orthogonalised stack.

    anchor: the first parameter (the kernel's base pointer and element type); table: int64
    [programs, 3] on the parameters' device; block: elements per program; vec: the largest power of
    two (<= 16) dividing every offset and count of the table."""

    def __init__(self, anchor: Tensor, table: Tensor, block: int, vec: int) -> None:
        self.anchor, self.table, self.block, self.vec = anchor, table, block, vec


def plan_flat_update(params: list[Tensor], starts: list[int], block: int | None = None) -> FlatUpdate:
    """The program table for updating ``params`` from a stack.

    Args:
        params: non-empty list of contiguous parameters of one dtype (fp32 / bf16 / fp16) on one device.
        starts: element offset in the (contiguous) orthogonalised stack where each parameter's values
            begin, in the parameter's row-major order.
        block: elements per program (power of two; default UPDATE_BLOCK, capped at the largest
            parameter).
    The table holds raw address differences: it is valid while the parameters keep their storage (the
    optimizer rebuilds it when a data_ptr changes).
    """
    if not params or len(params) != len(starts):
        raise ValueError(f"plan_flat_update: {len(params)} params for {len(starts)} starts")
    anchor = params[0]
    dtype, elsize = anchor.dtype, anchor.element_size()
    if dtype not in _PARAM_DTYPES:
        raise ValueError(f"plan_flat_update: parameters must be fp32, bf16 or fp16, got {dtype}")
    largest = max(p.numel() for p in params)
    bs = min(update_block(block), triton.next_power_of_2(max(largest, 1)))
    rows = []
    for p, start in zip(params, starts):
        if p.dtype != dtype or p.device != anchor.device or not p.is_contiguous():
            raise ValueError("plan_flat_update: parameters must be contiguous, of one dtype and device")
        delta = p.data_ptr() - anchor.data_ptr()
        if delta % elsize:
            raise ValueError("plan_flat_update: parameter addresses are not element-aligned to each other")
        chunk = torch.arange(0, p.numel(), bs, dtype=torch.int64)
        rows.append(torch.stack([chunk + delta // elsize, chunk + start,
                                 (p.numel() - chunk).clamp(max=bs)], dim=1))
    table = torch.cat(rows) if rows else torch.zeros(0, _TABLE_COLS, dtype=torch.int64)
    g = 0
    for v in table.unique().tolist():
        g = math.gcd(g, int(v))
    vec = 16
    while vec > 1 and g % vec:
        vec //= 2
    return FlatUpdate(anchor, table.to(anchor.device), bs, vec)


def plan_bucket_update(members: list[tuple[Tensor, dict, tuple[str, int]]], starts: list[int],
                       block: int | None = None) -> tuple[list[tuple[dict, FlatUpdate]], list[int]]:
    """The update launches of one optimizer bucket.

    Args:
        members: the bucket's (parameter, param group, block spec) in stack order.
        starts: element offset of each member's blocks in the contiguous [blocks, m, n] stack.
        block: elements per program (see :func:`update_block`).
    Returns:
        ([(group, FlatUpdate)], [member index]): one launch per (group, parameter dtype) over the members
        whose stack range is the parameter's own row-major layout ('rows', 'whole', 'experts' specs on a
        contiguous fp32 / bf16 / fp16 parameter), and the rest, which the caller updates through a
        parameter-shaped view in torch ('cols': the stack holds the transpose; odd layouts or dtypes).
    """
    launches: dict[tuple, tuple[dict, list[int]]] = {}
    rest = []
    for i, (p, group, spec) in enumerate(members):
        if spec[0] != "cols" and p.is_contiguous() and p.dtype in _PARAM_DTYPES:
            launches.setdefault((id(group), p.dtype), (group, []))[1].append(i)
        else:
            rest.append(i)
    plans = [(group, plan_flat_update([members[i][0] for i in idx], [starts[i] for i in idx], block))
             for group, idx in launches.values()]
    return plans, rest


def apply_flat_update(plan: FlatUpdate, ortho: Tensor, decay: float, alpha: float) -> None:
    """p <- p * decay + alpha * o for every parameter of ``plan``, in place.

    Args:
        plan: from :func:`plan_flat_update` for these parameters (same storage).
        ortho: the contiguous orthogonalised stack (bf16 / fp16 / fp32) the plan's starts index.
        decay: 1 - lr*wd (1.0 without weight decay); alpha: -lr * scale.
    Rounding as the torch path's ``p.mul_(decay)`` then ``p.add_(o.to(p.dtype), alpha=alpha)``: fp32
    parameters get fma(alpha, o, p*decay) (the cast of a bf16 o to fp32 is exact); bf16 / fp16
    parameters round p*decay to their dtype first, then the fma's result.
    """
    if not ortho.is_contiguous() or ortho.device != plan.anchor.device:
        raise ValueError("apply_flat_update: ortho must be contiguous and on the parameters' device")
    n = plan.table.shape[0]
    if n:
        _update_kernel[(n,)](plan.anchor, ortho, plan.table, _f32(decay), _f32(alpha),
                             BLOCK=plan.block, VEC=plan.vec, num_warps=8 if plan.block >= 4096 else 4)
