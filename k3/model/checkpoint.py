"""Official Kimi K3 checkpoint adapter: the ONE module that knows the official tensor names.

Internal names (``K3ForCausalLM.state_dict()``) are the official text names without the
``language_model.`` prefix, with three layout differences handled only here:

* ``self_attn.A_log``: internal [H] float32; official [ceil(H/128)*128] F32, zero-padded
  (H = 96 -> [128]; entries H.. are exactly 0 -- asserted on load, written as +0.0 on save).
* routed experts: internal STACKED ``block_sparse_moe.experts.w1`` [E, I, L] (gate),
  ``experts.w3`` [E, I, L] (up), ``experts.w2`` [E, L, I] (down); official per expert
  ``experts.{e}.w{1,2,3}.weight`` (plain) or MXFP4 ``.weight_packed`` U8 [out, in/2] +
  ``.weight_scale`` U8 [out, in/32] (codec: k3.quant.mxfp4).
* vision: a model built with a ``vision_config`` holds ``vision.vision_tower.*`` and
  ``vision.mm_projector.*``, stored WITHOUT the ``language_model.`` prefix as the official
  ``vision_tower.*`` / ``mm_projector.*`` (BF16). A text-only model skips those tensors (reported
  in ``LoadReport.skipped``). The vision names are modelled on Kimi-VL / Kimi-K2.5 (MoonViT) and
  are NOT verified against the K3 shards; at full size there are exactly 168 of them, the count
  the spec derives from the K3 index (docs/vision.md has the derivation).

Dtypes: the official F32 tensors (q/k/v conv weights, A_log, dt_bias, KDA o_norm,
e_score_correction_bias) are float32 internally whatever the model dtype and are saved as F32.
Everything else is saved BF16 (the official dtype) unless ``save_checkpoint(dtype="float32")``
is asked for (k3's own lossless fp32 export); the loader accepts BF16 or F32 for those tensors.

Bit-exact round trips: a bf16 model saved with the default dtype, or an fp32 model saved with
``dtype="float32"``, loads back bit-identically (MXFP4 experts: when the weights lie on the MXFP4
grid, e.g. they came from an MXFP4 checkpoint or from QAT). After loading MXFP4 experts the
original E8M0 scale bytes are remembered in ``model._k3_mxfp4_scales`` (internal stacked name ->
uint8 [E, out, in/32], CPU) and reused on save wherever they still encode the weights exactly, so
re-saving an unmodified model reproduces the packed and scale tensors byte for byte.
"""

from __future__ import annotations

import copy
import math
import os
import re
import shutil
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterator, NamedTuple

import torch
from torch import nn

from k3.config import K3Config, TextConfig, kimi_k3
from k3.model.safetensors_io import (
    INDEX_FILE,
    SINGLE_FILE,
    CheckpointError,
    commit,
    header,
    open_shard,
    read_weight_map,
    target_dtype,
    write_shards,
)
from k3.vision_config import VisionConfig
from k3.quant.mxfp4 import BLOCK, decode_mxfp4, encode_mxfp4, encode_mxfp4_reuse, fake_quant_mxfp4

__all__ = [
    "CheckpointError",
    "LoadReport",
    "internal_shapes",
    "official_shapes",
    "is_fp32_name",
    "a_log_padded_len",
    "load_checkpoint",
    "save_checkpoint",
    "INDEX_FILE",
    "SINGLE_FILE",
]

PREFIX = "language_model."
VISION = "vision."  # internal prefix of the vision encoder; dropped in the official names
_FP32_SUFFIXES = ("self_attn.q_conv1d.weight", "self_attn.k_conv1d.weight", "self_attn.v_conv1d.weight",
                  "self_attn.A_log", "self_attn.dt_bias", "self_attn.o_norm.weight",
                  "block_sparse_moe.gate.e_score_correction_bias")
_SKIP_RE = re.compile(r"(^|\.)(vision_tower|mm_projector)(\.|$)")
_EXPERT_RE = re.compile(r"^(?P<group>.*\.block_sparse_moe\.experts)\.(?P<w>w[123])$")
# Loader tolerance: BF16 tensors may also be stored F32 (k3's lossless fp32 export).
_ACCEPTED = {"BF16": ("BF16", "F32"), "F32": ("F32",), "U8": ("U8",)}


