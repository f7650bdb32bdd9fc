"""`torch.compile` for K3 training: the per-layer elementwise regions, compiled one by one.

The regions are the fwd/bwd pairs of :mod:`k3.model.fused` (SiTU-GLU, RMSNorm, KDA's gated output
norm, Block-AttnRes mixing, the MoE combine) plus the router, the MLA output gate and the
short-conv epilogue. Each is compiled with ``fullgraph=True`` (a graph break is an error, not a
silent slowdown), so Inductor turns each into one or two fused kernels. The matmuls, the grouped
expert GEMMs, attention and the KDA kernels stay outside the compiled regions, run exactly as in
eager mode, and need no graph breaks.

    from k3.model.compile import compile_model
    compile_model(model)                        # Inductor, default mode
    compile_model(model, backend="aot_eager")   # tracing only (tests, debugging)

Compilation happens lazily on the first forward/backward. By default shapes that change recompile
once and are then treated as dynamic; `dynamic=False` (what `k3 train` uses for text, whose
micro-batches have fixed shapes) compiles each distinct shape for its size, so the training kernels
stay the ones `bench/train.py` measures. Serving (`k3 serve --compile`)
uses it too: the CUDA-graph decode buckets have fixed shapes, so the compiled kernels are captured in
the graphs.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from k3.kernel_config import KernelConfig
from k3.model.fused import EAGER, Kernels, uses_kernels

# Distinct (shape, dtype, constant) variants per region: norms see several widths, the AttnRes mix
# one variant per candidate count; the default limit of 8 would fall back to eager silently.
RECOMPILE_LIMIT = 64


def _raise_recompile_limit() -> None:
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name) and getattr(cfg, name) < RECOMPILE_LIMIT:
            setattr(cfg, name, RECOMPILE_LIMIT)


def compile_model(model: nn.Module, *, backend: str | Callable = "inductor", mode: str | None = None,
                  dynamic: bool | None = None) -> nn.Module:
    """Switch every K3 module of `model` (in place) to compiled elementwise regions; returns `model`.

    backend / mode / dynamic: as for ``torch.compile`` (mode only with Inductor; the trainer passes
    dynamic=False so that validation batches never turn the training kernels dynamic). All modules
    share one compiled table. :func:`uncompile_model` switches back to eager."""
    if mode is not None and backend != "inductor":
        raise ValueError(f"mode={mode!r} needs backend='inductor', got backend={backend!r}")
    _raise_recompile_limit()
    kernels = Kernels(compiled=True, backend=backend, mode=mode, dynamic=dynamic, config=kernel_config(model))
    return _set_kernels(model, kernels)


def uncompile_model(model: nn.Module) -> nn.Module:
    """Back to the eager kernels (e.g. before serving a model that was trained compiled); the KernelConfig
    stays."""
    return _set_kernels(model, EAGER.with_config(kernel_config(model)))


def kernel_config(model: nn.Module) -> KernelConfig:
    """The KernelConfig `model`'s K3 modules run with (the first one's; `set_kernel_config` keeps them equal)."""
    for m in model.modules():
        if uses_kernels(m):
            return m.kernels.config
    raise ValueError("model: no K3 module with fused kernels found (expected a K3ForCausalLM or part of one)")


def set_kernel_config(model: nn.Module, config: KernelConfig) -> nn.Module:
    """Which regions of `model` run Triton kernels (`k3.kernel_config`), in place, keeping each module's table
    compiled or eager; returns `model`."""
    tables: dict[int, Kernels] = {}
    found = False
    for m in model.modules():
        if uses_kernels(m):
            m.kernels = tables.setdefault(id(m.kernels), m.kernels.with_config(config))
            found = True
    if not found:
        raise ValueError("model: no K3 module with fused kernels found (expected a K3ForCausalLM or part of one)")
    return model


def _set_kernels(model: nn.Module, kernels: Kernels) -> nn.Module:
    found = False
    for m in model.modules():
        if uses_kernels(m):
            m.kernels = kernels
            found = True
    if not found:
        raise ValueError("model: no K3 module with fused kernels found (expected a K3ForCausalLM or part of one)")
    return model


__all__ = ["compile_model", "uncompile_model", "kernel_config", "set_kernel_config", "RECOMPILE_LIMIT"]
