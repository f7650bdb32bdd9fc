"""Kimi Delta Attention: one public entry point, `kda`, over interchangeable backends.

Backends:
    "reference": per-token recurrence (reference.py), the spec; float64-capable.
    "torch":     chunked WY/UT form in plain PyTorch (chunk_torch.py); the CPU default.
    "triton":    Triton chunked kernels (chunk.py); the CUDA default. Runs on CPU tensors
                 under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch

from k3.ops.kda.gate import kda_gate
from k3.ops.kda.reference import kda_reference
from k3.ops.kda.validate import check_kda_shapes

__all__ = ["kda", "kda_gate", "kda_reference", "l2norm"]

BACKENDS = ("auto", "reference", "torch", "triton")


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x * rsqrt(sum(x^2) + eps) over the last dim, computed in fp32, returned in x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().sum(-1, keepdim=True) + eps)).to(x.dtype)


def kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked/recurrent KDA with fla's layout.

    Args:
        q, k: [B, T, H, K], L2-normalised unless `use_qk_l2norm_in_kernel`.
        v: [B, T, H, V] (V may differ from K).
        g: [B, T, H, K] log-decay; or, when `A_log` is given, the raw gate input f that
            `kda_gate(f, A_log, dt_bias, lower_bound)` turns into the log-decay.
        lower_bound: with `A_log`, the bounded-gate constant L (None = Kimi-Linear softplus gate);
            with a pre-computed g, a declared bound g >= L that lets the Triton kernels factorise.
        beta: [B, T, H] in (0, 1); or logits when `use_beta_sigmoid_in_kernel`.
        scale: query scale, default K ** -0.5.
        initial_state: [N, H, K, V] (N = B, or the number of packed sequences); fp32 preferred.
        cu_seqlens: [N + 1] int, packed sequences in a B == 1 batch.
        cu_seqlens_cpu: optional host copy of cu_seqlens (CPU tensor, same values): spares the
            device-to-host reads of the offsets (checks, chunk bookkeeping) that stall the GPU queue.
        backend: "auto" | "reference" | "torch" | "triton".
    Returns:
        o: [B, T, H, V] in v's dtype; final_state [N, H, K, V] fp32 (None unless requested).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    gate_fused = A_log is not None
    if not gate_fused and dt_bias is not None:
        raise ValueError("dt_bias is only meaningful with A_log (in-kernel gate)")
    if gate_fused and dt_bias is None:
        raise ValueError("the in-kernel gate needs dt_bias together with A_log")
    if lower_bound is not None and not -5.0 <= lower_bound < 0.0:
        raise ValueError(f"lower_bound must be in [-5, 0), got {lower_bound}")
    if cu_seqlens is not None and cu_seqlens_cpu is None:
        cu_seqlens_cpu = cu_seqlens.cpu()  # read back once here, not in every check below
    check_kda_shapes(q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu)
    if backend == "auto":
        # The Triton kernels need a known lower bound on the per-step decay (the K3 gate gives one).
        backend = "triton" if q.is_cuda and lower_bound is not None else "torch"
    if backend == "triton":
        from k3.ops.kda.chunk import chunk_kda

        return chunk_kda(
            q, k, v, g, beta, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, A_log=A_log,
            dt_bias=dt_bias, lower_bound=lower_bound, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        )
    # Unfused backends: apply the optional prologue in PyTorch, then run the core.
    if gate_fused:
        g = kda_gate(g, A_log, dt_bias, lower_bound)
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    if use_beta_sigmoid_in_kernel:
        beta = torch.sigmoid(beta.float())
    if backend == "reference":
        o, s = kda_reference(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                             output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                             dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)
        return o, s
    from k3.ops.kda.chunk_torch import chunk_kda_torch

    return chunk_kda_torch(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                           output_final_state=output_final_state, cu_seqlens=cu_seqlens)
