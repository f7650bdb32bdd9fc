"""One-pass chunked KDA forward for Hopper (sm_90) in Gluon (`triton.experimental.gluon`, Triton 3.6).

One program per (sequence, head, value block of BV columns) walks the sequence's chunks of 64 tokens
with the state S [K, BV] (fp32) in registers; nothing but the inputs, o and the states touches global
memory (the Triton path writes and re-reads W, U, P, qg, kg, gl between two launches).  Per chunk,
with G the within-chunk cumulative log-decay, the maths of `triton_fwd` / docs/kda_kernels.md:

    A[t,s] = beta_t k_t.k_s e^{G_t - G_s} (s < t),  P[t,s] = scale q_t.k_s e^{G_t - G_s} (s <= t)
    T = (I + A)^-1;  R = beta v - (beta k e^G) S;  Vn = T R
    O = (scale q e^G) S + P Vn;  S <- e^{gl} S + (k e^{gl - G})^T Vn

* G = L g with L the 0/1 lower triangle: one tf32 wgmma (two, hi + lo, when g is not a tf32 value).
* A and P: per 16-row block i the factorised products e^{G_t - mid_i} e^{mid_i - G_s} (mid_i = G at
  row 16 i + 7; finite for per-step decays >= -5, see chunk.py) as transposed dots X_i [64(s), 32]
  = (k e^{mid_i - G})[64, K] @ ([q_i; k_i] e^{G_i - mid_i})^T: wgmma needs M = 64, so the block's 16 q
  and 16 k rows are the dot's N.  tf32 operands rounded to nearest first (as the Triton kernels).
* T: the 16x16 diagonal blocks by thread-local forward substitution, then
  T = Td - N (Td - N (Td - N Td)) with N = Td A_off (exact: N^4 = 0), tf32 wgmma.
* State dots with bf16 / fp16 operands (S, Vn and P rounded to the input dtype, as the Triton path
  and fla); Vn = T R in tf32.

Two warpgroups (8 warps) side by side along the dots' N.  Operands go through shared memory in the
wgmma (NVMMA) layouts; buffers of different phases share bytes through reinterpreted views.

Contract (checked by `supported`): CUDA sm_90, Triton 3.6's Gluon, q / k / v bf16 or fp16, K in {64, 128},
V in {32, 64, 128}; everything else (fp32 inputs, other head dims, the interpreter) runs the Triton
kernels.  Inference only: the autograd path keeps the Triton forward (its backward needs W, P, ...).
"""

from __future__ import annotations

import torch
import triton

from k3.ops.triton_utils import INTERPRETED

try:  # Gluon's API changes between Triton releases: this file is written against Triton 3.6.
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

    _IMPORTED = True
except Exception:  # noqa: BLE001 - any import problem means "no Gluon"
    _IMPORTED = False

__all__ = ["GLUON_AVAILABLE", "supported", "kda_fwd_gluon"]

GLUON_AVAILABLE = _IMPORTED and tuple(int(x) for x in triton.__version__.split(".")[:2]) == (3, 6)
HEAD_DIMS_K = (64, 128)
HEAD_DIMS_V = (32, 64, 128)


