"""Kernel launches per training step, counted on CPU (no GPU needed).

    python bench/launch_count.py                  # k3-tiny, 2 x 128 tokens, eager
    python bench/launch_count.py --compile        # with the compiled elementwise regions

torch.profiler records every aten operator; a kernel launch is a *leaf* operator (no aten
children) that does real work, i.e. not a view/metadata/allocation op. On CUDA each such op is
(at least) one kernel launch, so the count is a device-independent proxy for launch overhead and
for the number of passes over memory. Compiled regions run as one fused kernel per Inductor
kernel; with --compile their generated kernels are counted through Inductor's kernel profiling.
Prints the totals for forward+backward and for the optimizer step, and the top operators.

The routed experts run on CUDA as grouped GEMMs with one activation over all slots, on CPU as a loop
over experts; the count uses one expert per MoE layer by default (--experts), so the CPU loop has the
GPU's structure (3 GEMMs, one activation per layer) and the count does not scale with the expert count.
The KDA recurrence is the other region whose CPU implementation (the chunked PyTorch backend) is not
what runs on the GPU (a few Triton kernels); by default it is counted as one opaque launch forward
and one backward, so the count reflects the rest of the model (--kda-ops counts its operators too).
To count another checkout (e.g. before a change): PYTHONPATH=/path/to/checkout python bench/launch_count.py
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

if "PYTHONPATH" not in os.environ:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from k3.config import apply_overrides, get_preset  # noqa: E402
from k3.model.causal_lm import K3ForCausalLM  # noqa: E402
from k3.optim import HeadGeometry, PerHeadMuon, build_param_groups  # noqa: E402

# Operators that launch no kernel: views, metadata, allocation without fill, autograd bookkeeping.
NO_KERNEL = {
    "aten::view", "aten::_unsafe_view", "aten::reshape", "aten::_reshape_alias", "aten::as_strided",
    "aten::expand", "aten::expand_as", "aten::t", "aten::transpose", "aten::permute", "aten::unsqueeze",
    "aten::squeeze", "aten::select", "aten::slice", "aten::split", "aten::split_with_sizes", "aten::unbind",
    "aten::alias", "aten::detach", "aten::detach_", "aten::lift_fresh", "aten::empty", "aten::empty_like",
    "aten::empty_strided", "aten::resize_", "aten::set_", "aten::view_as", "aten::narrow", "aten::chunk",
    "aten::diagonal", "aten::unflatten", "aten::flatten", "aten::contiguous", "aten::numpy_T",
    "aten::result_type", "aten::is_nonzero", "aten::_has_compatible_shallow_copy_type", "aten::size",
    "aten::stride", "aten::dim", "aten::is_same_size", "aten::to", "aten::_to_copy", "aten::type_as",
    "aten::_local_scalar_dense", "aten::item", "aten::movedim", "aten::swapaxes", "aten::matrix_H",
    "aten::mT", "aten::_unsafe_split", "aten::unfold", "aten::lift", "aten::retains_grad",
    "aten::_make_dual", "aten::_conj", "aten::conj", "aten::resolve_conj", "aten::resolve_neg",
    "aten::new_empty", "aten::new_empty_strided", "aten::scalar_tensor", "aten::as_strided_",
}
MATMUL = {"aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::addmv_", "aten::addmv", "aten::mv",
          "aten::_grouped_mm", "aten::addbmm", "aten::dot", "aten::vdot"}


OPAQUE = "_OpaqueKDA"


class _OpaqueKDA(torch.autograd.Function):
    """The KDA core as one profiler event forward ("_OpaqueKDA") and one backward ("_OpaqueKDABackward");
    the backward recomputes through the real implementation."""

    @staticmethod
    def forward(ctx, fn, *tensors):  # noqa: ANN001
        ctx.fn = fn
        ctx.save_for_backward(*tensors)
        return fn(*tensors)[0]

    @staticmethod
    def backward(ctx, go):  # noqa: ANN001
        tensors = [t.detach().requires_grad_(True) for t in ctx.saved_tensors]
        with torch.enable_grad():
            o = ctx.fn(*tensors)[0]
            grads = torch.autograd.grad(o, tensors, go, allow_unused=True)
        return (None, *grads)


def make_kda_opaque() -> None:
    """Route k3.model.kda's training-time KDA calls (no cache) through `_OpaqueKDA`."""
    import k3.model.kda as kda_mod

    real = kda_mod.kda

    def opaque(q, k, v, g, beta, *, A_log=None, dt_bias=None, initial_state=None, output_final_state=False,
               **kw):  # noqa: ANN001, ANN003
        if initial_state is not None or output_final_state or A_log is None:
            return real(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=initial_state,
                        output_final_state=output_final_state, **kw)

        def fn(q, k, v, g, beta, A_log, dt_bias):  # noqa: ANN001
            return real(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, **kw)

        return _OpaqueKDA.apply(fn, q, k, v, g, beta, A_log, dt_bias), None

    kda_mod.kda = opaque


