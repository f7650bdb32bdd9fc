"""Per-Head Muon: Muon with block-wise (per attention head / per expert) orthogonalisation.

One :class:`PerHeadMuon` object optimises the whole model. Each param group carries a
``kind``:

* ``"muon"`` -- every parameter has a block spec (``"block_specs"``, aligned with ``"params"``)
  describing how its momentum is cut into independent matrices before Newton-Schulz:

  ============  ===================  =====================================================
  spec          parameter shape      blocks (each orthogonalised on its own)
  ============  ===================  =====================================================
  ``whole``     [m, n]               the matrix itself
  ``rows b``    [N*b, n]             N blocks of [b, n] (rows h*b .. h*b+b-1, one per head)
  ``cols b``    [m, N*b]             N blocks of [m, b] (columns h*b .. h*b+b-1)
  ``experts``   [E, m, n]            E blocks of [m, n] (one per expert)
  ============  ===================  =====================================================

* ``"adamw"`` -- plain AdamW with decoupled weight decay.

Muon update for a parameter W with gradient G (momentum mu, Nesterov by default, same
algebra as ``torch.optim.Muon``)::

    B <- mu*B + (1-mu)*G                      (fp32 momentum buffer)
    U <- (1-mu)*G + mu*B   (Nesterov)  or  B
    O_j <- NS5(U_j) for every block U_j       (per-block Frobenius normalisation, 5 quintic steps)
    W <- W * (1 - lr*wd)
    W_j <- W_j - lr * 0.2*sqrt(max(m_j, n_j)) * O_j

The 0.2*sqrt(max(m, n)) factor makes the update RMS match AdamW's (Moonlight, "Muon is
Scalable"), using the *block* shape, so a [K, d] head slice is scaled like a [K, d] matrix.
Newton-Schulz runs batched: all blocks of one shape (across every parameter and group) are
stacked and go through one batched call.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

__all__ = ["BlockSpec", "PerHeadMuon", "newton_schulz", "split_blocks", "merge_blocks"]

# Quintic coefficients tuned for bf16 (Keller Jordan's Muon; also torch.optim.Muon's default).
NS_COEFFICIENTS: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
_BLOCK_KINDS = ("whole", "rows", "cols", "experts")
_NS_DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}


class BlockSpec(NamedTuple):
    """How a Muon parameter is cut into independent matrices.

    kind: "whole" | "rows" | "cols" | "experts"; block: block size along dim 0 ("rows") or
    dim 1 ("cols"), 0 otherwise. Stored in param groups as a plain tuple so optimizer
    checkpoints load with ``torch.load(weights_only=True)``.
    """

    kind: str
    block: int = 0

    @staticmethod
    def whole() -> "BlockSpec":
        return BlockSpec("whole", 0)

    @staticmethod
    def rows(block: int) -> "BlockSpec":
        return BlockSpec("rows", int(block))

    @staticmethod
    def cols(block: int) -> "BlockSpec":
        return BlockSpec("cols", int(block))

    @staticmethod
    def experts() -> "BlockSpec":
        return BlockSpec("experts", 0)


def _check_spec(spec: Sequence[Any], shape: torch.Size, where: str) -> tuple[str, int]:
    """Validate a block spec against a parameter shape; returns it as a plain tuple."""
    if len(spec) != 2 or spec[0] not in _BLOCK_KINDS:
        raise ValueError(f"{where}: block spec must be (kind, block) with kind in {_BLOCK_KINDS}, got {spec!r}")
    kind, block = str(spec[0]), int(spec[1])
    if kind == "experts":
        if len(shape) != 3:
            raise ValueError(f"{where}: 'experts' block spec needs a 3-D [E, out, in] parameter, got {tuple(shape)}")
        return kind, 0
    if len(shape) != 2:
        raise ValueError(f"{where}: '{kind}' block spec needs a 2-D parameter, got {tuple(shape)}")
    if kind == "whole":
        return kind, 0
    dim = 0 if kind == "rows" else 1
    if block <= 0 or shape[dim] % block != 0:
        raise ValueError(
            f"{where}: '{kind}' block size {block} must be positive and divide dim {dim} of {tuple(shape)}"
        )
    return kind, block


def split_blocks(x: Tensor, spec: Sequence[Any]) -> Tensor:
    """View/copy a parameter-shaped tensor as a stack of blocks [num_blocks, m, n]."""
    kind, block = spec[0], int(spec[1])
    if kind == "whole":
        return x.unsqueeze(0)
    if kind == "rows":
        return x.reshape(x.shape[0] // block, block, x.shape[1])
    if kind == "cols":
        return x.reshape(x.shape[0], x.shape[1] // block, block).transpose(0, 1)
    if kind == "experts":
        return x
    raise ValueError(f"spec: unknown block kind {kind!r}")


def merge_blocks(blocks: Tensor, spec: Sequence[Any], shape: torch.Size) -> Tensor:
    """Inverse of :func:`split_blocks`: [num_blocks, m, n] -> parameter shape."""
    kind = spec[0]
    if kind == "whole":
        return blocks[0]
    if kind == "rows":
        return blocks.reshape(shape)
    if kind == "cols":
        return blocks.transpose(0, 1).reshape(shape)
    if kind == "experts":
        return blocks
    raise ValueError(f"spec: unknown block kind {kind!r}")


def newton_schulz(
    x: Tensor,
    steps: int = NS_STEPS,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = 1e-7,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Approximate orthogonalisation (U V^T of the SVD) of every matrix in a batch.

    x: [B, m, n] (any float dtype). Each matrix is divided by its own Frobenius norm (so the
    spectral norm is <= 1) and put through ``steps`` quintic iterations
    X <- a X + (b A + c A^2) X with A = X X^T, computed in ``dtype`` on the wide
    orientation (m <= n). Singular values land roughly in [0.7, 1.2] rather than exactly 1,
    which is the intended Muon behaviour. Returns [B, m, n] in ``dtype``.
    """
    if x.ndim != 3:
        raise ValueError(f"x: expected [B, m, n], got shape {tuple(x.shape)}")
    if not 0 < steps < 100:
        raise ValueError(f"steps: must be in 1..99, got {steps}")
    a, b, c = coefficients
    y = x.to(dtype)
    tall = y.shape[1] > y.shape[2]
    if tall:
        y = y.transpose(1, 2)
    norm = torch.linalg.vector_norm(y, dim=(1, 2), keepdim=True)
    y = y / norm.clamp(min=eps)
    for _ in range(steps):
        gram = torch.bmm(y, y.transpose(1, 2))
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        y = torch.baddbmm(y, poly, y, beta=a)
    if tall:
        y = y.transpose(1, 2)
    return y.contiguous()


