"""Chunked KDA in Triton: forward/backward kernels behind one autograd.Function.

Public entry point: `chunk_kda` (called by `k3.ops.kda.kda(..., backend="triton")`).

Bounded gate.  The intra-chunk products exp(G_t - G_s) are factorised per 16-row sub-block
around the block's middle (triton_common), which stays finite in fp32 / bf16 only when the
per-step log-decay is bounded below.  Hence:
  * in-kernel gate (A_log given): `lower_bound` in [-5, 0) is required (K3 form
    g = lower_bound * sigmoid(exp(A_log) (f + dt_bias)) is in (lower_bound, 0) by construction);
    the unbounded Kimi-Linear softplus gate raises ValueError;
  * pre-computed g (A_log None): the caller must *declare* the bound by passing `lower_bound`
    (a promise that g >= lower_bound everywhere; the kernels tolerate about twice that decay
    before the factors overflow).  Without a declared bound this backend raises ValueError:
    use the torch or reference backend for unbounded gates.

Precision.  State, decay and the UT inverse are fp32.  For bf16/fp16 inputs the state / value
dots take their operands in the input dtype (bf16 tensor cores, fp32 accumulation), the intra-
chunk A/P dots and the inverse fp32 operands rounded to tf32 (round to nearest, not the tensor
cores' truncation), the backward A/P dots tf32x3 (see `_precisions`); fp32 inputs use tf32x3
throughout.  The factorised exponentials need fp32 range, so fp16 inputs are safe.  Intermediates
(W, U, qg, kg, P, per-chunk states, Vn, dR) are stored in the input dtype, which bounds bf16
accuracy to ~0.3 % relative (fla's level).

Kernels.  Forward: the split intra-chunk kernels (fwd_intra: keys / A-P / finish launches of
small programs), then the sequential state scan (fwd_state._kda_fwd_state).  Backward: the state
scan (bwd_state._kda_bwd_state), then the split intra-chunk kernels (bwd_intra: values /
keys / finish).  Their tiles are constants beside the kernels; the measurements behind them are in
docs/kda_kernels.md and docs/dev_log.md.

Memory (training).  The forward keeps W, P, qg, kg (input dtype), gl, T (fp32), the per-chunk
states and Vn for the backward instead of recomputing them: about 1.5x the bytes of q, k, v, g.
Intermediates are chunk-major [chunks, H, 64, D] with the last chunk of each sequence zero-padded.
"""

from __future__ import annotations

import torch
import triton

from k3.ops import to_device_async
from k3.ops.backend import triton_runs_on
from k3.ops.kda.bwd_state import _kda_bwd_state
from k3.ops.kda.bwd_intra import kda_bwd_intra
from k3.ops.kda.fwd_state import _kda_fwd_state
from k3.ops.kda.fwd_intra import kda_fwd_intra
from k3.ops.kda.validate import check_kda_shapes, host_offsets

__all__ = ["chunk_kda", "ChunkKDAFunction", "chunk_meta"]