def leaf_ops(prof) -> collections.Counter:
    """Counter of kernel-launching aten operators in a profile, plus Inductor kernels.

    An operator launches a kernel when it does work itself: it is not a view/metadata op and none
    of its descendants does work (e.g. aten::linear -> aten::mm counts once, as aten::mm)."""
    counts: collections.Counter = collections.Counter()
    memo: dict[int, bool] = {}

    def works(ev) -> bool:  # ev or a descendant launches a kernel
        key = id(ev)
        if key not in memo and ev.name.startswith(OPAQUE):
            counts["kda core (opaque)"] += 1
            memo[key] = True
        if key not in memo and ev.name.startswith("aten::_foreach_"):
            # one multi-tensor launch on CUDA (per ~100 tensors / 20M elements); its CPU per-tensor
            # loop is recorded separately as the per-tensor upper bound
            counts[ev.name] += 1
            counts["(per-tensor kernels inside foreach ops)"] += sum(1 for c in ev.cpu_children
                                                                     if c.name.startswith("aten::"))
            memo[key] = True
        if key not in memo:
            below = [works(c) for c in ev.cpu_children]  # visit every child (fills counts)
            mine = ev.name.startswith("aten::") and ev.name not in NO_KERNEL and not any(below)
            if mine:
                counts[ev.name] += 1
            elif "cpp_fused" in ev.name or ev.name.startswith("triton_"):
                counts["inductor kernel"] += 1
                mine = True
            memo[key] = mine or any(below)
        return memo[key]

    for ev in prof.events():
        if ev.cpu_parent is None:
            works(ev)
    return counts


def profile_counts(fn) -> collections.Counter:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return leaf_ops(prof)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="k3-tiny")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--compile", action="store_true", help="compile the elementwise regions first")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--kda-ops", action="store_true", help="count the CPU KDA backend's operators too")
    ap.add_argument("--experts", type=int, default=1, help="routed experts per MoE layer (top-k = min(k, this))")
    args = ap.parse_args()
    if not args.kda_ops:
        make_kda_opaque()
    torch.manual_seed(0)
    cfg = get_preset(args.preset)
    k = min(cfg.text_config.num_experts_per_token, args.experts)
    model = K3ForCausalLM(apply_overrides(cfg, {"num_experts": args.experts, "num_experts_per_token": k}))
    model.init_weights(seed=0)
    if args.compile:
        import torch._inductor.config as inductor_config

        from k3.model.compile import compile_model

        inductor_config.cpp.enable_kernel_profile = True
        compile_model(model)
    opt = PerHeadMuon(build_param_groups(model, HeadGeometry.from_config(model.config.text_config), lr=1e-3,
                                         weight_decay=0.1))
    T, B = args.seq_len, args.batch
    ids = torch.randint(0, model.config.text_config.vocab_size, (1, B * T + 1))
    cu = torch.arange(0, B * T + 1, T, dtype=torch.int32)

    def fwd_bwd() -> None:
        model(ids[:, :-1], labels=ids[:, 1:], cu_seqlens=cu).loss.backward()

    for _ in range(2):  # warm-up: optimizer state, compilation
        fwd_bwd()
        opt.step()
        opt.zero_grad(set_to_none=True)
    train = profile_counts(fwd_bwd)
    optim = profile_counts(opt.step)
    print(f"# {args.preset} with {args.experts} routed expert(s), {B} x {T} tokens, "
          f"{'compiled' if args.compile else 'eager'}, KDA core {'as its CPU operators' if args.kda_ops else 'opaque'}")
    for name, counts in (("forward+backward", train), ("optimizer step", optim)):
        inner = counts.pop("(per-tensor kernels inside foreach ops)", 0)
        mm = sum(n for op, n in counts.items() if op in MATMUL)
        total = sum(counts.values())
        print(f"{name}: {total} kernel launches ({mm} matmul, {total - mm} other)"
              + (f"; {inner} per-tensor kernels inside foreach ops" if inner else ""))
        for op, n in counts.most_common(args.top):
            print(f"    {n:6d}  {op}")


if __name__ == "__main__":
    main()
