"""Sigmoid router with a selection-only bias, routed experts in latent space, and LatentMoE."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from k3.config import TextConfig
from k3.model.common import GLUMLP, RMSNorm, glu_act, keep_fp32


class Router(nn.Module):
    """`gate`: scores s = sigmoid(x W^T) in fp32; top-k of (s + e_score_correction_bias) chooses experts;
    weights = s_chosen / (sum s_chosen + 1e-20) * routed_scaling_factor. The bias never enters the weights.
    """

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
        scores = torch.sigmoid(x.float() @ self.weight.float().t())
        choice = (scores + self.e_score_correction_bias.float()).detach()
        idx = torch.topk(choice, self.top_k, dim=-1, sorted=False).indices
        w = scores.gather(-1, idx)
        if self.renormalize:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        if self.score_observer is not None and self.training:
            self.score_observer(scores.detach(), self.e_score_correction_bias)
        return idx, w * self.scaling, scores


class RoutedExperts(nn.Module):
    """E experts stacked as w1 (gate) [E, I, L], w3 (up) [E, I, L], w2 (down) [E, L, I], working in
    the latent width L: E_e(z) = w2_e SiTU(w1_e z, w3_e z).
    """

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

    def weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        f = self.weight_transform
        return (self.w1, self.w3, self.w2) if f is None else (f(self.w1), f(self.w3), f(self.w2))

    def forward(self, z: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """z: [N, L]; idx, w: [N, k] -> sum_k w * round_to_dtype(E_idx(z)) accumulated in fp32, [N, L] fp32."""
        N, k = idx.shape
        E = self.w1.shape[0]
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token = order // k
        # not bincount: on CUDA it reads the max id back to the host, which breaks CUDA graph capture
        counts = torch.zeros(E, dtype=torch.long, device=flat.device).index_add_(0, flat, torch.ones_like(flat))
        xs = z.index_select(0, token)  # (backward: one index_add, not an accumulating index_put)
        w1, w3, w2 = self.weights()
        if z.is_cuda and z.dtype == torch.bfloat16:
            # fp32 master weights under autocast: _grouped_mm wants both operands in bf16.
            w1, w3, w2 = (t.to(z.dtype) for t in (w1, w3, w2))
            offs = torch.cumsum(counts, 0, dtype=torch.int32)
            a = torch._grouped_mm(xs, w1.transpose(-2, -1), offs=offs)
            b = torch._grouped_mm(xs, w3.transpose(-2, -1), offs=offs)
            h = glu_act(a, b, self.act, self.beta, self.beta_lin)
            y = torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)
        else:  # CPU / fp32: a loop over the experts that received tokens (counts are on the host).
            # split/unbind/cat keep the backward to one op each, instead of a full-size gradient per slice.
            sizes = counts.tolist()
            w1s, w3s, w2s = w1.unbind(0), w3.unbind(0), w2.unbind(0)
            outs = [glu_act(xe @ w1s[e].t(), xe @ w3s[e].t(), self.act, self.beta, self.beta_lin) @ w2s[e].t()
                    for e, xe in enumerate(xs.split(sizes)) if sizes[e]]
            y = torch.cat(outs) if outs else xs.new_zeros(0, w2.shape[1])
        contrib = y.float() * w.reshape(-1).index_select(0, order)[:, None]
        # back to (token, k) order, then a sum over k: a fixed reduction order (atomic index_add on CUDA
        # is not), so a CUDA graph replay and an eager step give identical bits
        unsorted = torch.empty_like(contrib).index_copy_(0, order, contrib)
        return unsorted.view(N, k, -1).sum(1)


class LatentMoE(nn.Module):
    """`block_sparse_moe`: y = up(norm(sum_e w_e E_e(down(x)))) + shared(x); router on the full-width x."""

    def __init__(self, config: TextConfig) -> None:
        super().__init__()
        d, L = config.hidden_size, config.routed_expert_hidden_size
        self.gate = Router(config)
        self.routed_expert_down_proj = nn.Linear(d, L, bias=False)
        self.routed_expert_up_proj = nn.Linear(L, d, bias=False)
        self.routed_expert_norm = RMSNorm(L, config.rms_norm_eps) if config.latent_moe_use_norm else None
        self.experts = RoutedExperts(config)
        self.shared_experts = None
        if config.num_shared_experts > 0:
            self.shared_experts = GLUMLP(d, config.num_shared_experts * config.moe_intermediate_size,
                                         config.hidden_act, config.activation_situ_beta,
                                         config.activation_situ_linear_beta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        idx, w, _ = self.gate(x2)
        r = self.experts(self.routed_expert_down_proj(x2), idx, w).to(x.dtype)
        if self.routed_expert_norm is not None:
            r = self.routed_expert_norm(r)
        y = self.routed_expert_up_proj(r)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x2)
        return y.reshape(shape)
