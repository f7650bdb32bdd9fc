"""The hybrid inference cache: KDA recurrent state + conv tails, MLA latent cache, per sequence.

Sequences in a cache are rows 0..N-1. A forward with a cache takes new tokens either as
`[N, T]` rows (every sequence gets T new tokens, e.g. one-token decode) or packed `[1, total]`
with `cu_seqlens` `[N + 1]` (different numbers of new tokens per sequence, e.g. batched prefill).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from k3.config import TextConfig
from k3.ops import to_device_async


@dataclass
class SeqLayout:
    """How the sequences of one forward are laid out in the input tensor.

    num_seqs: N. cu_seqlens: [N+1] int on the input's device (packed input [1, total]) or None
    (input rows [N, T]). new_lens: [N] long, tokens of each sequence in this forward. past_lens: [N]
    long, tokens already in the cache (zeros without a cache). cu_seqlens_cpu: the same offsets on
    the host (int64, CPU), so the layers need no device-to-host read (each one would stall the GPU
    queue: a training forward used to read cu_seqlens back ~30 times).
    """

    num_seqs: int
    cu_seqlens: torch.Tensor | None
    new_lens: torch.Tensor
    past_lens: torch.Tensor
    cu_seqlens_cpu: torch.Tensor | None = None

    @staticmethod
    def build(batch: int, seqlen: int, cu_seqlens: torch.Tensor | None, cache: "HybridCache | None",
              device: torch.device) -> "SeqLayout":
        """cu_seqlens may live on the host (free: what the trainer passes) or on `device` (read back once)."""
        cu_cpu = None
        if cu_seqlens is not None:
            if batch != 1:
                raise ValueError(f"cu_seqlens needs packed input of batch 1, got batch {batch}")
            cu_cpu = cu_seqlens.to("cpu", torch.long)
            both = to_device_async(torch.cat([cu_cpu, cu_cpu[1:] - cu_cpu[:-1]]), device)
            cu_seqlens, new = both[: cu_cpu.numel()], both[cu_cpu.numel():]
        else:
            new = torch.full((batch,), seqlen, dtype=torch.long, device=device)
        n = new.numel()
        if cache is not None:
            if cache.num_seqs != n:
                raise ValueError(f"cache holds {cache.num_seqs} sequences but the input has {n}")
            past = cache.lengths.to(device)
        else:
            past = torch.zeros(n, dtype=torch.long, device=device)
        return SeqLayout(n, cu_seqlens, new, past, cu_cpu)

    def max_new(self) -> int:
        """The longest sequence's new-token count (from the host copy when there is one)."""
        if self.num_seqs == 0:
            return 0
        if self.cu_seqlens_cpu is not None:
            return int((self.cu_seqlens_cpu[1:] - self.cu_seqlens_cpu[:-1]).max())
        return int(self.new_lens.max())

    def total_new(self) -> int:
        """New tokens of all sequences together."""
        if self.cu_seqlens_cpu is not None:
            return int(self.cu_seqlens_cpu[-1] - self.cu_seqlens_cpu[0])
        return int(self.new_lens.sum())

    def token_seq_pos(self, total: int) -> tuple[torch.Tensor, torch.Tensor]:
        """For packed input: (sequence index [total], position within the new tokens [total])."""
        assert self.cu_seqlens is not None
        cu = self.cu_seqlens.to(self.new_lens.device, torch.long)
        seq = torch.repeat_interleave(torch.arange(self.num_seqs, device=cu.device), self.new_lens, output_size=total)
        pos = torch.arange(total, device=cu.device) - cu[seq]
        return seq, pos


