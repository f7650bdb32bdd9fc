"""Quantisation-aware training (QAT) of the routed experts: MXFP4 weights, optionally MXFP8 activations.

    from k3.quant.qat import QATConfig, apply_qat
    apply_qat(model, QATConfig.parse("mxfp4,mxfp8"))   # before building the optimizer or after: no new params

What is fake-quantised (forward = decode(encode(.)), backward = identity, the straight-through
estimator of spec k3_posttraining.md §6):

* weights (`weights="mxfp4"`): every routed expert matrix w1 / w3 / w2, in 32-blocks along its input
  dim, E8M0 scale by the OCP FLOOR rule (`k3.quant.mxfp4.fake_quant_mxfp4`), installed on
  `RoutedExperts.weight_transform` -- the one place the expert weights pass through on their way to
  compute. The fp32 masters stay full precision (the optimizer updates them); saving the model with
  `experts_format="mxfp4"` encodes the masters with the same rule, so the checkpoint's packed experts
  decode to exactly the weights the forward used.
* activations (`activations="mxfp8"`): the inputs of the expert GEMMs -- the latent tokens z before
  w1 / w3 and the SiTU output before w2 -- in 32-blocks along the reduction dim, E4M3 elements
  (`k3.quant.mxfp8.fake_quant_mxfp8`), installed on `RoutedExperts.input_transform`. These are the
  activations an MX expert kernel reads (spec k3_model.md §4.4: SiTU output quantised to MXFP8
  before the down projection).

Everything else stays in high precision (BF16 compute, fp32 masters), as in the official release,
whose quantization_config ignores `self_attn`, `shared_experts`, the dense MLP, `lm_head` and the
vision tower: attention / KDA (the recurrent state and softmax logits are the precision-sensitive
part of the model), the shared experts (always active, a small share of the parameters), the router
(top-k selection flips on small score changes; the scores are fp32 already), embeddings and lm_head
(a gather and one GEMM; the logits feed the loss). `QATConfig.high_precision` names these parts; it
is informative -- QAT never touches them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from k3.config import ConfigError
from k3.quant.mxfp4 import fake_quant_mxfp4
from k3.quant.mxfp8 import fake_quant_mxfp8

__all__ = ["QATConfig", "HIGH_PRECISION", "apply_qat", "remove_qat", "qat_modules"]

WEIGHT_FORMATS = ("mxfp4",)
ACTIVATION_FORMATS = ("mxfp8",)
HIGH_PRECISION = ("attention", "shared_experts", "dense_mlp", "router", "latent_projections", "embeddings",
                  "lm_head", "vision")


@dataclass
class QATConfig:
    """Which fake quantisers `apply_qat` installs on the routed experts.

    weights: "mxfp4" or None; activations: "mxfp8" or None (the experts' GEMM inputs).
    high_precision: the parts that stay BF16 / fp32 (fixed: see the module docstring).
    """

    weights: str | None = "mxfp4"
    activations: str | None = None
    high_precision: tuple[str, ...] = field(default=HIGH_PRECISION)

    def validate(self) -> "QATConfig":
        if self.weights not in (None, *WEIGHT_FORMATS):
            raise ConfigError(f"qat weights={self.weights!r}: must be one of {list(WEIGHT_FORMATS)} or None")
        if self.activations not in (None, *ACTIVATION_FORMATS):
            raise ConfigError(f"qat activations={self.activations!r}: must be one of {list(ACTIVATION_FORMATS)} "
                              "or None")
        if tuple(self.high_precision) != HIGH_PRECISION:
            raise ConfigError(f"qat high_precision={self.high_precision!r}: only the routed experts are "
                              f"quantised; the rest stays high precision ({list(HIGH_PRECISION)})")
        return self

    @property
    def enabled(self) -> bool:
        return self.weights is not None or self.activations is not None

    @classmethod
    def parse(cls, spec: str | None) -> "QATConfig":
        """'mxfp4', 'mxfp4,mxfp8', 'mxfp8', '' / 'none' / None (off) -> QATConfig."""
        parts = [p.strip().lower() for p in (spec or "").split(",") if p.strip()]
        if parts == ["none"]:
            parts = []
        unknown = [p for p in parts if p not in WEIGHT_FORMATS + ACTIVATION_FORMATS]
        if unknown or len(set(parts)) != len(parts):
            raise ConfigError(f"--qat {spec!r}: expected a comma list of mxfp4 (expert weights) and mxfp8 "
                              "(expert activations), each at most once")
        return cls(weights="mxfp4" if "mxfp4" in parts else None,
                   activations="mxfp8" if "mxfp8" in parts else None).validate()

    def spec(self) -> str:
        """The inverse of `parse` ('' when off)."""
        return ",".join(p for p in (self.weights, self.activations) if p)


def qat_modules(model: nn.Module) -> list[nn.Module]:
    """The routed-expert modules of `model` (those with the `weight_transform` / `input_transform` hooks)."""
    return [m for m in model.modules() if hasattr(m, "weight_transform") and hasattr(m, "input_transform")]


def _hook(fmt: str | None, table: dict[str, Callable[[torch.Tensor], torch.Tensor]]):
    return None if fmt is None else table[fmt]


def apply_qat(model: nn.Module, cfg: QATConfig) -> int:
    """Install the fake quantisers of `cfg` on every routed-expert module of `model` (in place;
    replaces earlier ones; cfg with nothing enabled removes them). Returns the number of modules.

    Raises ValueError when the model has no routed experts but cfg asks for QAT, or when cfg fake-quantises
    weights that are already packed (a serving model; MXFP8 activations may be put on one)."""
    cfg.validate()
    mods = qat_modules(model)
    if cfg.enabled and not mods:
        raise ValueError("apply_qat: the model has no routed experts to quantise")
    for m in mods:
        if cfg.weights is not None and getattr(m, "packed", False):
            raise ValueError("apply_qat: the experts are stored packed (serving); load them unpacked to train")
        m.weight_transform = _hook(cfg.weights, {"mxfp4": fake_quant_mxfp4})
        m.input_transform = _hook(cfg.activations, {"mxfp8": fake_quant_mxfp8})
    return len(mods)


def remove_qat(model: nn.Module) -> None:
    """Remove every fake quantiser (e.g. to evaluate the same masters unquantised)."""
    for m in qat_modules(model):
        m.weight_transform = None
        m.input_transform = None
