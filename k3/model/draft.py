"""EAGLE-3-style draft for speculative decoding: one decoder layer on fused target features.

The target (`K3ForCausalLM`) exposes the hidden states entering chosen layers through its existing
`hidden_state_layers` argument (`K3Model.forward`: index l < num_layers is the AttnRes mix entering
layer l's mixer, l = num_layers the pre-norm output mix). The draft takes three of them (low, middle,
high; `DraftConfig.target_layers`, `default_target_layers`) at position i, concatenates them [.., 3H] and projects them to H
(`fuse`). Entry i of the draft's sequence is the pair (feature of target position i, token i + 1);
its output predicts token i + 2:

    x_i   = cat(norm_e(embed(token_{i+1})), norm_f(feature_i))              [.., 2H]
    a_i   = o_proj(attention(q(x_i), k(x_<=i), v(x_<=i)))                   [.., H]
    h_i   = feature_i + a_i;  h_i = h_i + mlp(norm(h_i))                     (the draft's hidden)
    logits= lm_head(final_norm(h_i))

When the draft runs ahead of the target on its own guesses, its hidden h_i replaces the fused target
feature of the next entry (as in EAGLE-3; training unrolls this: `k3.draft.ttt`).

Choices:
* Attention is plain causal softmax attention without positional encoding (NoPE), not MLA/KDA: the
  draft sees at most a few thousand positions, its features already carry position information from
  the target's KDA layers (K3's own MLA layers are NoPE too), and a plain KV cache needs no rollback
  (the serving path drops its speculative entries) and can skip positions it has no feature for
  (prefix-cache hits) without renumbering anything. A recurrent (KDA) draft would need its own
  per-position state rollback.
* Vocabulary: the target's full vocabulary; the target's token embedding and LM head are shared by
  reference (`attach`), frozen and not stored in the draft checkpoint. A reduced draft vocabulary
  with a d2t map saves LM-head FLOPs only when the vocabulary is large relative to H (K3: 160k x 7168);
  for the k3 presets the shared head is simpler and keeps q over the same support as p, so rejection
  sampling needs no mapping.

Checkpoint: a directory with `config.json` ({"model_type": "k3_eagle3_draft", ...DraftConfig}) and
`model.safetensors` (the draft's own weights only), usually next to the target's. `load_draft` checks
it against the target (hidden size, vocabulary, layer indices) and says what does not match.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from k3.model.common import RMSNorm, glu_act
from k3.model.safetensors_io import CheckpointError, write_shard

MODEL_TYPE = "k3_eagle3_draft"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def default_target_layers(num_layers: int) -> tuple[int, int, int]:
    """(low, middle, high) capture indices for a target of `num_layers` layers: the states entering
    layer 1, the middle layer and the last layer. The output mix (index num_layers) works as well (the
    target then computes that mix a second time, unnormalised, so its own output keeps the fused
    output-mix + final-norm kernel's rounding) but is not the default."""
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    return (min(1, num_layers - 1), num_layers // 2, num_layers - 1)


@dataclass
class DraftConfig:
    """The draft's shape plus what it must match in its target.

    hidden_size / vocab_size: the target's (features and the shared embedding/LM head).
    target_num_layers: the target's depth; target_layers: the three capture indices in [0, depth]
    (`K3Model.forward(hidden_state_layers=...)` semantics). Attention: num_heads x head_dim.
    hidden_act / situ betas: the GLU of the MLP (the target's by default)."""

    hidden_size: int
    vocab_size: int
    target_num_layers: int
    target_layers: tuple[int, int, int]
    num_heads: int = 4
    head_dim: int = 64
    intermediate_size: int = 1024
    rms_norm_eps: float = 1e-5
    hidden_act: str = "silu"
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float = 25.0

    def __post_init__(self) -> None:
        self.target_layers = tuple(int(x) for x in self.target_layers)  # type: ignore[assignment]

    def validate(self) -> "DraftConfig":
        for name in ("hidden_size", "vocab_size", "target_num_layers", "num_heads", "head_dim", "intermediate_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"DraftConfig.{name} must be a positive integer, got {v!r}")
        if len(self.target_layers) != 3 or any(not 0 <= x <= self.target_num_layers for x in self.target_layers):
            raise ValueError(f"DraftConfig.target_layers must be 3 indices in [0, {self.target_num_layers}], "
                             f"got {self.target_layers}")
        return self

    @classmethod
    def for_target(cls, target_config: Any, **overrides: Any) -> "DraftConfig":
        """Defaults from a target `K3Config` (or its text_config): its hidden size, vocabulary, depth,
        activation; heads of 64 dims; an MLP 4x hidden."""
        tc = getattr(target_config, "text_config", target_config)
        d = tc.hidden_size
        base = dict(hidden_size=d, vocab_size=tc.vocab_size, target_num_layers=tc.num_hidden_layers,
                    target_layers=default_target_layers(tc.num_hidden_layers), num_heads=max(1, d // 64),
                    head_dim=min(64, d), intermediate_size=4 * d, rms_norm_eps=tc.rms_norm_eps,
                    hidden_act=tc.hidden_act, activation_situ_beta=tc.activation_situ_beta,
                    activation_situ_linear_beta=tc.activation_situ_linear_beta)
        return cls(**(base | overrides)).validate()

    def to_dict(self) -> dict[str, Any]:
        return {"model_type": MODEL_TYPE} | asdict(self) | {"target_layers": list(self.target_layers)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DraftConfig":
        if d.get("model_type") != MODEL_TYPE:
            raise CheckpointError(f"not a k3 draft config (model_type {d.get('model_type')!r}, expected {MODEL_TYPE!r})")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known - {"model_type"})
        if unknown:
            raise CheckpointError(f"draft config has unknown fields {unknown}")
        return cls(**{k: v for k, v in d.items() if k in known}).validate()


class _Shared:
    """The target's embedding and LM head, held by reference: a plain object, so nn.Module neither
    registers them as submodules (not in the draft's parameters or state_dict) nor moves them."""

    def __init__(self, embed: nn.Module, lm_head: nn.Module) -> None:
        self.embed, self.lm_head = embed, lm_head


class EagleDraft(nn.Module):
    """The draft layer. Shapes: tokens [B, T] long; features [B, T, H]; q/k/v [B, T, heads, head_dim]."""

    def __init__(self, config: DraftConfig) -> None:
        super().__init__()
        self.config = c = config.validate()
        d, a = c.hidden_size, c.num_heads * c.head_dim
        self.fc = nn.Linear(3 * d, d, bias=False)
        self.embed_norm = RMSNorm(d, c.rms_norm_eps)
        self.feature_norm = RMSNorm(d, c.rms_norm_eps)
        self.q_proj = nn.Linear(2 * d, a, bias=False)
        self.k_proj = nn.Linear(2 * d, a, bias=False)
        self.v_proj = nn.Linear(2 * d, a, bias=False)
        self.o_proj = nn.Linear(a, d, bias=False)
        self.post_attention_norm = RMSNorm(d, c.rms_norm_eps)
        self.gate_proj = nn.Linear(d, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(d, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, d, bias=False)
        self.norm = RMSNorm(d, c.rms_norm_eps)
        self.shared: _Shared | None = None

    # ---- target coupling ----------------------------------------------------------------------------
    def attach(self, target: nn.Module) -> "EagleDraft":
        """Share `target`'s (a K3ForCausalLM) token embedding and LM head; checks that they fit."""
        check_compatible(self.config, target.config)
        self.shared = _Shared(target.model.embed_tokens, target.lm_head)
        return self

    def _need_shared(self) -> _Shared:
        if self.shared is None:
            raise RuntimeError("EagleDraft: call attach(target) first (the embedding and LM head are the target's)")
        return self.shared

    # ---- pieces (the serving path and the training unroll compose them) --------------------------------
    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """aux: [..., 3H] (the three captured target states concatenated) -> fused feature [..., H]."""
        return self.fc(aux.to(self.fc.weight.dtype))

    def qkv(self, tokens: torch.Tensor, features: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """tokens [B, T], features [B, T, H] -> q, k, v each [B, T, heads, head_dim]."""
        emb = self._need_shared().embed(tokens).to(features.dtype)
        x = torch.cat([self.embed_norm(emb), self.feature_norm(features)], -1)
        shape = (*tokens.shape, self.config.num_heads, self.config.head_dim)
        return self.q_proj(x).view(shape), self.k_proj(x).view(shape), self.v_proj(x).view(shape)

    def finish(self, features: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """features [B, T, H], attention output [B, T, heads, head_dim] -> the draft's hidden [B, T, H]."""
        h = features + self.o_proj(attn.flatten(-2))
        c = self.config
        m = glu_act(self.gate_proj(self.post_attention_norm(h)), self.up_proj(self.post_attention_norm(h)),
                    c.hidden_act, c.activation_situ_beta, c.activation_situ_linear_beta)
        return h + self.down_proj(m)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> logits [..., vocab] through the shared LM head."""
        head = self._need_shared().lm_head
        return head(self.norm(hidden).to(head.weight.dtype))

    def forward(self, tokens: torch.Tensor, features: torch.Tensor, past_k: torch.Tensor | None = None,
                past_v: torch.Tensor | None = None, past_valid: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run new entries after a cache. tokens [B, T], features [B, T, H]; past_k/past_v
        [B, S, heads, head_dim] with past_valid [B, S] bool (padding False). New entry t attends to the
        valid past and new entries <= t (right padding of the new entries is harmless: a valid entry
        never sees a later one). Returns (hidden [B, T, H], k, v of the new entries)."""
        q, k, v = self.qkv(tokens, features)
        B, T = tokens.shape
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        if past_k is not None and past_k.shape[1] > 0:
            keys, values = torch.cat([past_k, k], 1), torch.cat([past_v, v], 1)
            mask = torch.cat([past_valid[:, None, :].expand(B, T, -1), causal.expand(B, T, T)], -1)
        else:
            keys, values, mask = k, v, causal.expand(B, T, T)
        return self.finish(features, attend(q, keys, values, mask)), k, v


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Softmax attention. q [B, T, h, d], k/v [B, S, h, d], mask [B, T, S] bool (True = may attend;
    every query row needs at least one True) -> [B, T, h, d]."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask[:, None])
    return out.transpose(1, 2)


def check_compatible(config: DraftConfig, target_config: Any) -> None:
    """CheckpointError naming every field where the draft does not fit the target config."""
    tc = getattr(target_config, "text_config", target_config)
    bad = [f"{name}: draft {mine}, target {theirs}" for name, mine, theirs in (
        ("hidden_size", config.hidden_size, tc.hidden_size), ("vocab_size", config.vocab_size, tc.vocab_size),
        ("num_hidden_layers", config.target_num_layers, tc.num_hidden_layers)) if mine != theirs]
    if bad:
        raise CheckpointError("the draft was not trained for this target model (" + "; ".join(bad) + ")")


def save_draft(draft: EagleDraft, path: str | os.PathLike) -> None:
    """Write config.json + model.safetensors (the draft's own weights, fp32 copies) into `path`,
    atomically: a temporary directory, then a rename over any existing one."""
    path = os.fspath(path)
    tmp = f"{path.rstrip(os.sep)}.tmp{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    write_shard({k: v.detach().to("cpu").contiguous() for k, v in draft.state_dict().items()},
                os.path.join(tmp, WEIGHTS_FILE))
    with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
        json.dump(draft.config.to_dict(), f, indent=1)
    if os.path.isdir(path):
        old = f"{path.rstrip(os.sep)}.old{os.getpid()}"
        os.replace(path, old)
        os.replace(tmp, path)
        _rmtree(old)
    else:
        os.replace(tmp, path)


def _rmtree(path: str) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def load_draft(path: str | os.PathLike, target: nn.Module | None = None, *,
               device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> EagleDraft:
    """The draft saved at `path`; attached to `target` (checked against it) when given, on the target's
    device and dtype unless device/dtype say otherwise. CheckpointError / FileNotFoundError on a
    directory that is not a draft, missing or extra tensors, or a draft of another target."""
    path = os.fspath(path)
    cfg_path, w_path = os.path.join(path, CONFIG_FILE), os.path.join(path, WEIGHTS_FILE)
    for p in (cfg_path, w_path):
        if not os.path.isfile(p):
            raise FileNotFoundError(f"--draft {path}: no {os.path.basename(p)} (expected a `k3 train-draft` output dir)")
    with open(cfg_path) as f:
        try:
            config = DraftConfig.from_dict(json.load(f))
        except (json.JSONDecodeError, TypeError, ValueError) as e:
            raise CheckpointError(f"{cfg_path}: {e}") from None
    draft = EagleDraft(config)
    from safetensors.torch import load_file

    state = load_file(w_path)
    missing, extra = sorted(set(draft.state_dict()) - set(state)), sorted(set(state) - set(draft.state_dict()))
    if missing or extra:
        raise CheckpointError(f"{w_path}: missing tensors {missing}, unexpected tensors {extra}")
    bad = [f"{k} {list(v.shape)} vs {list(draft.state_dict()[k].shape)}" for k, v in state.items()
           if v.shape != draft.state_dict()[k].shape]
    if bad:
        raise CheckpointError(f"{w_path}: tensor shapes do not match the config: {bad}")
    draft.load_state_dict(state)
    if target is not None:
        draft.attach(target)
        w = target.lm_head.weight
        device, dtype = device or w.device, dtype or w.dtype
    return draft.to(device=device, dtype=dtype).eval()
