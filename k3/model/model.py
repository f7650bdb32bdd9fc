"""The K3 text backbone: embeddings, 93 (or fewer) decoder layers wired with Block Attention
Residuals, the output AttnRes mix and the final norm."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from k3.config import TextConfig
from k3.model.cache import DecodeCache, SeqLayout
from k3.model.common import GLUMLP, RMSNorm
from k3.model.fused import EAGER, Kernels
from k3.model.kda import KDAttention
from k3.model.mla import GatedMLA
from k3.model.moe import LatentMoE


class ResVector(nn.Module):
    """A named [1, d] or [d] vector of an AttnRes pair (`*_res_proj.weight` / `*_res_norm.weight`)."""

    def __init__(self, shape: tuple[int, ...], fill: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full(shape, fill))


@dataclass
class ResidualState:
    """Block-AttnRes state between layers: completed block sums (the bank) and the running prefix."""

    bank: list[torch.Tensor] = field(default_factory=list)
    prefix: torch.Tensor | None = None


class DecoderLayer(nn.Module):
    kernels: Kernels = EAGER

    def __init__(self, config: TextConfig, layer_idx: int) -> None:
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.layer_idx, self.eps = layer_idx, eps
        self.block_size = config.attn_res_block_size
        self.is_mla = config.is_mla(layer_idx)
        self.self_attn = GatedMLA(config, layer_idx) if self.is_mla else KDAttention(config, layer_idx)
        if config.is_moe(layer_idx):
            self.block_sparse_moe = LatentMoE(config)
        else:
            self.mlp = GLUMLP(d, config.intermediate_size, config.hidden_act, config.activation_situ_beta,
                              config.activation_situ_linear_beta)
        self.input_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.self_attention_res_norm = ResVector((d,), 1.0)
        self.self_attention_res_proj = ResVector((1, d), 0.0)
        self.mlp_res_norm = ResVector((d,), 1.0)
        self.mlp_res_proj = ResVector((1, d), 0.0)

    def ffn(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """FFN(x) [+ residual, the sum inside the FFN's last GEMM]."""
        return self.block_sparse_moe(x, residual) if hasattr(self, "block_sparse_moe") else self.mlp(x, residual)

    def forward(self, bank: list[torch.Tensor], prefix: torch.Tensor, layout: SeqLayout,
                cache: DecodeCache | None) -> tuple[list[torch.Tensor], torch.Tensor]:
        """One layer of Block AttnRes: there is no plain residual path.

        bank: completed block sums [B, T, d] each; prefix: running sum of the current block.
        Returns the updated (bank, prefix).
        """
        h, bank, prefix = self._mix(bank, prefix, self.self_attention_res_norm, self.self_attention_res_proj,
                                    self.input_layernorm)
        if self.layer_idx % self.block_size == 0:  # block boundary: bank the prefix, restart it at 0
            bank, prefix = bank + [prefix], self.self_attn(h, layout, cache)
        else:  # prefix + attention, the sum inside the output projection's GEMM
            prefix = self.self_attn(h, layout, cache, residual=prefix)
        m, bank, prefix = self._mix(bank, prefix, self.mlp_res_norm, self.mlp_res_proj, self.post_attention_layernorm)
        return bank, self.ffn(m, prefix)

    def _mix(self, bank, prefix, norm: ResVector, proj: ResVector, ln: RMSNorm | None = None
             ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        """(mix of bank + [prefix] [through the RMSNorm ln], the bank and the prefix to use from here on:
        pass-through views on the Triton path, whose kernels may also apply ln: `Kernels.attn_res_bank`)."""
        return self.kernels.attn_res_bank(bank, prefix, norm.weight, proj.weight, self.eps, ln)


class K3Model(nn.Module):
    """Token ids [B, T] (or embeddings) -> final hidden states [B, T, d] after the output mix and norm."""

    kernels: Kernels = EAGER

    def __init__(self, config: TextConfig) -> None:
        super().__init__()
        d = config.hidden_size
        self.config = config
        # _weight skips nn.Embedding's normal_ init (slow on meta: it imports torch._refs); init_weights sets it.
        self.embed_tokens = nn.Embedding(config.vocab_size, d, _weight=torch.empty(config.vocab_size, d))
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(d, config.rms_norm_eps)
        self.output_attn_res_norm = ResVector((d,), 1.0)
        self.output_attn_res_proj = ResVector((1, d), 0.0)
        self.gradient_checkpointing = False
        # Under autocast the token embeddings enter the residual stream in the autocast dtype, as in the
        # official bf16 model (the other AttnRes candidates already are: mixer and FFN outputs leave bf16
        # GEMMs). True keeps the fp32 embeddings of fp32 master weights (k3 before 2026-12-01): bank
        # entry 0 of every later mix then costs twice the bytes, forward and backward.
        self.fp32_embeddings = False

    def forward(self, input_ids: torch.Tensor | None = None, *, inputs_embeds: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None, cache: DecodeCache | None = None,
                hidden_state_layers: list[int] | None = None) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Returns (final hidden [B, T, d], {layer: that layer's output mix input}) where the dict holds,
        for each requested layer index l, the hidden state entering layer l's mixer (l = num_layers:
        the pre-norm output mix)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids [B, T] or inputs_embeds [B, T, d]")
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if x.dim() != 3:
            raise ValueError(f"expected input_ids [B, T] / inputs_embeds [B, T, d], got {list(x.shape)}")
        x = self._embeddings_dtype(x)
        B, T, _ = x.shape
        layout = SeqLayout.build(B, T, cu_seqlens, cache, x.device)
        want = set(hidden_state_layers or [])
        hidden: dict[int, torch.Tensor] = {}
        bank: list[torch.Tensor] = []
        prefix = x
        for i, layer in enumerate(self.layers):
            if i in want:
                hidden[i] = layer._mix(bank, prefix, layer.self_attention_res_norm, layer.self_attention_res_proj)[0]
            if self.gradient_checkpointing and self.training and cache is None:
                bank, prefix = checkpoint(layer, bank, prefix, layout, None, use_reentrant=False)
            else:
                bank, prefix = layer(bank, prefix, layout, cache)
        mix = (bank + [prefix], self.output_attn_res_norm.weight, self.output_attn_res_proj.weight,
               self.config.rms_norm_eps)
        out = self.kernels.attn_res(*mix, self.norm)
        if len(self.layers) in want:  # the pre-norm mix separately: the output keeps the fused kernel's rounding
            hidden[len(self.layers)] = self.kernels.attn_res(*mix, None)
        if cache is not None:
            cache.advance(layout.new_lens)
        return out, hidden

    def _embeddings_dtype(self, x: torch.Tensor) -> torch.Tensor:
        dev = x.device.type
        if self.fp32_embeddings or not torch.is_autocast_enabled(dev):
            return x
        return x.to(torch.get_autocast_dtype(dev))