def supported(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the Gluon forward can run these inputs (device, Triton version, dtype, head dims)."""
    if INTERPRETED or not (GLUON_AVAILABLE and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)):
        return False
    if q.shape[-1] not in HEAD_DIMS_K or v.shape[-1] not in HEAD_DIMS_V:
        return False
    return torch.cuda.get_device_capability(q.device)[0] == 9


if _IMPORTED:

    @gluon.jit
    def _exp(x):
        return gl.exp2(x * 1.4426950408889634)

    @gluon.jit
    def _tf32r(x):
        """fp32 -> nearest tf32 value (the tensor cores would truncate the 13 low mantissa bits)."""
        u = x.to(gl.uint32, bitcast=True)
        return ((u + 0x1000) & 0xFFFFE000).to(gl.float32, bitcast=True)

    @gluon.jit
    def _clock():
        """SM cycle counter (profiling builds only)."""
        return gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)

    @gluon.jit
    def _ap_operands(k_s, q_s, g_s, g1_s, base, bend, jb, lk_s, bqk_s, i: gl.constexpr, K: gl.constexpr,
                     BL: gl.constexpr, BL3: gl.constexpr):
        """Row block i's operands of the transposed A / P dot into lk_s ([64, K]) and bqk_s ([32, K])."""
        mid3 = g1_s.slice(K * (16 * i + 7), K).load(gl.SliceLayout(0, gl.SliceLayout(1, BL3)))[None, None, :]
        lk_s.reshape([4, 16, K]).store(_tf32r(base * gl.where(jb <= i, _exp(mid3 - bend), 0.0)))
        mid = g1_s.slice(K * (16 * i + 7), K).load(gl.SliceLayout(0, BL))[None, :]
        e = _exp(g_s.slice(16 * i, 16).load(BL) - mid)
        bqk_s.slice(0, 16).store(_tf32r(q_s.slice(16 * i, 16).load(BL).to(gl.float32) * e))
        bqk_s.slice(16, 16).store(_tf32r(k_s.slice(16 * i, 16).load(BL).to(gl.float32) * e))
        fence_async_shared()

    @gluon.jit
    def _chunk_ap(k_s, q_s, g_s, g1_s, yy_s, lk2_s, pa3_s, rk3, K: gl.constexpr, BL: gl.constexpr,
                  BL3: gl.constexpr, M32: gl.constexpr):
        """Raw P^T and A^T of one chunk into pa3_s ([2, 64(s), 64(t)] fp32: P^T, A^T; unmasked, without the
        t-side norms, beta and scale): per row block i one transposed dot with N = 32, issued
        asynchronously while the next block's operands are written (double-buffered: lk2_s, and the
        [32, K] right operands in the two [64, 64] buffers of yy_s).

        Left operand (k e^{mid_i - G}, zero past block i) without exponentials per i: with B_j = G at
        the last row of block j, e^{mid_i - G_s} = e^{B_j - G_s} e^{mid_i - B_j} for s in block j; the
        first factor (<= 1) is computed once per chunk, the second is a [4, K] table per i (<= 1 for
        j < i, <= e^40 for j = i, 0 for j > i).  Right operand: the block's 16 q rows, then its 16 k
        rows, times e^{G - mid_i}."""
        g3_s = g_s.reshape([4, 16, K])
        G3 = g3_s.load(BL3)
        bend = g3_s.slice(15, 1, dim=1).load(BL3)  # [4, 1, K]
        base = k_s.reshape([4, 16, K]).load(BL3).to(gl.float32) * rk3 * _exp(bend - G3)
        jb = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, BL3)))[:, None, None]
        BQ: gl.constexpr = gl.NVMMASharedLayout.get_default_for([32, K], gl.float32)
        _ap_operands(k_s, q_s, g_s, g1_s, base, bend, jb, lk2_s.index(0),
                     yy_s.index(0)._reinterpret(gl.float32, [32, K], BQ), 0, K, BL, BL3)
        gl.thread_barrier()
        for i in gl.static_range(4):
            x = warpgroup_mma(lk2_s.index(i % 2), yy_s.index(i % 2)._reinterpret(gl.float32, [32, K], BQ).permute((1, 0)),
                              gl.zeros([64, 32], gl.float32, M32), use_acc=False, is_async=True)
            if i < 3:
                _ap_operands(k_s, q_s, g_s, g1_s, base, bend, jb, lk2_s.index((i + 1) % 2),
                             yy_s.index((i + 1) % 2)._reinterpret(gl.float32, [32, K], BQ), i + 1, K, BL, BL3)
            x = warpgroup_mma_wait(0, deps=[x])
            pa3_s.slice(16 * i, 16, dim=2).permute((1, 0, 2)).store(gl.reshape(x, [64, 2, 16]))
            gl.thread_barrier()

    @gluon.jit
    def _diag_inverse(pt_s, ad_s, L16: gl.constexpr, L3: gl.constexpr, PLAIN3: gl.constexpr):
        """pt_s holds the block-diagonal part Ad of A ([64, 64], zeros off the 16x16 diagonal blocks).
        Overwrites its diagonal blocks with (I + Ad_b)^-1 by forward substitution.  L3 keeps a block's
        16 rows in one thread's registers (a thread owns one column of one block), so each of the 15
        steps is thread-local: a 16-term dot with the step's row of A_b, read from shared memory.
        ad_s: [64, 16] fp32 scratch, the four blocks stacked (seen as [4, 16, 16])."""
        for b in gl.static_range(4):
            ad_s.slice(16 * b, 16).store(pt_s.slice(16 * b, 16, dim=0).slice(16 * b, 16, dim=1).load(L16))
        gl.thread_barrier()
        ad3_s = ad_s._reinterpret(gl.float32, [4, 16, 16], PLAIN3)  # [b, r, s] = A_b[r, s]
        adt_s = ad3_s.permute((0, 2, 1))  # [b, s, r]
        r1 = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
        c1 = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
        r3 = r1[None, :, None]
        c3 = c1[None, None, :]
        x3 = gl.zeros([4, 16, 16], gl.float32, L3) + gl.where(r3 == c3, 1.0, 0.0)  # x3[b, s, c] = Td_b[s, c]
        for j in gl.static_range(1, 16):
            coef = adt_s.slice(j, 1, dim=2).load(L3)  # [4, 16, 1] = A_b[j, s]
            row = gl.sum(coef * x3, axis=1)  # [4, 16(c)] = sum_s A_b[j, s] Td_b[s, c]
            x3 = gl.where(r3 == j, x3 - row[:, None, :], x3)
        gl.thread_barrier()
        ad3_s.store(x3)
        gl.thread_barrier()
        for b in gl.static_range(4):
            pt_s.slice(16 * b, 16, dim=0).slice(16 * b, 16, dim=1).store(ad_s.slice(16 * b, 16).load(L16))
        gl.thread_barrier()

    @gluon.jit
    def _kda_fwd_gluon(
        q, k, v, g, beta, A_log, dt_bias, o, h0, ht, cu_seqlens, prof, scale, lower_bound,
        H: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr, NW: gl.constexpr, PIPE: gl.constexpr,
        GATE: gl.constexpr, L2: gl.constexpr, BSIG: gl.constexpr, USE_H0: gl.constexpr, STORE_HT: gl.constexpr,
        PROFILE: gl.constexpr,
    ):
        dt: gl.constexpr = q.dtype.element_ty
        WN: gl.constexpr = NW // 4  # warpgroups side by side along the dots' N
        BL: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [NW, 1], [1, 0])
        BLR: gl.constexpr = gl.SliceLayout(1, BL)
        BLC: gl.constexpr = gl.SliceLayout(0, BL)
        L16: gl.constexpr = gl.BlockedLayout([1, 2], [4, 8], [NW, 1], [1, 0])
        L3: gl.constexpr = gl.BlockedLayout([1, 16, 1], [2, 1, 16], [NW, 1, 1], [2, 1, 0])
        BL3: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 4, 8], [4, WN, 1], [2, 1, 0])
        MG: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WN], instr_shape=[16, K // WN, 8])
        M32: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WN], instr_shape=[16, 32 // WN, 8])
        M64: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WN], instr_shape=[16, 64 // WN, 8])
        MV8: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WN], instr_shape=[16, BV // WN, 8])
        MV16: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WN],
                                                       instr_shape=[16, BV // WN, 16])
        PLAIN1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        PLAIN2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        PLAIN3: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])

        # Shared memory; buffers of different phases share bytes (reinterpreted views).  Per chunk:
        #   load:    q_s, k_s (raw inputs), g_s (G) -- q_s / k_s / g_s then hold qg / kg / Xw (state phase)
        #   A / P:   lk2_s, yy_s (double-buffered operands), P^T / A^T in pa_s
        #   inverse: Ad / Td (pt_s, in pa_s), ad_s, A_off^T and Horner iterates (y_s, y1_s), -N (n_s, in pa_s)
        #   state:   T (in y_s), s_s (in lk2_s), R^T then Vn (in pa_s), P (p_s, from the A / P phase)
        NV: gl.constexpr = gl.NVMMASharedLayout.get_default_for
        q_s = gl.allocate_shared_memory(dt, [64, K], PLAIN2)
        k_s = gl.allocate_shared_memory(dt, [64, K], PLAIN2)
        qg_s = q_s._reinterpret(dt, [64, K], NV([64, K], dt))
        kg_s = k_s._reinterpret(dt, [64, K], NV([64, K], dt))
        g_s = gl.allocate_shared_memory(gl.float32, [64, K], PLAIN2)
        g1_s = g_s._reinterpret(gl.float32, [64 * K], PLAIN1)
        xw_s = g_s._reinterpret(dt, [64, K], NV([64, K], dt))
        pa_s = gl.allocate_shared_memory(gl.float32, [128, 64], PLAIN2)
        pa3_s = pa_s._reinterpret(gl.float32, [2, 64, 64], PLAIN3)
        pt_s = pa_s.slice(0, 64)
        at_s = pa_s.slice(64, 64)
        n_s = pa_s._reinterpret(gl.float32, [128, 64], NV([128, 64], gl.float32)).slice(64, 64)
        r_s = pa_s._reinterpret(gl.float32, [BV, 64], NV([BV, 64], gl.float32))
        vn_s = pa_s._reinterpret(dt, [64, BV], NV([64, BV], dt))
        yy_s = gl.allocate_shared_memory(gl.float32, [2, 64, 64], NV([64, 64], gl.float32))
        y_s = yy_s.index(0)
        y1_s = yy_s.index(1)
        lk2_s = gl.allocate_shared_memory(gl.float32, [2, 64, K], NV([64, K], gl.float32))
        sx_s = lk2_s.index(0)
        gt_s = sx_s._reinterpret(gl.float32, [K, 64], NV([K, 64], gl.float32))
        lt_s = gl.allocate_shared_memory(gl.float32, [64, 64], NV([64, 64], gl.float32))
        s_s = sx_s._reinterpret(dt, [K, BV], NV([K, BV], dt))
        ad_s = gl.allocate_shared_memory(gl.float32, [64, 16], PLAIN2)
        p_s = gl.allocate_shared_memory(dt, [64, 64], NV([64, 64], dt))

        i_nh = gl.program_id(0)
        i_v = gl.program_id(1)
        i_n = i_nh // H
        i_h = i_nh % H
        bos = gl.load(cu_seqlens + i_n)
        eos = gl.load(cu_seqlens + i_n + 1)
        nt = gl.cdiv(eos - bos, 64)
        v0 = i_v * BV

        # state [K, BV] in the accumulator layout of the state-update dot
        srow = gl.arange(0, K, layout=gl.SliceLayout(1, MV16))
        scol = gl.arange(0, BV, layout=gl.SliceLayout(0, MV16))
        soff = i_nh.to(gl.int64) * (K * V) + srow[:, None] * V + v0 + scol[None, :]
        if USE_H0:
            S = gl.load(h0 + soff)
        else:
            S = gl.zeros([K, BV], gl.float32, MV16)

        rows = gl.arange(0, 64, layout=BLR)
        colk = gl.arange(0, K, layout=BLC)
        tr = gl.arange(0, 64, layout=gl.SliceLayout(1, M64))
        sc = gl.arange(0, 64, layout=gl.SliceLayout(0, M64))
        orow = gl.arange(0, 64, layout=gl.SliceLayout(1, MV16))
        if GATE:
            a_h = _exp(gl.load(A_log + i_h).to(gl.float32))
            bias = gl.load(dt_bias + i_h * K + colk).to(gl.float32)
        t_load = gl.to_tensor(0).to(gl.int64)  # PROFILE: cycles per phase, summed over the chunks
        t_ap = t_load
        t_inv = t_load
        t_ops = t_load
        t_state = t_load
        # the 0/1 lower triangle: G = L g is the within-chunk cumulative sum (tensor cores, exact products)
        EXACT_G: gl.constexpr = (not GATE) and g.dtype.element_ty.primitive_bitwidth == 16  # g is a tf32 value
        lt_s.store(gl.where(sc[None, :] <= tr[:, None], 1.0, 0.0) + gl.zeros([64, 64], gl.float32, M64))
        fence_async_shared()
        # PIPE: chunk c + 1's q, k, g are loaded while chunk c's last dots run (loop-carried registers)
        if PIPE:
            offk = ((bos + rows).to(gl.int64) * H + i_h)[:, None] * K + colk[None, :]
            mk = ((rows < eos - bos)[:, None]) & (colk[None, :] < K)
            nq = gl.load(q + offk, mask=mk, other=0.0)
            nk = gl.load(k + offk, mask=mk, other=0.0)
            ng = gl.load(g + offk, mask=mk, other=0.0)
        else:
            nq = gl.zeros([64, K], dt, BL)
            nk = nq
            ng = gl.zeros([64, K], g.dtype.element_ty, BL)
        for c in range(nt):
            t0 = bos + c * 64
            nr = eos - t0
            m_t = rows < nr
            row64 = (t0 + rows).to(gl.int64) * H + i_h
            orow64 = (t0 + orow).to(gl.int64) * H + i_h
            mk = m_t[:, None] & (colk[None, :] < K)
            if PROFILE:
                c0 = _clock()
            if PIPE:
                bq = nq
                bk = nk
                bg = ng.to(gl.float32)
            else:
                bq = gl.load(q + row64[:, None] * K + colk[None, :], mask=mk, other=0.0)
                bk = gl.load(k + row64[:, None] * K + colk[None, :], mask=mk, other=0.0)
                bg = gl.load(g + row64[:, None] * K + colk[None, :], mask=mk, other=0.0).to(gl.float32)
            if GATE:
                bg = gl.where(mk, lower_bound / (1.0 + _exp(-a_h * (bg + bias[None, :]))), 0.0)
            bb = gl.load(beta + row64, mask=m_t, other=0.0).to(gl.float32)
            if BSIG:
                bb = gl.where(m_t, 1.0 / (1.0 + _exp(-bb)), 0.0)
            if L2:
                qf = bq.to(gl.float32)
                kf = bk.to(gl.float32)
                rq = gl.rsqrt(gl.sum(qf * qf, axis=1) + 1e-6)
                rk = gl.rsqrt(gl.sum(kf * kf, axis=1) + 1e-6)
            else:
                rq = gl.full([64], 1.0, gl.float32, BLR)
                rk = gl.full([64], 1.0, gl.float32, BLR)
            gl.thread_barrier()  # the previous chunk's readers of q_s, k_s, g_s, sx_s are done
            q_s.store(bq)  # rows past the sequence end as zeros
            k_s.store(bk)
            zg = gl.zeros([64, K], gl.float32, MG)
            if EXACT_G:
                gt_s.store(gl.permute(bg, (1, 0)))
                fence_async_shared()
                gl.thread_barrier()
                G = warpgroup_mma(lt_s, gt_s.permute((1, 0)), zg, use_acc=False)
            else:  # g = hi + lo, both parts exact in tf32 up to 2^-22 |g|
                hi = _tf32r(bg)
                gt_s.store(gl.permute(hi, (1, 0)))
                fence_async_shared()
                gl.thread_barrier()
                G = warpgroup_mma(lt_s, gt_s.permute((1, 0)), zg, use_acc=False)
                gl.thread_barrier()
                gt_s.store(gl.permute(bg - hi, (1, 0)))
                fence_async_shared()
                gl.thread_barrier()
                G = warpgroup_mma(lt_s, gt_s.permute((1, 0)), G)
            g_s.store(G)
            gl.thread_barrier()

            if PROFILE:
                c1 = _clock()
                t_load += c1 - c0
            # ---- A, P (raw transposed pieces), then masks and row scales in [t, s] orientation
            if L2:
                k3 = k_s.reshape([4, 16, K]).load(BL3).to(gl.float32)
                rk3 = gl.rsqrt(gl.sum(k3 * k3, axis=2) + 1e-6)[:, :, None]
            else:
                rk3 = gl.full([4, 16, 1], 1.0, gl.float32, BL3)
            _chunk_ap(k_s, q_s, g_s, g1_s, yy_s, lk2_s, pa3_s, rk3, K, BL, BL3, M32)
            P = pt_s.permute((1, 0)).load(M64)
            A = at_s.permute((1, 0)).load(M64)
            rq_t = gl.convert_layout(rq * scale, gl.SliceLayout(1, M64))
            bk_t = gl.convert_layout(bb * rk, gl.SliceLayout(1, M64))
            P = gl.where(sc[None, :] <= tr[:, None], P * rq_t[:, None], 0.0)
            A = gl.where(sc[None, :] < tr[:, None], A * bk_t[:, None], 0.0)
            p_s.store(P.to(dt))
            same = (tr[:, None] // 16) == (sc[None, :] // 16)
            gl.thread_barrier()
            pt_s.store(gl.where(same, A, 0.0))
            y_s.store(gl.permute(_tf32r(gl.where(same, 0.0, A)), (1, 0)))  # A_off^T: K-major operand
            gl.thread_barrier()

            if PROFILE:
                c2 = _clock()
                t_ap += c2 - c1
            # ---- T = (I + A)^-1 = Td - N (Td - N (Td - N Td)),  N = Td A_off
            _diag_inverse(pt_s, ad_s, L16, L3, PLAIN3)
            Td = pt_s.load(M64)
            fence_async_shared()
            N = warpgroup_mma(_tf32r(pt_s.load(gl.DotOperandLayout(0, M64, 1))), y_s.permute((1, 0)),
                              gl.zeros([64, 64], gl.float32, M64), use_acc=False)
            n_s.store(_tf32r(-N))
            Y = Td
            for it in gl.static_range(3):  # iterates alternate between y1_s and y_s: one barrier each
                yb = y1_s if it % 2 == 0 else y_s
                yb.store(gl.permute(_tf32r(Y), (1, 0)))
                fence_async_shared()
                gl.thread_barrier()
                Y = warpgroup_mma(n_s, yb.permute((1, 0)), Td)

            if PROFILE:
                c3 = _clock()
                t_inv += c3 - c2
            # ---- operands of the state phase: T, Xw = beta k e^G, qg = scale q e^G, kg = k e^{gl - G}
            gl.thread_barrier()
            y_s.store(_tf32r(Y))
            s_s.store(S.to(dt))
            G = g_s.load(BL)
            glast = g1_s.slice(K * 63, K).load(gl.SliceLayout(0, BL))[None, :]
            egl = _exp(g1_s.slice(K * 63, K).load(gl.SliceLayout(1, MV16)))
            kf = k_s.load(BL).to(gl.float32) * rk[:, None]
            qr = q_s.load(BL)
            gl.thread_barrier()  # q_s, k_s, g_s are read: their bytes take qg, kg, Xw
            eG = _exp(G)
            xw_s.store((-bb[:, None] * kf * eG).to(dt))
            kg_s.store((kf * _exp(glast - G)).to(dt))
            qg_s.store((qr.to(gl.float32) * (rq * scale)[:, None] * eG).to(dt))
            fence_async_shared()
            gl.thread_barrier()

            if PROFILE:
                c4 = _clock()
                t_ops += c4 - c3
            # ---- R = beta v - Xw S;  Vn = T R
            bv = gl.load(v + orow64[:, None] * V + v0 + scol[None, :], mask=(orow < nr)[:, None] & (scol[None, :] < BV),
                         other=0.0).to(gl.float32)
            bvb = gl.load(beta + orow64, mask=orow < nr, other=0.0).to(gl.float32)
            if BSIG:
                bvb = 1.0 / (1.0 + _exp(-bvb))
            R = warpgroup_mma(xw_s, s_s, bv * bvb[:, None])
            r_s.store(gl.permute(_tf32r(R), (1, 0)))
            fence_async_shared()
            gl.thread_barrier()
            Vn = warpgroup_mma(y_s, r_s.permute((1, 0)), gl.zeros([64, BV], gl.float32, MV8), use_acc=False)
            gl.thread_barrier()  # vn_s shares r_s's bytes
            vn_s.store(Vn.to(dt))
            fence_async_shared()
            gl.thread_barrier()

            # ---- O = qg S + P Vn;  S <- e^gl S + kg^T Vn
            O = warpgroup_mma(qg_s, s_s, gl.zeros([64, BV], gl.float32, MV16), use_acc=False, is_async=True)
            O = warpgroup_mma(p_s, vn_s, O, is_async=True)
            S = warpgroup_mma(kg_s.permute((1, 0)), vn_s, S * egl[:, None], is_async=True)
            if PIPE:
                offk = (row64 + 64 * H)[:, None] * K + colk[None, :]
                mk = ((rows < nr - 64)[:, None]) & (colk[None, :] < K)
                nq = gl.load(q + offk, mask=mk, other=0.0)
                nk = gl.load(k + offk, mask=mk, other=0.0)
                ng = gl.load(g + offk, mask=mk, other=0.0)
            O, S = warpgroup_mma_wait(0, deps=[O, S])
            gl.store(o + orow64[:, None] * V + v0 + scol[None, :], O.to(o.dtype.element_ty),
                     mask=(orow < nr)[:, None] & (scol[None, :] < BV))
            if PROFILE:
                t_state += _clock() - c4
        if STORE_HT:
            gl.store(ht + soff, S)
        if PROFILE:
            pp = prof + (i_nh * gl.num_programs(1) + i_v) * 5
            gl.store(pp, t_load)
            gl.store(pp + 1, t_ap)
            gl.store(pp + 2, t_inv)
            gl.store(pp + 3, t_ops)
            gl.store(pp + 4, t_state)


WARPS = 8  # two warpgroups side by side along the value columns
PIPE = False  # True: load chunk c + 1's q, k, g during chunk c's last dots (measured slower: register spills)
PROFILE: torch.Tensor | None = None  # int64 [programs, 5]: cycles per phase (load, A/P, inverse, operands, state)
VALUE_BLOCK: int | None = None  # BV override (benchmarks, tests); None: `_value_block`'s rule


def _value_block(V: int, NH: int) -> int:
    """Value block per program: all of V when that gives at least ~3/4 of the SMs a program (the
    intra-chunk work is then done once per (sequence, head)), else 64 (one program per SM is the
    occupancy: ~220 KB of shared memory each)."""
    bv = V
    while bv > 64 and NH * (V // bv) < 96:
        bv //= 2
    return bv


def kda_fwd_gluon(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, N, scale, lower_bound,
                  l2, bsig, output_final_state):
    """Inference forward (no intermediates kept).  Shapes as `chunk_kda`; cu_seqlens int32 [N + 1] on
    the device (the fixed-length batch as offsets b * T).  Returns (o [B, T, H, V] in v's dtype,
    final state [N, H, K, V] fp32 or None)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    o = torch.empty_like(v)
    ht = torch.empty(N, H, K, V, device=q.device, dtype=torch.float32) if output_final_state else None
    h0 = initial_state.float().contiguous() if initial_state is not None else None
    gate = A_log is not None
    BV = min(V, VALUE_BLOCK) if VALUE_BLOCK is not None else _value_block(V, N * H)
    _kda_fwd_gluon[(N * H, V // BV)](
        q, k, v, g, beta, A_log if gate else q, dt_bias if gate else q, o,
        h0 if h0 is not None else o, ht if ht is not None else o, cu_seqlens,
        PROFILE if PROFILE is not None else cu_seqlens, float(scale), float(lower_bound),
        H=H, K=K, V=V, BV=BV, NW=WARPS, PIPE=PIPE, GATE=gate, L2=bool(l2), BSIG=bool(bsig), USE_H0=h0 is not None,
        STORE_HT=ht is not None, PROFILE=PROFILE is not None, num_warps=WARPS,
    )
    return o, ht
