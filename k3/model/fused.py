"""The model's hot elementwise regions as autograd Functions with hand-derived backwards.

Each region is a pair of pure functions, ``fwd(inputs) -> (output, saved)`` and
``bwd(grad_output, *saved) -> input grads``, that does exactly the maths of the plain reference in
:mod:`k3.model.common` (fp32 where the spec asks for it, same casts). A :class:`Kernels` table
holds one set of pairs: :data:`EAGER` runs them as ordinary PyTorch; ``Kernels(compiled=True)``
runs each fwd and each bwd through ``torch.compile`` (inference graphs: Inductor fuses every
region into one or two kernels, no AOTAutograd partitioning needed). A table also carries a
:class:`k3.kernel_config.KernelConfig`, which picks per region between these torch regions and the
Triton kernels of `k3.ops`. Modules hold a table in their ``kernels`` attribute (class default
:data:`EAGER`); `K3ForCausalLM` sets one built from its KernelConfig, and
:func:`k3.model.compile.compile_model` swaps it for a compiled one with the same KernelConfig.

The saved tensors are the inputs plus small per-row statistics, except for SiTU in eager mode,
which saves its three fp32 intermediates (recomputing them would cost more eager passes than it
saves); compiled SiTU saves only its inputs (recomputation is free inside a fused kernel). Regions
whose backward autograd derives well (the router, the MLA output gate, the short-conv epilogue,
the loss) are plain functions, compiled with AOTAutograd when the table is compiled.

Why hand-derived backwards: eager PyTorch runs one kernel per operator, and autograd saves and
re-reads every fp32 intermediate; a compiled region still needs a backward graph, and an inference
graph per direction is the simplest thing for Inductor to fuse (and keeps gathers gathers: the MoE
combine's backward is a gather, not an atomic scatter).
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from k3.model.step_weights import StepCache, gemm_weight
from k3.ops.attn_res import MAX_CANDIDATES, attn_res_mix
from k3.kernel_config import DEFAULT, KernelConfig
from k3.ops.backend import use_triton
from k3.ops.cross_entropy import linear_cross_entropy
from k3.ops.mla_kv import mla_expand_kv, mla_kv_reference
from k3.ops.moe_combine import moe_combine, moe_dispatch
from k3.ops.moe_route import sort_slots_triton, topk_route
from k3.ops.router import router_logits
from k3.ops.situ import situ_glu

# --------------------------------------------------------------------------------------------
# SiTU-GLU: act = beta*tanh(a/beta)*sigmoid(a) * beta_lin*tanh(b/beta_lin), fp32, cast to a's dtype


def situ_fwd_save(a: Tensor, b: Tensor, beta: float, beta_lin: float) -> tuple[Tensor, tuple]:
    """Eager: saves tanh(a/beta), sigmoid(a), tanh(b/beta_lin) (fp32); empty tensors carry a's, b's dtypes."""
    af, bf = a.float(), b.float()
    ta, sa, tb = torch.tanh(af / beta), torch.sigmoid(af), torch.tanh(bf / beta_lin)
    act = beta * ta * sa * (beta_lin * tb)
    return act.to(a.dtype), (ta, sa, tb, a.new_empty(0), b.new_empty(0))


def situ_fwd_recompute(a: Tensor, b: Tensor, beta: float, beta_lin: float) -> tuple[Tensor, tuple]:
    """Compiled: saves the inputs only (the backward recomputes the activations inside its kernel)."""
    af, bf = a.float(), b.float()
    act = beta * torch.tanh(af / beta) * torch.sigmoid(af) * (beta_lin * torch.tanh(bf / beta_lin))
    return act.to(a.dtype), (None, None, None, a, b)


def situ_bwd(go: Tensor, ta: Tensor | None, sa: Tensor | None, tb: Tensor | None, a: Tensor, b: Tensor,
             beta: float, beta_lin: float) -> tuple[Tensor, Tensor]:
    """d/da [beta tanh(a/beta) sigmoid(a)] = (1 - ta^2) sa + beta ta sa (1 - sa); d/db [bl tanh(b/bl)] = 1 - tb^2."""
    if ta is None:
        af, bf = a.float(), b.float()
        ta, sa, tb = torch.tanh(af / beta), torch.sigmoid(af), torch.tanh(bf / beta_lin)
    g = go.float()
    left = beta * ta * sa
    d_left = (1 - ta * ta) * sa + left * (1 - sa)
    ga = g * (beta_lin * tb) * d_left
    gb = g * left * (1 - tb * tb)
    return ga.to(a.dtype), gb.to(b.dtype)


def situ_bwd_packed(go: Tensor, ta: Tensor | None, sa: Tensor | None, tb: Tensor | None, a: Tensor, b: Tensor,
                    beta: float, beta_lin: float) -> Tensor:
    """`situ_bwd` for a and b that are the halves of one [..., 2I] projection: the gradient [..., 2I]
    as one tensor (compiled, both halves are written in place; no separate concatenation pass)."""
    return torch.cat(situ_bwd(go, ta, sa, tb, a, b, beta, beta_lin), dim=-1)


# --------------------------------------------------------------------------------------------
# RMSNorm with optional sigmoid output gate (KimiRMSNorm; KDA's gated o_norm)


def norm_fwd(x: Tensor, w: Tensor | None, gate: Tensor | None, eps: float, round_normed: bool,
             out_dtype: torch.dtype) -> tuple[Tensor, tuple]:
    """out = cast(w * n [* sigmoid(gate)]), n = x_f32 * rsqrt(mean(x_f32^2) + eps), rounded to x's dtype
    first when round_normed (KimiRMSNorm); w: [D] or None; gate: x-shaped or None."""
    xf = x.float()
    r = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    n = xf * r
    if round_normed:
        n = n.to(x.dtype)
    y = n if w is None else w * n
    if gate is not None:
        y = y.float() * torch.sigmoid(gate.float())
    return y.to(out_dtype), (x, w, gate, r)


def norm_bwd(go: Tensor, x: Tensor, w: Tensor | None, gate: Tensor | None, r: Tensor, round_normed: bool
             ) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """dx = r * (gn - n * mean(gn * n)), gn = grad w.r.t. the normalised value (rounding: identity)."""
    g = go.float()
    xf = x.float()
    n = xf * r
    n_used = n.to(x.dtype).float() if round_normed else n
    ggate = None
    if gate is not None:
        s = torch.sigmoid(gate.float())
        y = n_used if w is None else w.float() * n_used
        ggate = (g * y * s * (1 - s)).to(gate.dtype)
        g = g * s
    gw = None
    if w is not None:
        gw = (g * n_used).reshape(-1, n.shape[-1]).sum(0).to(w.dtype)
        g = g * w.float()
    gx = r * (g - n * (g * n).mean(-1, keepdim=True))
    return gx.to(x.dtype), gw, ggate


# --------------------------------------------------------------------------------------------
# Block AttnRes mix: logit_i = (V_i . w) * rsqrt(mean(V_i^2) + eps), p = softmax_i, mix = sum_i p_i V_i


def res_fwd(cands: list[Tensor], w: Tensor, eps: float) -> tuple[Tensor, tuple]:
    """cands: n tensors [..., d] (any float dtypes); w = w_norm * w_proj [d] fp32. Returns the fp32 mix
    cast to the last candidate's dtype, and (p, r, s) [n, ...] fp32 for the backward."""
    vf = [c.float() for c in cands]
    s = torch.stack([v @ w for v in vf])
    r = torch.stack([torch.rsqrt(v.square().mean(-1) + eps) for v in vf])
    p = torch.softmax(s * r, dim=0)
    out = vf[0] * p[0].unsqueeze(-1)
    for i in range(1, len(vf)):
        out = out + vf[i] * p[i].unsqueeze(-1)
    return out.to(cands[-1].dtype), (p, r, s)


