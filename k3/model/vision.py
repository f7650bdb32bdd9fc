"""MoonViT-style native-resolution vision encoder and ``patchmergerv2`` projector (issue 8).

Pipeline for one image ``[3, H, W]`` (see docs/vision.md for the exact rules):

1. zero-pad bottom/right to a multiple of ``patch * merge`` (28 at full size), no resize;
2. cut into ``patch x patch`` patches (row-major over the patch grid) and embed them with a
   Conv2d-shaped weight applied as a linear map over each flattened ``(C, ph, pw)`` patch;
3. add the learned position table (``init_pos_emb_height x init_pos_emb_width x hidden``,
   interpolated to the image's patch grid);
4. pre-norm transformer blocks with 2-D RoPE (Kimi-VL layout: channel pairs alternate between the
   column and the row frequency); attention never crosses image/frame boundaries;
5. 2x2 patch merge (the 4 patches of each 2x2 window are concatenated, 4 * hidden wide);
6. projector: Linear(4h, 4h), GELU, Linear(4h, text_hidden), RMSNorm(text_hidden).

Video ``[T, 3, H, W]``: every frame is encoded as an image, then consecutive groups of
``temporal_pool`` frames are averaged (a short last group averages what it has) before the merge.

Module names follow the official checkpoint (``vision_tower.patch_embed.proj``,
``vision_tower.encoder.blocks.{i}.wqkv`` ..., ``mm_projector.linear_1`` ...), modelled on Kimi-VL /
Kimi-K2.5 and not verified against the K3 shards; ``k3.model.checkpoint`` owns the mapping.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn.functional as F
from torch import nn

from k3.model.common import RMSNorm
from k3.vision_config import (
    VisionConfig,
    _check_size,
    encoder_param_count,
    num_media_tokens,
    num_video_tokens,
    tiny_vision_config,
)

__all__ = [
    "MoonViTEncoder",
    "MoonViTTower",
    "PatchMergerV2",
    "PositionTable2D",
    "VisionConfig",
    "encoder_param_count",
    "merge_windows",
    "num_media_tokens",
    "num_video_tokens",
    "patchify",
    "rope_2d",
    "tiny_vision_config",
]


def _check_image(img: torch.Tensor, cfg: VisionConfig, where: str) -> None:
    if not isinstance(img, torch.Tensor) or img.dim() != 3 or img.shape[0] != 3:
        shape = tuple(img.shape) if isinstance(img, torch.Tensor) else type(img).__name__
        raise ValueError(f"{where}: expected a float tensor [3, H, W], got {shape}")
    if not img.is_floating_point():
        raise ValueError(f"{where}: expected a float tensor (normalised pixels), got {img.dtype}")
    _check_size(int(img.shape[1]), int(img.shape[2]), cfg, where)


def _check_video(frames: torch.Tensor, cfg: VisionConfig, where: str) -> None:
    if not isinstance(frames, torch.Tensor) or frames.dim() != 4 or frames.shape[0] == 0 or frames.shape[1] != 3:
        shape = tuple(frames.shape) if isinstance(frames, torch.Tensor) else type(frames).__name__
        raise ValueError(f"{where}: expected a float video tensor [T, 3, H, W] with T >= 1, got {shape}")
    _check_image(frames[0], cfg, where)


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

    Channel pairs ``(2k, 2k+1)`` are rotated as complex numbers; pair ``2j`` by ``col * f_j`` and
    pair ``2j+1`` by ``row * f_j`` with ``f_j = theta^(-4j/d)``, j < d/4 (Kimi-VL's Rope2DPosEmb
    layout). Computed in fp32, returned in x's dtype.
    """
    d = x.shape[-1]
    inv = theta ** (-4.0 * torch.arange(d // 4, device=x.device, dtype=torch.float32) / d)
    ang = torch.stack((cols.to(torch.float32)[:, None] * inv, rows.to(torch.float32)[:, None] * inv), -1)
    ang = ang.flatten(1)[:, None, :]  # [N, 1, d/2]: col f0, row f0, col f1, row f1, ...
    c, s = ang.cos(), ang.sin()
    xf = x.float().unflatten(-1, (d // 2, 2))
    a, b = xf[..., 0], xf[..., 1]
    return torch.stack((a * c - b * s, a * s + b * c), -1).flatten(-2).to(x.dtype)


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """Attention within consecutive segments. q, k, v: [N, heads, d]; lens: segment lengths (sum N).

    Segments of equal length are stacked and attended in one batched call (no [N, N] mask), so
    many same-size images cost what one batch of them costs. Returns [N, heads, d].
    """
    starts = [0]
    for n in lens[:-1]:
        starts.append(starts[-1] + n)
    groups: dict[int, list[int]] = defaultdict(list)
    for i, n in enumerate(lens):
        groups[n].append(i)
    outs: list[torch.Tensor | None] = [None] * len(lens)
    for n, ids in groups.items():
        qs, ks, vs = (torch.stack([t[starts[i]:starts[i] + n] for i in ids]).transpose(1, 2)  # [g, heads, n, d]
                      for t in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2)
        for j, i in enumerate(ids):
            outs[i] = o[j]
    return torch.cat(outs)  # type: ignore[arg-type]


def _norm(cfg: VisionConfig) -> nn.Module:
    if cfg.norm_type == "layernorm":
        return nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
    return RMSNorm(cfg.hidden_size, cfg.layer_norm_eps)


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.fc0 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.linear_bias)
        self.fc1 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.linear_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(F.gelu(self.fc0(x), approximate="tanh"))


class VisionBlock(nn.Module):
    """Pre-norm block: x + wo(attn(wqkv(norm0(x)))); x + mlp(norm1(x))."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.heads, self.head_dim, self.theta = cfg.num_attention_heads, cfg.head_dim, cfg.rope_theta
        width = cfg.num_attention_heads * cfg.head_dim
        self.norm0 = _norm(cfg)
        self.wqkv = nn.Linear(cfg.hidden_size, 3 * width, bias=cfg.attn_bias)
        self.wo = nn.Linear(width, cfg.hidden_size, bias=cfg.attn_bias)
        self.norm1 = _norm(cfg)
        self.mlp = VisionMLP(cfg)

    def attention(self, x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, lens: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.wqkv(x).view(n, 3, self.heads, self.head_dim).unbind(1)
        q, k = rope_2d(q, rows, cols, self.theta), rope_2d(k, rows, cols, self.theta)
        return self.wo(segment_attention(q, k, v, lens).reshape(n, self.heads * self.head_dim))

    def forward(self, x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, lens: list[int]) -> torch.Tensor:
        """x: [N, hidden] (several images packed); rows/cols: [N] patch positions; lens: per image."""
        x = x + self.attention(self.norm0(x), rows, cols, lens)
        return x + self.mlp(self.norm1(x))


class PositionTable2D(nn.Module):
    """Learned ``[H0, W0, hidden]`` table, resampled to each patch grid (``F.interpolate``,
    align_corners=False, in fp32) and added after the patch embedding. A grid of exactly
    ``H0 x W0`` uses the table as is."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.mode = cfg.pos_emb_interpolation_mode
        self.weight = nn.Parameter(torch.zeros(cfg.init_pos_emb_height, cfg.init_pos_emb_width, cfg.hidden_size))

    def forward(self, gh: int, gw: int) -> torch.Tensor:
        """Returns [gh*gw, hidden] in the table's dtype, row-major over the grid."""
        w = self.weight
        if (gh, gw) == tuple(w.shape[:2]):
            return w.flatten(0, 1)
        grid = F.interpolate(w.float().permute(2, 0, 1)[None], size=(gh, gw), mode=self.mode, align_corners=False)
        return grid[0].permute(1, 2, 0).flatten(0, 1).to(w.dtype)


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        p = cfg.patch_size
        # Conv2d-shaped so the weight has the layout of a stride-p convolution; applied as a linear map.
        self.proj = nn.Conv2d(3, cfg.hidden_size, kernel_size=p, stride=p, bias=cfg.patch_embed_proj_bias)
        self.pos_emb = PositionTable2D(cfg)

    def forward(self, grids: list[tuple[torch.Tensor, int, int]]) -> torch.Tensor:
        """grids: (patches [gh*gw, 3*p*p], gh, gw) per image -> packed [sum gh*gw, hidden]."""
        x = torch.cat([pt for pt, _, _ in grids]).to(self.proj.weight.dtype)
        x = F.linear(x, self.proj.weight.flatten(1), self.proj.bias)
        tables: dict[tuple[int, int], torch.Tensor] = {}
        for _, gh, gw in grids:
            if (gh, gw) not in tables:
                tables[(gh, gw)] = self.pos_emb(gh, gw)
        return x + torch.cat([tables[(gh, gw)] for _, gh, gw in grids])


class VisionEncoderStack(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.num_hidden_layers))
        self.final_layernorm = _norm(cfg)

    def forward(self, x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, lens: list[int]) -> torch.Tensor:
        for blk in self.blocks:
            x = blk(x, rows, cols, lens)
        return self.final_layernorm(x)


class MoonViTTower(nn.Module):
    """``vision_tower``: patch embedding (+ position table) and the transformer stack."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.patch_embed = PatchEmbed(cfg)
        self.encoder = VisionEncoderStack(cfg)

    def forward(self, grids: list[tuple[torch.Tensor, int, int]]) -> list[torch.Tensor]:
        """grids: (patches, gh, gw) per image/frame -> per-grid features [gh*gw, hidden]."""
        dev = self.patch_embed.proj.weight.device
        lens = [gh * gw for _, gh, gw in grids]
        x = self.patch_embed(grids)
        rows = torch.cat([torch.arange(gh, device=dev).repeat_interleave(gw) for _, gh, gw in grids])
        cols = torch.cat([torch.arange(gw, device=dev).repeat(gh) for _, gh, gw in grids])
        return list(self.encoder(x, rows, cols, lens).split(lens))


class PatchMergerV2(nn.Module):
    """``patchmergerv2`` projector: flatten each mh*mw window, Linear(mh*mw*h -> same), GELU,
    Linear(-> text_hidden), RMSNorm(text_hidden). Full size: 4096 -> 4096 -> 7168, no biases."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        width = cfg.hidden_size * cfg.merge_kernel_size[0] * cfg.merge_kernel_size[1]
        self.linear_1 = nn.Linear(width, width, bias=False)
        self.linear_2 = nn.Linear(width, cfg.text_hidden_size, bias=False)
        self.post_norm = RMSNorm(cfg.text_hidden_size, cfg.rms_norm_eps)

    def forward(self, windows: torch.Tensor) -> torch.Tensor:
        """windows: [tokens, mh*mw, hidden] -> [tokens, text_hidden]."""
        return self.post_norm(self.linear_2(F.gelu(self.linear_1(windows.flatten(1)))))


def merge_windows(x: torch.Tensor, gh: int, gw: int, merge: tuple[int, int]) -> torch.Tensor:
    """x: [gh*gw, D] row-major patches -> [(gh/mh)*(gw/mw), mh*mw, D] (merged tokens row-major)."""
    mh, mw = merge
    d = x.shape[-1]
    x = x.view(gh // mh, mh, gw // mw, mw, d).permute(0, 2, 1, 3, 4)
    return x.reshape((gh // mh) * (gw // mw), mh * mw, d)


class MoonViTEncoder(nn.Module):
    """Vision tower + projector. Images and videos in, media-token embeddings (text hidden size) out."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.vision_tower = MoonViTTower(cfg)
        self.mm_projector = PatchMergerV2(cfg)

    def encode(self, media: list[torch.Tensor]) -> list[torch.Tensor]:
        """media: images float [3, H, W] and/or videos float [T, 3, H, W] (normalised pixels).

        Every image and every video frame is one attention segment of a single packed tower pass.
        Returns, per item in order, [num_media_tokens(H, W)] or [num_video_tokens(T, H, W)] rows
        of text_hidden embeddings, in the weights' dtype.
        """
        if not isinstance(media, (list, tuple)) or not media:
            raise ValueError("media: expected a non-empty list of [3, H, W] images / [T, 3, H, W] videos")
        dev = self.vision_tower.patch_embed.proj.weight.device
        grids, counts = [], []
        for i, item in enumerate(media):
            if isinstance(item, torch.Tensor) and item.dim() == 4:
                _check_video(item, self.cfg, f"media[{i}]")
                frames = list(item.to(dev))
            else:
                _check_image(item, self.cfg, f"media[{i}]")
                frames = [item.to(dev)]
            grids.extend(patchify(f, self.cfg) for f in frames)
            counts.append(len(frames))
        feats = self.vision_tower(grids)
        windows, sizes, at = [], [], 0
        tp = self.cfg.temporal_pool
        for n in counts:
            _, gh, gw = grids[at]
            group = feats[at:at + n]
            pooled = [group[0]] if n == 1 else [torch.stack(group[j:j + tp]).mean(0) for j in range(0, n, tp)]
            wins = [merge_windows(f, gh, gw, self.cfg.merge_kernel_size) for f in pooled]
            windows.extend(wins)
            sizes.append(sum(w.shape[0] for w in wins))
            at += n
        return list(self.mm_projector(torch.cat(windows)).split(sizes))

    def forward(self, images: list[torch.Tensor]) -> list[torch.Tensor]:
        """images: list of float [3, H_i, W_i] -> list of [num_media_tokens(H_i, W_i), text_hidden]."""
        if not isinstance(images, (list, tuple)) or not images:
            raise ValueError("images: expected a non-empty list of [3, H, W] tensors")
        for i, img in enumerate(images):
            _check_image(img, self.cfg, f"images[{i}]")
        return self.encode(list(images))

    def encode_video(self, frames: torch.Tensor) -> torch.Tensor:
        """frames: float [T, 3, H, W] -> [num_video_tokens(T, H, W), text_hidden], groups in order."""
        if not isinstance(frames, torch.Tensor) or frames.dim() != 4 or frames.shape[0] == 0:
            shape = tuple(frames.shape) if isinstance(frames, torch.Tensor) else type(frames).__name__
            raise ValueError(f"frames: expected a float tensor [T, 3, H, W] with T >= 1, got {shape}")
        _check_video(frames, self.cfg, "frames")
        return self.encode([frames])[0]

    def num_tokens(self, item: torch.Tensor) -> int:
        """Media tokens that ``encode`` produces for one image [3, H, W] or video [T, 3, H, W]."""
        if isinstance(item, torch.Tensor) and item.dim() == 4:
            return num_video_tokens(int(item.shape[0]), int(item.shape[2]), int(item.shape[3]), self.cfg)
        if not isinstance(item, torch.Tensor) or item.dim() != 3:
            raise ValueError(f"media item: expected [3, H, W] or [T, 3, H, W], got "
                             f"{tuple(item.shape) if isinstance(item, torch.Tensor) else type(item).__name__}")
        return num_media_tokens(int(item.shape[1]), int(item.shape[2]), self.cfg)

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator, std: float = 0.02) -> None:
        """From-scratch init: matrices and the position table ~ N(0, std), norms 1, biases 0."""
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif p.dim() == 1:  # norm weights
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=generator) * std)