def _resolve_ns_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' -> bf16 on CUDA (tensor cores), fp32 elsewhere (CPU bf16 matmul is slow and lossy)."""
    if name not in _NS_DTYPES:
        raise ValueError(f"ns_dtype: expected one of {sorted(_NS_DTYPES)}, got {name!r}")
    resolved = _NS_DTYPES[name]
    if resolved is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return resolved


class _Pending(NamedTuple):
    """One Muon parameter waiting for its orthogonalised blocks."""

    param: Tensor
    group: dict
    spec: tuple[str, int]
    blocks: Tensor  # [nb, m, n] nesterov momentum blocks


class PerHeadMuon(torch.optim.Optimizer):
    """Muon (block-wise, batched Newton-Schulz) + AdamW in one optimizer.

    params: iterable of param-group dicts; each has ``kind`` ("muon" or "adamw") and
    ``params``; Muon groups may give ``block_specs`` (one (kind, block) per parameter; default
    whole for 2-D, experts for 3-D). Per-group overrides of any default are allowed.

    Defaults: lr (Muon and AdamW unless the group overrides), weight_decay (decoupled:
    p *= 1 - lr*wd), momentum / nesterov / ns_steps / ns_coefficients / eps (Muon), betas /
    adam_eps (AdamW), ns_dtype ("auto": bf16 on CUDA, fp32 on CPU; or "float32"/"bfloat16").
    Parameters may be fp32 or bf16; optimizer state is fp32.
    """

    def __init__(
        self,
        params: Iterable[dict[str, Any]],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = NS_STEPS,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = 1e-7,
        betas: tuple[float, float] = (0.9, 0.95),
        adam_eps: float = 1e-8,
        ns_dtype: str = "auto",
    ) -> None:
        if lr < 0:
            raise ValueError(f"lr: must be >= 0, got {lr}")
        if weight_decay < 0:
            raise ValueError(f"weight_decay: must be >= 0, got {weight_decay}")
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum: must be in [0, 1), got {momentum}")
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"betas: each must be in [0, 1), got {betas}")
        if ns_dtype not in _NS_DTYPES:
            raise ValueError(f"ns_dtype: expected one of {sorted(_NS_DTYPES)}, got {ns_dtype!r}")
        defaults = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
            ns_steps=ns_steps, ns_coefficients=tuple(ns_coefficients), eps=eps,
            betas=tuple(betas), adam_eps=adam_eps, ns_dtype=ns_dtype,
        )
        groups = list(params)
        if not groups or not all(isinstance(g, dict) for g in groups):
            raise ValueError("params: expected a non-empty list of param-group dicts with a 'kind' key")
        super().__init__(groups, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        kind = param_group.get("kind")
        if kind not in ("muon", "adamw"):
            raise ValueError(f"param_group['kind']: expected 'muon' or 'adamw', got {kind!r}")
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if kind == "muon":
            group["block_specs"] = self._normalise_specs(group)

    @staticmethod
    def _normalise_specs(group: dict[str, Any]) -> list[tuple[str, int]]:
        params = group["params"]
        specs = group.get("block_specs")
        names = group.get("names") or [f"params[{i}]" for i in range(len(params))]
        if specs is None:
            specs = [("experts", 0) if p.ndim == 3 else ("whole", 0) for p in params]
        if len(specs) != len(params):
            raise ValueError(
                f"param_group['block_specs']: {len(specs)} specs for {len(params)} params"
            )
        return [_check_spec(s, p.shape, f"muon param {n}") for s, p, n in zip(specs, params, names)]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Like torch's, but state stays exact fp32: torch would round it to a bf16 param's dtype."""
        saved = state_dict["state"]
        super().load_state_dict(state_dict)
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for idx, p in zip(ids, params):
            for key, value in saved.get(idx, {}).items():
                if key != "step" and torch.is_tensor(value) and value.is_floating_point():
                    self.state[p][key] = value.to(device=p.device, dtype=torch.float32, copy=True)

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 - torch.optim signature
        """One optimisation step over all groups; returns closure() if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        pending: list[_Pending] = []
        for group in self.param_groups:
            if group["kind"] == "muon":
                pending.extend(self._muon_momentum(group))
            else:
                self._adamw_step(group)
        self._apply_muon(pending)
        return loss

    def _muon_momentum(self, group: dict[str, Any]) -> list[_Pending]:
        """Update momentum buffers; return the Nesterov update of each param, split into blocks."""
        out = []
        mu = group["momentum"]
        for p, spec in zip(group["params"], group["block_specs"]):
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("PerHeadMuon does not support sparse gradients")
            grad = p.grad.float()
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32)
            buf = state["momentum_buffer"]
            buf.lerp_(grad, 1 - mu)
            update = grad.lerp(buf, mu) if group["nesterov"] else buf
            out.append(_Pending(p, group, spec, split_blocks(self._full(update), spec)))
        return out

    # ---- hooks for sharded parameters (k3.distributed overrides these three) --------------------
    def _full(self, update: Tensor) -> Tensor:
        """The whole-parameter update that Newton-Schulz sees (identity on one device)."""
        return update

    def _apply_delta(self, param: Tensor, delta: Tensor, lr: float, wd: float, scale: float) -> None:
        """param <- param * (1 - lr * wd) - lr * scale * delta, delta being the whole orthogonalised update."""
        if wd != 0:
            param.mul_(1 - lr * wd)
        param.add_(delta.to(param.dtype), alpha=-lr * scale)

    def _local(self, t: Tensor) -> Tensor:
        """The tensor AdamW updates elementwise (identity on one device)."""
        return t

    def _apply_muon(self, pending: list[_Pending]) -> None:
        """Batched Newton-Schulz per shape bucket, then scaled update + decoupled weight decay."""
        buckets: dict[tuple, list[int]] = {}
        for i, item in enumerate(pending):
            g = item.group
            dtype = _resolve_ns_dtype(g["ns_dtype"], item.param.device)
            key = (tuple(item.blocks.shape[1:]), item.param.device, dtype,
                   g["ns_steps"], tuple(g["ns_coefficients"]), g["eps"])
            buckets.setdefault(key, []).append(i)
        for (shape, _, dtype, steps, coeffs, eps), members in buckets.items():
            stacked = torch.cat([pending[i].blocks for i in members], dim=0)
            ortho = newton_schulz(stacked, steps, coeffs, eps, dtype)
            sizes = [pending[i].blocks.shape[0] for i in members]
            scale = 0.2 * math.sqrt(max(shape))
            for i, chunk in zip(members, torch.split(ortho, sizes, dim=0)):
                item = pending[i]
                self._apply_delta(item.param, merge_blocks(chunk, item.spec, item.param.shape),
                                  item.group["lr"], item.group["weight_decay"], scale)

    def _adamw_step(self, group: dict[str, Any]) -> None:
        """Standard AdamW (bias-corrected moments, decoupled weight decay), fp32 state."""
        beta1, beta2 = group["betas"]
        lr, wd, eps = group["lr"], group["weight_decay"], group["adam_eps"]
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("PerHeadMuon (AdamW part) does not support sparse gradients")
            state = self.state[p]
            if "exp_avg" not in state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
            state["step"] += 1
            t = float(state["step"])
            w, grad = self._local(p), self._local(p.grad).float()
            exp_avg, exp_avg_sq = self._local(state["exp_avg"]), self._local(state["exp_avg_sq"])
            exp_avg.lerp_(grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            step_size = lr / (1 - beta1**t)
            denom = (exp_avg_sq / (1 - beta2**t)).sqrt_().add_(eps)
            if wd != 0:
                w.mul_(1 - lr * wd)
            w.add_((exp_avg / denom).to(w.dtype), alpha=-step_size)
