"""Linear + cross-entropy, chunked over rows, with the loss's gradients computed in the forward (see
k3.ops.cross_entropy for the maths and the interface).

Why: the model's loss path wrote bf16 logits [N, V] (4.3 GB for k3-small's 65,536-token micro-batch)
and the compiled cross-entropy read them twice, once per direction, writing their gradient in the
backward. Here each chunk of rows gets its logits from one GEMM, then one kernel reads each row once
for its logsumexp and loss and once more (mostly from L2: one row is 64 KB) to write the gradient
over the logits, which the dh and dW GEMMs consume at once. Only one chunk of logits is alive.

The kernel: one program per row; an online max / sum of exponentials over the vocabulary in BV-wide
blocks, all in fp32, then a second sweep writing (softmax - onehot(label)) / n_valid in the logits'
dtype. Rows labelled -100 get a zero gradient and a zero loss; a label outside [0, V) gives a nan
loss (not checked on the host: that would synchronise).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3.ops.cross_entropy.reference import IGNORE_INDEX, add_weight_grad
from k3.ops.triton_utils import cvt

TILE = (8192, 8)  # vocabulary block, warps per program: fastest of bench/cross_entropy.py --sweep (V 32,768)


@triton.jit
def _ce_rows(X, LABELS, LOSS, SCALE, V, IGNORE: tl.constexpr, GRAD: tl.constexpr, BV: tl.constexpr):
    """Row r of X [n, V]: LOSS[r] = logsumexp(x) - x[label] in fp32 (0 if ignored, nan if the label is
    outside [0, V)); with GRAD, X[r] is overwritten by (softmax(x) - onehot(label)) * SCALE[0]."""
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * V
    label = tl.load(LABELS + row).to(tl.int64)
    valid = label != IGNORE
    in_range = (label >= 0) & (label < V)
    cols = tl.arange(0, BV)

    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], dtype=tl.float32)
    for start in range(0, V, BV):
        c = start + cols
        x = tl.load(x_row + c, mask=c < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(s)

    target = tl.load(x_row + tl.where(in_range, label, 0)).to(tl.float32)
    loss = tl.where(in_range, lse - target, float("nan"))
    tl.store(LOSS + row, tl.where(valid, loss, 0.0))

    if GRAD:
        scale = tl.load(SCALE)
        for start in range(0, V, BV):
            c = start + cols
            mask = c < V
            x = tl.load(x_row + c, mask=mask, other=0.0).to(tl.float32)
            g = (tl.exp(x - lse) - tl.where(c == label, 1.0, 0.0)) * scale
            # where, not a zero scale: n_valid = 0 makes the scale inf, and 0 * inf is nan
            g = tl.where(valid, g, 0.0)
            tl.store(x_row + c, cvt(g, X.dtype.element_ty), mask=mask)


def tile() -> tuple[int, ...]:
    """TILE, read at call time (a module constant beside the kernels; tests and bench sweeps set it)."""
    return TILE


def ce_rows(logits: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor, loss: torch.Tensor, grad: bool) -> None:
    """The kernel on one chunk. logits [n, V] contiguous, bf16 / fp16 / fp32 (overwritten by the scaled
    gradient when `grad`); labels [n] int32 / int64; scale: 1-element fp32 tensor; loss [n] fp32 out."""
    n, V = logits.shape
    if n == 0:
        return
    bv, warps = tile()
    bv = min(bv, triton.next_power_of_2(V))
    _ce_rows[(n,)](logits, labels, loss, scale, V, IGNORE=IGNORE_INDEX, GRAD=grad, BV=bv, num_warps=warps)


def chunked_forward(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, chunk_rows: int, need_dh: bool,
                    need_dw: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """h [N, d], w [V, d] in one dtype (contiguous), labels [N] -> (loss 0-dim fp32, dh [N, d] in h's dtype
    or None, dW [V, d] fp32 or None): the gradients of the loss itself (incoming gradient 1)."""
    N, V = h.shape[0], w.shape[0]
    n_valid = (labels != IGNORE_INDEX).sum()
    scale = (1.0 / n_valid.float()).reshape(1)  # on the device: no host sync; inf when nothing counts
    grad = need_dh or need_dw
    row_loss = torch.empty(N, dtype=torch.float32, device=h.device)
    dh = torch.empty_like(h) if need_dh else None
    dw = None
    buf = h.new_empty(min(chunk_rows, N), V)  # the one chunk of logits alive at a time
    for lo in range(0, N, chunk_rows):
        hc = h[lo:lo + chunk_rows]
        n = hc.shape[0]
        logits = torch.mm(hc, w.t(), out=buf[:n])
        ce_rows(logits, labels[lo:lo + n], scale, row_loss[lo:lo + n], grad)
        if need_dh:
            torch.mm(logits, w, out=dh[lo:lo + n])
        if need_dw:
            dw = add_weight_grad(dw, logits, hc)
    if need_dw and dw is None:  # no rows
        dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
    return row_loss.sum() / n_valid, dh, dw


class LinearCrossEntropy(torch.autograd.Function):
    """Forward computes the loss and its gradients (chunk by chunk); backward only scales them."""

    @staticmethod
    def forward(ctx, h, weight, labels, dtype, chunk_rows):  # noqa: ANN001 - autograd signature
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # `dtype` was chosen from autocast's state by the caller: the GEMMs run in exactly that
        with torch.autocast(h.device.type, enabled=False):
            loss, dh, dw = chunked_forward(h.to(dtype).contiguous(), weight.to(dtype).contiguous(), labels,
                                           chunk_rows, need_dh, need_dw)
        ctx.save_for_backward(dh, dw)
        ctx.dtypes = (h.dtype, weight.dtype)
        return loss

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001
        dh, dw = ctx.saved_tensors
        gh = None if dh is None else (dh * g).to(ctx.dtypes[0])
        gw = None if dw is None else (dw * g).to(ctx.dtypes[1])
        return gh, gw, None, None, None
