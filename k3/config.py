"""Typed configuration that reads and writes the official Kimi K3 `config.json`.

The official file is a `kimi_k3` VLM config wrapping a `kimi_linear` text config. Every key is kept:
known keys become typed fields, unknown keys are carried verbatim in `extra` so a load -> save
round trip reproduces the file (and `rope_theta` is never injected).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable

from k3.kernel_config import KernelConfig
from k3.vision_config import VisionConfig, tiny_vision_config  # the typed view; K3Config keeps the raw dict


class ConfigError(ValueError):
    """An invalid configuration value; the message names the field and the rule."""


@dataclass
class LinearAttnConfig:
    """`text_config.linear_attn_config`: KDA geometry and the 1-based layer layout."""

    num_heads: int = 96
    head_dim: int = 128
    short_conv_kernel_size: int = 4
    use_full_rank_gate: bool = True
    gate_lower_bound: float | None = -5.0
    full_attn_layers: list[int] = field(default_factory=list)  # 1-based
    kda_layers: list[int] = field(default_factory=list)  # 1-based
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class TextConfig:
    """`text_config` (model_type "kimi_linear"). Defaults are the official Kimi K3 values."""

    vocab_size: int = 163840
    hidden_size: int = 7168
    num_hidden_layers: int = 93
    num_attention_heads: int = 96
    num_key_value_heads: int = 96
    intermediate_size: int = 33792
    hidden_act: str = "situ"
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float = 25.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 1048576
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_use_nope: bool = True
    mla_use_output_gate: bool = True
    num_experts: int = 896
    num_experts_per_token: int = 16
    num_shared_experts: int = 2
    moe_intermediate_size: int = 3072
    routed_expert_hidden_size: int = 3584
    latent_moe_use_norm: bool = True
    moe_router_activation_func: str = "sigmoid"
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    topk_method: str = "noaux_tc"
    use_grouped_topk: bool = True
    num_expert_group: int = 1
    topk_group: int = 1
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    attn_res_block_size: int = 12
    num_nextn_predict_layers: int = 0
    tie_word_embeddings: bool = False
    linear_attn_config: LinearAttnConfig = field(default_factory=LinearAttnConfig)
    extra: dict[str, Any] = field(default_factory=dict)

    # ---- derived layout -------------------------------------------------------------------
    @property
    def mla_layers(self) -> list[int]:
        """0-based indices of the Gated-MLA layers."""
        return sorted(i - 1 for i in self.linear_attn_config.full_attn_layers)

    def is_mla(self, layer: int) -> bool:
        return (layer + 1) in set(self.linear_attn_config.full_attn_layers)

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    @property
    def kda_num_heads(self) -> int:
        return self.linear_attn_config.num_heads

    @property
    def kda_head_dim(self) -> int:
        return self.linear_attn_config.head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def validate(self) -> "TextConfig":
        _validate_text(self)
        return self


@dataclass
class K3Config:
    """Top-level `kimi_k3` config: text model plus vision/quantisation kept as data."""

    text_config: TextConfig = field(default_factory=TextConfig)
    vision_config: dict[str, Any] | None = None
    quantization_config: dict[str, Any] | None = None
    bos_token_id: int = 163584
    eos_token_id: int = 163586
    pad_token_id: int = 163839
    media_placeholder_token_id: int = 163605
    image_placeholder: str = "<|kimi_image_placeholder|>"
    tie_word_embeddings: bool = False
    dtype: str = "bfloat16"
    model_type: str = "kimi_k3"
    architectures: list[str] = field(default_factory=lambda: ["KimiK3ForConditionalGeneration"])
    # Which hot regions run Triton kernels (k3.kernel_config); not part of the checkpoint format:
    # written to config.json only when it differs from the default.
    kernels: KernelConfig = field(default_factory=KernelConfig)
    extra: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> "K3Config":
        self.text_config.validate()
        t = self.text_config
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            v = getattr(self, name)
            if v is not None and not 0 <= v < t.vocab_size:
                raise ConfigError(f"{name}={v}: must be a token id in [0, vocab_size={t.vocab_size})")
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ConfigError(f"dtype={self.dtype!r}: must be one of bfloat16, float16, float32")
        if self.quantization_config is not None:
            _validate_quant(self.quantization_config, t)
        if self.vision_config is not None:
            _validate_vision(self)
        return self

    @property
    def experts_mxfp4(self) -> bool:
        """True when routed experts are stored MXFP4-packed (compressed-tensors)."""
        q = self.quantization_config
        return bool(q) and q.get("format") == "mxfp4-pack-quantized"

    # ---- (de)serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return _config_to_dict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "K3Config":
        return _config_from_dict(d)

    def save(self, path: str | os.PathLike) -> None:
        """Write `config.json` (a file path or a directory) atomically."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "K3Config":
        """Read a `config.json` (file or directory). A bare `kimi_linear` text config is accepted too."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.exists(path):
            raise FileNotFoundError(f"no config.json at {path}")
        with open(path) as f:
            try:
                d = json.load(f)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(d)


# ---------------------------------------------------------------------------------------------
# (de)serialisation helpers


def _split_known(cls, d: dict[str, Any], where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
    known = {k: v for k, v in d.items() if k in names}
    extra = {k: copy.deepcopy(v) for k, v in d.items() if k not in names}
    return known, extra


def _typed(cls, known: dict[str, Any], where: str) -> dict[str, Any]:
    """Check the JSON types of known fields against the dataclass annotations."""
    out = {}
    hints = {f.name: f.type for f in dataclasses.fields(cls)}
    for k, v in known.items():
        h = str(hints[k])
        ok = True
        if h.startswith("int") and "None" not in h:
            ok = isinstance(v, int) and not isinstance(v, bool)
        elif h.startswith("float") and "None" not in h:
            ok = isinstance(v, (int, float)) and not isinstance(v, bool)
            v = float(v) if ok else v
        elif h == "bool":
            ok = isinstance(v, bool)
        elif h == "str":
            ok = isinstance(v, str)
        elif h.startswith("list[int]"):
            ok = isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
        if not ok:
            raise ConfigError(f"{where}.{k}={v!r}: expected {h}")
        out[k] = v
    return out


def _config_from_dict(d: dict[str, Any]) -> K3Config:
    if not isinstance(d, dict):
        raise ConfigError("config: expected a JSON object")
    if d.get("model_type") == "kimi_linear":  # a bare text config (e.g. Kimi-Linear or a text-only export)
        d = {"text_config": d, "model_type": "kimi_k3"}
    if "text_config" not in d:
        raise ConfigError("config: missing field 'text_config' (expected a kimi_k3 config)")
    t = dict(d["text_config"])
    lac = t.pop("linear_attn_config", None)
    if lac is None:
        raise ConfigError("text_config.linear_attn_config: missing (K3 needs the KDA/MLA layout)")
    lac_known, lac_extra = _split_known(LinearAttnConfig, lac, "text_config.linear_attn_config")
    lin = LinearAttnConfig(**_typed(LinearAttnConfig, lac_known, "text_config.linear_attn_config"), extra=lac_extra)
    t_known, t_extra = _split_known(TextConfig, t, "text_config")
    text = TextConfig(**_typed(TextConfig, t_known, "text_config"), linear_attn_config=lin, extra=t_extra)
    top = {k: v for k, v in d.items() if k != "text_config"}
    top_known, top_extra = _split_known(K3Config, top, "config")
    if "kernels" in top_known:
        try:
            top_known["kernels"] = KernelConfig.from_dict(top_known["kernels"])
        except ValueError as e:
            raise ConfigError(f"config.{e}") from None
    for k in ("vision_config", "quantization_config"):
        if k in top_known and top_known[k] is not None and not isinstance(top_known[k], dict):
            raise ConfigError(f"config.{k}: expected an object")
    cfg = K3Config(text_config=text, **top_known, extra=top_extra)
    return cfg.validate()


def _config_to_dict(cfg: K3Config) -> dict[str, Any]:
    t = cfg.text_config
    lin = t.linear_attn_config
    lin_d = {f.name: copy.deepcopy(getattr(lin, f.name)) for f in dataclasses.fields(lin) if f.name != "extra"}
    lin_d.update(copy.deepcopy(lin.extra))
    t_d: dict[str, Any] = {}
    for f in dataclasses.fields(t):
        if f.name in ("extra", "linear_attn_config"):
            continue
        t_d[f.name] = copy.deepcopy(getattr(t, f.name))
    t_d["linear_attn_config"] = lin_d
    t_d.update(copy.deepcopy(t.extra))
    t_d.setdefault("model_type", "kimi_linear")
    t_d.setdefault("architectures", ["KimiLinearForCausalLM"])
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        if f.name in ("extra", "text_config"):
            continue
        v = getattr(cfg, f.name)
        if v is None and f.name in ("vision_config", "quantization_config"):
            continue
        if f.name == "kernels":
            if v != KernelConfig():
                out["kernels"] = v.to_dict()
            continue
        out[f.name] = copy.deepcopy(v)
    out["text_config"] = t_d
    out.update(copy.deepcopy(cfg.extra))
    return out


# ---------------------------------------------------------------------------------------------
# validation


def _require(cond: bool, field_name: str, value: Any, rule: str) -> None:
    if not cond:
        raise ConfigError(f"{field_name}={value!r}: {rule}")


def _validate_text(t: TextConfig) -> None:
    p = "text_config"
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                 "qk_nope_head_dim", "v_head_dim", "num_experts", "num_experts_per_token",
                 "moe_intermediate_size", "routed_expert_hidden_size", "attn_res_block_size", "moe_layer_freq"):
        _require(getattr(t, name) > 0, f"{p}.{name}", getattr(t, name), "must be a positive integer")
    _require(t.qk_rope_head_dim >= 0, f"{p}.qk_rope_head_dim", t.qk_rope_head_dim, "must be >= 0")
    _require(t.intermediate_size > 0 or t.first_k_dense_replace == 0, f"{p}.intermediate_size",
             t.intermediate_size, "must be positive when first_k_dense_replace > 0")
    _require(t.q_lora_rank is None or t.q_lora_rank > 0, f"{p}.q_lora_rank", t.q_lora_rank, "must be positive or null")
    _require(t.hidden_act in ("situ", "silu"), f"{p}.hidden_act", t.hidden_act, "must be 'situ' or 'silu'")
    _require(t.activation_situ_beta > 0 and t.activation_situ_linear_beta > 0, f"{p}.activation_situ_beta",
             (t.activation_situ_beta, t.activation_situ_linear_beta), "SiTU betas must be positive")
    _require(0 < t.rms_norm_eps < 1, f"{p}.rms_norm_eps", t.rms_norm_eps, "must be in (0, 1)")
    _require(t.num_key_value_heads == t.num_attention_heads, f"{p}.num_key_value_heads", t.num_key_value_heads,
             f"MLA needs num_key_value_heads == num_attention_heads ({t.num_attention_heads})")
    _require(t.mla_use_nope, f"{p}.mla_use_nope", t.mla_use_nope, "only NoPE MLA (true) is supported")
    _require(t.num_experts_per_token <= t.num_experts, f"{p}.num_experts_per_token", t.num_experts_per_token,
             f"must be <= num_experts ({t.num_experts})")
    _require(t.num_shared_experts >= 0, f"{p}.num_shared_experts", t.num_shared_experts, "must be >= 0")
    _require(t.moe_router_activation_func == "sigmoid", f"{p}.moe_router_activation_func",
             t.moe_router_activation_func, "only 'sigmoid' is supported")
    _require(t.topk_method == "noaux_tc", f"{p}.topk_method", t.topk_method, "only 'noaux_tc' is supported")
    _require(t.num_expert_group == 1 and t.topk_group == 1, f"{p}.num_expert_group",
             (t.num_expert_group, t.topk_group), "grouped routing is not used by K3; both must be 1")
    _require(t.first_k_dense_replace >= 0, f"{p}.first_k_dense_replace", t.first_k_dense_replace, "must be >= 0")
    _require(t.num_nextn_predict_layers == 0, f"{p}.num_nextn_predict_layers", t.num_nextn_predict_layers,
             "MTP heads are not in the K3 checkpoint; must be 0")
    _require(not t.tie_word_embeddings, f"{p}.tie_word_embeddings", t.tie_word_embeddings,
             "K3 has untied embeddings and lm_head")
    lin = t.linear_attn_config
    lp = f"{p}.linear_attn_config"
    _require(lin.num_heads > 0 and lin.head_dim > 0, f"{lp}.num_heads/head_dim", (lin.num_heads, lin.head_dim),
             "must be positive")
    _require(lin.short_conv_kernel_size >= 1, f"{lp}.short_conv_kernel_size", lin.short_conv_kernel_size, "must be >= 1")
    _require(lin.use_full_rank_gate, f"{lp}.use_full_rank_gate", lin.use_full_rank_gate,
             "K3 uses the full-rank g_proj output gate (true)")
    _require(lin.gate_lower_bound is None or -5.0 <= lin.gate_lower_bound < 0.0, f"{lp}.gate_lower_bound",
             lin.gate_lower_bound, "must be in [-5, 0) or null (Kimi-Linear softplus gate)")
    L = t.num_hidden_layers
    full, kda = lin.full_attn_layers, lin.kda_layers
    for name, lst in (("full_attn_layers", full), ("kda_layers", kda)):
        bad = [i for i in lst if not 1 <= i <= L]
        _require(not bad, f"{lp}.{name}", bad, f"1-based layer numbers must be in [1, {L}]")
        _require(len(set(lst)) == len(lst), f"{lp}.{name}", lst, "has duplicates")
    _require(len(full) + len(kda) == L and not set(full) & set(kda), f"{lp}.full_attn_layers/kda_layers",
             (len(full), len(kda)), f"must partition the {L} layers (1-based, disjoint)")


def _validate_vision(cfg: K3Config) -> None:
    v = VisionConfig.from_dict(cfg.vision_config, text_hidden_size=cfg.text_config.hidden_size)
    _require(v.text_hidden_size == cfg.text_config.hidden_size, "vision_config.text_hidden_size",
             v.text_hidden_size, f"must equal text_config.hidden_size ({cfg.text_config.hidden_size})")
    m = cfg.media_placeholder_token_id
    _require(isinstance(m, int) and 0 <= m < cfg.text_config.vocab_size, "media_placeholder_token_id", m,
             f"must be a token id in [0, vocab_size={cfg.text_config.vocab_size}) for a vision model")


def _validate_quant(q: dict[str, Any], t: TextConfig) -> None:
    fmt = q.get("format")
    if fmt != "mxfp4-pack-quantized":
        raise ConfigError(f"quantization_config.format={fmt!r}: only 'mxfp4-pack-quantized' is supported")
    for name in ("moe_intermediate_size", "routed_expert_hidden_size"):
        v = getattr(t, name)
        _require(v % 32 == 0, f"text_config.{name}", v, "must be a multiple of 32 for MXFP4 experts")


# ---------------------------------------------------------------------------------------------
# presets


def _layout(num_layers: int, mla_1based: list[int]) -> LinearAttnConfig:
    kda = [i for i in range(1, num_layers + 1) if i not in set(mla_1based)]
    return LinearAttnConfig(full_attn_layers=list(mla_1based), kda_layers=kda)


def kimi_k3() -> K3Config:
    """The official full-size Kimi K3 config (values of the released config.json)."""
    lin = _layout(93, list(range(4, 93, 4)) + [93])
    text = TextConfig(linear_attn_config=lin, extra={"transformers_version": "4.56.2"})
    quant = {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32,
                            "symmetric": True, "scale_dtype": "torch.uint8"},
                "input_activations": None,
            }
        },
        "ignore": [r"re:.*self_attn.*", r"re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
                   r"re:.*lm_head.*", r"re:.*vision_tower.*", r"re:.*mm_projector.*"],
    }
    vision = {
        "model_type": "moonvit3d", "num_hidden_layers": 27, "hidden_size": 1024, "num_attention_heads": 12,
        "intermediate_size": 4096, "patch_size": 14, "merge_kernel_size": [2, 2],
        "mm_projector_type": "patchmergerv2", "text_hidden_size": 7168,
    }
    return K3Config(text_config=text, quantization_config=quant, vision_config=vision).validate()


def k3_tiny() -> K3Config:
    """~13M parameters for 2 CPU cores; every structural feature of K3 is present:
    dense layer 0, KDA + MLA (last layer MLA), 2 AttnRes blocks, LatentMoE with a shared expert."""
    lin = _layout(6, [3, 6])
    lin.num_heads, lin.head_dim = 4, 64
    text = TextConfig(
        vocab_size=4096, hidden_size=256, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=768, q_lora_rank=192, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32,
        v_head_dim=64, num_experts=32, num_experts_per_token=4, num_shared_experts=1, moe_intermediate_size=128,
        routed_expert_hidden_size=128, attn_res_block_size=3, max_position_embeddings=65536,
        linear_attn_config=lin,
    )
    return _small_ids(K3Config(text_config=text), 4096).validate()


def k3_tiny_vl() -> K3Config:
    """k3-tiny plus a CPU-sized MoonViT tower (2 layers, hidden 64) and patchmergerv2 projector into
    the 256-wide text model; media ids are k3's own tokenizer specials (pad = base + 21)."""
    cfg = k3_tiny()
    cfg.vision_config = tiny_vision_config(cfg.text_config.hidden_size).to_dict()
    return cfg.validate()


