"""Vision configuration and the media-token rule (issue 8), beside `k3.config` so that data, chat and
serving read it without importing the model. The modules live in ``k3.model.vision``.

Fields that the released ``vision_config`` dict leaves implicit have defaults derived from the
spec's tensor inventory (168 vision/projector tensors, ~401M tower parameters): no biases,
weight-only RMSNorm in the tower, a 64x64 learned position table and a ``patchmergerv2``
projector whose only norm is the RMSNorm after ``linear_2``. See docs/vision.md for the derivation.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "VisionConfig",
    "encoder_param_count",
    "num_media_tokens",
    "num_video_tokens",
    "tiny_vision_config",
]

_INTS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "head_dim", "intermediate_size", "patch_size",
         "text_hidden_size", "max_image_size", "temporal_pool", "init_pos_emb_height", "init_pos_emb_width")
_BOOLS = ("attn_bias", "linear_bias", "patch_embed_proj_bias")
_CHOICES = {"mm_projector_type": ("patchmergerv2",), "norm_type": ("rmsnorm", "layernorm"),
            "pos_emb_interpolation_mode": ("bicubic", "bilinear")}


@dataclass
class VisionConfig:
    """The official ``vision_config`` fields (plus defaults the released dict leaves implicit).

    ``head_dim`` defaults to 128: the released tower has qkv width 1536 = 12 heads x 128, which is
    not ``hidden_size / heads``. Unknown keys of the dict are kept in ``extra`` and written back.
    """

    model_type: str = "moonvit3d"
    num_hidden_layers: int = 27
    hidden_size: int = 1024
    num_attention_heads: int = 12
    head_dim: int = 128
    intermediate_size: int = 4096
    patch_size: int = 14
    merge_kernel_size: tuple[int, int] = (2, 2)
    mm_projector_type: str = "patchmergerv2"
    text_hidden_size: int = 7168
    rope_theta: float = 10000.0
    layer_norm_eps: float = 1e-6
    rms_norm_eps: float = 1e-5  # the projector's post_norm
    max_image_size: int = 3584
    temporal_pool: int = 2
    norm_type: str = "rmsnorm"  # tower norms: "rmsnorm" (weight only) or "layernorm" (weight + bias)
    attn_bias: bool = False
    linear_bias: bool = False
    patch_embed_proj_bias: bool = False
    init_pos_emb_height: int = 64
    init_pos_emb_width: int = 64
    pos_emb_interpolation_mode: str = "bicubic"
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None, text_hidden_size: int | None = None) -> VisionConfig:
        """Read ``K3Config.vision_config``. ``text_hidden_size`` fills the field when the dict lacks it."""
        if not isinstance(d, dict):
            raise ValueError(f"vision_config: expected a dict, got {type(d).__name__}")  # noqa: TRY004 (project: bad input -> ValueError)
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in d.items() if k in names}
        extra = {k: v for k, v in d.items() if k not in names}
        if "merge_kernel_size" in known:
            m = known["merge_kernel_size"]
            if not (isinstance(m, (list, tuple)) and len(m) == 2):
                raise ValueError(f"vision_config.merge_kernel_size: expected [mh, mw], got {m!r}")
            known["merge_kernel_size"] = (m[0], m[1])
        if "text_hidden_size" not in known and text_hidden_size is not None:
            known["text_hidden_size"] = text_hidden_size
        return cls(**known, extra=extra).validate()

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        out["merge_kernel_size"] = list(self.merge_kernel_size)
        out.update(self.extra)
        return out

    @property
    def merge_unit(self) -> tuple[int, int]:
        """Pixel granularity (rows, cols) that images are padded to: patch * merge."""
        return self.patch_size * self.merge_kernel_size[0], self.patch_size * self.merge_kernel_size[1]

    def validate(self) -> VisionConfig:
        for name in _INTS:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"vision_config.{name}: must be a positive int, got {v!r}")
        for v in self.merge_kernel_size:
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"vision_config.merge_kernel_size: entries must be positive ints, "
                                 f"got {self.merge_kernel_size!r}")
        if self.head_dim % 4:
            raise ValueError(f"vision_config.head_dim: 2-D RoPE needs a multiple of 4, got {self.head_dim}")
        for name, allowed in _CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"vision_config.{name}: must be one of {list(allowed)}, got {getattr(self, name)!r}")
        for name in _BOOLS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"vision_config.{name}: must be true or false, got {getattr(self, name)!r}")  # noqa: TRY004
        for name in ("rope_theta", "layer_norm_eps", "rms_norm_eps"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"vision_config.{name}: must be a positive number, got {v!r}")
        return self


def tiny_vision_config(text_hidden_size: int = 256) -> VisionConfig:
    """A CPU-sized tower (~0.12M parameters; projector ~0.13M at text hidden 256) with the full-size
    patch/merge geometry.

    The position table is 16x16 (not 64x64): at hidden 64 a 64x64 table alone would be 2.5x the
    rest of the tower, and CPU training images are only a few patches on a side.
    """
    return VisionConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, head_dim=16,
                        intermediate_size=128, text_hidden_size=text_hidden_size,
                        init_pos_emb_height=16, init_pos_emb_width=16).validate()


def _check_size(height: int, width: int, cfg: VisionConfig, where: str) -> None:
    for name, v in (("height", height), ("width", width)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{where}: {name} must be a positive int, got {v!r}")
    if height > cfg.max_image_size or width > cfg.max_image_size:
        raise ValueError(f"{where}: image {height}x{width} exceeds the maximum "
                         f"{cfg.max_image_size}x{cfg.max_image_size}; resize it first")


def num_media_tokens(height: int, width: int, cfg: VisionConfig) -> int:
    """Media tokens for one image: ``ceil(H / (p*mh)) * ceil(W / (p*mw))`` (p = 14, 2x2 merge -> 28).

    Equivalently: pad to a multiple of 28, take ``ceil(H/14) x ceil(W/14)`` patches (even counts
    after the padding), and divide by the 2x2 merge. Raises ValueError for non-positive sizes or
    sizes above ``cfg.max_image_size`` on either side.
    """
    _check_size(height, width, cfg, "num_media_tokens")
    uh, uw = cfg.merge_unit
    return -(-height // uh) * -(-width // uw)


def num_video_tokens(num_frames: int, height: int, width: int, cfg: VisionConfig) -> int:
    """Media tokens for a clip: ``ceil(T / temporal_pool) * num_media_tokens(H, W)``."""
    if isinstance(num_frames, bool) or not isinstance(num_frames, int) or num_frames <= 0:
        raise ValueError(f"num_video_tokens: num_frames must be a positive int, got {num_frames!r}")
    return -(-num_frames // cfg.temporal_pool) * num_media_tokens(height, width, cfg)


def encoder_param_count(cfg: VisionConfig) -> dict[str, int]:
    """Parameter counts of ``MoonViTEncoder(cfg)`` from shapes alone (nothing is allocated).

    Returns ``{"tower": ..., "projector": ..., "total": ...}``. Full size (defaults):
    tower 401,214,464 = patch embed 602,112 + position table 4,194,304 (64x64x1024)
    + 27 blocks x 14,682,112 + final norm 1,024; projector 46,144,512 (4096x4096 + 4096x7168 + 7168).
    """
    h, i, p = cfg.hidden_size, cfg.intermediate_size, cfg.patch_size
    w = cfg.num_attention_heads * cfg.head_dim
    nb = 2 if cfg.norm_type == "layernorm" else 1  # tensors per norm
    ab, lb = int(cfg.attn_bias), int(cfg.linear_bias)
    blk = 2 * nb * h + (h * 3 * w + ab * 3 * w) + (w * h + ab * h) + (h * i + lb * i) + (i * h + lb * h)
    patch = 3 * p * p * h + int(cfg.patch_embed_proj_bias) * h
    pos = cfg.init_pos_emb_height * cfg.init_pos_emb_width * h
    tower = patch + pos + cfg.num_hidden_layers * blk + nb * h
    m = h * cfg.merge_kernel_size[0] * cfg.merge_kernel_size[1]
    proj = m * m + m * cfg.text_hidden_size + cfg.text_hidden_size
    return {"tower": tower, "projector": proj, "total": tower + proj}
