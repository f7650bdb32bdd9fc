"""Training configuration: a typed dataclass, TOML/JSON overrides, and the context-extension stages."""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib
from dataclasses import dataclass, field
from typing import Any

from k3.config import ConfigError
from k3.optim.balance_baselines import BALANCING_METHODS


@dataclass
class Stage:
    """One stage of progressive context extension: rows of `seq_len` tokens for `fraction` of the run."""

    seq_len: int
    fraction: float


@dataclass
class TrainConfig:
    """Everything `k3 train` needs besides the model config (which comes from `preset` + `model`).

    tokens_per_step stays constant across stages: batch size = tokens_per_step // seq_len.
    Learning rates follow warmup-stable-decay: linear warmup, flat, then linear decay to
    `min_lr_ratio * lr` over the last `decay_fraction` of the steps.
    """

    preset: str = "k3-tiny"
    model: dict[str, Any] = field(default_factory=dict)  # overrides of the model config (text_config keys)
    data: str | None = None  # None = the Python stdlib source of the running interpreter
    out: str | None = None
    max_steps: int = 170
    seed: int = 0
    deterministic: bool = False
    tokens_per_step: int = 2048
    # Tokens per forward/backward: a step accumulates gradients over micro-batches of
    # max(1, micro_batch_tokens // seq_len) rows (None = the whole step in one forward).
    micro_batch_tokens: int | None = None
    # Tiny default, scaled down from K3's 8K -> 64K -> 256K -> 1M.
    stages: list[Stage] = field(default_factory=lambda: [Stage(128, 0.6), Stage(512, 0.25), Stage(2048, 0.15)])
    lr: float = 4e-3  # Muon (update RMS matched to AdamW, so the same scale as AdamW's)
    adamw_lr: float = 4e-3
    weight_decay: float = 0.1
    warmup_steps: int = 10
    decay_fraction: float = 0.3
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    val_fraction: float = 0.01
    eval_every: int = 40
    eval_tokens: int = 16384
    eval_seq_len: int = 128
    save_every: int = 100
    log_every: int = 1
    vocab_size: int | None = None  # tokenizer vocab; default = the model's vocab_size
    tokenizer: str | None = None  # an existing tokenizer dir (e.g. with the official tiktoken.model)
    # MoE router balancing (k3.optim.balance_baselines): "quantile" (Quantile Balancing, histogram
    # estimator), "quantile_exact" (exact order statistic; one process), "sign" (DeepSeek-V3's
    # aux-loss-free b += rate*sign(mean - load)), "none" (loads are still logged). bias_update_rate:
    # the QB damping in (0, 1] (default 1) or the sign step (default 1e-3). quantile_balancing=False
    # (the older switch) means "none".
    balancing: str = "quantile"
    bias_update_rate: float | None = None
    quantile_balancing: bool = True
    qb_bins: int = 256
    activation_checkpointing: bool = False
    compile: bool = False
    # CPU only: train like on CUDA, with bf16 autocast (the model's matmuls and attention; fp32 master
    # weights, losses, KDA recurrence and expert GEMMs) and Muon's Newton-Schulz in bf16: faster on CPUs
    # with native bf16 (AVX512-BF16 or AMX; docs/training.md); False = fp32 throughout. CUDA always trains
    # this way.
    cpu_bf16: bool = False
    # Quantisation-aware training of the routed experts (k3.quant.qat): "mxfp4" (weights), "mxfp4,mxfp8"
    # (+ the experts' input activations) or None. The final export then stores the experts packed MXFP4.
    qat: str | None = None
    device: str | None = None  # default: cuda if available else cpu
    cache_dir: str | None = None  # tokenised-corpus cache; default ~/.cache/k3
    # Vision-language models only (the model config has a vision_config): each step also trains on
    # `vision_batch_size` generated image-question-answer chats (k3.data.synth_vision), loss weight
    # `vision_loss_weight`; a held-out multiple-choice evaluation runs at the end.
    vision_batch_size: int = 16
    vision_loss_weight: float = 1.0
    vision_train_examples: int = 4000
    vision_eval_examples: int = 300
    vision_image_size: list[int] = field(default_factory=lambda: [56, 112])
    # generator kinds -> relative frequency (colour / shape / count carry the scored questions)
    vision_kinds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(
        ("colour", "shape", "count", "plot", "code"), 1.0))

    def validate(self) -> "TrainConfig":
        def bad(name: str, rule: str) -> None:
            raise ConfigError(f"train config {name}={getattr(self, name)!r}: {rule}")

        if self.max_steps < 1:
            bad("max_steps", "must be >= 1")
        for name in ("activation_checkpointing", "compile", "cpu_bf16"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "must be true or false")
        if not self.stages:
            bad("stages", "needs at least one stage")
        if abs(sum(s.fraction for s in self.stages) - 1.0) > 1e-6:
            bad("stages", "fractions must sum to 1")
        for s in self.stages:
            if s.seq_len < 2 or self.tokens_per_step % s.seq_len:
                bad("stages", f"seq_len {s.seq_len} must be >= 2 and divide tokens_per_step={self.tokens_per_step}")
        if self.micro_batch_tokens is not None and (not isinstance(self.micro_batch_tokens, int)
                                                    or not 1 <= self.micro_batch_tokens <= self.tokens_per_step):
            bad("micro_batch_tokens", f"must be None or an int in [1, tokens_per_step={self.tokens_per_step}]")
        if self.lr <= 0 or self.adamw_lr <= 0:
            bad("lr", "learning rates must be positive")
        if not 0 <= self.decay_fraction <= 1:
            bad("decay_fraction", "must be in [0, 1]")
        if not 0 < self.val_fraction < 1:
            bad("val_fraction", "must be in (0, 1)")
        if self.grad_clip < 0:
            bad("grad_clip", "must be >= 0 (0 = off)")
        if self.balancing not in BALANCING_METHODS:
            bad("balancing", f"must be one of {BALANCING_METHODS}")
        if self.bias_update_rate is not None and not (
                self.bias_update_rate > 0 and (self.bias_update_rate <= 1 or self.balancing == "sign")):
            bad("bias_update_rate", "must be None or > 0 (and <= 1 for quantile balancing)")
        for name in ("vision_batch_size", "vision_train_examples", "vision_eval_examples"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                bad(name, "must be a positive int")
        if self.vision_train_examples < self.vision_batch_size:
            bad("vision_train_examples", f"must be >= vision_batch_size ({self.vision_batch_size})")
        if self.vision_loss_weight < 0:
            bad("vision_loss_weight", "must be >= 0")
        if len(self.vision_image_size) != 2 or not 28 <= self.vision_image_size[0] <= self.vision_image_size[1]:
            bad("vision_image_size", "must be [min_side, max_side] with 28 <= min_side <= max_side")
        if self.qat is not None:
            from k3.quant.qat import QATConfig

            QATConfig.parse(self.qat)  # raises ConfigError naming the flag
        freqs = list(self.vision_kinds.values()) if isinstance(self.vision_kinds, dict) else []
        if not freqs or any(not isinstance(w, (int, float)) or w < 0 for w in freqs) or sum(freqs) <= 0:
            bad("vision_kinds", "must map generator kinds to non-negative frequencies with a positive sum")
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainConfig":
        """Keys of `d` override the preset's training defaults (PRESET_DEFAULTS), which override
        the dataclass defaults."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(f"unknown train config keys {unknown}; known: {sorted(names)}")
        d = PRESET_DEFAULTS.get(d.get("preset", cls.preset), {}) | dict(d)
        if "stages" in d:
            d["stages"] = [s if isinstance(s, Stage) else Stage(**s) for s in d["stages"]]
        return cls(**d)


# Training defaults of presets whose defaults differ from k3-tiny's. k3-tiny-vl: few text tokens
# and many image chats per step (the optimizer step is a fixed ~1.3 s on CPU, so big steps pay),
# vision loss weighted 2 (its mean spreads over the answer and ~8 closing-tag tokens), 56 x 56
# images (4 media tokens: cheap rows, and one patch grid for every image), count and shape asked
# more often than colour (which is learnt first), plots and rendered code at a low frequency
# (long answers, not scored). See docs/vision.md for the runs.
#
# k3-small: the single-H200 recipe: 512K tokens per step in 64K-token micro-batches (where one H200
# runs it fastest, docs/benchmarks.md), 8K -> 32K -> 64K context, compiled regions; ~2.1B tokens,
# about 4 hours at the measured ~160K tokens/s. It needs a real corpus (--data): the default stdlib
# corpus is read many times over (the data line says how many).
# kimi-k3: the full K3 schedule 8K -> 64K -> 256K -> 1M at 16M tokens per step, for torchrun with
# FSDP2 / EP / CP. Moonshot has not published K3's optimisation hyperparameters: the learning rate,
# warmup and stage fractions here are a starting point in the range public Muon runs of this size
# use, not the official values.
PRESET_DEFAULTS: dict[str, dict[str, Any]] = {
    # k3-tiny is the CPU recipe: bf16 autocast and bf16 Newton-Schulz on the CPU (docs/training.md); the
    # dataclass defaults are otherwise k3-tiny's.
    "k3-tiny": {"cpu_bf16": True},
    "k3-small": {
        "max_steps": 4000, "tokens_per_step": 1 << 19, "micro_batch_tokens": 1 << 16,
        "stages": [{"seq_len": 8192, "fraction": 0.8}, {"seq_len": 32768, "fraction": 0.15},
                   {"seq_len": 65536, "fraction": 0.05}],
        "lr": 2e-3, "adamw_lr": 2e-3, "warmup_steps": 200, "eval_every": 250, "eval_tokens": 1 << 20,
        "eval_seq_len": 8192, "save_every": 500, "compile": True,
    },
    "kimi-k3": {
        "max_steps": 500_000, "tokens_per_step": 1 << 24, "micro_batch_tokens": 1 << 20,
        "stages": [{"seq_len": 8192, "fraction": 0.9}, {"seq_len": 65536, "fraction": 0.07},
                   {"seq_len": 262144, "fraction": 0.02}, {"seq_len": 1 << 20, "fraction": 0.01}],
        "lr": 2e-4, "adamw_lr": 2e-4, "warmup_steps": 2000, "decay_fraction": 0.2, "eval_every": 2000,
        "eval_tokens": 1 << 24, "eval_seq_len": 8192, "save_every": 1000, "compile": True,
    },
    "k3-tiny-vl": {
        "max_steps": 200, "tokens_per_step": 256, "stages": [{"seq_len": 128, "fraction": 1.0}],
        "warmup_steps": 10, "eval_every": 100, "eval_tokens": 4096,
        "vision_batch_size": 32, "vision_loss_weight": 2.0, "vision_image_size": [56, 56],
        "vision_kinds": {"colour": 0.4, "shape": 1.3, "count": 1.4, "plot": 0.05, "code": 0.05},
    },
}


def load_overrides(path: str | os.PathLike) -> dict[str, Any]:
    """Read a JSON or TOML file of overrides: top-level TrainConfig keys, plus a `model` table of
    model-config overrides."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        data = f.read()
    try:
        return tomllib.loads(data.decode()) if path.endswith(".toml") else json.loads(data)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot parse overrides ({e})") from None


def stage_at(cfg: TrainConfig, step: int) -> int:
    """Index of the context-extension stage that contains optimizer step `step` (0-based)."""
    edge = 0.0
    for i, s in enumerate(cfg.stages):
        edge += s.fraction * cfg.max_steps
        if step < round(edge):
            return i
    return len(cfg.stages) - 1


def lr_factor(cfg: TrainConfig, step: int) -> float:
    """Warmup-stable-decay multiplier for optimizer step `step` (0-based)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    decay_start = cfg.max_steps * (1 - cfg.decay_fraction)
    if step < decay_start or cfg.decay_fraction == 0:
        return 1.0
    t = (step - decay_start) / max(1.0, cfg.max_steps - decay_start)
    return 1.0 - (1.0 - cfg.min_lr_ratio) * min(1.0, t)