def k3_small() -> K3Config:
    """~0.8B total parameters for one GPU, K3 proportions scaled down."""
    lin = _layout(12, [4, 8, 12])
    lin.num_heads, lin.head_dim = 8, 128
    text = TextConfig(
        vocab_size=32768, hidden_size=1024, num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=8,
        intermediate_size=4096, q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, num_experts=64, num_experts_per_token=8, num_shared_experts=1, moe_intermediate_size=512,
        routed_expert_hidden_size=512, attn_res_block_size=4, max_position_embeddings=262144,
        linear_attn_config=lin,
    )
    return _small_ids(K3Config(text_config=text), 32768).validate()


def _small_ids(cfg: K3Config, vocab: int) -> K3Config:
    """k3's own tokenizers put the 256 official special tokens at the last 256 ids, same order."""
    base = vocab - 256
    cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = base + 0, base + 2, base + 255
    cfg.media_placeholder_token_id = base + 21
    return cfg


PRESETS: dict[str, Callable[[], K3Config]] = {
    "kimi-k3": kimi_k3,
    "k3-tiny": k3_tiny,
    "k3-tiny-vl": k3_tiny_vl,
    "k3-small": k3_small,
}


def get_preset(name: str) -> K3Config:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    return PRESETS[name]()


def apply_overrides(cfg: K3Config, overrides: dict[str, Any]) -> K3Config:
    """Apply `{"text_config": {...}, ...}` (or flat text-config keys) overrides and re-validate."""
    d = cfg.to_dict()
    text = d["text_config"]

    def set_text(key: str, value: Any) -> None:
        if key == "linear_attn_config" and isinstance(value, dict):
            text["linear_attn_config"].update(value)  # merge: keep the layout unless it is overridden
        else:
            text[key] = value

    top_level = {f.name for f in dataclasses.fields(K3Config)} - {"text_config"}
    for k, v in overrides.items():
        if k == "text_config" and isinstance(v, dict):
            for tk, tv in v.items():
                set_text(tk, tv)
        elif k in top_level:
            d[k] = v
        else:
            set_text(k, v)
    return K3Config.from_dict(d)
