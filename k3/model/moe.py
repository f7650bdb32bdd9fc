"""Sigmoid router with a selection-only bias, routed experts in latent space, and LatentMoE."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from k3.config import TextConfig
from k3.model.common import GLUMLP, RMSNorm, fan_in_linears, keep_fp32, linear_residual
from k3.model.fused import EAGER, Kernels, route_slots
from k3.model.step_weights import StepCache, StepLinear, step_weight
from k3.ops.grouped_gemm import expert_gemm
from k3.ops.backend import triton_runs_on
from k3.ops.mxfp4_gemm import from_kernel_order, mxfp4_grouped_mm, to_kernel_order
from k3.quant.mxfp4 import decode_mxfp4, encode_mxfp4, encode_mxfp4_reuse


class Router(nn.Module):
    """`gate`: scores s = sigmoid(x W^T) in fp32; top-k of (s + e_score_correction_bias) chooses experts;
    weights = s_chosen / (sum s_chosen + 1e-20) * routed_scaling_factor. The bias never enters the weights.
    """

    kernels: Kernels = EAGER

    def __init__(self, config: TextConfig) -> None:
        super().__init__()
        self.top_k, self.num_experts = config.num_experts_per_token, config.num_experts
        self.renormalize, self.scaling = config.moe_renormalize, config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", keep_fp32(torch.zeros(config.num_experts)))
        # Set by the trainer (Quantile Balancing): called as observer(scores [N, E] fp32, bias [E]).
        self.score_observer: Callable[[torch.Tensor, torch.Tensor], None] | None = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [N, d] -> (expert ids [N, k] long, weights [N, k] fp32, scores [N, E] fp32)."""
        idx, w, scores = self.kernels.route(x, self.weight, self.e_score_correction_bias, self.top_k,
                                            self.renormalize, self.scaling)
        if self.score_observer is not None and self.training:
            self.score_observer(scores.detach(), self.e_score_correction_bias)
        return idx, w, scores


