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

The step is launch-light: plain (non-DTensor) Muon parameters live in persistent per-shape stacks
(:class:`_Bucket`): the fp32 momentum buffers are views into one [blocks, m, n] tensor per shape, so
a bucket's momentum update, Nesterov update and Newton-Schulz are one kernel each (plus the five
quintic steps) with no per-step cat; gradients arrive with one ``_foreach_copy_``, and weight decay
and the update go out with ``_foreach_mul_`` / ``_foreach_add_``. ``cols`` blocks are stored as row
blocks of the transposed parameter (NS(X^T) = NS(X)^T, exactly what Newton-Schulz does to tall
blocks anyway), so every block is a contiguous slice. With a bf16 Newton-Schulz on Triton-capable
tensors (CUDA; ``PerHeadMuon(fused=False)`` turns it off) the elementwise work around Newton-Schulz is two Triton
kernels (:mod:`k3.optim.muon_kernels`): momentum + Nesterov + cast + norm partials in one pass, and
decay + update from the bf16 result in one pass per (group, dtype). AdamW uses ``torch._foreach_*`` too. Sharded
(DTensor) parameters take the per-parameter path through the ``_full``/``_apply_delta``/``_local``
hooks that k3.distributed overrides.
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
    return _ns_iterate(_cast_normalised(x, dtype, eps), steps, coefficients)


def _cast_normalised(x: Tensor, dtype: torch.dtype, eps: float) -> Tensor:
    """x [B, m, n] cast to ``dtype``, every block divided by max(its Frobenius norm, eps) (the norm of the
    cast block, in ``dtype``, reduced over the wide orientation as Newton-Schulz sees it)."""
    y = x.to(dtype)
    norm = torch.linalg.vector_norm(y.transpose(1, 2) if y.shape[1] > y.shape[2] else y, dim=(1, 2), keepdim=True)
    return y / norm.clamp(min=eps)


def _ns_iterate(y: Tensor, steps: int, coefficients: tuple[float, float, float]) -> Tensor:
    """The quintic steps on already normalised blocks (shared by :func:`newton_schulz` and the fused step,
    whose prep kernel yields the norms).

    y: [B, m, n] in the Newton-Schulz dtype, each block of Frobenius norm <= 1. Pass a temporary: this
    frame then holds the only reference and frees it at the first step (a caller's name would keep a
    second copy alive through the GEMMs). Returns [B, m, n] contiguous in y's dtype; tall blocks are
    iterated transposed (the GEMMs see the same strides whether the division happened before or after).
    """
    a, b, c = coefficients
    tall = y.shape[1] > y.shape[2]
    if tall:
        y = y.transpose(1, 2)
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


def _stackable(p: Tensor) -> bool:
    """Plain dense tensors can live in bucket stacks; DTensors and other subclasses cannot."""
    return type(p.data) is torch.Tensor and p.layout == torch.strided


def _bucket_block(spec: tuple[str, int], shape: torch.Size) -> tuple[int, int, int]:
    """(number of blocks, m, n) of a parameter's blocks as stored in a bucket ('cols': of its transpose)."""
    kind, block = spec
    if kind == "cols":
        return shape[1] // block, block, shape[0]
    if kind == "rows":
        return shape[0] // block, block, shape[1]
    if kind == "experts":
        return shape[0], shape[1], shape[2]
    return 1, shape[0], shape[1]


def _param_view(blocks: Tensor, spec: tuple[str, int], shape: torch.Size) -> Tensor:
    """Contiguous bucket slice [nb, m, n] -> a parameter-shaped view of it."""
    if spec[0] == "cols":
        return blocks.reshape(shape[1], shape[0]).t()
    return merge_blocks(blocks, spec, shape)


def _foreach_by_layout(fn, dst: list[Tensor], src: list[Tensor], **kwargs: Any) -> None:
    """fn(dst, src) in two calls: pairs with matching strides and dtypes (the multi-tensor fast path)
    and the rest (per-tensor kernels inside one call)."""
    fast = [(d, s) for d, s in zip(dst, src) if d.stride() == s.stride() and d.dtype == s.dtype]
    slow = [(d, s) for d, s in zip(dst, src) if d.stride() != s.stride() or d.dtype != s.dtype]
    for part in (fast, slow):
        if part:
            fn([d for d, _ in part], [s for _, s in part], **kwargs)


