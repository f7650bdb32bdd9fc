"""MoonViT-style native-resolution vision encoder and ``patchmergerv2`` projector (issue 8, part 1).

Pipeline for one image ``[3, H, W]`` (see docs/vision.md for the exact rules):

1. zero-pad bottom/right to a multiple of ``patch * merge`` (28 at full size), no resize;
2. cut into ``patch x patch`` patches (row-major over the patch grid) and embed them with a
   Conv2d-shaped weight applied as a linear map over each flattened ``(C, ph, pw)`` patch;
3. pre-norm transformer blocks; positions enter only through 2-D RoPE (half of each head's
   channels rotate with the patch row, half with the patch column); attention never crosses
   image boundaries (block-diagonal over ``cu_seqlens`` when several images are packed);
4. 2x2 patch merge (the 4 patches of each 2x2 window are concatenated, 4 * hidden wide);
5. projector: RMSNorm per patch, Linear(4h, 4h), GELU, Linear(4h, text_hidden).

Video: every frame is encoded as an image, then consecutive frame pairs are averaged (an odd
last frame stands alone) before the merge, so a clip of T frames gives ``ceil(T / 2)`` frames
worth of media tokens.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from k3.model.common import rms_norm

__all__ = [
    "MoonViTEncoder",
    "PatchMergerV2",
    "VisionConfig",
    "encoder_param_count",
    "merge_windows",
    "num_media_tokens",
    "num_video_tokens",
    "patchify",
    "rope_2d",
    "tiny_vision_config",
]


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
    rms_norm_eps: float = 1e-5
    max_image_size: int = 3584
    temporal_pool: int = 2
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
        ints = ("num_hidden_layers", "hidden_size", "num_attention_heads", "head_dim", "intermediate_size",
                "patch_size", "text_hidden_size", "max_image_size", "temporal_pool")
        for name in ints:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"vision_config.{name}: must be a positive int, got {v!r}")
        for v in self.merge_kernel_size:
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"vision_config.merge_kernel_size: entries must be positive ints, "
                                 f"got {self.merge_kernel_size!r}")
        if self.head_dim % 4:
            raise ValueError(f"vision_config.head_dim: 2-D RoPE needs a multiple of 4, got {self.head_dim}")
        if self.mm_projector_type != "patchmergerv2":
            raise ValueError(f"vision_config.mm_projector_type: only 'patchmergerv2' is supported, "
                             f"got {self.mm_projector_type!r}")
        for name in ("rope_theta", "layer_norm_eps", "rms_norm_eps"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"vision_config.{name}: must be a positive number, got {v!r}")
        return self


def tiny_vision_config(text_hidden_size: int = 256) -> VisionConfig:
    """A CPU-sized tower (~0.2M parameters) with the full-size patch/merge geometry."""
    return VisionConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, head_dim=16,
                        intermediate_size=128, text_hidden_size=text_hidden_size).validate()


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


def _check_image(img: torch.Tensor, cfg: VisionConfig, where: str) -> None:
    if not isinstance(img, torch.Tensor) or img.dim() != 3 or img.shape[0] != 3:
        shape = tuple(img.shape) if isinstance(img, torch.Tensor) else type(img).__name__
        raise ValueError(f"{where}: expected a float tensor [3, H, W], got {shape}")
    if not img.is_floating_point():
        raise ValueError(f"{where}: expected a float tensor (normalised pixels), got {img.dtype}")
    _check_size(int(img.shape[1]), int(img.shape[2]), cfg, where)


def patchify(img: torch.Tensor, cfg: VisionConfig) -> tuple[torch.Tensor, int, int]:
    """Zero-pad ``img [3, H, W]`` to the merge unit and cut it into patches.

    Returns ``(patches [gh*gw, 3*p*p], gh, gw)``: row-major over the patch grid, each patch
    flattened in ``(C, ph, pw)`` order (the Conv2d weight layout). ``gh``/``gw`` are even for 2x2.
    """
    uh, uw = cfg.merge_unit
    p = cfg.patch_size
    h, w = img.shape[1], img.shape[2]
    img = F.pad(img, (0, -(-w // uw) * uw - w, 0, -(-h // uh) * uh - h))
    gh, gw = img.shape[1] // p, img.shape[2] // p
    x = img.reshape(3, gh, p, gw, p).permute(1, 3, 0, 2, 4).reshape(gh * gw, 3 * p * p)
    return x, gh, gw


def rope_2d(x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, theta: float) -> torch.Tensor:
    """2-D rotary embedding. x: [N, heads, d] (d % 4 == 0); rows, cols: [N] integer positions.

    Channels ``[0, d/2)`` rotate with the row, ``[d/2, d)`` with the column (rotate-half pairing
    within each half). Computed in fp32, returned in x's dtype.
    """
    d = x.shape[-1]
    q = d // 4
    inv = theta ** (-torch.arange(q, device=x.device, dtype=torch.float32) / q)
    xf = x.float()

    def rot(part: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        ang = pos.to(torch.float32)[:, None] * inv  # [N, q]
        c, s = ang.cos()[:, None, :], ang.sin()[:, None, :]
        a, b = part[..., :q], part[..., q:]
        return torch.cat((a * c - b * s, a * s + b * c), dim=-1)

    return torch.cat((rot(xf[..., : 2 * q], rows), rot(xf[..., 2 * q:], cols)), dim=-1).to(x.dtype)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.heads, self.head_dim, self.theta = cfg.num_attention_heads, cfg.head_dim, cfg.rope_theta
        width = cfg.num_attention_heads * cfg.head_dim
        self.wqkv = nn.Linear(cfg.hidden_size, 3 * width)
        self.wo = nn.Linear(width, cfg.hidden_size)

    def forward(self, x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
                cu_seqlens: torch.Tensor) -> torch.Tensor:
        """x: [N, hidden] (several images packed); cu_seqlens: [n_images + 1] int64 boundaries."""
        n = x.shape[0]
        q, k, v = self.wqkv(x).view(n, 3, self.heads, self.head_dim).unbind(1)
        q, k = rope_2d(q, rows, cols, self.theta), rope_2d(k, rows, cols, self.theta)
        lens = cu_seqlens[1:] - cu_seqlens[:-1]
        seg = torch.repeat_interleave(torch.arange(lens.numel(), device=x.device), lens)
        # Block-diagonal mask: a patch attends only to patches of its own image/frame.
        mask = seg[:, None] == seg[None, :]
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           attn_mask=mask)
        return self.wo(o.transpose(0, 1).reshape(n, self.heads * self.head_dim))


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.fc0 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc1 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(F.gelu(self.fc0(x), approximate="tanh"))


class VisionBlock(nn.Module):
    """Pre-norm block: x + attn(LN(x)); x + mlp(LN(x))."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm0 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.attn = VisionAttention(cfg)
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
                cu_seqlens: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm0(x), rows, cols, cu_seqlens)
        return x + self.mlp(self.norm1(x))