# ---------------------------------------------------------------------------------------------
# inventories


def _text(cfg: K3Config | TextConfig) -> TextConfig:
    if isinstance(cfg, K3Config):
        return cfg.text_config
    if isinstance(cfg, TextConfig):
        return cfg
    raise ValueError(f"cfg: expected K3Config or TextConfig, got {type(cfg).__name__}")


def is_fp32_name(name: str) -> bool:
    """True for the tensors the official file stores as F32 (kept float32 internally)."""
    return name.endswith(_FP32_SUFFIXES)


def a_log_padded_len(num_heads: int) -> int:
    """Official `A_log` length: the H per-head values zero-padded up to a multiple of 128."""
    return math.ceil(num_heads / 128) * 128


def internal_shapes(cfg: K3Config | TextConfig) -> dict[str, tuple[tuple[int, ...], bool]]:
    """Internal tensor inventory of `K3ForCausalLM.state_dict()`: name -> (shape, is_fp32)."""
    t = _text(cfg)
    d, V = t.hidden_size, t.vocab_size
    out: dict[str, tuple[tuple[int, ...], bool]] = {}

    def add(name: str, *shape: int) -> None:
        out[name] = (tuple(shape), is_fp32_name(name))

    add("model.embed_tokens.weight", V, d)
    for i in range(t.num_hidden_layers):
        p = f"model.layers.{i}."
        for n in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
            add(f"{p}{n}.weight", d)
        for n in ("self_attention_res_proj", "mlp_res_proj"):
            add(f"{p}{n}.weight", 1, d)
        (_mla_shapes if t.is_mla(i) else _kda_shapes)(t, p + "self_attn.", add)
        (_moe_shapes if t.is_moe(i) else _dense_shapes)(t, p, add)
    add("model.norm.weight", d)
    add("model.output_attn_res_norm.weight", d)
    add("model.output_attn_res_proj.weight", 1, d)
    add("lm_head.weight", V, d)
    if isinstance(cfg, K3Config) and cfg.vision_config is not None:
        _vision_shapes(VisionConfig.from_dict(cfg.vision_config, text_hidden_size=d), add)
    return out


def _vision_shapes(v: VisionConfig, add) -> None:
    """`vision.vision_tower.*` + `vision.mm_projector.*` (official names: drop the `vision.`)."""
    h, w, inter = v.hidden_size, v.num_attention_heads * v.head_dim, v.intermediate_size
    t = VISION + "vision_tower."

    def linear(name: str, n_out: int, n_in: int, bias: bool) -> None:
        add(name + ".weight", n_out, n_in)
        if bias:
            add(name + ".bias", n_out)

    def norm(name: str) -> None:
        add(name + ".weight", h)
        if v.norm_type == "layernorm":
            add(name + ".bias", h)

    add(t + "patch_embed.proj.weight", h, 3, v.patch_size, v.patch_size)
    if v.patch_embed_proj_bias:
        add(t + "patch_embed.proj.bias", h)
    add(t + "patch_embed.pos_emb.weight", v.init_pos_emb_height, v.init_pos_emb_width, h)
    for i in range(v.num_hidden_layers):
        b = f"{t}encoder.blocks.{i}."
        norm(b + "norm0")
        linear(b + "wqkv", 3 * w, h, v.attn_bias)
        linear(b + "wo", h, w, v.attn_bias)
        norm(b + "norm1")
        linear(b + "mlp.fc0", inter, h, v.linear_bias)
        linear(b + "mlp.fc1", h, inter, v.linear_bias)
    norm(t + "encoder.final_layernorm")
    m = h * v.merge_kernel_size[0] * v.merge_kernel_size[1]
    p = VISION + "mm_projector."
    add(p + "linear_1.weight", m, m)
    add(p + "linear_2.weight", v.text_hidden_size, m)
    add(p + "post_norm.weight", v.text_hidden_size)