def _decay(params: list[Tensor], factor: float) -> None:
    """params *= factor. Multi-tensor for fp32; per tensor otherwise (the CPU foreach kernel rounds the
    scalar to a bf16 parameter's dtype: 0.998 would become 0.996)."""
    exact = [p for p in params if p.dtype == torch.float32]
    if exact:
        torch._foreach_mul_(exact, factor)
    for p in params:
        if p.dtype != torch.float32:
            p.mul_(factor)


class _Bucket:
    """Stacked Muon state of every plain parameter whose blocks have one shape and one NS setting.

    mom / grad: fp32 [total_blocks, m, n]; each member's optimizer state "momentum_buffer" is a
    parameter-shaped view of `mom` (checkpoints see ordinary per-parameter state)."""

    def __init__(self, key: tuple, members: list[tuple[Tensor, dict, tuple[str, int]]],
                 state: dict) -> None:
        self.key = key
        (self.m, self.n), device = key[0], key[1]
        self.members = members
        counts = [_bucket_block(spec, p.shape)[0] for p, _, spec in members]
        self.offsets = [sum(counts[:i]) for i in range(len(counts) + 1)]
        total = self.offsets[-1]
        self.mom = torch.zeros(total, self.m, self.n, dtype=torch.float32, device=device)
        self.grad = torch.empty_like(self.mom)
        self.mom_views = self.views(self.mom)
        self.grad_views = self.views(self.grad)
        self._fused: tuple[tuple, tuple[list, list[int]]] | None = None  # see fused_plan
        for (p, _, _), view in zip(members, self.mom_views):
            old = state[p].get("momentum_buffer")
            if old is not None:
                view.copy_(old)
            state[p]["momentum_buffer"] = view

    def views(self, stack: Tensor) -> list[Tensor]:
        return [_param_view(stack[self.offsets[i]: self.offsets[i + 1]], spec, p.shape)
                for i, (p, _, spec) in enumerate(self.members)]

    def valid(self, state: dict) -> bool:
        return all(state[p].get("momentum_buffer") is v for (p, _, _), v in zip(self.members, self.mom_views))

    def fused_plan(self) -> tuple[list[tuple[dict, Any]], list[int]]:
        """:func:`~k3.optim.muon_kernels.plan_bucket_update` for the members, cached; rebuilt when a member's
        storage moved (the launch tables hold address differences) or the program size changed."""
        from k3.optim.muon_kernels import plan_bucket_update, update_block

        key = (update_block(), tuple(p.data_ptr() for p, _, _ in self.members))
        if self._fused is None or self._fused[0] != key:
            starts = [o * self.m * self.n for o in self.offsets[:-1]]
            self._fused = (key, plan_bucket_update(self.members, starts, key[0]))
        return self._fused[1]


