"""`K3ForCausalLM`: the backbone plus the untied lm_head, checkpoint I/O, caches and log-probs."""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from k3.config import K3Config
from k3.kernel_config import KernelConfig
from k3.model.cache import HybridCache
from k3.model.common import KEEP_FP32
from k3.model.compile import set_kernel_config
from k3.model.fused import plain_weight
from k3.model.kda import KDAttention
from k3.model.model import K3Model, ResVector
from k3.model.step_weights import StepLinear
from k3.model.vision import MoonViTEncoder, VisionConfig
from k3.ops.cross_entropy.logprobs import linear_token_logprobs
from k3.ops.cross_entropy.reference import IGNORE_INDEX

_NO_VISION = ("media: this model has no vision encoder (config.vision_config is None); "
              "use a vision-language preset such as k3-tiny-vl")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class CausalLMOutput:
    """logits: [B, T, vocab] in the lm_head's compute dtype, or None when the forward was asked for the
    loss only (return_logits=False); loss: mean token cross-entropy (fp32) or None;
    hidden_states: {layer index: [B, T, d]} for the layers asked for."""

    logits: torch.Tensor | None
    loss: torch.Tensor | None = None
    hidden_states: dict[int, torch.Tensor] = field(default_factory=dict)


class K3ForCausalLM(nn.Module):
    def __init__(self, config: K3Config, kernels: KernelConfig | None = None) -> None:
        """kernels: which hot regions run Triton kernels (`k3.kernel_config`); default config.kernels.
        `k3.model.compile.set_kernel_config` changes it later."""
        super().__init__()
        config.validate()
        self.config = config
        tc = config.text_config
        self.model = K3Model(tc)
        self.lm_head = StepLinear(tc.hidden_size, tc.vocab_size)
        # Internal names `vision.vision_tower.*` / `vision.mm_projector.*`; the checkpoint adapter
        # writes them as the official `vision_tower.*` / `mm_projector.*`.
        self.vision: MoonViTEncoder | None = None
        if config.vision_config is not None:
            self.vision = MoonViTEncoder(VisionConfig.from_dict(config.vision_config, text_hidden_size=tc.hidden_size))
        set_kernel_config(self, config.kernels if kernels is None else KernelConfig.from_dict(kernels))

    # ---- forward ---------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor | None = None, *, labels: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
                cache: HybridCache | None = None, hidden_state_layers: list[int] | None = None,
                logits_to_keep: int = 0, logits_index: torch.Tensor | None = None,
                media: list[torch.Tensor] | None = None,
                media_embeds: torch.Tensor | None = None, return_logits: bool = True) -> CausalLMOutput:
        """input_ids: [B, T] long (packed [1, total] with `cu_seqlens` [N+1]).
        labels: [B, T] target ids aligned with the inputs (already shifted), -100 = ignore.
        logits_to_keep: if > 0, only the last that many positions get logits (e.g. 1 for decoding).
        logits_index: long [n] flat positions of the [B * T] grid that get logits (e.g. only the targets
            of an SFT batch); logits is then [n, V] and `labels` is not taken.
        media / media_embeds: images [3, H, W] and videos [T, 3, H, W] (normalised floats), or their
            `encode_media` output [N, hidden]; they replace the `media_placeholder_token_id` positions
            of input_ids in row-major order (see `embed_with_media`).
        return_logits: False (with labels) returns logits=None and only the loss, which may then be
            computed without materialising the logits (`Kernels.lm_loss`: the default when training on
            CUDA, kernels.cross_entropy); training loops that read only `.loss` pass False.
        """
        if not return_logits and labels is None:
            raise ValueError("return_logits=False needs labels: the loss is all the output would hold")
        input_ids, inputs_embeds = self._splice_media(input_ids, media, media_embeds, inputs_embeds)
        h, hidden = self.model(input_ids, inputs_embeds=inputs_embeds, cu_seqlens=cu_seqlens, cache=cache,
                               hidden_state_layers=hidden_state_layers)
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        if logits_index is not None:
            if labels is not None or logits_to_keep:
                raise ValueError("logits_index selects the positions itself: pass neither labels nor logits_to_keep")
            return CausalLMOutput(logits=self.lm_head(h.flatten(0, 1).index_select(0, logits_index)), loss=None,
                                  hidden_states=hidden)
        if labels is not None and labels.shape != h.shape[:2]:
            raise ValueError(f"labels must be {list(h.shape[:2])}, got {list(labels.shape)}")
        if not return_logits:
            return CausalLMOutput(logits=None, loss=self.model.kernels.lm_loss(h, self.lm_head, labels),
                                  hidden_states=hidden)
        logits = self.lm_head(h)
        loss = None
        if labels is not None:
            loss = self.model.kernels.cross_entropy(logits, labels)  # fp32 CE; one fused region when compiled
        return CausalLMOutput(logits=logits, loss=loss, hidden_states=hidden)

    # ---- media -------------------------------------------------------------------------------------
    def _splice_media(self, input_ids: torch.Tensor | None, media: list[torch.Tensor] | None,
                      media_embeds: torch.Tensor | None, inputs_embeds: torch.Tensor | None
                      ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(input_ids, inputs_embeds) for `K3Model`: with media (or media pads in input_ids) the
        embeddings with the media spliced in (`embed_with_media`) and no ids; else as given."""
        if media is None and media_embeds is None and not self._has_pads(input_ids):
            return input_ids, inputs_embeds
        return None, self.embed_with_media(input_ids, media=media, media_embeds=media_embeds,
                                           inputs_embeds=inputs_embeds)

    def _has_pads(self, input_ids: torch.Tensor | None) -> bool:
        """A vision model must never embed `<|media_pad|>` as a plain token (a forgotten image)."""
        return (self.vision is not None and input_ids is not None
                and bool((input_ids == self.config.media_placeholder_token_id).any()))

    def encode_media(self, media: list[torch.Tensor]) -> torch.Tensor:
        """Images float [3, H, W] / videos float [T, 3, H, W] (pixels normalised as (x/255-0.5)/0.5)
        -> projected embeddings [N, hidden] in the weights' dtype, items concatenated in order
        (N = sum of their media-token counts)."""
        if self.vision is None:
            raise ValueError(_NO_VISION)
        return torch.cat(self.vision.encode(media))

    def embed_with_media(self, input_ids: torch.Tensor, *, media: list[torch.Tensor] | None = None,
                         media_embeds: torch.Tensor | None = None,
                         inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Token embeddings [B, T, d] with every `media_placeholder_token_id` position replaced, in
        row-major order (row 0 left to right, then row 1, ...), by the rows of `media_embeds`
        ([N, d]) or of `encode_media(media)`. With a cache, pass only the embeddings of the pads in
        this chunk. Raises ValueError when the counts differ (both are named)."""
        if self.vision is None:
            raise ValueError(_NO_VISION)
        if input_ids is None:
            raise ValueError("media: input_ids are needed to find the media placeholder positions")
        if media is not None and media_embeds is not None:
            raise ValueError("pass media or media_embeds, not both")
        if media:  # an empty list is a chunk without media
            media_embeds = self.encode_media(media)
        x = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        pads = (input_ids == self.config.media_placeholder_token_id).flatten()
        n_pads = int(pads.sum())
        n_embeds = 0 if media_embeds is None else media_embeds.shape[0]
        if n_pads != n_embeds:
            raise ValueError(f"media: input_ids hold {n_pads} media placeholder tokens (id "
                             f"{self.config.media_placeholder_token_id}) but {n_embeds} media embeddings were given")
        if n_pads == 0:
            return x
        if media_embeds.dim() != 2 or media_embeds.shape[1] != x.shape[-1]:
            raise ValueError(f"media_embeds: expected [{n_pads}, {x.shape[-1]}], got {list(media_embeds.shape)}")
        idx = pads.nonzero().squeeze(1)
        flat = x.flatten(0, 1).index_copy(0, idx, media_embeds.to(x.dtype))
        return flat.view_as(x)

    def token_logprobs(self, input_ids: torch.Tensor, *, cu_seqlens: torch.Tensor | None = None,
                       temperature: float = 1.0, media: list[torch.Tensor] | None = None,
                       media_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """log p(x_t | x_<t) for t >= 1 of each row: [B, T] fp32 with position 0 (and each packed
        document's first token) set to 0. For RL and distillation: differentiable, and the [B, T, vocab]
        logits are never materialised (`k3.ops.cross_entropy.logprobs.linear_token_logprobs`: chunks of
        about 1 GiB of fp32 logits, recomputed in the backward). An lm_head weight held as a tensor
        subclass (FSDP-sharded) takes the full-logits path through `forward` instead."""
        if not plain_weight(self.lm_head.weight):
            logits = self(input_ids, cu_seqlens=cu_seqlens, media=media,
                          media_embeds=media_embeds).logits.float() / temperature
            lp = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
            lp[:, 1:] = torch.log_softmax(logits[:, :-1], -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
        else:
            ids, embeds = self._splice_media(input_ids, media, media_embeds, None)
            h, _ = self.model(ids, inputs_embeds=embeds, cu_seqlens=cu_seqlens)
            targets = torch.full_like(input_ids, IGNORE_INDEX)
            targets[:, :-1] = input_ids[:, 1:]  # row t predicts token t + 1; the last position has no target
            lp_next = linear_token_logprobs(h.reshape(-1, h.shape[-1]), self.lm_head.weight, targets.reshape(-1),
                                            temperature=temperature).view(input_ids.shape)
            lp = torch.cat([lp_next.new_zeros(input_ids.shape[0], 1), lp_next[:, :-1]], dim=1)
        if cu_seqlens is not None:
            lp[0, cu_seqlens[:-1].long().clamp(max=input_ids.shape[1] - 1)] = 0.0
        return lp

    def set_kda_backend(self, backend: str) -> "K3ForCausalLM":
        """Choose the KDA backend of every KDA layer ("auto", "reference", "torch", "triton")."""
        for m in self.modules():
            if isinstance(m, KDAttention):
                m.kda_backend = backend
        return self

    @contextlib.contextmanager
    def step_weights(self) -> Iterator[None]:
        """Context for one optimizer step's micro-batches (forward + backward each) in single-process
        training: the compute-dtype copies of the weights the training GEMMs use (the routed experts always;
        under autocast every dense projection, concatenated groups included, and the lm_head when the loss
        goes through the module, not the fused loss of `Kernels.lm_loss`, which casts inside and returns
        an fp32 gradient) are made once and shared, and their gradients are added straight into the
        fp32 `.grad` (see `k3.model.step_weights`). Leave it before the optimizer changes the weights. Not
        for FSDP / expert-parallel models, whose gradient hooks would not see those gradients.

        Every module that declares `step_cache` (RoutedExperts, StepLinear, GLUMLP, KDAttention) gets its
        own empty cache here; all are dropped on exit, so the copies live for one step."""
        mods = [m for m in self.modules() if hasattr(m, "step_cache")]
        if any(m.step_cache is not None for m in mods):
            raise RuntimeError("step_weights() is already active (nested steps would share stale weights)")
        for m in mods:
            m.step_cache = {}
        try:
            yield
        finally:
            for m in mods:
                m.step_cache = None

    def new_cache(self, num_seqs: int, *, capacity: int = 256, absorb_mla: bool = True) -> HybridCache:
        p = self.lm_head.weight
        return HybridCache(self.config.text_config, num_seqs, dtype=p.dtype, device=p.device, capacity=capacity,
                           absorb_mla=absorb_mla)

    # ---- parameters --------------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, seed: int | None = None, std: float = 0.02) -> "K3ForCausalLM":
        """Random initialisation for training from scratch (materialises a meta model on CPU)."""
        if any(p.is_meta for p in self.parameters()):
            self.to_empty(device="cpu")
        gen = torch.Generator(device="cpu")
        gen.manual_seed(0 if seed is None else seed)
        for name, p in self.named_parameters():
            if name.startswith("vision."):
                continue  # initialised below (its own norm names and position table)
            if name.endswith("norm.weight") or name.endswith("res_norm.weight"):
                p.fill_(1.0)
            elif name.endswith("res_proj.weight"):
                p.zero_()
            elif p.dim() >= 2:
                fan_in = p.shape[-1]
                s = std if "conv1d" not in name else 1.0 / math.sqrt(fan_in)
                p.copy_(torch.randn(p.shape, generator=gen) * s)
        for m in self.modules():
            if isinstance(m, KDAttention):
                m.reset_kda_parameters()
            if hasattr(m, "e_score_correction_bias"):
                m.e_score_correction_bias.zero_()
        if self.vision is not None:
            self.vision.reset_parameters(gen, std)
        return self

    def to_dtype(self, dtype: torch.dtype | str) -> "K3ForCausalLM":
        """Cast to `dtype`, keeping the tensors the official math holds in fp32 (A_log, dt_bias, conv
        weights, o_norm, router bias) in fp32."""
        dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
        for t in list(self.parameters()) + list(self.buffers()):
            if t.is_floating_point():
                t.data = t.data.to(torch.float32 if getattr(t, KEEP_FP32, False) else dtype)
        return self

    def num_parameters(self) -> tuple[int, int]:
        """(total, active per token). Total includes the vision encoder. Active counts every non-routed
        text weight plus top-k/E of the routed experts, and leaves out the input embedding table (a
        lookup, not compute), as the K3 report does, and the vision encoder (it runs per image)."""
        tc = self.config.text_config
        total = sum(p.numel() for p in self.parameters())
        routed = sum(p.numel() for n, p in self.named_parameters() if ".experts.w" in n)
        embed = self.model.embed_tokens.weight.numel()
        text = total - self.num_vision_parameters()
        return total, text - routed - embed + routed * tc.num_experts_per_token // tc.num_experts

    def num_vision_parameters(self) -> int:
        """Parameters of the vision tower + projector (0 for a text-only model); part of the total."""
        return 0 if self.vision is None else sum(p.numel() for p in self.vision.parameters())

    # ---- checkpoint I/O ------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, dtype: torch.dtype | str | None = None,
                        device: torch.device | str | None = None, strict: bool = True) -> "K3ForCausalLM":
        """Load an official-format checkpoint directory (sharded or single-file safetensors).

        Builds the model on `meta` and streams tensors shard by shard into `device` (default CPU) as
        `dtype` (default: the config's dtype), so peak host memory is about one model.
        """
        from k3.model.checkpoint import load_checkpoint

        config = K3Config.load(path)
        with torch.device("meta"):
            model = cls(config)
        dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
        load_checkpoint(model, path, dtype=dtype or DTYPES[config.dtype], device=device or "cpu", strict=strict)
        return model

    def save_pretrained(self, path: str | os.PathLike, *, max_shard_bytes: int = 5 * 2**30,
                        experts_format: str | None = None, dtype: str | None = None) -> list[str]:
        """Write the official layout: sharded safetensors + index + config.json (atomically).

        Tensors are stored BF16 (the official dtypes) unless `dtype="float32"`; experts are
        MXFP4-packed when the config has the MXFP4 quantization_config (or `experts_format="mxfp4"`).
        """
        from k3.model.checkpoint import save_checkpoint

        return save_checkpoint(self, self.config, path, max_shard_bytes=max_shard_bytes,
                               experts_format=experts_format, dtype=dtype)


__all__ = ["K3ForCausalLM", "CausalLMOutput", "ResVector"]
