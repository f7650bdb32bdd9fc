"""Per-token log-probabilities of a linear layer's logits, without materialising the logits.

    from k3.ops.cross_entropy.logprobs import linear_token_logprobs
    lp = linear_token_logprobs(h, weight, labels, temperature=1.0)   # h [N, d], weight [V, d] -> [N] fp32

equals `torch.log_softmax((h @ weight.T).float() / temperature, -1).gather(-1, labels[:, None])[:, 0]`
(rows whose label is -100 give 0 and no gradient). What RL and distillation read: the policy's log-prob
of each sampled token, differentiable, at contexts where [N, V] logits would not fit (K3: V = 163,840).

Forward, chunk_rows rows at a time: the logits GEMM in the compute dtype (as nn.Linear under autocast),
then logsumexp and the label's logit in fp32; only the row's logsumexp [N] is kept. Backward recomputes
each chunk's logits (one more GEMM per chunk: the same product, so the same values) and forms
g (onehot - softmax) / temperature, then dh = . @ W and dW += .^T @ h (summed over chunks in fp32).
Plain PyTorch (cuBLAS + elementwise), so it runs on any device.
"""

from __future__ import annotations

import torch

from k3.ops.cross_entropy import _check, _compute_dtype
from k3.ops.cross_entropy.reference import IGNORE_INDEX, add_weight_grad

__all__ = ["linear_token_logprobs"]

CHUNK_ELEMENTS = 2 ** 28  # default rows per chunk: about 1 GiB of fp32 logits


def _logits(hc: torch.Tensor, w: torch.Tensor, temperature: float) -> torch.Tensor:
    """One chunk's logits / temperature in fp32 [n, V] (the GEMM in hc's dtype, as nn.Linear)."""
    z = torch.mm(hc, w.t()).float()
    return z.div_(temperature) if temperature != 1.0 else z


class LinearTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, labels, dtype, chunk_rows, temperature):  # noqa: ANN001 - autograd signature
        with torch.autocast(h.device.type, enabled=False):
            hc, wc = h.to(dtype).contiguous(), weight.to(dtype).contiguous()
            valid = labels != IGNORE_INDEX
            target = labels.long().clamp(min=0)
            lp = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
            lse = torch.empty_like(lp)
            for lo in range(0, h.shape[0], chunk_rows):
                z = _logits(hc[lo:lo + chunk_rows], wc, temperature)
                lse[lo:lo + z.shape[0]] = torch.logsumexp(z, dim=1)
                lp[lo:lo + z.shape[0]] = z.gather(1, target[lo:lo + z.shape[0], None])[:, 0]
            lp = torch.where(valid, lp - lse, 0.0)
        ctx.save_for_backward(h, weight, labels, lse)  # the inputs as given: no second copy in memory
        ctx.args = (dtype, chunk_rows, temperature)
        return lp

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001
        h, weight, labels, lse = ctx.saved_tensors
        dtype, chunk_rows, temperature = ctx.args
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        with torch.autocast(h.device.type, enabled=False):
            hc, wc = h.to(dtype).contiguous(), weight.to(dtype).contiguous()
            # d lp / d z = onehot - softmax, times g, divided by the temperature (z = logits / T)
            gt = torch.where(labels != IGNORE_INDEX, g.float(), 0.0) / temperature
            target = labels.long().clamp(min=0)
            dh = torch.empty_like(hc) if need_dh else None
            dw = None
            for lo in range(0, h.shape[0], chunk_rows):
                rows = slice(lo, lo + chunk_rows)
                z = _logits(hc[rows], wc, temperature)
                n = z.shape[0]
                dz = z.sub_(lse[rows, None]).exp_().mul_(-gt[rows, None])
                dz.scatter_add_(1, target[rows, None], gt[rows, None])
                dl = dz.to(dtype)
                if need_dh:
                    torch.mm(dl, wc, out=dh[lo:lo + n])
                if need_dw:
                    dw = add_weight_grad(dw, dl, hc[rows])
            if need_dw and dw is None:
                dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        gh = None if dh is None else dh.to(h.dtype)
        gw = None if dw is None else dw.to(weight.dtype)
        return gh, gw, None, None, None, None


def linear_token_logprobs(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                          temperature: float = 1.0, chunk_rows: int | None = None) -> torch.Tensor:
    """log softmax(h @ weight^T / temperature)[label] per row, never holding more than one chunk of logits.

    Args:
        h: [N, d] bf16 / fp16 / fp32 hidden states.
        weight: [V, d] bf16 / fp16 / fp32 (e.g. an fp32 master weight under autocast).
        labels: [N] int32 / int64 token ids in [0, V), or -100 for rows without a target (log-prob 0, no
            gradient). Not checked on the host (a device read): an id outside [0, V) gives garbage.
        temperature: > 0; the logits are divided by it (sampling at that temperature).
        chunk_rows: rows per chunk; default about 1 GiB of fp32 logits (2^28 / V rows).
    Returns:
        [N] fp32, differentiable in h and weight (gradients in their own dtypes; an fp32 weight's summed
        over chunks in fp32). The GEMMs run in autocast's dtype when autocast is on for h's device, else
        in the inputs' dtype (which must then agree).
    """
    if chunk_rows is None:
        chunk_rows = max(1, CHUNK_ELEMENTS // max(1, weight.shape[0]))
    _check(h, weight, labels, chunk_rows)
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not temperature > 0:
        raise ValueError(f"temperature must be a positive number, got {temperature!r}")
    return LinearTokenLogprobs.apply(h, weight, labels.contiguous(), _compute_dtype(h, weight), chunk_rows,
                                     float(temperature))
