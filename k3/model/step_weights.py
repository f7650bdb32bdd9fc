"""One optimizer step's shared compute-dtype weight copies, for `K3ForCausalLM.step_weights()`.

Under autocast every GEMM casts its fp32 master weight to the compute dtype (bf16) on every micro-batch (an
fp32 read and a bf16 write), and in the backward autograd casts the weight's bf16 gradient back to fp32
(ToCopyBackward) before AccumulateGrad adds it into `.grad` (a second pass). Inside `step_weights()`
(single-process training) each weight, or a group of weights that one GEMM uses concatenated, is cast
once per optimizer step instead and the copy is shared by the step's micro-batches; each micro-batch's
backward adds its gradient straight into the fp32 `.grad` (fp32 += bf16 in one pass, or an fp32 copy
when `.grad` is None), as Megatron's main_grad does. The arithmetic is autograd's (upcasting bf16 is
exact, then one fp32 add), so the gradients are bit-identical. k3-small on an H200, per 65,536-token
micro-batch: ~1.8 ms for the routed experts; with the dense weights too, casts and gradient accumulation
4.7 -> 4.3 ms and ~330 fewer launches (docs/benchmarks.md, fourteenth session).

The gradients bypass autograd's AccumulateGrad (no gradient hooks fire on these parameters), which is
why only `step_weights()` turns this on: FSDP / expert-parallel wrappers need those hooks.

Modules that take part declare `step_cache: StepCache | None` (None outside a step); `step_weights()`
gives each its own empty dict and drops them all on exit. Entries are keyed by the parameters' identities
(and dtype and concatenation dim), so a copy is only ever reused for exactly the tensors it was made from.
This module imports only torch (k3.model.fused and k3.model.common both use it).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

# (dtype, dim, id(param), ...) -> the concatenated compute-dtype copy of those params
StepCache = dict[tuple[object, ...], Tensor]


class _StepWeights(torch.autograd.Function):
    """fp32 params -> torch.cat([p.to(dtype) for p in params], dim): the step's shared copy. The
    backward adds each param's slice of the gradient into its fp32 `.grad` and returns no gradient to
    autograd (nothing else may see these gradients; see the module docstring)."""

    @staticmethod
    def forward(ctx, dtype, dim, *params):  # noqa: ANN001 - autograd signature
        ctx.dim, ctx.params = dim, params  # the leaves themselves, not saved tensors: no version check needed
        # a consumer that adds the weight gradient into the masters itself (k3.ops.grouped_gemm.expert_gemm)
        # returns none for the copy: that must stay None here, not become a full-size zero tensor to add
        ctx.set_materialize_grads(False)
        if len(params) == 1:
            return params[0].to(dtype)
        return torch.cat([p.to(dtype) for p in params], dim=dim)  # cast first: half the bytes of an fp32 cat

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):  # noqa: ANN001
        if g is None:
            return (None, None) + (None,) * len(ctx.params)
        off = 0
        for p, need in zip(ctx.params, ctx.needs_input_grad[2:]):
            n = p.shape[ctx.dim]
            if need:  # a frozen param of a group gets nothing
                accumulate_grad(p, g.narrow(ctx.dim, off, n))
            off += n
        return (None, None) + (None,) * len(ctx.params)


def accumulate_grad(p: Tensor, g: Tensor) -> None:
    """p.grad += g (fp32 += a bf16 / fp16 / fp32 g of p's shape, one pass), or a contiguous fp32 copy of g
    when p.grad is None: the bits AccumulateGrad gives for g cast to fp32 first."""
    if p.grad is None:
        p.grad = g.to(p.dtype, memory_format=torch.contiguous_format, copy=True)
    else:
        p.grad.add_(g)


def _fp32_leaf(p: Tensor) -> bool:
    """A plain fp32 leaf (a master weight): not a transformed weight, not an FSDP DTensor."""
    return p.dtype == torch.float32 and p.is_leaf and type(p.data) is torch.Tensor


def step_weight(cache: StepCache | None, params: tuple[Tensor, ...], dtype: torch.dtype,
                dim: int = 0) -> Tensor | None:
    """The step's shared copy of `params` (fp32, equal shapes except along `dim`) concatenated along `dim`
    in `dtype`, made on first use; None when there is none to use: outside `step_weights()` (cache None),
    with grad disabled, or a param that is not a plain fp32 leaf. The caller then does what it does
    without a cache."""
    if cache is None or not torch.is_grad_enabled():
        return None
    key = (dtype, dim, *(id(p) for p in params))  # the cached copy's ctx holds the params: ids stay theirs
    w = cache.get(key)
    if w is None:  # the step's first use (the checks run once per step, not per GEMM)
        if not all(_fp32_leaf(p) for p in params):
            return None
        w = cache[key] = _StepWeights.apply(dtype, dim, *params)
    return w


def gemm_weight(cache: StepCache | None, params: tuple[Tensor, ...]) -> Tensor:
    """The weight for a GEMM over `params` ([n_i, k] each) concatenated along dim 0: [sum n_i, k].

    Inside `step_weights()` with autocast on for the params' device (lower-precision dtype): the step's
    shared copy in the autocast dtype (`step_weight`). Otherwise exactly what the GEMM got before: the
    param itself, or the params concatenated in their own dtype (autocast then casts inside the GEMM)."""
    if cache is not None:
        dev = params[0].device.type
        if torch.is_autocast_enabled(dev) and torch.get_autocast_dtype(dev) != torch.float32:
            w = step_weight(cache, params, torch.get_autocast_dtype(dev))
            if w is not None:
                return w
    return params[0] if len(params) == 1 else torch.cat(params)


class StepLinear(nn.Linear):
    """nn.Linear whose GEMM takes the step's shared compute-dtype weight inside `step_weights()`
    (`gemm_weight`); everywhere else (no cache, no grad, no autocast, FSDP) exactly nn.Linear.

    x [..., in_features] -> [..., out_features]. Callers that run their own GEMM with this weight (e.g.
    `linear_residual`) pass `gemm_weight()` instead of `.weight`."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.step_cache: StepCache | None = None

    def gemm_weight(self) -> Tensor:
        """[out_features, in_features]: the step's copy, or `.weight` itself."""
        return gemm_weight(self.step_cache, (self.weight,))

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.gemm_weight(), self.bias)


__all__ = ["StepCache", "StepLinear", "accumulate_grad", "gemm_weight", "step_weight"]
