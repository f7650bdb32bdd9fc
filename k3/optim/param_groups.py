"""Which k3 parameters get Muon (and how they are cut into blocks) and which get AdamW.

Names are k3's internal parameter names (the official checkpoint names without the
``language_model.`` prefix). The head geometry comes from :class:`HeadGeometry`, which the
model/trainer builds from the config (``HeadGeometry.from_config`` does it for any object
with the Kimi config attributes).

Rules (see docs/optim.md for the table):

* per-head row blocks: KDA ``q/k/v_proj`` and ``f_b_proj`` (K), KDA ``g_proj`` (V = K),
  MLA ``q_b_proj`` (nope+rope), ``kv_b_proj`` (nope+v), ``g_proj`` (v);
* per-head column blocks: ``o_proj`` (V for KDA, v for MLA);
* per expert: stacked ``experts.w1/w2/w3`` [E, out, in];
* whole matrix: every other hidden 2-D weight (low-rank/latent projections, router, dense and
  shared MLPs, ``b_proj``);
* AdamW: embeddings, lm_head, norms, AttnRes ``*_res_proj`` pseudo-queries [1, d], ``A_log``,
  ``dt_bias``, short-conv weights and any other 1-D parameter. Weight decay is applied to
  embeddings, lm_head and conv weights; norms, ``*_res_proj``, ``A_log`` and ``dt_bias`` get none.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from k3.optim.muon import BlockSpec

__all__ = ["HeadGeometry", "muon_block_spec", "build_param_groups", "layer_mixers"]

_LAYER = re.compile(r"(?:^|\.)model\.layers\.(\d+)\.(.+)$")  # tolerate wrapper prefixes

# Suffixes (after "model.layers.{i}.") whose block spec depends only on the mixer type.
_KDA_ROWS_K = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
               "self_attn.f_b_proj.weight", "self_attn.g_proj.weight")
_MLA_ROWS = {"self_attn.q_b_proj.weight": "mla_qk_head_dim",
             "self_attn.kv_b_proj.weight": "mla_kv_b_block",
             "self_attn.g_proj.weight": "mla_v_head_dim"}
_ADAMW_DECAY_SUFFIXES = ("_conv1d.weight",)
_ADAMW_NO_DECAY_PATTERNS = ("norm.weight", "_res_proj.weight", "A_log", "dt_bias", ".bias")
_EXPERTS = re.compile(r"block_sparse_moe\.experts\.w[123]$")


@dataclass(frozen=True)
class HeadGeometry:
    """Per-head block sizes used to cut attention projections for Muon.

    kda_head_dim: KDA head dim K (= V), ``linear_attn_config.head_dim``.
    mla_qk_head_dim: MLA query head dim ``qk_nope_head_dim + qk_rope_head_dim`` (q_b_proj rows).
    mla_kv_b_block: MLA kv_b_proj rows per head ``qk_nope_head_dim + v_head_dim``.
    mla_v_head_dim: MLA value head dim ``v_head_dim`` (g_proj rows, o_proj columns).
    """

    kda_head_dim: int
    mla_qk_head_dim: int
    mla_kv_b_block: int
    mla_v_head_dim: int

    def __post_init__(self) -> None:
        for field in ("kda_head_dim", "mla_qk_head_dim", "mla_kv_b_block", "mla_v_head_dim"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"HeadGeometry.{field}: must be a positive int, got {value!r}")

    @classmethod
    def from_config(cls, cfg: Any) -> "HeadGeometry":
        """Build from a Kimi text config (attributes or dict ``linear_attn_config``)."""
        lac = getattr(cfg, "linear_attn_config", None)
        kda = lac.get("head_dim") if isinstance(lac, dict) else getattr(lac, "head_dim", None)
        if kda is None:
            raise ValueError("cfg.linear_attn_config.head_dim: missing")
        nope, rope, v = (getattr(cfg, f, None) for f in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
        if None in (nope, rope, v):
            raise ValueError("cfg: needs qk_nope_head_dim, qk_rope_head_dim and v_head_dim")
        return cls(int(kda), int(nope) + int(rope), int(nope) + int(v), int(v))


def layer_mixers(names: Sequence[str]) -> dict[int, str]:
    """Mixer type per layer index from the parameter names: "kda" (has q_proj) or "mla" (has kv_b_proj)."""
    mixers: dict[int, str] = {}
    for name in names:
        match = _LAYER.search(name)
        if match is None:
            continue
        if match.group(2) == "self_attn.q_proj.weight":
            mixers[int(match.group(1))] = "kda"
        elif match.group(2) == "self_attn.kv_b_proj.weight":
            mixers[int(match.group(1))] = "mla"
    return mixers


def _is_adamw(name: str, shape: Sequence[int]) -> bool:
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        return True
    if name.endswith(_ADAMW_DECAY_SUFFIXES) or any(p in name for p in _ADAMW_NO_DECAY_PATTERNS):
        return True
    # Vectors and [1, d] / [d, 1] weights: orthogonalising a vector just normalises it.
    return len(shape) < 2 or (len(shape) == 2 and min(shape) == 1)


def muon_block_spec(
    name: str, shape: Sequence[int], geom: HeadGeometry, mixer: str | None = None
) -> BlockSpec | None:
    """Block spec for a parameter, or None when it belongs to AdamW.

    name: internal parameter name; shape: its shape; geom: head geometry. mixer ("kda" or
    "mla") disambiguates the ``self_attn.g_proj``/``o_proj`` of a layer; if None it is
    inferred only when both mixers would give the same block, else ValueError.
    Unknown hidden 2-D weights get "whole", unknown 3-D weights "experts".
    """
    shape = tuple(int(s) for s in shape)
    if _is_adamw(name, shape):
        return None
    if _EXPERTS.search(name):
        if len(shape) != 3:
            raise ValueError(f"{name}: stacked expert weight must be [E, out, in], got {shape}")
        return BlockSpec.experts()
    match = _LAYER.search(name)
    suffix = match.group(2) if match else name
    spec = _attention_spec(name, suffix, geom, mixer)
    if spec is None:
        spec = BlockSpec.experts() if len(shape) == 3 else BlockSpec.whole()
    _check_divisible(name, shape, spec)
    return spec


def _attention_spec(name: str, suffix: str, geom: HeadGeometry, mixer: str | None) -> BlockSpec | None:
    if suffix in ("self_attn.g_proj.weight", "self_attn.o_proj.weight"):
        mixer = _resolve_mixer(name, geom, mixer)
        block = geom.kda_head_dim if mixer == "kda" else geom.mla_v_head_dim
        return BlockSpec.rows(block) if suffix.endswith("g_proj.weight") else BlockSpec.cols(block)
    if suffix in _KDA_ROWS_K:
        return BlockSpec.rows(geom.kda_head_dim)
    if suffix in _MLA_ROWS:
        return BlockSpec.rows(getattr(geom, _MLA_ROWS[suffix]))
    return None


def _resolve_mixer(name: str, geom: HeadGeometry, mixer: str | None) -> str:
    if mixer in ("kda", "mla"):
        return mixer
    if mixer is not None:
        raise ValueError(f"mixer: expected 'kda', 'mla' or None for {name}, got {mixer!r}")
    if geom.kda_head_dim == geom.mla_v_head_dim:
        return "kda"
    raise ValueError(f"{name}: mixer ('kda' or 'mla') is needed because KDA and MLA head dims differ")


def _check_divisible(name: str, shape: tuple[int, ...], spec: BlockSpec) -> None:
    if spec.kind in ("rows", "cols"):
        dim = 0 if spec.kind == "rows" else 1
        if len(shape) != 2 or shape[dim] % spec.block != 0:
            raise ValueError(f"{name}: shape {shape} is not a multiple of head block {spec.block} on dim {dim}")
    elif spec.kind == "whole" and len(shape) != 2:
        raise ValueError(f"{name}: Muon needs a 2-D weight, got shape {shape}")


def _adamw_decays(name: str) -> bool:
    return not any(p in name for p in _ADAMW_NO_DECAY_PATTERNS) and (
        name.endswith(("embed_tokens.weight", "lm_head.weight") + _ADAMW_DECAY_SUFFIXES)
    )


def build_param_groups(
    model: nn.Module,
    geom: HeadGeometry | Any,
    lr: float,
    weight_decay: float,
    adamw_lr: float | None = None,
) -> list[dict[str, Any]]:
    """Param groups for :class:`~k3.optim.muon.PerHeadMuon`.

    Returns up to three groups (empty ones are dropped): ``muon`` (lr, weight_decay, with
    ``block_specs``), ``adamw`` with weight decay (embeddings, lm_head, conv weights) and
    ``adamw`` without (norms, pseudo-queries, A_log, dt_bias, other vectors). AdamW groups use
    ``adamw_lr`` (default: lr). Every group carries ``names`` (for logging/debugging); frozen
    parameters (requires_grad False) are skipped, buffers are never included. ``geom`` may
    also be a config object, converted with :meth:`HeadGeometry.from_config`.
    """
    if not isinstance(geom, HeadGeometry):
        geom = HeadGeometry.from_config(geom)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    mixers = layer_mixers([n for n, _ in named])
    muon: dict[str, list] = {"params": [], "names": [], "block_specs": []}
    decay: dict[str, list] = {"params": [], "names": []}
    no_decay: dict[str, list] = {"params": [], "names": []}
    for name, param in named:
        match = _LAYER.search(name)
        mixer = mixers.get(int(match.group(1))) if match else None
        spec = muon_block_spec(name, param.shape, geom, mixer)
        if spec is not None:
            muon["params"].append(param)
            muon["names"].append(name)
            muon["block_specs"].append(tuple(spec))
        else:
            target = decay if _adamw_decays(name) else no_decay
            target["params"].append(param)
            target["names"].append(name)
    a_lr = lr if adamw_lr is None else adamw_lr
    groups = [
        dict(muon, kind="muon", lr=lr, weight_decay=weight_decay),
        dict(decay, kind="adamw", lr=a_lr, weight_decay=weight_decay),
        dict(no_decay, kind="adamw", lr=a_lr, weight_decay=0.0),
    ]
    return [g for g in groups if g["params"]]
