"""Model FLOPs of a training step (the spec's k3 MFU convention, benchmarks.md section 3), the bf16
dense peak of known GPUs (for the MFU that `k3 train` logs and `bench/train.py` reports) and the bytes
of training state per parameter (`k3 train`'s memory check, `k3 info`).

Per token, forward: 2 x active matmul parameters (input embedding excluded, lm_head included), plus per
KDA layer H (6 K^2 + 3 C K + C^2) (C = 64, the chunk) and per MLA layer 2 H (d_qk + d_v) x the causal
average context of the token's document. Training = 3 x forward.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from k3.config import TextConfig

CHUNK = 64
BYTES_PER_PARAM = 16  # training state per parameter: fp32 weight + fp32 gradient + ~2 fp32 optimizer states
# dense bf16 tensor-core peak per GPU (datasheets), matched against torch.cuda.get_device_name()
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "H20": 148e12, "A100": 312e12, "A800": 312e12,
             "B200": 2250e12}


def _mixing_terms(tc: TextConfig) -> tuple[float, float]:
    """(forward FLOPs per token of all KDA layers, forward FLOPs per token per unit of context of all MLA layers)."""
    n_mla = sum(tc.is_mla(i) for i in range(tc.num_hidden_layers))
    H, K = tc.kda_num_heads, tc.kda_head_dim
    kda = (tc.num_hidden_layers - n_mla) * H * (6 * K * K + 3 * CHUNK * K + CHUNK * CHUNK)
    return float(kda), float(n_mla * 2 * tc.num_attention_heads * (tc.qk_head_dim + tc.v_head_dim))


def flops_per_token(tc: TextConfig, active_params: int, seq_len: int,
                    doc_lens: Sequence[int] | None = None) -> float:
    """Training FLOPs per token at context length seq_len (causal average seq_len / 2); with doc_lens
    (packed documents) MLA attends within each document: average context sum(len^2) / 2 / sum(len)."""
    kda, mla = _mixing_terms(tc)
    context = seq_len / 2 if not doc_lens else sum(n * n for n in doc_lens) / 2 / sum(doc_lens)
    return 3 * (2.0 * active_params + kda + mla * context)


def batch_flops(tc: TextConfig, active_params: int, cu_seqlens: torch.Tensor) -> float:
    """Training FLOPs of one packed batch given its host document offsets cu_seqlens [N + 1]."""
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    total = sum(lens)
    return flops_per_token(tc, active_params, 0, lens) * total if total else 0.0


def peak_bf16_flops(device: torch.device | str) -> float | None:
    """The GPU's dense bf16 peak (FLOP/s), or None for a CPU or a GPU not in PEAK_BF16."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key in sorted(PEAK_BF16, key=len, reverse=True):  # "H200" before "H20"
        if key in name:
            return PEAK_BF16[key]
    return None
