"""Which implementation each hot region of the model runs: one typed, frozen choice per region.

The model's elementwise regions (SiTU, the AttnRes mix, the MoE dispatch / combine / routing, the
MLA key-value expansion, the lm_head loss) each exist twice: Triton kernels in `k3.ops` and torch
code in `k3.model.fused` (eager, or compiled by Inductor under `k3.model.compile`). Both compute the
same maths (the tests compare them); which one runs is a `KernelConfig`, fixed when the model is
built (`K3Config.kernels`, `K3ForCausalLM(config, kernels=...)`), never read from the environment:

    "auto"    the Triton kernels for CUDA tensors under autograd (training), else the torch code
              (CPU; inference, where serving keeps its compiled graphs). Measured faster in the
              GPU training step for every region here (docs/dev_log.md).
    "triton"  the Triton kernels wherever Triton runs (CUDA, or the interpreter under
              TRITON_INTERPRET=1: the CPU tests' way to run them), training or not.
    "torch"   always the torch code.

`muon` is the optimizer's choice (`k3.optim.PerHeadMuon(fused=...)` takes it as a bool): "auto" /
"triton" fuse the elementwise work around Newton-Schulz into Triton kernels where Triton runs,
"torch" keeps the torch ops.

Program tiles are not configured here: each kernel module keeps its tuned tile as a constant
beside the kernel (one measured winner each).

This module imports nothing from k3 (so `k3.config` and `k3.ops` can both use it) and no torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

CHOICES = ("auto", "triton", "torch")


@dataclass(frozen=True)
class KernelConfig:
    """One of CHOICES per region (see the module docstring); the defaults are the measured winners."""

    situ: str = "auto"  # SiTU-GLU activation of the MLPs / experts: k3.ops.situ
    attn_res: str = "auto"  # Block-AttnRes mix (up to MAX_CANDIDATES candidates): k3.ops.attn_res
    moe_dispatch: str = "auto"  # tokens -> expert-sorted rows: k3.ops.moe_combine.moe_dispatch
    moe_combine: str = "auto"  # weighted sum of each token's expert outputs: k3.ops.moe_combine
    moe_route: str = "auto"  # router top-k + counting sort of the slots: k3.ops.moe_route, k3.ops.router
    cross_entropy: str = "auto"  # chunked lm_head + cross-entropy without logits: k3.ops.cross_entropy
    mla_kv: str = "auto"  # MLA keys / values from kv_b_proj's output: k3.ops.mla_kv
    muon: str = "auto"  # the optimizer's fused elementwise step: k3.optim.muon_kernels

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value not in CHOICES:
                raise ValueError(f"kernels.{f.name}={value!r}: must be one of {', '.join(CHOICES)}")

    def to_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | "KernelConfig" | None) -> "KernelConfig":
        """A KernelConfig from a JSON object (missing keys keep their defaults); unknown keys raise."""
        if d is None:
            return cls()
        if isinstance(d, cls):
            return d
        if not isinstance(d, dict):
            raise ValueError(f"kernels: expected an object mapping regions to {CHOICES}, got {type(d).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(d) - set(names))
        if unknown:
            raise ValueError(f"kernels: unknown regions {unknown}; known: {names}")
        return cls(**d)

    @property
    def muon_fused(self) -> bool:
        """Whether the optimizer may run its fused Triton step (where Triton runs)."""
        return self.muon != "torch"


DEFAULT = KernelConfig()
TORCH = KernelConfig(**{f.name: "torch" for f in dataclasses.fields(KernelConfig)})  # e.g. benchmarks' baselines

__all__ = ["CHOICES", "DEFAULT", "TORCH", "KernelConfig"]
