"""Kernel launches per training step, counted on CPU (no GPU needed).

    python bench/launch_count.py                  # k3-tiny, 2 x 128 tokens, eager
    python bench/launch_count.py --compile        # with the compiled elementwise regions

torch.profiler records every aten operator; a kernel launch is a *leaf* operator (no aten
children) that does real work, i.e. not a view/metadata/allocation op. On CUDA each such op is
(at least) one kernel launch, so the count is a device-independent proxy for launch overhead and
for the number of passes over memory. Compiled regions run as one fused kernel per Inductor
kernel; with --compile their generated kernels are counted through Inductor's kernel profiling.
Prints the totals for forward+backward and for the optimizer step, and the top operators.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from k3.config import get_preset  # noqa: E402
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
}


def leaf_ops(prof) -> collections.Counter:
    """Counter of kernel-launching aten operators in a profile, plus Inductor kernels.

    An operator launches a kernel when it does work itself: it is not a view/metadata op and none
    of its descendants does work (e.g. aten::linear -> aten::mm counts once, as aten::mm)."""
    counts: collections.Counter = collections.Counter()
    memo: dict[int, bool] = {}

    def works(ev) -> bool:  # ev or a descendant launches a kernel
        key = id(ev)
        if key not in memo:
            below = [works(c) for c in ev.cpu_children]  # visit every child (fills counts)
            mine = ev.name.startswith("aten::") and ev.name not in NO_KERNEL and not any(below)
            if mine:
                counts[ev.name] += 1
            elif ev.name.startswith(("cpp_fused", "triton_")):
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
    args = ap.parse_args()
    torch.manual_seed(0)
    model = K3ForCausalLM(get_preset(args.preset)).init_weights(seed=0)
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
    print(f"# {args.preset}, {B} x {T} tokens, {'compiled' if args.compile else 'eager'}")
    for name, counts in (("forward+backward", train), ("optimizer step", optim)):
        print(f"{name}: {sum(counts.values())} kernel launches")
        for op, n in counts.most_common(args.top):
            print(f"    {n:6d}  {op}")


if __name__ == "__main__":
    main()
