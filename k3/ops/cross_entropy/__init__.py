"""Mean token cross-entropy of a linear layer's logits, without materialising the logits.

    from k3.ops.cross_entropy import linear_cross_entropy
    loss = linear_cross_entropy(h, weight, labels)     # h [N, d], weight [V, d], labels [N] -> 0-dim fp32

equals `F.cross_entropy((h @ weight.T).float(), labels, ignore_index=-100)` (`reference.py` is the spec):
mean over the rows whose label is not -100 of logsumexp(logits) - logits[label], in fp32; nan when every
label is -100 (0 / 0, as F.cross_entropy). The forward runs chunk_rows rows at a time: the logits GEMM
(cuBLAS, in the compute dtype), the Triton kernel of `triton_ce.py` (row loss; the gradient
(softmax - onehot) / n_valid written over the logits), then dh = g @ W and dW += g^T @ h (fp32 sum over
chunks). The backward only scales dh and dW by the incoming gradient. Memory: one chunk of logits
(chunk_rows x V in the compute dtype) during the forward; dh [N, d] and dW [V, d] fp32 kept for the backward.
The gradients are computed only for inputs that require them (none under torch.no_grad()).

Triton runs on CUDA tensors, and on CPU tensors under TRITON_INTERPRET=1 (how CI tests it).
"""

from __future__ import annotations

import torch

__all__ = ["linear_cross_entropy"]

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def _compute_dtype(h: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The GEMMs' dtype: autocast's for h's device when it is on (what nn.Linear would use), else the
    inputs' own (which must then agree)."""
    device = h.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        if dtype in _FLOATS:
            return dtype
    if h.dtype != weight.dtype:
        raise ValueError(f"h and weight must have one dtype outside autocast, got {h.dtype} and {weight.dtype}")
    return h.dtype


def _check(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_rows: int) -> None:
    if h.dim() != 2 or weight.dim() != 2 or labels.dim() != 1:
        raise ValueError(f"expected h [N, d], weight [V, d], labels [N]; got {list(h.shape)}, "
                         f"{list(weight.shape)}, {list(labels.shape)}")
    if h.shape[1] != weight.shape[1] or labels.shape[0] != h.shape[0] or weight.shape[0] == 0:
        raise ValueError(f"shapes do not match h [N, d], weight [V >= 1, d], labels [N]: {list(h.shape)}, "
                         f"{list(weight.shape)}, {list(labels.shape)}")
    if h.dtype not in _FLOATS or weight.dtype not in _FLOATS:
        raise ValueError(f"h and weight must be bf16, fp16 or fp32, got {h.dtype} and {weight.dtype}")
    if labels.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"labels must be int32 or int64, got {labels.dtype}")
    if not (h.device == weight.device == labels.device):
        raise ValueError(f"h, weight and labels must be on one device, got {h.device}, {weight.device}, "
                         f"{labels.device}")
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1:
        raise ValueError(f"chunk_rows must be a positive int, got {chunk_rows!r}")


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                         chunk_rows: int = 8192) -> torch.Tensor:
    """Mean cross-entropy of the logits h @ weight^T against labels (-100 = ignore).

    Args:
        h: [N, d] bf16 / fp16 / fp32 hidden states.
        weight: [V, d] bf16 / fp16 / fp32 (e.g. an fp32 master weight under autocast).
        labels: [N] int32 / int64 target ids in [0, V), or -100 to ignore the row. Not checked on the
            host (a device-to-host read): a label outside [0, V) makes the loss nan.
        chunk_rows: rows per chunk (the logits of one chunk are alive at a time).
    Returns:
        0-dim fp32 loss; nan when no label counts. The GEMMs run in autocast's dtype when autocast is on
        for h's device (weight and h cast once per call), else in the inputs' dtype (which must agree).
        Differentiable in h and weight: their gradients come back in their own dtypes (an fp32 weight
        gets an fp32 gradient, summed over chunks in fp32).
    """
    from k3.ops.cross_entropy.triton_ce import LinearCrossEntropy

    _check(h, weight, labels, chunk_rows)
    dtype = _compute_dtype(h, weight)
    return LinearCrossEntropy.apply(h, weight, labels.contiguous(), dtype, chunk_rows)