def res_bwd(go: Tensor, cands: list[Tensor], w: Tensor, p: Tensor, r: Tensor, s: Tensor
            ) -> tuple[list[Tensor], Tensor]:
    """Grads of every candidate (its dtype) and of w (fp32 [d]).

    d logit_i / d V_i = r_i w - s_i r_i^3 V_i / d; the softmax gives glogit_i = p_i (gp_i - sum_j p_j gp_j)
    with gp_i = g . V_i."""
    g = go.float()
    d = g.shape[-1]
    vf = [c.float() for c in cands]
    gp = torch.stack([(g * v).sum(-1) for v in vf])
    glog = p * (gp - (p * gp).sum(0, keepdim=True))
    a = glog * r  # coefficient of w
    c = a * s * r * r / d  # coefficient of -V_i
    grads = [(g * p[i].unsqueeze(-1) + a[i].unsqueeze(-1) * w - c[i].unsqueeze(-1) * vf[i]).to(cands[i].dtype)
             for i in range(len(vf))]
    gw = sum((a[i].unsqueeze(-1) * vf[i]).reshape(-1, d).sum(0) for i in range(len(vf)))
    return grads, gw


# --------------------------------------------------------------------------------------------
# MoE combine: out[t] = sum_j w[t, j] * y[slot of (t, j)] in fp32 (expert outputs keep their dtype)


