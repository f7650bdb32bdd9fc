"""Small building blocks shared by the K3 modules: RMSNorm, SiTU-GLU, Block Attention Residuals."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from k3.model.fused import EAGER, Kernels, linear_multi
from k3.model.step_weights import StepCache, StepLinear, gemm_weight

KEEP_FP32 = "_k3_keep_fp32"


def keep_fp32(p: nn.Parameter | torch.Tensor) -> nn.Parameter | torch.Tensor:
    """Mark a parameter/buffer that the official checkpoint stores (and the math uses) in fp32."""
    setattr(p, KEEP_FP32, True)
    return p


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """KimiRMSNorm: normalise in fp32, cast to x's dtype, then multiply by the weight.

    x: [..., D] any float dtype; weight: [D] or None. Returns x's dtype (the weight's dtype
    promotes only when the weight is fp32 and x is not, as in the reference code).
    """
    xf = x.float()
    y = (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if weight is None else (weight * y).to(x.dtype)


class RMSNorm(nn.Module):
    kernels: Kernels = EAGER

    def __init__(self, dim: int, eps: float = 1e-5, fp32_weight: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        if fp32_weight:
            keep_fp32(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def situ_glu(a: torch.Tensor, b: torch.Tensor, beta: float, beta_lin: float) -> torch.Tensor:
    """SiTU-GLU: beta*tanh(a/beta)*sigmoid(a) * beta_lin*tanh(b/beta_lin), in fp32, cast back to a's dtype.

    a (gate), b (up): [..., I]. |output| < beta * beta_lin.
    """
    af, bf = a.float(), b.float()
    act = beta * torch.tanh(af / beta) * torch.sigmoid(af) * (beta_lin * torch.tanh(bf / beta_lin))
    return act.to(a.dtype)


def glu_act(a: torch.Tensor, b: torch.Tensor, act: str, beta: float, beta_lin: float) -> torch.Tensor:
    if act == "situ":
        return situ_glu(a, b, beta, beta_lin)
    return (F.silu(a.float()) * b.float()).to(a.dtype)


class GLUMLP(nn.Module):
    """gate/up/down MLP with the SiTU (or SiLU) GLU: the dense layer-0 MLP and the fused shared experts.

    While training, gate and up run as one GEMM against the concatenated weights and the activation
    reads its packed output (Kernels.glu_packed); the parameters stay separate (checkpoint names). Inside
    `K3ForCausalLM.step_weights()` the concatenation (and down's weight) is the step's shared compute-dtype
    copy (`k3.model.step_weights`)."""

    kernels: Kernels = EAGER

    def __init__(self, hidden: int, inter: int, act: str, beta: float, beta_lin: float) -> None:
        super().__init__()
        self.gate_proj = StepLinear(hidden, inter)
        self.up_proj = StepLinear(hidden, inter)
        self.down_proj = StepLinear(inter, hidden)
        self.act, self.beta, self.beta_lin = act, beta, beta_lin
        self.step_cache: StepCache | None = None  # gate|up's step copy: set by K3ForCausalLM.step_weights()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., hidden] -> down(GLU(gate x, up x)) [..., hidden], plus `residual` (same shape) if given,
        added inside the down projection's GEMM (`linear_residual`)."""
        if torch.is_grad_enabled():  # one GEMM; the activation's gradient comes back as one tensor
            return self.down_from_gate_up(F.linear(x, self.gate_up_weight()), residual)
        a, b = linear_multi(x, [[self.gate_proj.weight], [self.up_proj.weight]])
        h = self.kernels.glu(a, b, self.act, self.beta, self.beta_lin)
        return linear_residual(h, self.down_proj.gemm_weight(), residual)

    def gate_up_weight(self) -> torch.Tensor:
        """[2 inter, hidden]: gate's and up's weights stacked (the step's shared copy inside step_weights())."""
        return gemm_weight(self.step_cache, (self.gate_proj.weight, self.up_proj.weight))

    def down_from_gate_up(self, ab: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The rest of the training forward from the packed gate|up output ab [..., 2 inter]."""
        h = self.kernels.glu_packed(ab, self.act, self.beta, self.beta_lin)
        return linear_residual(h, self.down_proj.gemm_weight(), residual)


class _FanIn(torch.autograd.Function):
    """x [N, d] and its GEMMs y_i = x @ W_i^T for several consumers; see `fan_in_linears`."""

    @staticmethod
    def forward(ctx, x, *ws):  # noqa: ANN001 - autograd signature
        ctx.save_for_backward(x, *ws)
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None (no zero GEMM operands)
        return (x.view_as(x), *(torch.mm(x, w.t()) for w in ws))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gx, *gs):  # noqa: ANN001
        x, *ws = ctx.saved_tensors
        dx = gx
        own = gx is not None and _unshared(gx)
        for g, w in zip(gs, ws):
            if g is not None:  # each product added in its GEMM's epilogue; in place once dx is ours
                dx = torch.mm(g, w) if dx is None else (dx.addmm_(g, w) if own else torch.addmm(dx, g, w))
                own = True
        dws = [g.t().mm(x) if g is not None and need else None
               for g, need in zip(gs, ctx.needs_input_grad[1:])]
        return (dx if ctx.needs_input_grad[0] else None, *dws)


def _unshared(t: torch.Tensor) -> bool:
    """Whether a gradient handed to a backward is referenced by nothing else (no other tensor, no view, no
    shared storage), so it may serve as the accumulator in place: the test autograd's AccumulateGrad makes
    before taking a gradient over. (A consumer such as an add's backward hands one tensor to several
    places; summing into that in place would corrupt the others.)"""
    try:
        return (t._use_count() == 1 and not t._is_view() and t.is_contiguous()
                and torch._C._storage_Use_Count(t.untyped_storage()._cdata) == 2)  # t's and this call's
    except (AttributeError, RuntimeError):  # private helpers: a torch without them copies
        return False


def fan_in_linears(x: torch.Tensor, weights: list[torch.Tensor]) -> tuple[torch.Tensor, ...] | None:
    """(x', x @ W_1^T, ..., x @ W_n^T) for x [N, d] read by n GEMMs (weights [n_i, d]) and by other consumers
    through x' (x itself, as a view); None where the plain path must run (grad disabled, or x not in the
    compute dtype under autocast).

    The backward forms x's gradient as one chain: dx = g_x' + sum_i g_i W_i, each product added in its GEMM's
    epilogue (addmm: fp32 accumulator plus the running bf16 sum, rounded once; into g_x' itself when nothing
    else holds it, as the router's fresh gradient is: no copy of it first), where autograd writes every
    product and then adds the [N, d] tensors pairwise (k3-small's MoE input feeds the router, the latent
    down projection and the shared experts: two adds of [65,536, 1,024] bf16 per layer, ~2 ms per micro-batch
    on an H200). Weights come cast to the compute dtype (autocast's cast, or the step's shared copies) and
    get their gradients as autograd's linear gives them (g_i^T x)."""
    if not torch.is_grad_enabled() or x.dim() != 2:
        return None
    dev = x.device.type
    dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
    if x.dtype != dt:
        return None
    with torch.autocast(dev, enabled=False):
        return _FanIn.apply(x, *(w.to(dt) for w in weights))


def linear_residual(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """residual + x @ weight^T (x [..., k], weight [n, k], residual [..., n] or None -> [..., n]). weight: a
    parameter, or inside `K3ForCausalLM.step_weights()` its shared compute-dtype copy (`StepLinear.gemm_weight`).

    With a residual of x's dtype the sum runs in the GEMM's epilogue (addmm: fp32 accumulator plus the
    residual, rounded once) instead of a separate add that reads two [..., n] tensors and writes one (k3-small:
    each such add took ~93 us at 65,536 x 1,024 on an H200; the GEMM reads the residual instead). Another
    residual dtype (e.g. fp32 embeddings entering the stream) keeps the plain add and its type promotion."""
    if residual is None:
        return F.linear(x, weight)
    if residual.dtype != x.dtype or residual.shape[:-1] != x.shape[:-1]:
        return residual + F.linear(x, weight)
    n = residual.shape[-1]
    out = torch.addmm(residual.reshape(-1, n), x.reshape(-1, x.shape[-1]), weight.t())
    return out.reshape(residual.shape)


def attn_res_mix(candidates: list[torch.Tensor], w_norm: torch.Tensor, w_proj: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """Softmax-weighted mix of candidate streams (completed block sums + running prefix).

    candidates: m+1 tensors [..., d]; w_norm: [d]; w_proj: [1, d] or [d].
    logit_i = sum_c rmsnorm(V_i)[c] * w_norm[c] * w_proj[c]; p = softmax_i(logit); mix = sum_i p_i V_i.
    Everything in fp32; returns the candidates' dtype.
    """
    if len(candidates) == 1:
        return candidates[0]
    w = w_norm.float() * w_proj.float().reshape(-1)
    V = torch.stack([c.float() for c in candidates])  # [n, ..., d]
    # (rmsnorm(V) . w) computed as (V . w) * rsqrt(mean(V^2) + eps): the same sum, no normalised copy of V.
    # Autocast off: it would run the dot products in bf16.
    with torch.autocast(V.device.type, enabled=False):
        p = torch.softmax((V @ w) * torch.rsqrt(V.square().mean(-1) + eps), dim=0)  # [n, ...]
    return (p.unsqueeze(-1) * V).sum(0).to(candidates[-1].dtype)