class DecodeCache(Protocol):
    """What the layers read and write of a cache passed to a forward (`HybridCache`; the serving
    caches in `k3.serve.cache_manager` provide the same).

    lengths: [N] long, tokens already cached per sequence. kda_state / conv_tail: per KDA layer,
    [N, H, K, V] fp32 and [N, W-1, 3*H*K], replaced by the layer after its forward. absorb_mla: MLA
    attends in the weight-absorbed latent space (decode) instead of expanding keys/values.
    static_shapes: a fixed-shape decode step (one token per row, CUDA-graph friendly paths).
    paged_mla: MLA decode reads the latents in place through `mla_write`'s page tables.
    """

    num_seqs: int
    lengths: torch.Tensor
    kda_state: dict[int, torch.Tensor]
    conv_tail: dict[int, torch.Tensor]
    absorb_mla: bool
    static_shapes: bool
    paged_mla: bool

    def mla_append(self, layer: int, new: torch.Tensor, layout: SeqLayout) -> torch.Tensor:
        """Store new latents (padded [N, Tmax, D]) after each sequence's past -> [N, capacity, D]."""
        ...

    def mla_write(self, layer: int, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(paged_mla only) store [N, 1, D] latents -> (pages, page tables, attended lengths)."""
        ...


class HybridCache:
    """Per-request inference state of every layer.

    KDA layer l: `kda_state[l]` [N, H, K, V] fp32 and `conv_tail[l]` [N, W-1, 3*H*K] (the last W-1
    pre-conv q|k|v inputs). MLA layer l: `mla_kv[l]` [N, capacity, kv_lora_rank + qk_rope_head_dim]
    holding the normalised latent and the (un-normalised) k_pe of every past token. A `DecodeCache`.
    """

    static_shapes = False  # dynamic shapes: prefill and decode alike
    paged_mla = False  # latents live in dense per-sequence buffers (`mla_append`)

    def __init__(self, config: TextConfig, num_seqs: int, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", capacity: int = 256, absorb_mla: bool = True) -> None:
        self.config, self.num_seqs, self.dtype, self.device = config, num_seqs, dtype, torch.device(device)
        self.absorb_mla = absorb_mla
        self.lengths = torch.zeros(num_seqs, dtype=torch.long, device=self.device)
        H, K = config.kda_num_heads, config.kda_head_dim
        W = config.linear_attn_config.short_conv_kernel_size
        D = config.kv_lora_rank + config.qk_rope_head_dim
        self.kda_state: dict[int, torch.Tensor] = {}
        self.conv_tail: dict[int, torch.Tensor] = {}
        self.mla_kv: dict[int, torch.Tensor] = {}
        for layer in range(config.num_hidden_layers):
            if config.is_mla(layer):
                self.mla_kv[layer] = torch.zeros(num_seqs, capacity, D, dtype=dtype, device=self.device)
            else:
                self.kda_state[layer] = torch.zeros(num_seqs, H, K, K, dtype=torch.float32, device=self.device)
                self.conv_tail[layer] = torch.zeros(num_seqs, W - 1, 3 * H * K, dtype=dtype, device=self.device)

    def mla_append(self, layer: int, new: torch.Tensor, layout: SeqLayout) -> torch.Tensor:
        """Write new latents (padded [N, Tmax, D]) after each sequence's past; returns the buffer."""
        buf = self.mla_kv[layer]
        need = int((layout.past_lens + layout.new_lens).max()) if layout.num_seqs else 0
        if need > buf.shape[1]:
            grown = buf.new_zeros(buf.shape[0], max(need, 2 * buf.shape[1]), buf.shape[2])
            grown[:, : buf.shape[1]] = buf
            buf = self.mla_kv[layer] = grown
        i = torch.arange(new.shape[1], device=new.device)
        valid = i[None, :] < layout.new_lens[:, None]
        rows = torch.arange(layout.num_seqs, device=new.device)[:, None].expand_as(valid)[valid]
        cols = (layout.past_lens[:, None] + i[None, :])[valid]
        buf[rows, cols] = new[valid].to(buf.dtype)
        return buf

    def mla_write(self, layer: int, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError("HybridCache has no paged latent cache (paged_mla is False)")

    def advance(self, new_lens: torch.Tensor) -> None:
        self.lengths += new_lens.to(self.lengths.device)

    def select(self, rows: list[int] | torch.Tensor) -> "HybridCache":
        """A cache holding only the given sequences (e.g. to drop finished ones)."""
        idx = torch.as_tensor(rows, dtype=torch.long, device=self.device)
        out = HybridCache.__new__(HybridCache)
        out.config, out.dtype, out.device, out.absorb_mla = self.config, self.dtype, self.device, self.absorb_mla
        out.num_seqs = idx.numel()
        out.lengths = self.lengths[idx].clone()
        out.kda_state = {k: v[idx].clone() for k, v in self.kda_state.items()}
        out.conv_tail = {k: v[idx].clone() for k, v in self.conv_tail.items()}
        out.mla_kv = {k: v[idx].clone() for k, v in self.mla_kv.items()}
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.kda_state, self.conv_tail, self.mla_kv)
                   for t in d.values())