def combine_fwd(y: Tensor, w: Tensor, inv: Tensor) -> tuple[Tensor, tuple]:
    """y: [N*k, L] expert outputs in expert-sorted order; w: [N, k] fp32; inv: [N*k] sorted slot of each
    (token, choice). Returns [N, L] summed in fp32 and cast to y's dtype (compiled: one kernel, the
    gathered [N, k, L] rows are never written), and (y, w) for the backward."""
    N, k = w.shape
    yt = y.index_select(0, inv).view(N, k, y.shape[-1])
    return (yt * w.unsqueeze(-1)).sum(1).to(y.dtype), (y, w)


def combine_bwd(go: Tensor, y: Tensor, w: Tensor, order: Tensor, inv: Tensor) -> tuple[Tensor, Tensor]:
    """(grad y [N*k, L] in sorted order, grad w [N, k] fp32). Both re-gather inside their kernel:
    gw from the y rows of each token's slots, gy from the gradient row of each slot's token."""
    N, k = w.shape
    g = go.float().unsqueeze(1)  # [N, 1, L]
    gw = (y.index_select(0, inv).view(N, k, y.shape[-1]) * g).sum(-1)
    gyt = (g * w.unsqueeze(-1)).to(y.dtype)
    return gyt.flatten(0, 1).index_select(0, order), gw


# --------------------------------------------------------------------------------------------
# Plain regions (autograd derives the backward; compiled with AOTAutograd when the table is)


def router_scores(x: Tensor, weight: Tensor) -> Tensor:
    """x [N, d], weight [E, d] -> sigmoid scores [N, E] fp32. The logits matmul is fp32 even under
    autocast (which would run it in bf16)."""
    with torch.autocast(x.device.type, enabled=False):
        return torch.sigmoid(x.float() @ weight.float().t())


def router_weights(scores: Tensor, idx: Tensor, renormalize: bool, scaling: float) -> Tensor:
    """The chosen experts' scores [N, k] fp32, optionally renormalised to sum 1, times scaling."""
    w = scores.gather(-1, idx)
    if renormalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * scaling


