"""MoE routing bookkeeping: the top-k expert selection and the expert-sorted slot order.

    from k3.ops.moe_route import topk_route, sort_slots_triton
    idx = topk_route(scores, k, bias)                    # [N, E] fp32 -> [N, k] int64
    order, inv, counts = sort_slots_triton(idx, E)       # [N*k], [N*k], [E] int64

`reference.py` is the spec; `triton_route.py` the Triton kernels used on CUDA tensors (and under
TRITON_INTERPRET=1 on CPU, which is how CI tests them). Nothing here synchronises with the host, so
both run inside CUDA-graph captures.

The order of the k ids within a row is by descending value, equal values smaller id first (the
spec's stable sort). The model's torch path (`torch.topk(sorted=False)`) may list the same ids in
another order; the MoE result does not depend on it except through fp32 summation order: the
expert-sorted slots of one expert are in token order either way (a token picks an expert once), and
only the order of each token's k-way sums (weight renormalisation, the combine) follows the row.
"""

from __future__ import annotations

import torch

__all__ = ["topk_route", "sort_slots_triton", "MAX_EXPERTS"]

MAX_EXPERTS = 1024  # kimi-k3 has 896 experts; the top-k kernel packs an id in 10 bits


def topk_route(choice: torch.Tensor, k: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The k largest entries of each row of choice (+ bias), as `topk_route_reference`.

    Args:
        choice: [N, E] fp32 (bf16 / fp16 are widened exactly), E <= MAX_EXPERTS; not differentiated.
        k: 1 <= k <= E.
        bias: [E] float added to every row in fp32 before the selection (the router's selection-only
            correction bias: fp32 scores + fp32 bias round exactly as in torch), or None.
    Returns:
        [N, k] int64 expert ids, each row by descending value, equal values smaller id first; NaN
        counts as larger than +inf and -0.0 as +0.0 (torch's sort order). Deterministic.
    """
    from k3.ops.moe_route.triton_route import topk_rows

    if choice.dim() != 2:
        raise ValueError(f"choice must be [N, E], got shape {list(choice.shape)}")
    if choice.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"choice must be fp32, bf16 or fp16, got {choice.dtype}")
    E = choice.shape[1]
    if not 1 <= E <= MAX_EXPERTS:
        raise ValueError(f"the number of experts must be in [1, {MAX_EXPERTS}], got {E}")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= E:
        raise ValueError(f"k must be an int in [1, E = {E}], got {k!r}")
    if bias is not None:
        if bias.shape != (E,) or not bias.is_floating_point() or bias.device != choice.device:
            raise ValueError(f"bias must be a float [E = {E}] tensor on {choice.device}, got "
                             f"{bias.dtype} {list(bias.shape)} on {bias.device}")
        bias = bias.contiguous()
    if choice.stride(1) != 1:
        choice = choice.contiguous()
    return topk_rows(choice.detach(), k, None if bias is None else bias.detach())


def sort_slots_triton(idx: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stable counting sort of the flattened expert ids, as `sort_slots_reference`.

    Args:
        idx: [N, k] int32 / int64 expert ids in [0, num_experts) (N may be 0). Out-of-range ids raise
            on CPU tensors; on CUDA they are not checked (that needs a host sync, which CUDA-graph
            capture forbids): the kernels clamp them into range, so they never write out of bounds
            but the result is then not the spec's.
        num_experts: E, 1 <= E <= MAX_EXPERTS.
    Returns:
        order [N*k] int64: torch.argsort(idx.reshape(-1), stable=True), exactly;
        inv [N*k] int64: its inverse permutation (inv[order[i]] = i);
        counts [E] int64: slots per expert (torch.bincount(idx.reshape(-1), minlength=E)).
    """
    from k3.ops.moe_route.triton_route import sort_flat

    if idx.dim() != 2:
        raise ValueError(f"idx must be [N, k], got shape {list(idx.shape)}")
    if idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"idx must be int32 or int64 expert ids, got {idx.dtype}")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"num_experts must be an int in [1, {MAX_EXPERTS}], got {num_experts!r}")
    if idx.numel() >= 2 ** 31:
        raise ValueError(f"at most 2^31 - 1 slots, got {idx.numel()}")
    flat = idx.reshape(-1).contiguous()
    if not flat.is_cuda and flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= num_experts):
        raise ValueError(f"expert ids must be in [0, {num_experts}), got [{int(flat.min())}, {int(flat.max())}]")
    return sort_flat(flat, num_experts)
