"""Joint text + vision training glue: the generated image-caption data, the held-out questions and
the optimizer groups of the vision encoder.

Optimizer: the text model keeps its groups (`k3.optim.build_param_groups`); in the vision encoder
every 2-D matrix (wqkv, wo, fc0, fc1, projector linear_1/linear_2) gets Muon on the whole matrix,
the Conv2d-shaped patch embedding gets AdamW with weight decay, and the position table and the
norm weights get AdamW without decay.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from k3.data.packing import IGNORE_INDEX
from k3.data.vision_data import VisionBatch, VisionLoader, render_example
from k3.vision_config import VisionConfig
from k3.optim import build_param_groups
from k3.optim.muon import BlockSpec
from k3.train.config import TrainConfig

__all__ = ["SCORED_KINDS", "VisionData", "joint_loss", "param_groups", "prepare_vision_data"]

SCORED_KINDS = ("colour", "shape", "count")  # the kinds whose examples carry answer choices


@dataclass
class VisionData:
    loader: VisionLoader
    heldout: list[Any]  # VisionExample with choices, for `k3.train.vision_eval.evaluate_vision`


def prepare_vision_data(cfg: TrainConfig, tokenizer: Any, vcfg: VisionConfig,
                        log: Callable[[str], None]) -> VisionData:
    """Generate and render `vision_train_examples` training chats (seed `cfg.seed`) and
    `vision_eval_examples` held-out scored questions (the generator's held-out seed + `cfg.seed`)."""
    from k3.data.synth_vision import HELDOUT_SEED, generate_examples

    t0 = time.perf_counter()
    size = tuple(cfg.vision_image_size)
    kinds = [k for k, w in cfg.vision_kinds.items() if w > 0]
    train = generate_examples(cfg.vision_train_examples, cfg.seed, size=size, kinds=kinds,
                              weights=[cfg.vision_kinds[k] for k in kinds])
    rows = [render_example(e, tokenizer, vcfg) for e in train]
    scored = [k for k in kinds if k in SCORED_KINDS]
    if not scored:
        raise ValueError(f"train config vision_kinds={cfg.vision_kinds!r}: needs one of {SCORED_KINDS} "
                         "for the held-out evaluation")
    heldout = generate_examples(cfg.vision_eval_examples, HELDOUT_SEED + cfg.seed, size=size, kinds=scored)
    tokens = sum(len(r.ids) for r in rows)
    log(f"vision data: {len(rows)} generated image chats ({tokens:,} tokens, images {size[0]}-{size[1]} px, "
        f"kinds {', '.join(f'{k} {cfg.vision_kinds[k]:g}' for k in kinds)}), {len(heldout)} held-out questions, "
        f"{time.perf_counter() - t0:.1f} s")
    return VisionData(VisionLoader(rows, cfg.vision_batch_size, seed=cfg.seed), heldout)


def joint_loss(forward: Callable[..., Any], ids: torch.Tensor, labels: torch.Tensor, cu_seqlens: torch.Tensor,
               vb: VisionBatch, weight: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One packed forward over the text batch ([1, n] with cu_seqlens) followed by the packed
    vision rows (and their images). Returns (text_loss + weight * vision_loss, text_loss,
    vision_loss), each a mean over its own targets, so the text loss means what it always did."""
    n = ids.shape[1]
    all_ids = torch.cat([ids, vb.input_ids], 1)
    all_labels = torch.cat([labels, vb.labels], 1).flatten()
    cu = torch.cat([cu_seqlens, vb.cu_seqlens[1:].to(cu_seqlens.dtype) + n])
    logits = forward(all_ids, cu_seqlens=cu, media=vb.media).logits
    ce = F.cross_entropy(logits.float().flatten(0, 1), all_labels, ignore_index=IGNORE_INDEX, reduction="none")
    text = ce[:n].sum() / (all_labels[:n] != IGNORE_INDEX).sum().clamp(min=1)
    vision = ce[n:].sum() / (all_labels[n:] != IGNORE_INDEX).sum().clamp(min=1)
    return text + weight * vision, text, vision


class _TextView(nn.Module):
    """The text model's modules under their usual names (`model.*`, `lm_head`), without the vision encoder."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model.model
        self.lm_head = model.lm_head


def param_groups(model: nn.Module, geom: Any, cfg: TrainConfig) -> list[dict[str, Any]]:
    """Optimizer groups for `K3ForCausalLM`; a text-only model gets exactly `build_param_groups`."""
    vision = getattr(model, "vision", None)
    if vision is None:
        return build_param_groups(model, geom, lr=cfg.lr, weight_decay=cfg.weight_decay, adamw_lr=cfg.adamw_lr)
    groups = build_param_groups(_TextView(model), geom, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                adamw_lr=cfg.adamw_lr)
    muon: dict[str, list] = {"params": [], "names": [], "block_specs": []}
    decay: dict[str, list] = {"params": [], "names": []}
    no_decay: dict[str, list] = {"params": [], "names": []}
    for name, p in vision.named_parameters(prefix="vision"):
        if not p.requires_grad:
            continue
        if p.dim() == 2:
            target = muon
            muon["block_specs"].append(tuple(BlockSpec.whole()))
        else:
            target = decay if name.endswith("patch_embed.proj.weight") else no_decay
        target["params"].append(p)
        target["names"].append(name)
    extra = [dict(muon, kind="muon", lr=cfg.lr, weight_decay=cfg.weight_decay),
             dict(decay, kind="adamw", lr=cfg.adamw_lr, weight_decay=cfg.weight_decay),
             dict(no_decay, kind="adamw", lr=cfg.adamw_lr, weight_decay=0.0)]
    return groups + [g for g in extra if g["params"]]
