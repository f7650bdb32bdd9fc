"""Which backend a kernel call takes: Triton (CUDA, or the interpreter) or torch.

Importable without Triton (the model imports it to choose between its Triton and PyTorch paths);
the Triton helpers themselves live in `k3.ops.triton_utils`. The choices themselves are typed
(`k3.kernel_config.KernelConfig`); the only environment read is Triton's own TRITON_INTERPRET.
"""

from __future__ import annotations

import os

import torch


def triton_runs_on(x: torch.Tensor) -> bool:
    """Whether a Triton kernel can take x: a CUDA tensor, or any tensor under TRITON_INTERPRET=1 (read per
    call; the CPU tests' way to run the kernels)."""
    return x.is_cuda or os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(choice: str, x: torch.Tensor) -> bool:
    """Whether a region with `choice` ("auto" / "triton" / "torch", see `k3.kernel_config`) runs its Triton
    kernels on x: "auto" for CUDA tensors under autograd (training), "triton" wherever Triton runs."""
    if choice == "auto":
        return x.is_cuda and torch.is_grad_enabled()
    if choice == "triton":
        return triton_runs_on(x)
    if choice == "torch":
        return False
    raise ValueError(f"kernel choice must be 'auto', 'triton' or 'torch', got {choice!r}")