def _kda_shapes(t: TextConfig, p: str, add) -> None:
    d, H, K = t.hidden_size, t.kda_num_heads, t.kda_head_dim
    Vd = K  # K3 uses one head_dim for keys and values
    ks = t.linear_attn_config.short_conv_kernel_size
    add(p + "q_proj.weight", H * K, d)
    add(p + "k_proj.weight", H * K, d)
    add(p + "v_proj.weight", H * Vd, d)
    add(p + "q_conv1d.weight", H * K, 1, ks)
    add(p + "k_conv1d.weight", H * K, 1, ks)
    add(p + "v_conv1d.weight", H * Vd, 1, ks)
    add(p + "A_log", H)
    add(p + "dt_bias", H * K)
    add(p + "f_a_proj.weight", K, d)
    add(p + "f_b_proj.weight", H * K, K)
    add(p + "b_proj.weight", H, d)
    add(p + "o_norm.weight", Vd)
    add(p + "g_proj.weight", H * Vd, d)
    add(p + "o_proj.weight", d, H * Vd)


def _mla_shapes(t: TextConfig, p: str, add) -> None:
    d, H = t.hidden_size, t.num_attention_heads
    qk = t.qk_nope_head_dim + t.qk_rope_head_dim
    if t.q_lora_rank is None:
        add(p + "q_proj.weight", H * qk, d)
    else:
        add(p + "q_a_proj.weight", t.q_lora_rank, d)
        add(p + "q_a_layernorm.weight", t.q_lora_rank)
        add(p + "q_b_proj.weight", H * qk, t.q_lora_rank)
    add(p + "kv_a_proj_with_mqa.weight", t.kv_lora_rank + t.qk_rope_head_dim, d)
    add(p + "kv_a_layernorm.weight", t.kv_lora_rank)
    add(p + "kv_b_proj.weight", H * (t.qk_nope_head_dim + t.v_head_dim), t.kv_lora_rank)
    if t.mla_use_output_gate:
        add(p + "g_proj.weight", H * t.v_head_dim, d)
    add(p + "o_proj.weight", d, H * t.v_head_dim)


def _dense_shapes(t: TextConfig, p: str, add) -> None:
    d, F = t.hidden_size, t.intermediate_size
    add(p + "mlp.gate_proj.weight", F, d)
    add(p + "mlp.up_proj.weight", F, d)
    add(p + "mlp.down_proj.weight", d, F)


def _moe_shapes(t: TextConfig, p: str, add) -> None:
    d, E, I, L = t.hidden_size, t.num_experts, t.moe_intermediate_size, t.routed_expert_hidden_size
    m = p + "block_sparse_moe."
    add(m + "gate.weight", E, d)
    add(m + "gate.e_score_correction_bias", E)
    add(m + "routed_expert_down_proj.weight", L, d)
    add(m + "routed_expert_up_proj.weight", d, L)
    if t.latent_moe_use_norm:
        add(m + "routed_expert_norm.weight", L)
    if t.num_shared_experts > 0:
        S = t.num_shared_experts * I
        add(m + "shared_experts.gate_proj.weight", S, d)
        add(m + "shared_experts.up_proj.weight", S, d)
        add(m + "shared_experts.down_proj.weight", d, S)
    add(m + "experts.w1", E, I, L)
    add(m + "experts.w3", E, I, L)
    add(m + "experts.w2", E, L, I)


class _Entry(NamedTuple):
    """One official tensor and where it comes from internally."""

    name: str  # official name
    shape: tuple[int, ...]
    dtype: str  # "BF16" | "F32" | "U8"
    internal: str
    kind: str  # "plain" | "a_log" | "expert" | "packed" | "scale"
    expert: int = -1