class PerHeadMuon(torch.optim.Optimizer):
    """Muon (block-wise, batched Newton-Schulz) + AdamW in one optimizer.

    params: iterable of param-group dicts; each has ``kind`` ("muon" or "adamw") and
    ``params``; Muon groups may give ``block_specs`` (one (kind, block) per parameter; default
    whole for 2-D, experts for 3-D). Per-group overrides of any default are allowed.

    Defaults: lr (Muon and AdamW unless the group overrides), weight_decay (decoupled:
    p *= 1 - lr*wd), momentum / nesterov / ns_steps / ns_coefficients / eps (Muon), betas /
    adam_eps (AdamW), ns_dtype ("auto": bf16 on CUDA, fp32 on CPU; or "float32"/"bfloat16").
    fused: a bf16 / fp16 Newton-Schulz on tensors Triton runs on does its elementwise work in the Triton
    kernels of k3.optim.muon_kernels (False: torch ops; `KernelConfig.muon_fused`).
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
        fused: bool = True,
    ) -> None:
        self.fused = fused
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
        self._buckets: list[_Bucket] = []
        self._bucket_key: tuple = ()
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
        """Like torch's, but state stays exact fp32 (torch would round it to a bf16 param's dtype) and
        is always copied (torch keeps the given step counters, which the step increments in place)."""
        saved = state_dict["state"]
        super().load_state_dict(state_dict)
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for idx, p in zip(ids, params):
            for key, value in saved.get(idx, {}).items():
                if key == "step" and torch.is_tensor(value):
                    self.state[p][key] = value.to(dtype=torch.float32, copy=True)
                elif torch.is_tensor(value) and value.is_floating_point():
                    self.state[p][key] = value.to(device=p.device, dtype=torch.float32, copy=True)

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 - torch.optim signature
        """One optimisation step over all groups; returns closure() if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        pending: list[_Pending] = []
        stacked: list[tuple[Tensor, dict, tuple[str, int]]] = []
        for group in self.param_groups:
            if group["kind"] != "muon":
                self._adamw_step(group)
                continue
            for p, spec in zip(group["params"], group["block_specs"]):
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("PerHeadMuon does not support sparse gradients")
                if self._use_stacks(p):
                    stacked.append((p, group, spec))
                else:
                    pending.append(self._muon_momentum(p, group, spec))
        self._apply_muon(pending)
        for bucket in self._plan(stacked):
            self._bucket_step(bucket)
        return loss

    # ---- stacked path (plain tensors) ------------------------------------------------------------
    def _use_stacks(self, p: Tensor) -> bool:
        """Whether p takes the stacked path (plain dense tensors) or the per-parameter hooks (a hook:
        tests override it to run plain tensors through the per-parameter path)."""
        return _stackable(p)

    @staticmethod
    def _ns_key(p: Tensor, group: dict, spec: tuple[str, int]) -> tuple:
        _, m, n = _bucket_block(spec, p.shape)
        return ((m, n), p.device, _resolve_ns_dtype(group["ns_dtype"], p.device), group["ns_steps"],
                tuple(group["ns_coefficients"]), group["eps"], group["momentum"], group["nesterov"])

    def _plan(self, items: list[tuple[Tensor, dict, tuple[str, int]]]) -> list[_Bucket]:
        """The buckets for this step's parameters; rebuilt when the set of parameters with gradients,
        their settings, or their state (e.g. after load_state_dict) changed."""
        keys = [self._ns_key(p, g, spec) for p, g, spec in items]
        key = tuple((id(p), k) for (p, _, _), k in zip(items, keys))
        if key != self._bucket_key or not all(b.valid(self.state) for b in self._buckets):
            groups: dict[tuple, list] = {}
            for item, k in zip(items, keys):
                groups.setdefault(k, []).append(item)
            self._buckets = [_Bucket(k, members, self.state) for k, members in groups.items()]
            self._bucket_key = key
        return self._buckets

    def _bucket_step(self, b: _Bucket) -> None:
        """Momentum, Nesterov, one batched Newton-Schulz, decay and update for a whole bucket."""
        _, _, dtype, steps, coeffs, eps, mu, nesterov = b.key
        _foreach_by_layout(torch._foreach_copy_, b.grad_views, [p.grad for p, _, _ in b.members])
        if self._fused_step(b):
            self._fused_bucket_step(b)
            return
        b.mom.lerp_(b.grad, 1 - mu)
        update = b.grad.lerp_(b.mom, mu) if nesterov else b.mom
        ortho = newton_schulz(update, steps, coeffs, eps, dtype)
        scale = 0.2 * math.sqrt(max(b.m, b.n))
        by_group: dict[int, list[int]] = {}
        for i, (_, group, _) in enumerate(b.members):
            by_group.setdefault(id(group), []).append(i)
        cast: dict[torch.dtype, list[Tensor]] = {}
        for members in by_group.values():
            group = b.members[members[0]][1]
            lr, wd = group["lr"], group["weight_decay"]
            params = [b.members[i][0] for i in members]
            deltas = []
            for i in members:
                dt = b.members[i][0].dtype
                if dt not in cast:
                    cast[dt] = b.views(ortho if ortho.dtype == dt else ortho.to(dt))
                deltas.append(cast[dt][i])
            if wd != 0:
                _decay(params, 1 - lr * wd)
            _foreach_by_layout(torch._foreach_add_, params, deltas, alpha=-lr * scale)

    def _fused_step(self, b: _Bucket) -> bool:
        """Whether the bucket takes the Triton path: bf16 / fp16 Newton-Schulz ('auto' on CUDA) on tensors
        Triton runs on, unless fused=False (fp32 NS, CPU's 'auto', keeps the torch path)."""
        if b.key[2] not in (torch.bfloat16, torch.float16):
            return False
        from k3.ops.backend import triton_runs_on

        return self.fused and triton_runs_on(b.mom)

    @staticmethod
    def _fused_normalised(b: _Bucket) -> Tensor:
        """Momentum update (in place) and the normalised Nesterov update [B, m, n] in the NS dtype: the
        prep kernel's norm (of the rounded blocks, fp32 sums) rounded to the NS dtype as vector_norm rounds
        it, clamped and divided as in :func:`_cast_normalised` (in place: the kernel's output is scratch)."""
        from k3.optim.muon_kernels import muon_prep

        _, _, dtype, _, _, eps, mu, nesterov = b.key
        u, sumsq = muon_prep(b.grad, b.mom, mu, nesterov, dtype)
        return u.div_(sumsq.sqrt().to(dtype).view(-1, 1, 1).clamp(min=eps))

    def _fused_bucket_step(self, b: _Bucket) -> None:
        """The bucket step in two Triton passes around Newton-Schulz (gradients already copied in).

        The prep kernel updates the momentum and writes the Nesterov update already rounded to the NS dtype
        with its blocks' squared norms; the update kernel decays and updates the parameters straight from the
        bf16 result (no fp32 copy of the stack, no separate decay pass). Rounding against the torch path:
        momentum bit-identical; the norm's fp32 sum runs in another order, which can move the rounded bf16
        norm by one ulp in rare blocks (none in the tests); fp32 parameters bit-identical otherwise (the
        torch path's bf16 -> fp32 cast is exact); bf16 parameters as torch on CUDA -- torch's CPU bf16 add
        rounds alpha to bf16, so on CPU they differ by an ulp here and there."""
        from k3.optim import muon_kernels

        _, _, _, steps, coeffs, _, _, _ = b.key
        ortho = _ns_iterate(self._fused_normalised(b), steps, coeffs)
        scale = 0.2 * math.sqrt(max(b.m, b.n))
        plans, rest = b.fused_plan()
        for group, plan in plans:
            lr, wd = group["lr"], group["weight_decay"]
            muon_kernels.apply_flat_update(plan, ortho, 1 - lr * wd if wd != 0 else 1.0, -lr * scale)
        if rest:
            views = b.views(ortho)
            for i in rest:
                p, group, _ = b.members[i]
                lr, wd = group["lr"], group["weight_decay"]
                if wd != 0:
                    p.mul_(1 - lr * wd)  # per tensor: a python scalar stays exact for bf16 (see _decay)
                # mixed-dtype add: the bf16 view is widened inside the kernel, the same fma as the torch path
                p.add_(views[i], alpha=-lr * scale)

    # ---- per-parameter path (sharded parameters) ----------------------------------------------------
    def _muon_momentum(self, p: Tensor, group: dict[str, Any], spec: tuple[str, int]) -> _Pending:
        """Update p's momentum buffer; return its Nesterov update, split into blocks."""
        mu = group["momentum"]
        grad = p.grad.float()
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32)
        buf = state["momentum_buffer"]
        buf.lerp_(grad, 1 - mu)
        update = grad.lerp(buf, mu) if group["nesterov"] else buf
        return _Pending(p, group, spec, split_blocks(self._full(update), spec))

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
        """Standard AdamW (bias-corrected moments, decoupled weight decay), fp32 state, foreach kernels."""
        beta1, beta2 = group["betas"]
        lr, wd, eps = group["lr"], group["weight_decay"], group["adam_eps"]
        params, grads, avgs, sqs, steps = [], [], [], [], []
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
            params.append(self._local(p))
            grad = self._local(p.grad)
            grads.append(grad if grad.dtype == torch.float32 else grad.float())
            avgs.append(self._local(state["exp_avg"]))
            sqs.append(self._local(state["exp_avg_sq"]))
            steps.append(state["step"])
        if not params:
            return
        torch._foreach_add_(steps, 1)
        t = [float(s) for s in steps]  # host-side scalars (step counters live on the CPU)
        torch._foreach_lerp_(avgs, grads, 1 - beta1)
        torch._foreach_mul_(sqs, beta2)
        torch._foreach_addcmul_(sqs, grads, grads, value=1 - beta2)
        denom = torch._foreach_div(sqs, [1 - beta2**n for n in t])
        torch._foreach_sqrt_(denom)
        torch._foreach_add_(denom, eps)
        if wd != 0:
            _decay(params, 1 - lr * wd)
        sizes = [-lr / (1 - beta1**n) for n in t]
        if all(w.dtype == torch.float32 for w in params):
            torch._foreach_addcdiv_(params, avgs, denom, sizes)
        else:
            upd = torch._foreach_div(avgs, denom)
            torch._foreach_mul_(upd, sizes)
            _foreach_by_layout(torch._foreach_add_, params, upd)