CHUNK = 64
_SUPPORTED_DIMS = (16, 32, 64, 128)
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class ChunkMeta:
    """Sequence/chunk bookkeeping shared by all kernels of one call (all int32, on device).

    cu_seqlens [N + 1]; chunk_info [NC, 2] = (sequence, first token) per chunk;
    chunk_offsets [N + 1] = index of each sequence's first chunk.
    """

    def __init__(self, cu_seqlens: torch.Tensor, lengths: list[int]):
        """cu_seqlens: the offsets on the host (int64); built there, copied to `device` in one go."""
        self.N = len(lengths)
        counts = torch.tensor([(n + CHUNK - 1) // CHUNK for n in lengths], dtype=torch.int64)
        offs = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        self.NC = int(offs[-1])
        seq = torch.repeat_interleave(torch.arange(self.N), counts, output_size=self.NC)
        start = cu_seqlens[seq] + (torch.arange(self.NC) - offs[seq]) * CHUNK
        self._host = torch.cat([cu_seqlens, offs, seq, start]).to(torch.int32)

    def to(self, device: torch.device) -> "ChunkMeta":
        packed = to_device_async(self._host, device)
        n = self.N + 1
        self.cu_seqlens, self.chunk_offsets = packed[:n], packed[n: 2 * n]
        self.chunk_info = packed[2 * n:].view(2, self.NC).t().contiguous()
        return self


_META_CACHE: dict = {}


def chunk_meta(B: int, T: int, cu_seqlens: torch.Tensor | None, device: torch.device,
               cu_seqlens_cpu: torch.Tensor | None = None) -> ChunkMeta:
    """Build (or reuse) the chunk bookkeeping for a [B, T] batch or a packed varlen batch.

    Cached by the sequence lengths, so repeated calls with the same layout launch no extra work
    (a varlen call without `cu_seqlens_cpu` still reads cu_seqlens back from the device once)."""
    if cu_seqlens is None:
        key = (str(device), (T,) * B)
    else:
        key = (str(device), tuple(int(x) for x in host_offsets(cu_seqlens, cu_seqlens_cpu)))
    meta = _META_CACHE.get(key)
    if meta is None:
        cs = key[1] if cu_seqlens is not None else tuple(range(0, (B + 1) * T, T))
        lengths = [b - a for a, b in zip(cs, cs[1:])]
        meta = ChunkMeta(torch.tensor(cs, dtype=torch.int64), lengths).to(device)
        if len(_META_CACHE) > 256:
            _META_CACHE.clear()
        _META_CACHE[key] = meta
    return meta


def _state_bv(V: int, NH: int) -> int:
    """Value-block width of the chunk-state scans (forward and backward; one program per (sequence,
    head, value block), sequential over the chunks): 64, narrower only when fewer than 64 programs
    would run.  Wider blocks load each chunk's key-side tiles (W, qg, kg, P) for fewer programs, and
    each program's per-chunk step is the latency chain either way (measured: docs/kda_kernels.md).
    STATE_BV, when set (tests), overrides."""
    if STATE_BV is not None:
        return min(V, STATE_BV)
    bv = min(V, 64)
    while bv > 16 and NH * triton.cdiv(V, bv) < 64:
        bv //= 2
    return bv


def _fwd_state_tiles(V: int, NH: int) -> tuple[int, int]:
    """(BV, warps) of the forward state scan: `_state_bv` on 4 warps (BV 128 needs 8 warps: the whole
    128 x 128 state in one program)."""
    bv = _state_bv(V, NH)
    return bv, 8 if bv == 128 else 4


STATE_BV: int | None = None  # value block of the state scans; None: `_state_bv`'s rule (tests set one)
# Software-pipelining depth of the sequential kernels' chunk loop (loads of later chunks are issued
# while the current one computes; 1 hit an illegal address with Triton 3.6 on Hopper).
STAGES = 2
BWD_STATE_WARPS = 4
# Dot precisions for bf16 / fp16 inputs (see `_precisions`): forward A/P, UT inverse, state / value, backward A/P
HALF_PRECISIONS = ("tf32r", "tf32r", "half", "tf32x3")


def _precisions(dtype: torch.dtype) -> tuple[str, str, str, str]:
    """Dot precisions (forward A/P, UT inverse, state / value dots, backward A/P).

    fp32 inputs: tf32x3 everywhere (about fp32 accuracy).  bf16/fp16 inputs: the state / value
    dots take their operands in the storage dtype ("half"); the forward A/P dots and the inverse
    run on fp32 operands rounded to the nearest tf32 ("tf32r": plain "tf32" lets the tensor cores
    truncate, a bias); the backward A/P dots, whose outputs feed dg through a reverse cumsum with
    heavy cancellation and then the gate-parameter sums, run at "tf32x3".  Measured under the
    emulating interpreter (fp16, T 100, K = V = 64): ddt_bias 1.5e-2 -> 3.8e-4 and dg 2.5e-3 ->
    3.7e-4 relative when only the backward A/P dots move from tf32r to tf32x3; the forward A/P and
    inverse precision change neither.  HALF_PRECISIONS holds the bf16 / fp16 choice ("tf32", "tf32r",
    "tf32x3", "ieee"; S also "half")."""
    if dtype == torch.float32:
        return "tf32x3", "tf32x3", "tf32x3", "tf32x3"
    return HALF_PRECISIONS


def _fwd(q, k, v, g, beta, A_log, dt_bias, initial_state, meta: ChunkMeta, scale, lower_bound,
         l2, bsig, output_final_state, training):
    B, T, H, K = q.shape
    V = v.shape[-1]
    dev, dt = q.device, q.dtype
    NC, N = meta.NC, meta.N
    # chunk-major padded intermediates [NC, H, 64, D] (see triton_common)
    W = torch.empty(NC, H, CHUNK, K, device=dev, dtype=dt)
    QG = torch.empty_like(W)
    KG = torch.empty_like(W)
    U = torch.empty(NC, H, CHUNK, V, device=dev, dtype=dt)
    P = torch.empty(NC, H, CHUNK, CHUNK, device=dev, dtype=dt)
    GL = torch.empty(NC, H, K, device=dev, dtype=torch.float32)
    Tm = torch.empty(NC, H, CHUNK, CHUNK, device=dev, dtype=torch.float32) if training else GL
    ap, tp, sp, _ = _precisions(dt)
    lb = float(lower_bound)  # _validate guarantees a bound in [-5, 0)
    dummy = GL
    if NC > 0:
        # fwd_intra: Tm is the A / inverse scratch even without training (tiles: split_tiles)
        if not training:
            Tm = torch.empty(NC, H, CHUNK, CHUNK, device=dev, dtype=torch.float32)
        kda_fwd_intra(
            q, k, v, g, beta, A_log, dt_bias, W, U, P, QG, KG, GL, Tm, meta, scale,
            lb, l2, bsig, training, ap, tp,
        )
    o = torch.empty(B, T, H, V, device=dev, dtype=v.dtype)
    ht = torch.empty(N, H, K, V, device=dev, dtype=torch.float32) if output_final_state else None
    Hs = torch.empty(NC, H, K, V, device=dev, dtype=dt) if training else None
    VN = torch.empty(NC, H, CHUNK, V, device=dev, dtype=dt) if training else None
    BV, warps = _fwd_state_tiles(V, N * H)
    h0 = initial_state.float().contiguous() if initial_state is not None else None
    _kda_fwd_state[(N * H, triton.cdiv(V, BV))](
        W, U, P, QG, KG, GL, o, h0 if h0 is not None else dummy, ht if ht is not None else dummy,
        Hs if training else dummy, VN if training else dummy,
        meta.cu_seqlens, meta.chunk_offsets,
        H=H, K=K, V=V, BV=BV, USE_H0=h0 is not None, STORE_HT=ht is not None, STORE_H=training,
        PREC=sp, STAGES=STAGES, num_warps=warps,
    )
    saved = (W, P, QG, KG, GL, Tm, Hs, VN) if training else None
    return o, ht, saved


def _bwd(q, k, v, g, beta, A_log, dt_bias, o, meta: ChunkMeta, scale, lower_bound, l2, bsig,
         saved, do, dht, need_dh0):
    W, P, QG, KG, GL, Tm, Hs, VN = saved
    B, T, H, K = q.shape
    V = v.shape[-1]
    dev, dt = q.device, q.dtype
    NC, N = meta.NC, meta.N
    gate = A_log is not None
    _, tp, sp, apb = _precisions(dt)
    lb = float(lower_bound)  # _validate guarantees a bound in [-5, 0)
    do = do.contiguous()
    DH = torch.empty(NC, H, K, V, device=dev, dtype=dt)
    DR = torch.empty(NC, H, CHUNK, V, device=dev, dtype=dt)
    dh0 = torch.empty(N, H, K, V, device=dev, dtype=torch.float32)
    dv = torch.empty_like(v)
    BV = _state_bv(V, N * H)
    dummy = GL
    _kda_bwd_state[(N * H, triton.cdiv(V, BV))](
        P, QG, KG, W, Tm, GL, beta, do, dht.float().contiguous() if dht is not None else dummy, dh0, DH, DR, dv,
        meta.cu_seqlens, meta.chunk_offsets,
        H=H, K=K, V=V, BV=BV, USE_DHT=dht is not None, BSIG=bsig, PREC=sp, T_PREC=tp, STAGES=STAGES,
        num_warps=BWD_STATE_WARPS,
    )
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dg = torch.empty_like(g)
    dbeta = torch.empty_like(beta)
    if NC > 0:
        dA_log, ddt = kda_bwd_intra(
            q, k, v, g, beta, A_log, dt_bias, Hs, DH, VN, DR, do, o, dq, dk, dg, dbeta, meta, scale,
            lb, l2, bsig, apb, sp)
        if gate:
            dA_log, ddt = dA_log.to(A_log.dtype), ddt.reshape(dt_bias.shape).to(dt_bias.dtype)
        return dq, dk, dv, dg, dbeta, dA_log, ddt, (dh0 if need_dh0 else None)
    for t in (dq, dk, dg, dbeta):
        t.zero_()
    dA_log = torch.zeros(H, device=dev, dtype=torch.float32).to(A_log.dtype) if gate else None
    ddt = torch.zeros(H, K, device=dev, dtype=torch.float32).reshape(dt_bias.shape).to(dt_bias.dtype) if gate else None
    return dq, dk, dv, dg, dbeta, dA_log, ddt, (dh0 if need_dh0 else None)


class ChunkKDAFunction(torch.autograd.Function):
    """Autograd wrapper: forward saves the chunk intermediates, backward runs two kernels."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, initial_state, meta, scale, lower_bound,
                l2, bsig, output_final_state):
        o, ht, saved = _fwd(q, k, v, g, beta, A_log, dt_bias, initial_state, meta, scale,
                            lower_bound, l2, bsig, output_final_state, training=True)
        ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, initial_state, o, *saved)
        ctx.meta = meta
        ctx.args = (scale, lower_bound, l2, bsig)
        if ht is not None:
            return o, ht
        return o

    @staticmethod
    def backward(ctx, do, *rest):
        q, k, v, g, beta, A_log, dt_bias, h0, o, *saved = ctx.saved_tensors
        scale, lower_bound, l2, bsig = ctx.args
        dht = rest[0] if rest else None
        dq, dk, dv, dg, dbeta, dA_log, ddt, dh0 = _bwd(
            q, k, v, g, beta, A_log, dt_bias, o, ctx.meta, scale, lower_bound, l2, bsig, saved, do, dht,
            need_dh0=h0 is not None,
        )
        if dh0 is not None:
            dh0 = dh0.to(h0.dtype)
        return dq, dk, dv, dg, dbeta, dA_log, ddt, dh0, None, None, None, None, None, None


def _validate(q, k, v, g, beta, A_log, dt_bias, lower_bound, initial_state, cu_seqlens, cu_seqlens_cpu):
    check_kda_shapes(q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu)
    B, T, H, K = q.shape
    V = v.shape[-1]
    if K not in _SUPPORTED_DIMS or V not in _SUPPORTED_DIMS:
        raise ValueError(f"triton KDA supports head dims K, V in {_SUPPORTED_DIMS}; got K={K}, V={V}")
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype among bf16/fp16/fp32; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (g.is_floating_point() and beta.is_floating_point()):
        raise ValueError("g and beta must be floating point")
    if lower_bound is None:
        if A_log is not None:
            raise ValueError("triton KDA needs the bounded gate: pass lower_bound in [-5, 0) with A_log "
                             "(the unbounded softplus gate is supported by the torch/reference backends)")
        raise ValueError("triton KDA with a pre-computed g needs a declared lower_bound in [-5, 0) "
                         "(a promise that g >= lower_bound); use the torch/reference backend otherwise")
    if not -5.0 <= float(lower_bound) < 0.0:
        raise ValueError(f"lower_bound must be in [-5, 0), got {lower_bound}")
    if A_log is not None:
        if dt_bias is None:
            raise ValueError("the in-kernel gate needs dt_bias together with A_log")
        if A_log.shape != (H,):
            raise ValueError(f"A_log must have shape [{H}], got {list(A_log.shape)}")
        if dt_bias.numel() != H * K:
            raise ValueError(f"dt_bias must have {H * K} elements, got {dt_bias.numel()}")
    elif dt_bias is not None:
        raise ValueError("dt_bias given without A_log")
    if q.device.type == "cpu" and not triton_runs_on(q):
        raise ValueError("triton KDA on CPU tensors needs TRITON_INTERPRET=1 (set before importing k3.ops.kda.chunk)")


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA (chunk 64) with fused prologue; differentiable in every tensor input.

    Args:
        q, k: [B, T, H, K] bf16/fp16/fp32 (raw when `use_qk_l2norm_in_kernel`).
        v: [B, T, H, V], same dtype as q.  K, V in {16, 32, 64, 128}.
        g: [B, T, H, K] log-decay (>= lower_bound), or the raw gate input f when `A_log` is given.
        beta: [B, T, H] (logits when `use_beta_sigmoid_in_kernel`).
        scale: query scale, default K ** -0.5.
        initial_state: [N, H, K, V] (any float dtype; used as fp32).
        cu_seqlens: [N + 1] int32/int64 packed-sequence offsets (B must be 1).
        cu_seqlens_cpu: optional host copy of cu_seqlens (no device read-back when given).
        A_log: [H], dt_bias: [H * K] or [H, K]: in-kernel gate g = lb * sigmoid(exp(A_log) (f + dt_bias)).
        lower_bound: gate lower bound in [-5, 0) (required, see module docstring).
    Returns:
        o [B, T, H, V] in v's dtype; final state [N, H, K, V] fp32 if `output_final_state` else None.
    """
    if cu_seqlens is not None and cu_seqlens_cpu is None:
        cu_seqlens_cpu = cu_seqlens.cpu()  # read back once, for the checks and the chunk bookkeeping
    _validate(q, k, v, g, beta, A_log, dt_bias, lower_bound, initial_state, cu_seqlens, cu_seqlens_cpu)
    B, T, H, K = q.shape
    scale = K ** -0.5 if scale is None else float(scale)
    meta = chunk_meta(B, T, cu_seqlens, q.device, cu_seqlens_cpu)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    if A_log is not None:
        A_log, dt_bias = A_log.contiguous(), dt_bias.contiguous()
    l2, bsig = bool(use_qk_l2norm_in_kernel), bool(use_beta_sigmoid_in_kernel)
    inputs = (q, k, v, g, beta, A_log, dt_bias, initial_state)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)
    if needs_grad:
        out = ChunkKDAFunction.apply(q, k, v, g, beta, A_log, dt_bias, initial_state, meta, scale,
                                     lower_bound, l2, bsig, output_final_state)
        if output_final_state:
            return out[0], out[1]
        return out, None
    o, ht, _ = _fwd(q, k, v, g, beta, A_log, dt_bias, initial_state, meta, scale, lower_bound,
                    l2, bsig, output_final_state, training=False)
    return o, ht