def _entries(name: str, shape: tuple[int, ...], fmt: str, prefix: str) -> list[tuple]:
    """Official tensors of one internal tensor, as plain tuples in `_Entry` field order (plain
    tuples because the full inventory has ~500k entries)."""
    if name.startswith(VISION):
        return [(name[len(VISION):], shape, "BF16", name, "plain")]
    m = _EXPERT_RE.match(name)
    if m is None:
        if name.endswith("self_attn.A_log"):
            return [(prefix + name, (a_log_padded_len(shape[0]),), "F32", name, "a_log")]
        return [(prefix + name, shape, "F32" if is_fp32_name(name) else "BF16", name, "plain")]
    if len(shape) != 3:
        raise CheckpointError(f"{name}: stacked experts must be 3-D [E, out, in], got {shape}")
    E, n_out, n_in = shape
    base = f"{prefix}{m['group']}"
    w = m["w"]
    if fmt == "bf16":
        return [(f"{base}.{e}.{w}.weight", (n_out, n_in), "BF16", name, "expert", e) for e in range(E)]
    if n_in % BLOCK:
        raise CheckpointError(f"{name}: MXFP4 needs the input dim ({n_in}) to be a multiple of {BLOCK}")
    out = []
    for e in range(E):
        out.append((f"{base}.{e}.{w}.weight_packed", (n_out, n_in // 2), "U8", name, "packed", e))
        out.append((f"{base}.{e}.{w}.weight_scale", (n_out, n_in // BLOCK), "U8", name, "scale", e))
    return out


def _check_format(experts_format: str | None, cfg: K3Config | None) -> str:
    if experts_format is None:
        return "mxfp4" if (isinstance(cfg, K3Config) and cfg.experts_mxfp4) else "bf16"
    if experts_format not in ("mxfp4", "bf16"):
        raise ValueError(f"experts_format={experts_format!r}: must be 'mxfp4', 'bf16' or None")
    return experts_format


def official_shapes(cfg: K3Config | TextConfig, experts_format: str | None = None
                    ) -> dict[str, tuple[tuple[int, ...], str]]:
    """Official tensor inventory: official name -> (shape, dtype "BF16" | "F32" | "U8"); includes
    the 168 (full size) `vision_tower.*` / `mm_projector.*` tensors when `cfg` has a vision_config.

    experts_format: "mxfp4" (packed + scale per expert), "bf16" (plain per expert) or None
    (= "mxfp4" when `cfg.experts_mxfp4`, else "bf16").
    """
    fmt = _check_format(experts_format, cfg if isinstance(cfg, K3Config) else None)
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for name, (shape, _) in internal_shapes(cfg).items():
        for en in _entries(name, shape, fmt, PREFIX):
            out[en[0]] = (en[1], en[2])
    return out


# ---------------------------------------------------------------------------------------------
# loading


@dataclass
class LoadReport:
    """What `load_checkpoint` did. Names are official names."""

    files: list[str]
    experts_format: str  # "mxfp4" | "bf16" | "none" (no routed experts in the file)
    missing: list[str] = field(default_factory=list)  # only non-empty with strict=False
    unexpected: list[str] = field(default_factory=list)  # only non-empty with strict=False
    skipped: list[str] = field(default_factory=list)  # vision_tower / mm_projector (text-only model)


def _materialise(model: nn.Module, dtype: torch.dtype | None, device: torch.device | str | None) -> None:
    """Move/cast/allocate every parameter and buffer in place of the old ones, one at a time.

    meta tensors are allocated uninitialised (like `to_empty`) on `device` (default cpu); the
    official-F32 tensors are forced to float32; other floating tensors go to `dtype` if given.
    Non-persistent buffers are only moved/materialised, never cast.
    """
    with torch.no_grad():
        for mod_name, mod in model.named_modules():
            persistent = set(mod._buffers) - set(getattr(mod, "_non_persistent_buffers_set", ()))
            for store, keys in ((mod._parameters, set(mod._parameters)), (mod._buffers, persistent)):
                for key, t in list(store.items()):
                    if t is None:
                        continue
                    full = f"{mod_name}.{key}" if mod_name else key
                    want_dtype = t.dtype
                    if key in keys and t.is_floating_point():
                        want_dtype = torch.float32 if is_fp32_name(full) else (dtype or t.dtype)
                    want_dev = device if device is not None else ("cpu" if t.is_meta else t.device)
                    if t.is_meta:
                        new = torch.empty(t.shape, dtype=want_dtype, device=want_dev)
                    else:
                        new = t.to(device=want_dev, dtype=want_dtype)
                        if new is t:
                            continue
                    if isinstance(t, nn.Parameter):
                        new = nn.Parameter(new, requires_grad=t.requires_grad)
                    store[key] = new


def _plan(state: dict[str, torch.Tensor], weight_map: dict[str, str]
          ) -> tuple[list[_Entry], str, list[str], list[str], list[str], list[str]]:
    """Match the model's tensors against the checkpoint headers; returns
    (entries to load, experts format, missing, unexpected, skipped, errors)."""
    vision_model = any(n.startswith(VISION) for n in state)
    text_names = [n for n in weight_map if not _SKIP_RE.search(n)]
    vision_names = sorted(n for n in weight_map if _SKIP_RE.search(n))
    skipped = [] if vision_model else vision_names
    names = text_names + vision_names if vision_model else text_names  # what the model can take
    prefix = PREFIX if any(n.startswith(PREFIX) for n in text_names) or not text_names else ""
    if any(n.endswith(".weight_packed") for n in text_names):
        fmt = "mxfp4"
    elif any(".block_sparse_moe.experts." in n for n in text_names):
        fmt = "bf16"
    else:
        fmt = "none"
    entries: list[_Entry] = []
    for name, t in state.items():
        entries.extend(_Entry(*x) for x in _entries(name, tuple(t.shape), "bf16" if fmt == "none" else fmt, prefix))
    expected = {e.name for e in entries}
    headers: dict[str, dict[str, tuple[tuple[int, ...], str]]] = {}
    errors: list[str] = []
    for fn in sorted(set(weight_map[n] for n in names)):
        headers[fn] = header(fn)
    missing = sorted(expected - set(names))
    unexpected = sorted(set(names) - expected)
    found: list[_Entry] = []
    for e in entries:
        if e.name not in weight_map:
            continue
        fn = weight_map[e.name]
        if e.name not in headers[fn]:
            errors.append(f"{e.name}: listed in the index under {os.path.basename(fn)} but not in that file")
            continue
        shape, dt = headers[fn][e.name]
        if shape != e.shape:
            errors.append(f"{e.name}: shape mismatch, expected {list(e.shape)}, found {list(shape)} in "
                          f"{os.path.basename(fn)}")
        elif dt not in _ACCEPTED[e.dtype]:
            errors.append(f"{e.name}: dtype mismatch, expected {e.dtype}, found {dt} in {os.path.basename(fn)}")
        else:
            found.append(e)
    return found, fmt, missing, unexpected, skipped, errors


def load_checkpoint(model: nn.Module, path: str | os.PathLike, *, dtype: torch.dtype | str | None = None,
                    device: torch.device | str | None = None, strict: bool = True,
                    keep_mxfp4_scales: bool = True) -> LoadReport:
    """Stream an official-layout checkpoint into `model` (in place), shard by shard.

    Args:
        model: a module whose state_dict follows the internal naming contract; may live on
            `meta` (then it is materialised on `device`, default cpu, tensor by tensor).
        path: checkpoint directory (index + shards, or a single model.safetensors) or a
            .safetensors file.
        dtype: dtype for the non-F32 floating tensors (None: keep the model's); the official
            F32 tensors always become float32.
        device: target device (None: keep; cpu for meta tensors).
        strict: missing/unexpected tensors raise; otherwise they are only reported (missing
            tensors of a meta model are then left uninitialised). Mis-shaped or wrong-dtype
            tensors always raise, before anything is copied.
        keep_mxfp4_scales: remember the E8M0 scale bytes for byte-identical re-saves.
    Returns:
        LoadReport. Raises CheckpointError naming every offending tensor or file.
    """
    path = os.fspath(path)
    weight_map = read_weight_map(path)
    dt = target_dtype(dtype)
    state0 = model.state_dict(keep_vars=True)
    found, fmt, missing, unexpected, skipped, errors = _plan(state0, weight_map)
    del state0  # holding the old tensors would double peak memory while they are replaced
    if strict:
        errors += [f"{n}: missing from the checkpoint" for n in missing]
        errors += [f"{n}: unexpected tensor (the model has no such parameter)" for n in unexpected]
    if errors:
        raise CheckpointError(f"checkpoint {path} does not match the model ({len(errors)} problems):\n  "
                              + "\n  ".join(errors))
    _materialise(model, dt, device)
    state = model.state_dict(keep_vars=True)
    scales: dict[str, torch.Tensor] = {}
    if fmt == "mxfp4" and keep_mxfp4_scales:
        for e in found:
            if e.kind == "scale" and e.internal not in scales:
                E, n_out, n_in = state[e.internal].shape
                scales[e.internal] = torch.zeros(E, n_out, n_in // BLOCK, dtype=torch.uint8)
    by_file: dict[str, list[_Entry]] = defaultdict(list)
    for e in found:
        by_file[weight_map[e.name]].append(e)
    pending: dict[tuple[str, int], dict[str, torch.Tensor]] = defaultdict(dict)
    with torch.no_grad():
        for fn in sorted(by_file):
            with open_shard(fn) as f:
                for e in by_file[fn]:
                    try:
                        src = f.get_tensor(e.name)
                    except Exception as exc:
                        raise CheckpointError(f"{fn}: cannot read {e.name} ({exc})") from None
                    _apply(e, src, state, pending, scales, fn)
    if pending:  # strict=False with one half of a packed expert missing
        for (name, ex) in pending:
            missing.append(f"{PREFIX}{name} expert {ex} (incomplete MXFP4 pair)")
    if fmt == "mxfp4" and keep_mxfp4_scales:
        model._k3_mxfp4_scales = scales
    elif "_k3_mxfp4_scales" in model.__dict__:
        del model._k3_mxfp4_scales  # stale scales would describe other weights
    return LoadReport(files=sorted(by_file), experts_format=fmt, missing=missing, unexpected=unexpected,
                      skipped=skipped)


def _apply(e: _Entry, src: torch.Tensor, state: dict[str, torch.Tensor],
           pending: dict[tuple[str, int], dict[str, torch.Tensor]], scales: dict[str, torch.Tensor],
           fn: str) -> None:
    target = state[e.internal]
    if e.kind == "plain":
        target.copy_(src)
    elif e.kind == "a_log":
        H = target.shape[0]
        if (src[H:] != 0).any():
            raise CheckpointError(f"{e.name} in {fn}: padding entries {H}..{src.shape[0] - 1} must be exactly 0 "
                                  f"(the first {H} values are the per-head A_log)")
        target.copy_(src[:H])
    elif e.kind == "expert":
        target[e.expert].copy_(src)
    else:
        slot = pending[(e.internal, e.expert)]
        slot[e.kind] = src
        if len(slot) == 2:
            del pending[(e.internal, e.expert)]
            dev = target.device  # decode where the weights live (fast on GPU)
            target[e.expert].copy_(decode_mxfp4(slot["packed"].to(dev), slot["scale"].to(dev), dtype=target.dtype))
            if e.internal in scales:
                scales[e.internal][e.expert].copy_(slot["scale"])


# ---------------------------------------------------------------------------------------------
# saving


_ENCODE_CHUNK = 1 << 24  # weights per vectorised encode call (bounds the temporary memory)


def _experts_mxfp4(w: torch.Tensor, remembered: torch.Tensor | None, name: str
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack experts w [n, out, in] (remembered: uint8 [n, out, in/32] or None)."""
    w = w.detach().to("cpu")
    if not torch.isfinite(w).all():
        raise CheckpointError(f"{name}: non-finite weights cannot be written as MXFP4")
    if remembered is None or remembered.shape != (*w.shape[:-1], w.shape[-1] // BLOCK):
        return encode_mxfp4(w)
    return encode_mxfp4_reuse(w, remembered)


def _iter_experts(state: dict[str, torch.Tensor], group: str, fmt: str, out_dtype: torch.dtype,
                  scales: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """Per-expert official tensors of one stacked group, the matrices of one expert back to
    back; MXFP4 encoding is vectorised over chunks of experts."""
    mats = [(w, state[f"{group}.{w}"], scales.get(f"{group}.{w}")) for w in ("w1", "w2", "w3")]
    E = mats[0][1].shape[0]
    per = max(1, _ENCODE_CHUNK // max(1, mats[0][1][0].numel()))
    for e0 in range(0, E, per):
        e1 = min(E, e0 + per)
        chunk = {}
        for w, t, rem in mats:
            if fmt == "bf16":
                chunk[w] = (t[e0:e1].detach().to("cpu", out_dtype),)
            else:
                chunk[w] = _experts_mxfp4(t[e0:e1], None if rem is None else rem[e0:e1],
                                          f"{PREFIX}{group}.{e0}-{e1 - 1}.{w}")
        for e in range(e0, e1):
            for w, _, _ in mats:
                base = f"{PREFIX}{group}.{e}.{w}"
                # clone: safetensors refuses tensors that share storage within one file
                own = [x[e - e0].clone(memory_format=torch.contiguous_format) for x in chunk[w]]
                if fmt == "bf16":
                    yield f"{base}.weight", own[0]
                else:
                    yield f"{base}.weight_packed", own[0]
                    yield f"{base}.weight_scale", own[1]


def _iter_official(state: dict[str, torch.Tensor], fmt: str, out_dtype: torch.dtype,
                   scales: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (official name, contiguous CPU tensor not sharing storage) one at a time."""
    done: set[str] = set()
    for name, t in state.items():
        m = _EXPERT_RE.match(name)
        if name.startswith(VISION):
            yield name[len(VISION):], t.detach().to("cpu", out_dtype, copy=True).contiguous()
        elif m is None:
            if name.endswith("self_attn.A_log"):
                out = torch.zeros(a_log_padded_len(t.shape[0]), dtype=torch.float32)
                out[: t.shape[0]] = t.detach().to("cpu", torch.float32)
            else:
                want = torch.float32 if is_fp32_name(name) else out_dtype
                out = t.detach().to("cpu", want, copy=True).contiguous()
            yield PREFIX + name, out
        elif m["group"] not in done:
            done.add(m["group"])
            yield from _iter_experts(state, m["group"], fmt, out_dtype, scales)


def _check_model_layout(state: dict[str, torch.Tensor], cfg: K3Config) -> None:
    want = internal_shapes(cfg)
    errs = [f"{n}: missing from the model" for n in want if n not in state]
    errs += [f"{n}: not part of the K3 layout for this config" for n in state if n not in want]
    errs += [f"{n}: model shape {list(state[n].shape)} != config shape {list(want[n][0])}"
             for n in want if n in state and tuple(state[n].shape) != want[n][0]]
    if errs:
        raise CheckpointError("model does not match the config:\n  " + "\n  ".join(errs))


def _trains_mxfp4(model: nn.Module) -> bool:
    """True when the routed experts run through the MXFP4 fake quantiser (QAT, k3.quant.qat): their
    weights are then saved packed by default, and the packed tensors decode to exactly the fake-quantised
    weights the model computed with (the same OCP rule encodes the fp32 masters)."""
    return any(getattr(m, "weight_transform", None) is fake_quant_mxfp4 for m in model.modules())


def save_checkpoint(model: nn.Module, cfg: K3Config, path: str | os.PathLike, *,
                    max_shard_bytes: int = 5 * 2**30, experts_format: str | None = None,
                    dtype: str | torch.dtype | None = None) -> list[str]:
    """Write `model` in the official layout: shards `model-0000N-of-0000M.safetensors`,
    `model.safetensors.index.json` (metadata.total_size, weight_map) and config.json.

    Args:
        model: module with the internal naming contract, matching `cfg` (checked).
        cfg: the config to write (quantization_config adjusted to the experts format).
        path: target directory (created if absent; an existing checkpoint there is replaced).
        max_shard_bytes: shard size bound (a single tensor larger than it gets its own shard).
        experts_format: "mxfp4", "bf16" or None (= "mxfp4" iff cfg.experts_mxfp4 or the experts train
            with MXFP4 fake quantisation).
        dtype: storage dtype of the non-F32 tensors: "bfloat16" (default, official) or
            "float32" (lossless for an fp32 model; not the official dtype).
    Returns:
        the shard file names. Atomic: files are written into a temporary directory first and
        the index (the completeness marker) is moved in last; a crash leaves either the old
        checkpoint or the new one, never a mixture that carries an index.
    """
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes={max_shard_bytes}: must be positive")
    fmt = _check_format(experts_format if experts_format is not None or not _trains_mxfp4(model) else "mxfp4", cfg)
    out_dtype = target_dtype(dtype) or torch.bfloat16
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"dtype={dtype!r}: must be 'bfloat16' or 'float32'")
    state = model.state_dict()
    _check_model_layout(state, cfg)
    cfg_out = copy.deepcopy(cfg)
    if fmt == "mxfp4" and not cfg_out.experts_mxfp4:
        cfg_out.quantization_config = kimi_k3().quantization_config  # the official block
    elif fmt == "bf16" and cfg_out.experts_mxfp4:
        cfg_out.quantization_config = None
    cfg_out.dtype = "float32" if out_dtype == torch.float32 else "bfloat16"
    path = os.path.abspath(os.fspath(path))
    exists = os.path.isdir(path)
    parent = path if exists else os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.k3-save-", dir=parent)
    try:
        shards = write_shards(_iter_official(state, fmt, out_dtype, getattr(model, "_k3_mxfp4_scales", {})),
                               tmp, max_shard_bytes)
        cfg_out.save(os.path.join(tmp, "config.json"))
        commit(tmp, path, exists, shards)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return shards
