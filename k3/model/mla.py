"""Gated Multi-head Latent Attention (NoPE) of K3, with a latent cache and weight-absorbed decode."""

from __future__ import annotations

import inspect
import warnings
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import CausalBias, causal_lower_right

from k3.config import TextConfig
from k3.model.cache import DecodeCache, SeqLayout
from k3.model.common import RMSNorm, fan_in_linears, linear_residual
from k3.model.fused import EAGER, Kernels
from k3.model.segment import SegmentHooks
from k3.model.step_weights import StepLinear

MLA_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm (everything else uses rms_norm_eps)


class GatedMLA(nn.Module):
    """q = q_b(norm(q_a(x))) -> [H, nope + rope]; [latent | k_pe] = kv_a(x); kv = kv_b(norm(latent)) ->
    [H, k_nope | v]; k_h = [k_nope_h | k_pe] (k_pe shared, un-normalised, never rotated);
    softmax(q k^T / sqrt(nope + rope)) v, gated by sigmoid(g_proj x), then o_proj.

    Input x: [B, T, d]; output [B, T, d].
    """

    kernels: Kernels = EAGER

    def __init__(self, config: TextConfig, layer_idx: int) -> None:
        super().__init__()
        d, H = config.hidden_size, config.num_attention_heads
        self.layer_idx, self.num_heads = layer_idx, H
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.scale = (self.nope + self.rope) ** -0.5
        qk = self.nope + self.rope
        if config.q_lora_rank is None:
            self.q_proj = StepLinear(d, H * qk)
        else:
            self.q_a_proj = StepLinear(d, config.q_lora_rank)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, MLA_NORM_EPS)
            self.q_b_proj = StepLinear(config.q_lora_rank, H * qk)
        self.kv_a_proj_with_mqa = StepLinear(d, self.kv_lora_rank + self.rope)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, MLA_NORM_EPS)
        self.kv_b_proj = StepLinear(self.kv_lora_rank, H * (self.nope + self.v_dim))
        self.use_output_gate = config.mla_use_output_gate
        if self.use_output_gate:
            self.g_proj = StepLinear(d, H * self.v_dim)
        self.o_proj = StepLinear(H * self.v_dim, d)
        # keys/values from outside when this layer runs on one segment of a row (context parallelism)
        self.segment_hooks: SegmentHooks | None = None

    def _q_first(self) -> StepLinear:
        """The GEMM that reads x for the queries: q_proj, or q_a_proj of the low-rank path."""
        return self.q_proj if hasattr(self, "q_proj") else self.q_a_proj

    def _q(self, x: torch.Tensor) -> torch.Tensor:
        return self._q_from(self._q_first()(x))

    def _q_from(self, q: torch.Tensor) -> torch.Tensor:
        """The first query GEMM's output [B, T, *] -> q [B, T, H, nope+rope] (q_b_proj(q_a_layernorm(.)) when
        low-rank)."""
        if not hasattr(self, "q_proj"):
            q = self.q_b_proj(self.q_a_layernorm(q))
        return q.reshape(*q.shape[:2], self.num_heads, self.nope + self.rope)

    def _latent(self, x: torch.Tensor) -> torch.Tensor:
        """[latent normalised (kv_lora_rank) | k_pe (rope)] per token: what the cache stores."""
        return torch.cat(self._latent_parts(x), dim=-1)

    def _latent_parts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(latent normalised [..., kv_lora_rank], k_pe [..., rope]): `_latent` before its concatenation."""
        return self._latent_from(self.kv_a_proj_with_mqa(x))

    def _latent_from(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_a_proj_with_mqa's output [..., kv_lora_rank + rope] -> (latent normalised, k_pe)."""
        c, k_pe = kv.split([self.kv_lora_rank, self.rope], dim=-1)
        return self.kv_a_layernorm(c), k_pe

    def _expand(self, lat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """latent [..., S, kv_lora+rope] -> keys [..., S, H, nope+rope], values [..., S, H, v]."""
        return self._expand_parts(*lat.split([self.kv_lora_rank, self.rope], dim=-1))

    def _expand_parts(self, c: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`_expand` of the latent's two parts (c [..., S, kv_lora], k_pe [..., S, rope])."""
        return self.kernels.mla_kv(self.kv_b_proj(c), k_pe, self.num_heads, self.nope, self.v_dim)

    def _out(self, x: torch.Tensor, attn: torch.Tensor, residual: torch.Tensor | None,
             gate: torch.Tensor | None = None) -> torch.Tensor:
        """attn [B, T, H, v] -> gate -> o_proj [+ residual, inside the GEMM]; `gate`: g_proj(x) if already made."""
        B, T = attn.shape[:2]
        attn = attn.reshape(B, T, self.num_heads * self.v_dim)
        if self.use_output_gate:
            attn = self.kernels.sigmoid_gate(attn, self.g_proj(x) if gate is None else gate, x.dtype)
        return linear_residual(attn, self.o_proj.gemm_weight(), residual)

    def _fan_in(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """Training: x's three GEMMs (q / q_a, kv_a, g) as one fan-in (`fan_in_linears`: x's gradient summed
        inside the input-gradient GEMMs); (q [B, T, H, qk], latent [..., kv_lora] normalised, k_pe, gate or
        None), or None for the plain path (no grad, x off the compute dtype)."""
        lins = [self._q_first(), self.kv_a_proj_with_mqa] + ([self.g_proj] if self.use_output_gate else [])
        fan = fan_in_linears(x.reshape(-1, x.shape[-1]), [m.gemm_weight() for m in lins])
        if fan is None:
            return None
        B, T = x.shape[:2]
        q, kv, *g = (t.reshape(B, T, -1) for t in fan[1:])
        return (self._q_from(q), *self._latent_from(kv), g[0] if g else None)

    def forward(self, x: torch.Tensor, layout: SeqLayout, cache: DecodeCache | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, d] -> attention output [B, T, d], plus `residual` ([B, T, d]) if given, added inside the
        output projection's GEMM (`linear_residual`)."""
        if self.segment_hooks is not None:  # one segment of a row: keys/values come from the hooks
            if cache is not None:
                raise ValueError("GatedMLA: segment hooks (context parallel) are for training forwards; cache must be None")
            return self._out(x, self._attend_segment(self._q(x), self._latent(x), layout), residual)
        if cache is None:  # the latent's parts go straight to the expansion (no concatenation to split again)
            fan = self._fan_in(x)
            if fan is not None:
                q, c, k_pe, gate = fan
                k, v = self._expand_parts(c, k_pe)
                return self._out(x, self._attend_packed(q, k, v, layout), residual, gate)
            q = self._q(x)
            k, v = self._expand_parts(*self._latent_parts(x))
            return self._out(x, self._attend_packed(q, k, v, layout), residual)
        return self._out(x, self._attend_cached(self._q(x), self._latent(x), layout, cache), residual)

    # -- attention without a cache -------------------------------------------------------------
    def _attend_packed(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SeqLayout) -> torch.Tensor:
        """Causal attention over [B, T] rows, block-diagonal per document when packed."""
        tmax = layout.max_new() if layout.cu_seqlens is not None else 0
        if tmax * layout.num_seqs == q.shape[1] > 0:
            # Equal-length documents: the packed row [1, N*L] is N rows [N, L], a view (no gather/scatter).
            q, k, v = (t.reshape(layout.num_seqs, tmax, *t.shape[2:]).transpose(1, 2) for t in (q, k, v))
            o = _sdpa(q, k, v, None, causal=True, scale=self.scale).transpose(1, 2)
            return o.reshape(1, layout.num_seqs * tmax, *o.shape[2:])
        if layout.cu_seqlens is not None and _use_varlen(q):
            # Documents of any lengths on the GPU: flash attention over the packed row, sum of len^2 work
            # (re-padding costs N * Tmax^2 and a dense mask total^2, both far more on real corpora).
            cu = layout.cu_seqlens.to(q.device, torch.int32)
            try:
                return varlen_causal(q[0], k[0], v[0], cu, tmax, self.scale)[None]
            except RuntimeError as e:  # a torch build without flash varlen for this case: the exact paths below
                warnings.warn(f"MLA: flash varlen attention is unavailable here ({str(e).splitlines()[0]}); "
                              "attending over re-padded documents instead", RuntimeWarning, stacklevel=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, *]
        if layout.cu_seqlens is None:
            o = _sdpa(q, k, v, None, causal=True, scale=self.scale)
        elif layout.num_seqs * tmax ** 2 < q.shape[2] ** 2:
            # Re-pad documents to [N, Tmax] (padding at the end, so plain causal masking is exact):
            # N * Tmax^2 work instead of total^2 for a block-diagonal mask over the packed row.
            q, k, v = (_to_padded(t.transpose(1, 2), layout).transpose(1, 2) for t in (q, k, v))
            o = _sdpa(q, k, v, None, causal=True, scale=self.scale)
            return _from_padded(o.transpose(1, 2), layout, layout.total_new())
        else:
            T = q.shape[2]
            seq, _ = layout.token_seq_pos(T)
            idx = torch.arange(T, device=q.device)
            mask = (seq[:, None] == seq[None, :]) & (idx[None, :] <= idx[:, None])
            o = _sdpa(q, k, v, mask, causal=False, scale=self.scale)
        return o.transpose(1, 2)

    def _attend_segment(self, q: torch.Tensor, lat: torch.Tensor, layout: SeqLayout) -> torch.Tensor:
        """q [1, T, H, qk] against the latents `segment_hooks` provide ([1, S, D] with a [T, S] mask)."""
        full, mask = self.segment_hooks.mla_kv_source(lat, layout)
        k, v = self._expand(full)
        o = _sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, causal=False, scale=self.scale)
        return o.transpose(1, 2)

    # -- attention against the latent cache -------------------------------------------------------
    def _attend_cached(self, q: torch.Tensor, lat: torch.Tensor, layout: SeqLayout, cache: DecodeCache) -> torch.Tensor:
        q_pad, lat_pad = _to_padded(q, layout), _to_padded(lat, layout)
        if cache.paged_mla and (q_pad.shape[1] == 1 or cache.static_shapes):
            # serving decode / static verify: the kernel reads each token's valid pages in place (no gather,
            # no padded bucket); a static cache sizes its splits per row as in a decode step (mla_split_rows)
            pages, tables, lens = cache.mla_write(self.layer_idx, lat_pad)
            o = self._absorbed_paged(q_pad, pages, tables, lens, getattr(cache, "mla_split_rows", None))
            return _from_padded(o, layout, q.shape[1])
        buf = cache.mla_append(self.layer_idx, lat_pad, layout)  # [N, cap, D]
        if not cache.absorb_mla:  # prefill (static decode caches always absorb)
            return _from_padded(self._prefill_rows(q_pad, buf, layout), layout, q.shape[1])
        N, Tq = q_pad.shape[:2]
        if cache.static_shapes:
            S = buf.shape[1]  # CUDA-graph decode: attend over every gathered row, the mask hides the rest
        else:
            S = int((layout.past_lens + layout.new_lens).max()) if N else 0
        kpos = torch.arange(S, device=q.device)
        qpos = layout.past_lens[:, None] + torch.arange(Tq, device=q.device)[None, :]  # [N, Tq]
        mask = kpos[None, None, :] <= qpos[:, :, None]  # [N, Tq, S] causal incl. cache; padding keys excluded
        o = self._absorbed(q_pad, buf[:, :S], mask)
        return _from_padded(o, layout, q.shape[1])

    def _prefill_rows(self, q: torch.Tensor, buf: torch.Tensor, layout: SeqLayout) -> torch.Tensor:
        """Prefill against the cache, one row at a time: row i's new tokens attend causally to its own
        past + new latents (bottom-right aligned), expanded to keys and values for that row only.

        q [N, Tq, H, nope+rope] (padded rows), buf [N, cap, kv_lora+rope] -> [N, Tq, H, v]. No [N, Tq, S]
        mask and no padding to the longest row's context: on CUDA the lower-right causal bias keeps SDPA
        on its fused kernels, where a boolean mask can force the materialising path."""
        out = q.new_zeros(*q.shape[:3], self.v_dim)
        for i, (past, new) in enumerate(zip(layout.past_lens.tolist(), layout.new_lens.tolist())):
            if new == 0:
                continue
            k, v = self._expand(buf[i: i + 1, : past + new])
            o = _sdpa(q[i: i + 1, :new].transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                      causal_lower_right(new, past + new), causal=False, scale=self.scale)
            out[i, :new] = o[0].transpose(0, 1)
        return out

    def _absorbed(self, q: torch.Tensor, lat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Weight-absorbed attention over latents: q [N, Tq, H, nope+rope], lat [N, S, kv_lora+rope].

        scores_h = (q_nope_h W_uk_h) . c + q_pe_h . k_pe; out_h = (sum_s p_s c_s) W_uv_h^T. fp32 softmax.
        """
        r = self.kv_lora_rank
        w_uk, w_uv = self._absorb_weights()
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        c, k_pe = lat.split([r, self.rope], dim=-1)
        q_lat = torch.einsum("nthd,hdr->nthr", q_nope.float(), w_uk.float())
        scores = torch.einsum("nthr,nsr->nhts", q_lat, c.float()) + torch.einsum(
            "nthd,nsd->nhts", q_pe.float(), k_pe.float())
        scores = (scores * self.scale).masked_fill(~mask[:, None], float("-inf"))
        p = torch.softmax(scores, dim=-1)
        o_lat = torch.einsum("nhts,nsr->nthr", p, c.float())
        return torch.einsum("nthr,hvr->nthv", o_lat, w_uv.float()).to(q.dtype)

    def _absorb_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj split per head: W_uk [H, nope, r], W_uv [H, v, r] (views)."""
        w = self.kv_b_proj.weight.reshape(self.num_heads, self.nope + self.v_dim, self.kv_lora_rank)
        return w[:, : self.nope], w[:, self.nope:]

    def _absorbed_paged(self, q: torch.Tensor, pages: torch.Tensor, tables: torch.Tensor,
                        lens: torch.Tensor, split_rows: int | None = None) -> torch.Tensor:
        """`_absorbed` over paged latents by the Triton kernel, each query token a kernel row.

        q [N, T, H, nope+rope]; pages [num_blocks, page_size, kv_lora+rope] (one layer of the pool);
        tables [N * T, P] block ids; lens [N * T] tokens to attend (the token itself included; 0 =
        padding). split_rows: size the kernel's sequence splits as for this many rows (None: N * T).
        """
        from k3.ops.mla_decode import default_num_splits, paged_mla_decode  # Triton: imported where used

        N, T = q.shape[:2]
        w_uk, w_uv = self._absorb_weights()
        q_nope, q_pe = q.flatten(0, 1).split([self.nope, self.rope], dim=-1)
        q_lat = torch.einsum("nhd,hdr->nhr", q_nope.float(), w_uk.float())
        splits = (default_num_splits(split_rows, self.num_heads, tables.shape[1] * pages.shape[1], q.device)
                  if split_rows else None)
        o_lat = paged_mla_decode(q_lat, q_pe, pages, tables, lens, self.scale, num_splits=splits)
        return torch.einsum("nhr,hvr->nhv", o_lat, w_uv.float()).to(q.dtype).reshape(N, T, *o_lat.shape[1:2], -1)


def _load_varlen() -> tuple[Callable | None, dict]:
    """torch.nn.attention.varlen.varlen_attn (flash attention over cu_seqlens) when this torch has it, and
    its causal keyword: torch spelt it `is_causal=True` before it took `window_size=(-1, 0)`."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, {}
    params = inspect.signature(varlen_attn).parameters
    return varlen_attn, ({"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True})


_VARLEN_ATTN, _VARLEN_CAUSAL = _load_varlen()


def _use_varlen(q: torch.Tensor) -> bool:
    """Flash attention's envelope: CUDA sm80+, bf16 / fp16, one head size <= 256 that is a multiple of 8."""
    d = q.shape[-1]
    return (_VARLEN_ATTN is not None and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)
            and d <= 256 and d % 8 == 0 and torch.cuda.get_device_capability(q.device)[0] >= 8)


def varlen_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int,
                  scale: float) -> torch.Tensor:
    """Causal attention within each document of a packed row (flash attention, varlen).

    q, k: [total, H, Dqk]; v: [total, H, Dv] (Dv <= Dqk: flash attention takes one head size, so v is
    zero-padded to Dqk and the output sliced back); cu: int32 [N + 1] document offsets; max_len: the
    longest document. Returns [total, H, Dv] in q's dtype.
    """
    dqk, dv = q.shape[-1], v.shape[-1]
    if dv > dqk:
        raise ValueError(f"varlen_causal: value head size {dv} > query/key head size {dqk}")
    if dv < dqk:
        v = F.pad(v, (0, dqk - dv))
    o = _VARLEN_ATTN(q, k, v, cu, cu, max_len, max_len, scale=scale, **_VARLEN_CAUSAL)
    return o[..., :dv]


def _sdpa(q, k, v, mask, *, causal: bool, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale) v with fp32 softmax; q/k head dim may differ from v's.

    q: [B, H, T, Dqk], k: [B, H, S, Dqk], v: [B, H, S, Dv]; mask: bool [T, S] (True = attend), a
    CausalBias, or None. Returns [B, H, T, Dv] in q's dtype.
    """
    if q.is_cuda or q.dtype == torch.float64:  # CUDA kernels accumulate softmax in fp32
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)
    if isinstance(mask, CausalBias):  # lower-right causal: query t sees keys <= t + S - T
        T, S = q.shape[-2], k.shape[-2]
        mask, causal = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T), False
    # CPU: PyTorch's flash kernel (fp32 softmax and accumulation, also for bf16; far faster than the math
    # path, which materialises the scores) takes one head size, so v is zero-padded to q's and sliced back.
    dqk, dv = q.shape[-1], v.shape[-1]
    if dv > dqk or q.shape[-2] == 0 or k.shape[-2] == 0:
        return _sdpa_fp32(q, k, v, mask, causal=causal, scale=scale)
    vp = F.pad(v, (0, dqk - dv)) if dv < dqk else v
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        o = F.scaled_dot_product_attention(q, k, vp, attn_mask=mask, is_causal=causal, scale=scale)
    return o[..., :dv]


def _sdpa_fp32(q, k, v, mask, *, causal: bool, scale: float) -> torch.Tensor:
    """The same attention spelt out: scores and softmax in fp32, output in q's dtype."""
    s = torch.einsum("...td,...sd->...ts", q.float(), k.float()) * scale
    if causal:
        T, S = s.shape[-2:]
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("...ts,...sd->...td", torch.softmax(s, -1), v.float()).to(q.dtype)


def _to_padded(x: torch.Tensor, layout: SeqLayout) -> torch.Tensor:
    """[B, T, ...] rows or packed [1, total, ...] -> [N, Tmax, ...] (zero padded)."""
    if layout.cu_seqlens is None:
        return x
    total = x.shape[1]
    seq, pos = layout.token_seq_pos(total)
    tmax = layout.max_new()
    out = x.new_zeros(layout.num_seqs, tmax, *x.shape[2:])
    out[seq, pos] = x[0]
    return out


def _from_padded(x: torch.Tensor, layout: SeqLayout, total: int) -> torch.Tensor:
    """[N, Tmax, ...] -> packed [1, total, ...] (identity for row input)."""
    if layout.cu_seqlens is None:
        return x
    seq, pos = layout.token_seq_pos(total)
    flat = x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])
    return flat.index_select(0, seq * x.shape[1] + pos)[None]  # backward: index_add, not index_put