class RoutedExperts(nn.Module):
    """E experts stacked as w1 (gate) [E, I, L], w3 (up) [E, I, L], w2 (down) [E, L, I], working in
    the latent width L: E_e(z) = w2_e SiTU(w1_e z, w3_e z).
    """

    kernels: Kernels = EAGER

    def __init__(self, config: TextConfig) -> None:
        super().__init__()
        E, I, L = config.num_experts, config.moe_intermediate_size, config.routed_expert_hidden_size
        self.w1 = nn.Parameter(torch.empty(E, I, L))
        self.w3 = nn.Parameter(torch.empty(E, I, L))
        self.w2 = nn.Parameter(torch.empty(E, L, I))
        self.act, self.beta, self.beta_lin = (config.hidden_act, config.activation_situ_beta,
                                              config.activation_situ_linear_beta)
        # The one place expert weights pass through on their way to compute: QAT installs an
        # MXFP4 fake-quantiser here (weights -> weights), serving may install a dequantiser.
        self.weight_transform: Callable[[torch.Tensor], torch.Tensor] | None = None
        # Applied to the inputs of the expert GEMMs (the latent tokens, the GLU output): QAT's MXFP8
        # fake-quantiser (k3.quant.qat). Row-local, so it commutes with the token dispatch.
        self.input_transform: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.num_experts = E
        # Serving storage (`pack_mxfp4`): w13_packed / w2_packed uint8 + E8M0 scales instead of w1 / w3 / w2.
        self.packed = False
        self.packed_dtype = torch.float32
        # whether the packed bytes are in the MXFP4 kernel's byte order (k3.ops.mxfp4_gemm.layout: both
        # GEMMs' K a multiple of 64) rather than the official one
        self.kernel_order = False
        # Set by K3ForCausalLM.step_weights() for one optimizer step: the (w13, w2) compute copies shared by
        # the step's micro-batches (see _train_weights).
        self.step_cache: StepCache | None = None

    def weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w1, w3, w2) as the GEMMs use them: through `weight_transform`, or decoded from the packed
        MXFP4 storage (exact, in `packed_dtype`)."""
        if self.packed:
            w13p, w2p = self.w13_packed, self.w2_packed
            if self.kernel_order:
                w13p, w2p = from_kernel_order(w13p), from_kernel_order(w2p)
            w1, w3 = decode_mxfp4(w13p, self.w13_scale, dtype=self.packed_dtype).chunk(2, dim=1)
            return w1, w3, decode_mxfp4(w2p, self.w2_scale, dtype=self.packed_dtype)
        f = self.weight_transform
        return (self.w1, self.w3, self.w2) if f is None else (f(self.w1), f(self.w3), f(self.w2))

    def pack_mxfp4(self, scales: dict[str, torch.Tensor] | None = None) -> None:
        """Switch to packed MXFP4 storage for serving (in place, 4.25 bits per weight): buffers
        w13_packed uint8 [E, 2I, L/2], w13_scale uint8 [E, 2I, L/32] (gate rows then up rows),
        w2_packed [E, L, I/2], w2_scale [E, L, I/32]; the parameters w1 / w3 / w2 are dropped.

        Weights on the MXFP4 grid (an MXFP4 checkpoint, a QAT model's fake-quantised masters) are kept
        exactly; others are rounded by the OCP rule (post-training quantisation). `scales` ("w1", "w3",
        "w2" -> uint8 [E, out, in/32], e.g. a loaded checkpoint's) are reused where they encode a block
        exactly. Decoding happens in the dtype the weights had (`packed_dtype`). Where both matrices' input
        dims are multiples of 64 the bytes are kept in the MXFP4 kernel's order (`kernel_order`,
        k3.ops.mxfp4_gemm.layout: the same bytes permuted, which the CUDA kernel reads fastest)."""
        if self.packed:
            return
        scales = scales or {}
        with torch.no_grad():
            enc = {}
            for n in ("w1", "w3", "w2"):
                w = getattr(self, n)
                if not torch.isfinite(w).all():
                    raise ValueError(f"experts.{n}: non-finite weights cannot be packed as MXFP4")
                s = scales.get(n)
                enc[n] = encode_mxfp4(w) if s is None else encode_mxfp4_reuse(w, s.to(w.device))
            self.packed_dtype = self.w1.dtype
        for n in ("w1", "w3", "w2"):
            self._parameters[n] = None
        w13p, w2p = torch.cat([enc["w1"][0], enc["w3"][0]], dim=1), enc["w2"][0]
        self.kernel_order = w13p.shape[-1] % 32 == 0 and w2p.shape[-1] % 32 == 0  # K = 2 x bytes
        if self.kernel_order:
            w13p, w2p = to_kernel_order(w13p), to_kernel_order(w2p)
        self.register_buffer("w13_packed", w13p)
        self.register_buffer("w13_scale", torch.cat([enc["w1"][1], enc["w3"][1]], dim=1))
        self.register_buffer("w2_packed", w2p)
        self.register_buffer("w2_scale", enc["w2"][1])
        self.packed = True

    def _transform_input(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.input_transform is None else self.input_transform(x)

    def _packed_cuda(self, xs: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """Serving on CUDA from packed storage: the MXFP4 grouped GEMMs dequantise in registers."""
        ab = mxfp4_grouped_mm(xs, self.w13_packed, self.w13_scale, offs, kernel_order=self.kernel_order)
        h = self._transform_input(self.kernels.glu_packed(ab, self.act, self.beta, self.beta_lin))
        return mxfp4_grouped_mm(h, self.w2_packed, self.w2_scale, offs, kernel_order=self.kernel_order)

    def forward(self, z: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """z: [N, L]; idx, w: [N, k] -> sum_k w * round_to_dtype(E_idx(z)) accumulated in fp32, [N, L] in the
        experts' output dtype (bf16 under CUDA autocast; the cast fused into the sum).

        Tokens are permuted into expert-sorted slots once (a gather, whose backward is a gather and a
        k-way sum, no atomics) and combined back once (a gather fused with the fp32 weighting)."""
        k = idx.shape[1]
        E = self.num_experts
        order, inv, counts = route_slots(idx, E, self.kernels.config.moe_route)
        xs = self.kernels.dispatch(self._transform_input(z), order, inv, k)
        if self.packed and z.is_cuda and z.dtype == torch.bfloat16:
            y = self._packed_cuda(xs, torch.cumsum(counts, 0, dtype=torch.int32))
            return self.kernels.combine(y, w.float(), order, inv)
        w1, w3, w2 = self.weights()
        if z.is_cuda and z.dtype == torch.bfloat16:
            # fp32 master weights under autocast: _grouped_mm wants both operands in bf16. While training
            # gate and up share one grouped GEMM (one input-gradient GEMM in the backward); serving keeps
            # the weights in place (a concatenation would copy them every call).
            offs = torch.cumsum(counts, 0, dtype=torch.int32)
            masters: tuple[tuple[torch.Tensor, ...], ...] = ((), ())
            if torch.is_grad_enabled():
                w13, w2c, cached = self._train_weights(w1, w3, w2, z.dtype)
                if cached and triton_runs_on(z):
                    # inside step_weights(): the weight gradients go into the fp32 masters' .grad from
                    # the GEMM itself (k3.ops.grouped_gemm), not through the step copies' autograd
                    masters = ((self.w1, self.w3), (self.w2,))
                ab = _expert_mm(xs, w13, offs, masters[0])
                h = self.kernels.glu_packed(ab, self.act, self.beta, self.beta_lin)
            else:
                a, b = (torch._grouped_mm(xs, t.to(z.dtype).transpose(-2, -1), offs=offs) for t in (w1, w3))
                h = self.kernels.glu(a, b, self.act, self.beta, self.beta_lin)
                w2c = w2.to(z.dtype)
            y = _expert_mm(self._transform_input(h), w2c, offs, masters[1])
        else:
            y = self._experts_cpu(xs, counts, w1, w3, w2)
        # back in (token, k) order and summed over k in a fixed order (no atomics): a CUDA graph replay
        # and an eager step give identical bits
        return self.kernels.combine(y, w.float(), order, inv)

    def _experts_cpu(self, xs: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                     w2: torch.Tensor) -> torch.Tensor:
        """CPU / fp32: a loop over the experts that received tokens (counts are on the host); [S, L] -> [S, L].

        The GEMMs run in the weights' dtype even under CPU autocast: every expert's row count differs per
        step, and a bf16 CPU GEMM of a new shape pays a kernel generation (oneDNN) that costs more than it
        saves at these sizes, while fp32 GEMMs (MKL) need none. split/unbind/cat keep the backward to one
        op each, instead of a full-size gradient per slice; the activation runs once over all slots, as on
        the GPU path."""
        sizes = counts.tolist()
        live = [e for e in range(self.num_experts) if sizes[e]]
        with torch.autocast("cpu", enabled=False):
            xs = xs.to(w1.dtype)
            xe = xs.split(sizes)
            if not live:
                return xs.new_zeros(0, w2.shape[1])
            if torch.is_grad_enabled():  # as the GPU path: gate|up packed, the step's weight copies
                w13, w2c, _ = self._train_weights(w1, w3, w2, xs.dtype)
                w13s = w13.unbind(0)
                ab = torch.cat([xe[e] @ w13s[e].t() for e in live])
                h = self.kernels.glu_packed(ab, self.act, self.beta, self.beta_lin)
            else:
                w1s, w3s, w2c = w1.unbind(0), w3.unbind(0), w2
                a = torch.cat([xe[e] @ w1s[e].t() for e in live])
                b = torch.cat([xe[e] @ w3s[e].t() for e in live])
                h = self.kernels.glu(a, b, self.act, self.beta, self.beta_lin)
            h = self._transform_input(h)
            w2s = w2c.unbind(0)
            return torch.cat([he @ w2s[e].t() for he, e in zip(h.split([sizes[e] for e in live]), live)])

    def _train_weights(self, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, dtype: torch.dtype
                       ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """(w13 [E, 2I, L] = [w1; w3] per expert, w2 [E, L, I], cached) in the compute dtype, for the training
        GEMMs. Inside `K3ForCausalLM.step_weights()` (plain fp32 parameters, no weight transform) the step's
        shared copies with fused gradient accumulation (`k3.model.step_weights.step_weight`: the experts'
        casts and concatenation once per step, not per micro-batch), cached=True: the caller may then add the weight gradients into the masters' `.grad` itself
        (`k3.ops.grouped_gemm.expert_gemm`); else cast, then concatenated
        (half the bytes of concatenating the fp32 masters first), cached=False."""
        cache = self.step_cache if self.weight_transform is None else None
        w13 = step_weight(cache, (w1, w3), dtype, dim=1)
        w2c = step_weight(cache, (w2,), dtype) if w13 is not None else None
        if w2c is not None:
            return w13, w2c, True
        return torch.cat([w1.to(dtype), w3.to(dtype)], dim=1), w2.to(dtype), False


def _expert_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, masters: tuple[torch.Tensor, ...]
               ) -> torch.Tensor:
    """Rows of expert e times w[e]^T (x [S, K], w [E, N, K] -> [S, N]); with `masters` the weight gradient goes
    into their fp32 `.grad` (`expert_gemm`), else autograd's through w."""
    if masters:
        return expert_gemm(x, w, offs, masters)
    return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)


