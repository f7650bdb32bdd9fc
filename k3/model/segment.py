"""Hooks for running the sequence mixers on one segment of a longer packed row.

A mixer (`KDAttention`, `GatedMLA`) normally sees whole documents. When a row is split into
segments that run apart (context parallelism, `k3.distributed.cp`), a segment's first document may
have begun earlier, so the layer needs three pieces of history from outside: the short conv's
previous inputs, the KDA state entering the segment, and the keys/values of MLA attention. The
layers ask for them through `SegmentHooks`, an object set from outside on the layer's
`segment_hooks` attribute (None by default: the plain forward, at no cost). The model itself stays
single-device code; whatever the hooks communicate is their business.

Hooks are for training forwards of packed rows (`cu_seqlens` set, no cache).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from k3.model.cache import SeqLayout


class SegmentHooks(Protocol):
    """History of a segment of a packed row; N = layout.num_seqs local documents."""

    def conv_history(self, qkv: torch.Tensor, width: int, layout: SeqLayout) -> torch.Tensor:
        """This segment's pre-conv q|k|v inputs [1, T, C] -> conv history [N, width-1, C] of every local
        document (the inputs before its first token; zeros where the document starts here)."""
        ...

    def kda_initial_state(self, layer: Any, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, b: torch.Tensor,
                          layout: SeqLayout) -> torch.Tensor:
        """The KDA state [N, H, K, V] fp32 entering every local document. `layer`: the KDAttention (gate
        parameters A_log, dt_bias, lower_bound); k, v: [1, T, H, K] after the conv; f: [1, T, H, K] raw
        gate input; b: [1, T, H] beta logits (fp32)."""
        ...

    def mla_kv_source(self, latent: torch.Tensor, layout: SeqLayout) -> tuple[torch.Tensor, torch.Tensor]:
        """This segment's latents [1, T, D] -> (the latents its queries attend to [1, S, D], the mask
        [T, S] bool: query i may see key j)."""
        ...
