"""The KDA (Kimi Delta Attention) mixer layer of K3."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from k3.config import TextConfig
from k3.model.cache import DecodeCache, SeqLayout
from k3.model.common import keep_fp32, linear_residual
from k3.model.fused import EAGER, Kernels, linear_multi
from k3.model.segment import SegmentHooks
from k3.model.step_weights import StepCache, StepLinear
from k3.ops.kda import kda, kda_gate, l2norm
from k3.ops.short_conv import document_starts, short_conv_silu


def causal_conv_silu(x: torch.Tensor, weight: torch.Tensor, layout: SeqLayout,
                     tail: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv (no bias) followed by SiLU, with per-sequence history.

    x: [B, T, C] (rows, or packed [1, total] when layout.cu_seqlens is set); weight: [C, 1, W] fp32,
    tap W-1 multiplies the current token; tail: [N, W-1, C] previous inputs (zeros = sequence start)
    or None. Returns (SiLU(conv(x)) in x's dtype, new tail [N, W-1, C] = last W-1 inputs per sequence).
    The conv is evaluated in fp32.
    """
    B, T, C = x.shape
    W = weight.shape[-1]
    w = weight.reshape(C, W).float()
    N = layout.num_seqs
    if tail is None:
        tail = x.new_zeros(N, W - 1, C)
    if layout.cu_seqlens is None:
        ext = torch.cat([tail.to(x.dtype), x], dim=1).float()  # [B, W-1+T, C]
        y = sum(ext[:, j: j + T] * w[:, j] for j in range(W))
        new_tail = ext[:, T:].to(x.dtype)
        return torch.nn.functional.silu(y).to(x.dtype), new_tail
    # Packed: source rows are the T packed tokens followed by every sequence's W-1 tail rows.
    src = torch.cat([x[0], tail.reshape(N * (W - 1), C).to(x.dtype)], dim=0).float()
    seq, pos = layout.token_seq_pos(T)
    starts = layout.cu_seqlens.to(x.device, torch.long)

    def index(s: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        # virtual position p within sequence s (negative = inside the tail) -> row of `src`
        return torch.where(p >= 0, starts[s] + p, T + s * (W - 1) + (W - 1) + p)

    y = sum(src.index_select(0, index(seq, pos - (W - 1 - j))) * w[:, j] for j in range(W))
    n = torch.arange(N, device=x.device)
    p_tail = layout.new_lens[:, None] - (W - 1) + torch.arange(W - 1, device=x.device)[None, :]
    new_tail = src.index_select(0, index(n[:, None].expand_as(p_tail), p_tail).flatten()).view(N, W - 1, C)
    new_tail = new_tail.to(x.dtype)
    return torch.nn.functional.silu(y).to(x.dtype)[None], new_tail


def conv_fix_rows(layout: SeqLayout, total: int, width: int, device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Packed rows whose causal window would reach into the previous document: the first W-1 tokens
    of every document. Returns (rows [N*(W-1)], in-document mask of their W taps [N*(W-1), W]), or
    None for row input (the conv's zero padding is already exact). A document shorter than W-1 has
    fewer such rows; its spare entries point at row `total` (a scratch row), so the real rows are
    distinct and each gets its value (and gradient) once."""
    if layout.cu_seqlens is None:
        return None
    memo = layout.__dict__.setdefault("_conv_fix_rows", {})  # every KDA layer of a forward shares the layout
    if (total, width, device) not in memo:
        memo[(total, width, device)] = _conv_fix_rows(layout, total, width, device)
    return memo[(total, width, device)]


def _conv_fix_rows(layout: SeqLayout, total: int, width: int, device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    starts = layout.cu_seqlens[:-1].to(device, torch.long)
    p = torch.arange(width - 1, device=device)
    rows = torch.where(p < layout.new_lens.to(device)[:, None], starts[:, None] + p, total).flatten()
    _, pos = layout.token_seq_pos(total)
    taps = torch.arange(width, device=device) - (width - 1)  # source offset of tap j
    return rows, pos.index_select(0, rows.clamp(max=total - 1))[:, None] + taps >= 0


def conv_silu_streams(x: torch.Tensor, weight: torch.Tensor, layout: SeqLayout, streams: int,
                      kernels: Kernels = EAGER, passthrough: tuple[int, ...] = ()) -> tuple[torch.Tensor, ...]:
    """`causal_conv_silu` for a forward without history (training, fresh prefill), as one depthwise
    conv1d over the whole row in fp32, then SiLU, cast, and a split into `streams` equal parts.

    x: [B, T, S*C + sum(passthrough)] any layout (e.g. a fused projection's output); weight [S*C, 1, W]
    fp32. Returns S tensors [B, T, C] in x's dtype, each contiguous (ready for the KDA kernel as is),
    then x's `passthrough` column groups after the conv channels, untouched (see `short_conv_silu`: on
    CUDA their gradients and the conv's are written into one tensor, no concatenation).
    Packed documents: the conv runs across document edges, then the first W-1 rows of each document
    are recomputed from their own document's taps (a few gathers), so the result is exact.
    On CUDA the fused Triton kernels of `k3.ops.short_conv` do all of it in one launch each way, with
    S separate outputs, so the backward takes the S gradients as they are (no stack of them into one
    [S, B, T, C] tensor). The CPU path's streams are views of one [S, B, T, C] tensor.
    """
    T, C = x.shape[1], x.shape[2] - sum(passthrough)
    if x.is_cuda:
        starts = None
        if layout.cu_seqlens is not None:  # shared by every KDA layer of the forward
            memo = layout.__dict__.setdefault("_conv_starts", {})
            if T not in memo:
                memo[T] = document_starts(layout.cu_seqlens.to(x.device), T)
            starts = memo[T]
        return short_conv_silu(x, weight, streams=streams, starts=starts, passthrough=passthrough)
    rest = tuple(x[..., C:].split(list(passthrough), dim=-1)) if passthrough else ()
    x = x[..., :C]
    W = weight.shape[-1]
    xt = x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)  # [B, C, T]
    w = weight.float()
    with torch.autocast(x.device.type, enabled=False):
        y = torch.nn.functional.conv1d(xt, w, padding=W - 1, groups=C)  # [B, C, T + W - 1], first T causal
    fix = conv_fix_rows(layout, T, W, x.device)
    if fix is not None:
        rows, keep = fix
        src = (rows[:, None] + torch.arange(W, device=x.device) - (W - 1)).clamp(0, T - 1)  # [R, W]
        taps = xt[0][:, src] * (w.reshape(C, 1, W) * keep)  # [C, R, W]
        y[0].index_copy_(1, rows, taps.sum(-1))  # row T (spare entries) lies outside the kept [:T]
    return tuple(kernels.silu_streams(y[..., :T], streams, x.dtype).unbind(0)) + rest


class KDAttention(nn.Module):
    """KDA mixer: q/k/v projections, short conv + SiLU, L2-normalised q/k, bounded forget gate,
    beta = sigmoid(b_proj x), delta-rule recurrence, per-head gated RMSNorm, o_proj.

    Input x: [B, T, d] (after input_layernorm). Output [B, T, d] in x's dtype.
    While training, the six input projections run as one GEMM (k3.model.fused.linear_multi) and the
    short conv as one fp32 conv1d over the packed row (`conv_silu_streams`). Inside
    `K3ForCausalLM.step_weights()` the GEMMs take the step's shared compute-dtype weight copies
    (`k3.model.step_weights`: the six projections' concatenation, f_b's and o's weights).
    """

    kernels: Kernels = EAGER

    def __init__(self, config: TextConfig, layer_idx: int) -> None:
        super().__init__()
        d = config.hidden_size
        lin = config.linear_attn_config
        self.layer_idx = layer_idx
        self.num_heads, self.head_dim = H, K = lin.num_heads, lin.head_dim
        self.lower_bound = lin.gate_lower_bound
        self.eps = config.rms_norm_eps
        W = lin.short_conv_kernel_size
        self.q_proj = StepLinear(d, H * K)
        self.k_proj = StepLinear(d, H * K)
        self.v_proj = StepLinear(d, H * K)
        self.q_conv1d = nn.Conv1d(H * K, H * K, W, groups=H * K, bias=False)
        self.k_conv1d = nn.Conv1d(H * K, H * K, W, groups=H * K, bias=False)
        self.v_conv1d = nn.Conv1d(H * K, H * K, W, groups=H * K, bias=False)
        self.A_log = keep_fp32(nn.Parameter(torch.zeros(H)))
        self.dt_bias = keep_fp32(nn.Parameter(torch.zeros(H * K)))
        self.f_a_proj = StepLinear(d, K)
        self.f_b_proj = StepLinear(K, H * K)
        self.b_proj = StepLinear(d, H)
        self.o_norm = nn.Module()
        self.o_norm.weight = keep_fp32(nn.Parameter(torch.ones(K)))
        self.g_proj = StepLinear(d, H * K)
        self.o_proj = StepLinear(H * K, d)
        for conv in (self.q_conv1d, self.k_conv1d, self.v_conv1d):
            keep_fp32(conv.weight)
        self.kda_backend = "auto"
        # the fused input projection's step copy (q|k|v|g|f_a|b): set by K3ForCausalLM.step_weights()
        self.step_cache: StepCache | None = None
        # history from outside when this layer runs on one segment of a row (context parallelism)
        self.segment_hooks: SegmentHooks | None = None

    @torch.no_grad()
    def reset_kda_parameters(self) -> None:
        """Initial gate parameters: A_log = 0 and dt_bias spreading the initial per-step decay
        log-uniformly over (1e-3, 1) nats, so channels start with memories from ~1 to ~1000 tokens.
        (Moonshot's initialisation is not public; this is k3's choice.)"""
        self.A_log.zero_()
        if self.lower_bound is None:
            decay = torch.exp(torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), 0.0))
            self.dt_bias.copy_(decay + torch.log(-torch.expm1(-decay)))  # inverse softplus
        else:
            frac = torch.exp(torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), 0.0)) / -self.lower_bound
            self.dt_bias.copy_(torch.log(frac) - torch.log1p(-frac))  # logit

    def forward(self, x: torch.Tensor, layout: SeqLayout, cache: DecodeCache | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, d] -> KDA output [B, T, d], plus `residual` ([B, T, d]) if given, added inside the
        output projection's GEMM (`linear_residual`)."""
        B, T, _ = x.shape
        H, K = self.num_heads, self.head_dim
        hooks = self.segment_hooks
        if hooks is not None and cache is not None:
            raise ValueError("KDAttention: segment hooks (context parallel) are for training forwards; cache must be None")
        conv_w = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight], dim=0)
        tail = cache.conv_tail[self.layer_idx] if cache is not None else None
        groups = [[self.q_proj.weight, self.k_proj.weight, self.v_proj.weight], [self.g_proj.weight],
                  [self.f_a_proj.weight], [self.b_proj.weight]]
        if cache is None and hooks is None:  # no history: the whole-row conv, passing the other outputs through
            proj = linear_multi(x, [sum(groups, [])], self.step_cache)[0]  # [B, T, 3HK + HK + K + H]
            *qkv, g_in, f_a, b = conv_silu_streams(proj, conv_w, layout, 3, self.kernels, passthrough=(H * K, K, H))
            q, k, v = (t.reshape(B, T, H, K) for t in qkv)
        else:
            qkv, g_in, f_a, b = linear_multi(x, groups, self.step_cache)
            if hooks is not None:
                tail = hooks.conv_history(qkv, conv_w.shape[-1], layout)
            raw = qkv
            qkv, new_tail = causal_conv_silu(qkv, conv_w, layout, tail)
            q, k, v = (t.reshape(B, T, H, K) for t in qkv.split(H * K, dim=-1))
        f = self.f_b_proj(f_a).reshape(B, T, H, K)
        record = getattr(cache, "kda_inputs", None)  # speculative verify: keep the inputs for a replay
        if record is not None:
            record[self.layer_idx] = (raw, k, v, f, b.float())
        initial = cache.kda_state[self.layer_idx] if cache is not None else None
        if hooks is not None:
            initial = hooks.kda_initial_state(self, k, v, f, b.float(), layout)
        steps = getattr(cache, "kda_steps", None)  # static verify: the state after every token, for a selection
        if cache is not None and cache.static_shapes:
            o, final, inter = self._decode_step(q, k, v, f, b.float(), initial, intermediate=steps is not None)
            if steps is not None:
                steps[self.layer_idx] = (inter, torch.cat([tail.to(raw.dtype), raw], 1))
        else:
            o, final = kda(
                q, k, v, f, b.float(), initial_state=initial, output_final_state=cache is not None,
                cu_seqlens=layout.cu_seqlens, cu_seqlens_cpu=layout.cu_seqlens_cpu, A_log=self.A_log,
                dt_bias=self.dt_bias, lower_bound=self.lower_bound,
                use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, backend=self.kda_backend,
            )
        if cache is not None:
            cache.kda_state[self.layer_idx] = final.float()
            cache.conv_tail[self.layer_idx] = new_tail
        o = self.kernels.gated_rms_norm(o, self.o_norm.weight, g_in.reshape(B, T, H, K), self.eps, x.dtype)
        return linear_residual(o.reshape(B, T, H * K), self.o_proj.gemm_weight(), residual)

    @torch.no_grad()
    def replay(self, state: torch.Tensor, tail: torch.Tensor, inputs: tuple[torch.Tensor, ...],
               n: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The recurrent state and conv tail after the first n[i] tokens of row i, rebuilt from the state
        and tail before them and the layer's inputs recorded during a forward over those rows (a cache
        with a `kda_inputs` dict; rows padded [N, T, ...]): (raw pre-conv q|k|v [N, T, 3HK], k, v,
        f [N, T, H, K], b [N, T, H] fp32). Speculative decoding's rollback: only the recurrence runs.
        state [N, H, K, K] fp32, tail [N, W-1, 3HK]; n[i] in 1..T. Returns (state, tail) like them."""
        raw, k, v, f, b = inputs
        out_s = state.clone()
        S = state.float()
        g = kda_gate(f, self.A_log, self.dt_bias, self.lower_bound)
        kf, vf, beta = l2norm(k).float(), v.float(), torch.sigmoid(b)
        for t in range(max(n)):
            S = S * g[:, t].exp()[..., None]
            u = beta[:, t, :, None] * (vf[:, t] - torch.einsum("nhk,nhkv->nhv", kf[:, t], S))
            S = S + kf[:, t, :, :, None] * u[:, :, None, :]
            done = torch.tensor([m == t + 1 for m in n], device=S.device)
            out_s[done] = S[done]
        W1 = tail.shape[1]
        ext = torch.cat([tail.to(raw.dtype), raw], 1)  # [N, W-1+T, C]
        new_tail = torch.stack([ext[i, m: m + W1] for i, m in enumerate(n)])
        return out_s, new_tail.to(tail.dtype)

    def _decode_step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, b: torch.Tensor,
                     state: torch.Tensor, intermediate: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """KDA over a few tokens per row ([N, T] rows, no packing) with only shape-static ops (CUDA graphs).

        q, k, v, f: [N, T, H, K] (f: raw gate input); b: [N, T, H] beta logits; state: [N, H, K, K] fp32.
        Returns (o [N, T, H, K] in v's dtype, final state [N, H, K, K] fp32, the state after every token
        [N, T, H, K, K] fp32 when `intermediate` else None). The Triton recurrent
        kernel runs on CUDA (or with the "triton" backend under TRITON_INTERPRET); elsewhere the
        token recurrence of `kda_reference` in PyTorch.
        """
        use_kernel = self.kda_backend == "triton" or (self.kda_backend == "auto" and q.is_cuda)
        if use_kernel and q.shape[1] <= 16 and _pow2_in(self.head_dim, 16, 128):
            from k3.ops.kda.recurrent import fused_recurrent_kda

            pool = state.to(torch.float32, memory_format=torch.contiguous_format, copy=True)  # updated in place
            rows = torch.arange(q.shape[0], device=q.device)
            o, inter = fused_recurrent_kda(q, k, v, f, b, pool, rows, A_log=self.A_log, dt_bias=self.dt_bias,
                                           lower_bound=self.lower_bound, use_qk_l2norm_in_kernel=True,
                                           use_beta_sigmoid_in_kernel=True, return_intermediate_states=intermediate)
            return o, pool, inter
        g = kda_gate(f, self.A_log, self.dt_bias, self.lower_bound)
        qf, kf = l2norm(q).float(), l2norm(k).float()
        vf, beta = v.float(), torch.sigmoid(b.float())
        S = state.float()
        scale = self.head_dim ** -0.5
        outs, states = [], []
        for t in range(q.shape[1]):
            S = S * g[:, t].exp()[..., None]
            u = beta[:, t, :, None] * (vf[:, t] - torch.einsum("nhk,nhkv->nhv", kf[:, t], S))
            S = S + kf[:, t, :, :, None] * u[:, :, None, :]
            outs.append(torch.einsum("nhk,nhkv->nhv", qf[:, t] * scale, S))
            states.append(S)
        return torch.stack(outs, 1).to(v.dtype), S, (torch.stack(states, 1) if intermediate else None)


def _pow2_in(n: int, lo: int, hi: int) -> bool:
    return lo <= n <= hi and n & (n - 1) == 0