class LatentMoE(nn.Module):
    """`block_sparse_moe`: y = up(norm(sum_e w_e E_e(down(x)))) + shared(x); router on the full-width x."""

    def __init__(self, config: TextConfig) -> None:
        super().__init__()
        d, L = config.hidden_size, config.routed_expert_hidden_size
        self.gate = Router(config)
        self.routed_expert_down_proj = StepLinear(d, L)
        self.routed_expert_up_proj = StepLinear(L, d)
        self.routed_expert_norm = RMSNorm(L, config.rms_norm_eps) if config.latent_moe_use_norm else None
        self.experts = RoutedExperts(config)
        self.shared_experts = None
        if config.num_shared_experts > 0:
            self.shared_experts = GLUMLP(d, config.num_shared_experts * config.moe_intermediate_size,
                                         config.hidden_act, config.activation_situ_beta,
                                         config.activation_situ_linear_beta)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., d] -> the MoE output [..., d], plus `residual` (same shape) if given. The sums ride in the
        shared experts' and the up projection's GEMMs (`linear_residual`): no separate adds."""
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        shared = self.shared_experts
        ab = None
        # training: the down projection and the shared experts' gate|up as one fan-in (x2's three gradients
        # summed inside the input-gradient GEMMs; None off the training path: autograd's adds)
        fan = fan_in_linears(x2, [self.routed_expert_down_proj.gemm_weight()]
                             + ([shared.gate_up_weight()] if shared is not None else []))
        if fan is not None:
            x2, z, *ab = fan
        else:
            z = self.routed_expert_down_proj(x2)
        idx, w, _ = self.gate(x2)
        r = self.experts(z, idx, w).to(x.dtype)
        if self.routed_expert_norm is not None:
            r = self.routed_expert_norm(r)
        rest = residual.reshape(-1, shape[-1]) if residual is not None else None
        if shared is not None:
            rest = shared.down_from_gate_up(ab[0], rest) if ab else shared(x2, rest)
        return linear_residual(r, self.routed_expert_up_proj.gemm_weight(), rest).reshape(shape)


def pack_routed_experts(model: nn.Module) -> int:
    """Switch every `RoutedExperts` of `model` to packed MXFP4 storage (`RoutedExperts.pack_mxfp4`), reusing
    the E8M0 bytes a loaded MXFP4 checkpoint left in `model._k3_mxfp4_scales` (so the packed bytes are the
    file's). Returns the number of expert modules packed."""
    remembered = getattr(model, "_k3_mxfp4_scales", {})
    n = 0
    for name, m in model.named_modules():
        if isinstance(m, RoutedExperts):
            m.pack_mxfp4({w: remembered[f"{name}.{w}"] for w in ("w1", "w3", "w2") if f"{name}.{w}" in remembered})
            n += 1
    return n