class PatchMergerV2(nn.Module):
    """``patchmergerv2`` projector: RMSNorm(hidden) per patch, concat the mh*mw window, then
    Linear(mh*mw*hidden -> same), GELU, Linear(-> text_hidden). Full size: 4096 -> 4096 -> 7168."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.eps = cfg.rms_norm_eps
        width = cfg.hidden_size * cfg.merge_kernel_size[0] * cfg.merge_kernel_size[1]
        self.pre_norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.linear_1 = nn.Linear(width, width)
        self.linear_2 = nn.Linear(width, cfg.text_hidden_size)

    def forward(self, windows: torch.Tensor) -> torch.Tensor:
        """windows: [tokens, mh*mw, hidden] -> [tokens, text_hidden]."""
        x = rms_norm(windows, self.pre_norm, self.eps).flatten(1)
        return self.linear_2(F.gelu(self.linear_1(x)))


def merge_windows(x: torch.Tensor, gh: int, gw: int, merge: tuple[int, int]) -> torch.Tensor:
    """x: [gh*gw, D] row-major patches -> [(gh/mh)*(gw/mw), mh*mw, D] (merged tokens row-major)."""
    mh, mw = merge
    d = x.shape[-1]
    x = x.view(gh // mh, mh, gw // mw, mw, d).permute(0, 2, 1, 3, 4)
    return x.reshape((gh // mh) * (gw // mw), mh * mw, d)


class MoonViTEncoder(nn.Module):
    """Vision tower + projector. Images in, media-token embeddings (text hidden size) out."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        p = cfg.patch_size
        # Conv2d-shaped so the weight has the layout of a stride-p convolution; applied as a linear map.
        self.patch_embed = nn.Conv2d(3, cfg.hidden_size, kernel_size=p, stride=p)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.num_hidden_layers))
        self.final_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mm_projector = PatchMergerV2(cfg)

    def _tower(self, patches: list[tuple[torch.Tensor, int, int]]) -> list[torch.Tensor]:
        """Embed and encode packed patch grids; returns per-grid features [gh*gw, hidden]."""
        dev = self.patch_embed.weight.device
        lens = [gh * gw for _, gh, gw in patches]
        x = torch.cat([pt for pt, _, _ in patches]).to(self.patch_embed.weight.dtype)
        x = F.linear(x, self.patch_embed.weight.flatten(1), self.patch_embed.bias)
        rows = torch.cat([torch.arange(gh, device=dev).repeat_interleave(gw) for _, gh, gw in patches])
        cols = torch.cat([torch.arange(gw, device=dev).repeat(gh) for _, gh, gw in patches])
        cu = torch.tensor([0, *lens], device=dev).cumsum(0)
        for blk in self.blocks:
            x = blk(x, rows, cols, cu)
        return list(self.final_layernorm(x).split(lens))

    def forward(self, images: list[torch.Tensor]) -> list[torch.Tensor]:
        """images: list of float [3, H_i, W_i] (normalised pixels, any size up to max_image_size).

        All images are packed into one sequence (attention stays within each image). Returns a
        list of [num_media_tokens(H_i, W_i), text_hidden] tensors in the weights' dtype.
        """
        if not isinstance(images, (list, tuple)) or not images:
            raise ValueError("images: expected a non-empty list of [3, H, W] tensors")
        for i, img in enumerate(images):
            _check_image(img, self.cfg, f"images[{i}]")
        grids = [patchify(img.to(self.patch_embed.weight.device), self.cfg) for img in images]
        feats = self._tower(grids)
        return [self.mm_projector(merge_windows(f, gh, gw, self.cfg.merge_kernel_size))
                for f, (_, gh, gw) in zip(feats, grids)]

    def encode_video(self, frames: torch.Tensor) -> torch.Tensor:
        """frames: float [T, 3, H, W]. Each frame is encoded alone; groups of ``temporal_pool``
        consecutive frames are averaged (a short last group averages what it has) before the merge.

        Returns [num_video_tokens(T, H, W), text_hidden], temporal groups in order.
        """
        if not isinstance(frames, torch.Tensor) or frames.dim() != 4 or frames.shape[0] == 0:
            shape = tuple(frames.shape) if isinstance(frames, torch.Tensor) else type(frames).__name__
            raise ValueError(f"frames: expected a float tensor [T, 3, H, W] with T >= 1, got {shape}")
        for t in range(frames.shape[0]):
            _check_image(frames[t], self.cfg, f"frames[{t}]")
        grids = [patchify(f.to(self.patch_embed.weight.device), self.cfg) for f in frames]
        feats = torch.stack(self._tower(grids))  # [T, gh*gw, hidden]
        _, gh, gw = grids[0]
        tp = self.cfg.temporal_pool
        pooled = [feats[i:i + tp].mean(0) for i in range(0, feats.shape[0], tp)]
        return torch.cat([self.mm_projector(merge_windows(f, gh, gw, self.cfg.merge_kernel_size))
                          for f in pooled])


def encoder_param_count(cfg: VisionConfig) -> int:
    """Parameter count of ``MoonViTEncoder(cfg)`` computed from shapes (no allocation)."""
    h, i, p = cfg.hidden_size, cfg.intermediate_size, cfg.patch_size
    w = cfg.num_attention_heads * cfg.head_dim
    blk = 4 * h + (h * 3 * w + 3 * w) + (w * h + h) + (h * i + i) + (i * h + h)
    m = h * cfg.merge_kernel_size[0] * cfg.merge_kernel_size[1]
    proj = h + (m * m + m) + (m * cfg.text_hidden_size + cfg.text_hidden_size)
    return (3 * p * p * h + h) + cfg.num_hidden_layers * blk + 2 * h + proj

