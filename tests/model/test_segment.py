"""Segment hooks (`k3.model.segment`): a mixer given empty history by its hooks equals its plain forward,
and history the hooks supply reaches the layer (split a row in two, carry the state, compare)."""

from __future__ import annotations

import pytest
import torch

from k3.config import k3_tiny
from k3.model.cache import HybridCache, SeqLayout
from k3.model.kda import KDAttention
from k3.model.mla import GatedMLA

CPU = torch.device("cpu")


class WholeRow:
    """Hooks for a segment that is the whole row: no history, keys = its own latents (causal, per document)."""

    def conv_history(self, qkv, width, layout):
        return qkv.new_zeros(layout.num_seqs, width - 1, qkv.shape[-1])

    def kda_initial_state(self, layer, k, v, f, b, layout):
        return torch.zeros(layout.num_seqs, k.shape[2], k.shape[3], v.shape[3])

    def mla_kv_source(self, latent, layout):
        T = latent.shape[1]
        seq, _ = layout.token_seq_pos(T)
        i = torch.arange(T)
        return latent, (seq[:, None] == seq[None, :]) & (i[None, :] <= i[:, None])


class FromCache(WholeRow):
    """Hooks for the second half of one document: history taken from a cache filled by the first half."""

    def __init__(self, cache: HybridCache, layer: int) -> None:
        self.cache, self.layer = cache, layer

    def conv_history(self, qkv, width, layout):
        return self.cache.conv_tail[self.layer]

    def kda_initial_state(self, layer, k, v, f, b, layout):
        return self.cache.kda_state[self.layer]


def _layers():
    cfg = k3_tiny().text_config
    torch.manual_seed(0)
    kda_idx = next(i for i in range(cfg.num_hidden_layers) if not cfg.is_mla(i))
    mla_idx = next(i for i in range(cfg.num_hidden_layers) if cfg.is_mla(i))
    return cfg, KDAttention(cfg, kda_idx).eval(), GatedMLA(cfg, mla_idx).eval()


@torch.no_grad()
def test_empty_history_hooks_equal_the_plain_forward() -> None:
    cfg, kda_layer, mla_layer = _layers()
    x = torch.randn(1, 24, cfg.hidden_size)
    cu = torch.tensor([0, 9, 24])
    layout = SeqLayout.build(1, 24, cu, None, CPU)
    for layer in (kda_layer, mla_layer):
        plain = layer(x, layout)
        layer.segment_hooks = WholeRow()
        hooked = layer(x, layout)
        layer.segment_hooks = None
        torch.testing.assert_close(hooked, plain, rtol=1e-4, atol=1e-5)


@torch.no_grad()
def test_kda_history_from_hooks_continues_the_document() -> None:
    cfg, layer, _ = _layers()
    x = torch.randn(1, 20, cfg.hidden_size)
    whole = layer(x, SeqLayout.build(1, 20, torch.tensor([0, 20]), None, CPU))
    cache = HybridCache(cfg, 1)
    first = layer(x[:, :12], SeqLayout.build(1, 12, torch.tensor([0, 12]), cache, CPU), cache)
    layer.segment_hooks = FromCache(cache, layer.layer_idx)
    second = layer(x[:, 12:], SeqLayout.build(1, 8, torch.tensor([0, 8]), None, CPU))
    layer.segment_hooks = None
    torch.testing.assert_close(torch.cat([first, second], 1), whole, rtol=1e-4, atol=1e-5)


def test_hooks_refuse_a_cache() -> None:
    cfg, kda_layer, mla_layer = _layers()
    x = torch.randn(1, 4, cfg.hidden_size)
    for layer in (kda_layer, mla_layer):
        cache = HybridCache(cfg, 1)
        layer.segment_hooks = WholeRow()
        with pytest.raises(ValueError, match="cache must be None"):
            layer(x, SeqLayout.build(1, 4, None, cache, CPU), cache)