def router_select(x: Tensor, weight: Tensor, bias: Tensor, top_k: int, renormalize: bool, scaling: float
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """Sigmoid router: x [N, d] -> (ids [N, k] long, weights [N, k] fp32, scores [N, E] fp32); the bias
    [E] only selects. The torch region (the spec; `Kernels.route` may run the selection in Triton)."""
    scores = router_scores(x, weight)
    choice = (scores + bias.float()).detach()
    idx = torch.topk(choice, top_k, dim=-1, sorted=False).indices
    return idx, router_weights(scores, idx, renormalize, scaling), scores


def sigmoid_gate(x: Tensor, gate: Tensor, out_dtype: torch.dtype) -> Tensor:
    """(x_f32 * sigmoid(gate_f32)) cast to out_dtype (the MLA output gate)."""
    return (x.float() * torch.sigmoid(gate.float())).to(out_dtype)


def cross_entropy(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean token cross-entropy in fp32: logits [..., V] (any dtype), labels [...] with -100 = ignore.
    Compiled, the fp32 upcast fuses into the softmax (no fp32 copy of the logits is written)."""
    return F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), ignore_index=-100)


def silu_streams(y: Tensor, streams: int, out_dtype: torch.dtype) -> Tensor:
    """Short-conv epilogue: y [B, S*C, T] fp32 -> SiLU, cast, laid out [S, B, T, C] contiguous."""
    B, SC, T = y.shape
    out = F.silu(y).view(B, streams, SC // streams, T).permute(1, 0, 3, 2)
    return out.to(out_dtype, memory_format=torch.contiguous_format)


# --------------------------------------------------------------------------------------------
# autograd wrappers


def _situ_forward(ctx, a: Tensor, b: Tensor, beta: float, beta_lin: float, kern: "Kernels") -> Tensor:  # noqa: ANN001
    out, saved = kern.situ_fwd(a, b, beta, beta_lin)
    ctx.save_for_backward(*(t if t is not None else a.new_empty(0) for t in saved))
    ctx.none = tuple(t is None for t in saved)
    ctx.args = (beta, beta_lin, kern)
    return out


def _situ_saved(ctx) -> tuple:  # noqa: ANN001
    """(saved tensors with None restored, beta, beta_lin, kern)."""
    return [None if none else t for t, none in zip(ctx.saved_tensors, ctx.none)], *ctx.args


class _SiTU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, beta, beta_lin, kern):  # noqa: ANN001 - autograd signature
        return _situ_forward(ctx, a, b, beta, beta_lin, kern)

    @staticmethod
    def backward(ctx, go):  # noqa: ANN001
        saved, beta, beta_lin, kern = _situ_saved(ctx)
        ga, gb = kern.situ_bwd(go, *saved, beta, beta_lin)
        return ga, gb, None, None, None


class _SiTUPacked(torch.autograd.Function):
    """_SiTU on gate|up packed side by side in one tensor; the backward returns one gradient tensor."""

    @staticmethod
    def forward(ctx, ab, beta, beta_lin, kern):  # noqa: ANN001 - autograd signature
        return _situ_forward(ctx, *ab.chunk(2, dim=-1), beta, beta_lin, kern)

    @staticmethod
    def backward(ctx, go):  # noqa: ANN001
        saved, beta, beta_lin, kern = _situ_saved(ctx)
        return kern.situ_bwd_packed(go, *saved, beta, beta_lin), None, None, None


class _Norm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, gate, eps, round_normed, out_dtype, kern):  # noqa: ANN001
        out, (x, w, gate, r) = kern.norm_fwd(x, w, gate, eps, round_normed, out_dtype)
        ctx.save_for_backward(x, w, gate, r)
        ctx.args = (round_normed, kern)
        return out

    @staticmethod
    def backward(ctx, go):  # noqa: ANN001
        x, w, gate, r = ctx.saved_tensors
        round_normed, kern = ctx.args
        gx, gw, ggate = kern.norm_bwd(go, x, w, gate, r, round_normed)
        return gx, gw, ggate, None, None, None, None


class _AttnRes(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w_norm, w_proj, eps, kern, *cands):  # noqa: ANN001
        w = w_norm.float() * w_proj.float().reshape(-1)
        with torch.autocast(cands[0].device.type, enabled=False):  # the logits' dot products stay fp32
            out, (p, r, s) = kern.res_fwd(list(cands), w, eps)
        ctx.save_for_backward(w_norm, w_proj, w, p, r, s, *cands)
        ctx.kern = kern
        return out

    @staticmethod
    def backward(ctx, go):  # noqa: ANN001
        w_norm, w_proj, w, p, r, s, *cands = ctx.saved_tensors
        grads, gw = ctx.kern.res_bwd(go, cands, w, p, r, s)
        g_norm = (gw * w_proj.float().reshape(-1)).to(w_norm.dtype).reshape(w_norm.shape)
        g_proj = (gw * w_norm.float()).to(w_proj.dtype).reshape(w_proj.shape)
        return (g_norm, g_proj, None, None, *grads)


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, w, order, inv, kern):  # noqa: ANN001
        out, (y, w) = kern.combine_fwd(y, w, inv)
        ctx.save_for_backward(y, w, order, inv)  # y, not its [N, k, L] gather: no extra write, no extra memory
        ctx.kern = kern
        return out

    @staticmethod
    def backward(ctx, go):  # noqa: ANN001
        y, w, order, inv = ctx.saved_tensors
        gy, gw = ctx.kern.combine_bwd(go, y, w, order, inv)
        return gy, gw, None, None, None


def gather_sum(g: Tensor, inv: Tensor, k: int) -> Tensor:
    """Dispatch backward: g [N*k, L] in expert-sorted slot order -> [N, L], each token's k slots summed
    in a fixed order (compiled: one kernel, the gathered [N*k, L] rows are never written)."""
    return g.index_select(0, inv).view(-1, k, g.shape[-1]).sum(1)


class _Dispatch(torch.autograd.Function):
    """rows of z repeated per choice, in expert-sorted order; backward gathers (no atomics) and sums."""

    @staticmethod
    def forward(ctx, z, order, inv, k, kern):  # noqa: ANN001
        ctx.save_for_backward(inv)
        ctx.k, ctx.kern = k, kern
        return z.index_select(0, torch.div(order, k, rounding_mode="floor"))

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001
        (inv,) = ctx.saved_tensors
        return ctx.kern.gather_sum(g, inv, ctx.k), None, None, None, None


def linear_multi(x: Tensor, groups: list[list[Tensor]], step_cache: StepCache | None = None) -> list[Tensor]:
    """For each group of weights [W_1, ..., W_m], x @ [W_1; ...; W_m]^T (no biases), i.e. the group's
    outputs side by side. While training this is one GEMM against all weights concatenated, split once
    (its backward is one cat): one input-gradient GEMM, no accumulation passes over x's gradient; with the
    caller's `step_cache` inside `K3ForCausalLM.step_weights()` the concatenation is the step's shared
    compute-dtype copy (`k3.model.step_weights.gemm_weight`), else the weights concatenated per call.
    Without autograd (serving) each weight is used in place and a group's outputs are concatenated:
    copying every weight per call costs more than it saves at decode."""
    if not torch.is_grad_enabled():
        return [F.linear(x, g[0]) if len(g) == 1 else torch.cat([F.linear(x, w) for w in g], dim=-1)
                for g in groups]
    out = F.linear(x, gemm_weight(step_cache, tuple(w for g in groups for w in g)))
    if len(groups) == 1:
        return [out]  # no split: its backward would copy the gradient
    return list(out.split([sum(w.shape[0] for w in g) for g in groups], dim=-1))


def dispatch(z: Tensor, order: Tensor, inv: Tensor, k: int) -> Tensor:
    """z [N, L] -> [N*k, L]: row i is z[order[i] // k] (the token of the i-th expert-sorted slot).
    order: [N*k] stable argsort of the flattened expert ids; inv: its inverse permutation."""
    return EAGER.dispatch(z, order, inv, k)


def sort_slots(idx: Tensor) -> tuple[Tensor, Tensor]:
    """Expert ids [N, k] -> (order, inv): the stable expert-sorted order of the N*k slots and its inverse."""
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    inv = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return order, inv


def route_slots(idx: Tensor, num_experts: int, choice: str = "auto") -> tuple[Tensor, Tensor, Tensor]:
    """Expert ids [N, k] int64 -> (order [N*k], inv [N*k], counts [E]) int64: `sort_slots` and the slots
    per expert. The Triton counting sort of `k3.ops.moe_route` (identical results) when `choice` (a
    KernelConfig value, see `k3.ops.backend.use_triton`) picks it. Neither synchronises with the host, so
    both run inside CUDA-graph captures; no autograd involved."""
    if use_triton(choice, idx):
        return sort_slots_triton(idx, num_experts)
    order, inv = sort_slots(idx)
    # not bincount: on CUDA it reads the max id back to the host, which breaks CUDA graph capture
    flat = idx.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device).index_add_(0, flat, torch.ones_like(flat))
    return order, inv, counts


# --------------------------------------------------------------------------------------------
# the table


def plain_weight(w: Tensor) -> bool:
    """w is a plain, unsharded tensor (not an FSDP DTensor or another subclass): what the chunked lm_head
    ops (the fused loss, the token log-probs) need; others take the full-logits path."""
    return type(w.data) is torch.Tensor


class Kernels:
    """One implementation of every hot region; modules call through their ``kernels`` attribute.

    compiled=False: plain PyTorch. compiled=True: each fwd/bwd/plain region wrapped in
    ``torch.compile(fullgraph=True, backend=backend, mode=mode)``. config: which regions run their
    Triton kernels instead (`k3.kernel_config`).
    """

    def __init__(self, compiled: bool = False, backend: str | Callable = "inductor", mode: str | None = None,
                 dynamic: bool | None = None, config: KernelConfig = DEFAULT) -> None:
        """dynamic: as for torch.compile: None recompiles a region once with dynamic shapes when its shapes
        change (serving: every prefill length differs), False specialises every shape (training: a
        handful of fixed micro-batch / validation shapes, each compiled for its size)."""
        self.compiled = compiled
        self.config = KernelConfig.from_dict(config)

        opts: dict[str, Any] = {"fullgraph": True, "backend": backend}
        if mode is not None:
            opts["mode"] = mode
        if dynamic is not None:
            opts["dynamic"] = dynamic
        self.options = dict(opts) if compiled else {}

        def wrap(fn: Callable) -> Callable:
            return torch.compile(fn, **opts) if compiled else fn

        self.situ_fwd = wrap(situ_fwd_recompute if compiled else situ_fwd_save)
        self.situ_bwd, self.situ_bwd_packed = wrap(situ_bwd), wrap(situ_bwd_packed)
        self.norm_fwd, self.norm_bwd = wrap(norm_fwd), wrap(norm_bwd)
        self.res_fwd, self.res_bwd = wrap(res_fwd), wrap(res_bwd)
        self.combine_fwd, self.combine_bwd = wrap(combine_fwd), wrap(combine_bwd)
        self.gather_sum = wrap(gather_sum)
        self.router_select, self.sigmoid_gate = wrap(router_select), wrap(sigmoid_gate)
        self.router_scores, self.router_weights = wrap(router_scores), wrap(router_weights)
        self.silu_streams, self.cross_entropy = wrap(silu_streams), wrap(cross_entropy)

    def __repr__(self) -> str:
        return f"Kernels(compiled={self.compiled}, config={self.config})"

    def with_config(self, config: KernelConfig) -> "Kernels":
        """This table (sharing its compiled regions) with another KernelConfig."""
        if config == self.config:
            return self
        table = copy.copy(self)
        table.config = KernelConfig.from_dict(config)
        return table

    # -- module-facing API --------------------------------------------------------------------
    def glu(self, a: Tensor, b: Tensor, act: str, beta: float, beta_lin: float) -> Tensor:
        """GLU activation of gate a and up b ([..., I]); SiTU (fp32 maths) or SiLU. Returns a's dtype."""
        if act == "situ":
            return _SiTU.apply(a, b, float(beta), float(beta_lin), self)
        return (F.silu(a.float()) * b.float()).to(a.dtype)

    def glu_packed(self, ab: Tensor, act: str, beta: float, beta_lin: float) -> Tensor:
        """`glu` of gate and up packed as ab = [a | b] ([..., 2I], e.g. one GEMM's output) -> [..., I].
        Its gradient is one [..., 2I] tensor, so the GEMM's backward needs no concatenation.
        SiTU runs as the Triton kernels of `k3.ops.situ` when config.situ picks them."""
        if act == "situ":
            if use_triton(self.config.situ, ab):
                return situ_glu(ab, beta, beta_lin)
            return _SiTUPacked.apply(ab, float(beta), float(beta_lin), self)
        a, b = ab.chunk(2, dim=-1)
        return self.glu(a, b, act, beta, beta_lin)

    def rms_norm(self, x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
        """KimiRMSNorm (see k3.model.common.rms_norm): x [..., D] -> x's dtype."""
        return _Norm.apply(x, weight, None, float(eps), True, x.dtype, self)

    def gated_rms_norm(self, x: Tensor, weight: Tensor, gate: Tensor, eps: float, out_dtype: torch.dtype) -> Tensor:
        """cast_out(rms_norm(x_f32, weight) * sigmoid(gate_f32)), all fp32 (KDA's o_norm + output gate)."""
        return _Norm.apply(x, weight, gate, float(eps), False, out_dtype, self)

    def attn_res(self, cands: list[Tensor], w_norm: Tensor, w_proj: Tensor, eps: float,
                 norm: torch.nn.Module | None = None) -> Tensor:
        """Block-AttnRes mix (see k3.model.common.attn_res_mix): the Triton kernels of `k3.ops.attn_res`
        when config.attn_res picks them, up to MAX_CANDIDATES. norm: an
        RMSNorm module applied to the mix (see `_attn_res`)."""
        return self._attn_res(cands, w_norm, w_proj, eps, 0, norm)[0]

    def attn_res_bank(self, bank: list[Tensor], prefix: Tensor, w_norm: Tensor, w_proj: Tensor, eps: float,
                      norm: torch.nn.Module | None = None) -> tuple[Tensor, list[Tensor], Tensor]:
        """`attn_res` over bank + [prefix] -> (mix, the bank to pass on, the prefix to use from here on).
        On the Triton path bank and prefix come back as pass-through views (`attn_res_mix(carry=...)`):
        each bank entry then has one consumer per mix in a chain, and the prefix one consumer (its
        residual add, or the bank at a block boundary) besides this mix, so the gradients from those
        uses are summed inside the backward kernels, not by autograd's separate add passes. Elsewhere
        bank and prefix are returned as given."""
        mix, carried = self._attn_res(bank + [prefix], w_norm, w_proj, eps, len(bank) + 1, norm)
        return mix, carried[:-1], carried[-1]

    def _attn_res(self, cands: list[Tensor], w_norm: Tensor, w_proj: Tensor, eps: float, carry: int,
                  norm: torch.nn.Module | None) -> tuple[Tensor, list[Tensor]]:
        """(mix of cands [through norm], cands[:carry] to pass on: pass-through views on the Triton path).
        norm: a KimiRMSNorm module, called on the mix (so its hooks see it)."""
        if len(cands) == 1:
            mix, carried = cands[0], cands[:carry]
        elif len(cands) <= MAX_CANDIDATES and use_triton(self.config.attn_res, cands[-1]):
            out = attn_res_mix(cands, w_norm, w_proj, eps, carry=carry)
            mix, carried = out if carry else (out, [])
        else:
            mix, carried = _AttnRes.apply(w_norm, w_proj, float(eps), self, *cands), cands[:carry]
        return (mix if norm is None else norm(mix)), carried

    def mla_kv(self, kv: Tensor, k_pe: Tensor, num_heads: int, nope: int, v_dim: int) -> tuple[Tensor, Tensor]:
        """MLA's keys [..., H, nope + rope] and values [..., H, v_dim] from kv_b_proj's output kv [..., H *
        (nope + v_dim)] and the shared k_pe [..., rope]: the Triton kernels of `k3.ops.mla_kv` when config.mla_kv
        picks them (one pass each way, where the split / expand / cat's backward reads the gradients twice),
        else the spec's torch ops."""
        if kv.dim() == 3 and use_triton(self.config.mla_kv, kv):
            return mla_expand_kv(kv, k_pe, num_heads=num_heads, nope=nope, v_dim=v_dim)
        return mla_kv_reference(kv, k_pe, num_heads, nope, v_dim)

    def route(self, x: Tensor, weight: Tensor, bias: Tensor, top_k: int, renormalize: bool, scaling: float
              ) -> tuple[Tensor, Tensor, Tensor]:
        """`router_select`: x [N, d] -> (ids [N, k] int64, weights [N, k] fp32, scores [N, E] fp32). The
        top-k selection (bias added inside) runs as the Triton kernel of `k3.ops.moe_route` when
        config.moe_route picks it: its rows list the ids by
        descending choice value, where torch.topk(sorted=False) keeps its own order (see
        k3.ops.moe_route: the MoE output differs by fp32 summation order only). On that path a bf16 x gets
        its fp32 logits from bf16 tensor-core GEMMs against the weight split exactly in three bf16 parts
        (`k3.ops.router`, faster than casting x for an fp32 GEMM)."""
        if use_triton(self.config.moe_route, x):
            if x.dtype == torch.bfloat16 and weight.dtype == torch.float32:  # training: fp32 master weight
                scores = torch.sigmoid(router_logits(x, weight))  # fp32 logits from bf16 GEMMs: k3.ops.router
            else:
                scores = self.router_scores(x, weight)
            idx = topk_route(scores.detach(), top_k, bias)
            return idx, self.router_weights(scores, idx, renormalize, scaling), scores
        return self.router_select(x, weight, bias, top_k, renormalize, scaling)

    def lm_loss(self, h: Tensor, lm_head: torch.nn.Linear, labels: Tensor) -> Tensor:
        """Mean token cross-entropy of lm_head(h) against labels, for callers that need no logits: h [..., d],
        labels [...] (-100 = ignore) -> 0-dim fp32. When config.cross_entropy picks it the chunked
        linear + cross-entropy of `k3.ops.cross_entropy`, which
        never holds more than one chunk of logits and computes the gradients in its forward (an fp32
        lm_head weight under autocast is cast to the autocast dtype inside and gets an fp32 gradient);
        else the lm_head module and `cross_entropy`, as `K3ForCausalLM.forward` with logits. The fused
        loss has no bias and needs a plain weight: under "auto" a biased or sharded (FSDP DTensor) lm_head
        takes the module path; an explicit "triton" raises instead."""
        choice = self.config.cross_entropy
        if use_triton(choice, h):
            unfit = None
            if lm_head.bias is not None:
                unfit = "kernels.cross_entropy='triton': the fused loss has no lm_head bias"
            elif not plain_weight(lm_head.weight):  # e.g. an FSDP-sharded DTensor
                unfit = (f"kernels.cross_entropy='triton' needs a plain, unsharded lm_head weight, got "
                         f"{type(lm_head.weight.data).__name__}; use 'torch' or 'auto'")
            if unfit is None:
                return linear_cross_entropy(h.reshape(-1, h.shape[-1]), lm_head.weight, labels.reshape(-1))
            if choice == "triton":
                raise ValueError(unfit)
        return self.cross_entropy(lm_head(h), labels)

    def dispatch(self, z: Tensor, order: Tensor, inv: Tensor, k: int) -> Tensor:
        """See :func:`dispatch`. The Triton kernels of `k3.ops.moe_combine` when config.moe_dispatch picks
        them."""
        if use_triton(self.config.moe_dispatch, z):
            return moe_dispatch(z, inv, k)
        return _Dispatch.apply(z, order, inv, k, self)

    def combine(self, y: Tensor, w: Tensor, order: Tensor, inv: Tensor) -> Tensor:
        """Weighted sum of each token's k expert outputs: y [N*k, L] sorted, w [N, k] fp32 -> [N, L], summed
        in fp32 and cast to y's dtype (the spec: bf16 expert outputs, fp32 weighted sum, cast to bf16).
        The Triton kernels of `k3.ops.moe_combine` when config.moe_combine picks them."""
        if use_triton(self.config.moe_combine, y):
            return moe_combine(y, w, inv)
        return _Combine.apply(y, w, order, inv, self)


EAGER = Kernels()


def uses_kernels(module: Any) -> bool:
    return isinstance(getattr(module, "kernels", None), Kernels)
