"""The loss path on one GPU: lm_head GEMM + the model's cross-entropy (compiled with Inductor, as
`Kernels.cross_entropy` runs it, and eager) against the fused chunked linear + cross-entropy of
`k3.ops.cross_entropy` (`linear_cross_entropy`, kernels.cross_entropy in the model), at k3-small's
micro-batch: 65,536 tokens, hidden 1,024, vocabulary 32,768, bf16 autocast with an fp32 lm_head
weight as in training.

Prints forward and forward+backward ms (the fused forward already computes the gradients, its
backward only scales them), the speed ratio to the Inductor row, and the peak memory each adds on top
of the inputs (torch.cuda.max_memory_allocated). Then the cross-entropy alone on materialised bf16
logits: the compiled region's forward+backward against the kernel (one read for the loss, one
gradient write over the logits) with GB/s for one read + one write. Correctness first: loss, dh and
dW of the fused path against the Inductor path.

Usage: python bench/cross_entropy.py [--tokens 65536] [--chunks 4096,8192,16384] [--sweep]
       python bench/cross_entropy.py --tiny --device cpu     # smoke run under the Triton interpreter
"""

from __future__ import annotations

import os
import sys
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench._regions import HBM, device_name, start, sweep  # noqa: E402


def _args(argv):  # noqa: ANN001, ANN202
    def chunks(ap):  # noqa: ANN001, ANN202
        ap.add_argument("--chunks", default=None, help="comma-separated chunk_rows of the fused path (default "
                        "8192; tiny 16,64)")

    args, bench, compiled = start(__doc__, argv, "64 tokens, hidden 32, vocabulary 300", chunks)
    args.chunks = [int(c) for c in (args.chunks or ("16,64" if args.tiny else "8192")).split(",")]
    return args, bench, compiled


def _peak_gb(fn: Callable, device: str) -> float | None:
    """Memory fn() allocates at its peak beyond what was allocated before (GB); None off CUDA."""
    if device != "cuda":
        fn()
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 1e9


def _check(impls: dict[str, Callable], h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor) -> None:
    outs = {}
    for name in ("inductor", next(n for n in impls if n.startswith("k3"))):
        hh, ww = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        loss = impls[name](hh, ww, labels)
        loss.backward()
        outs[name] = [loss.detach().float(), hh.grad.float(), ww.grad.float()]
    a, b = outs.values()
    errs = [((x - y).abs().max() / y.abs().max().clamp_min(1e-30)).item() for x, y in zip(b, a)]
    print(f"check fused vs inductor ({list(h.shape)} x {list(w.shape)}): "
          + ", ".join(f"{n} {e:.2e}" for n, e in zip(("loss", "dh", "dW"), errs)))
    if max(errs) > 2e-2:
        raise SystemExit("cross-entropy check FAILED")


def _time_paths(impls: dict[str, Callable], h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor,
                bench: Callable, device: str) -> None:
    print("| path | fwd ms | fwd+bwd ms | inductor / path | peak GB over inputs |\n|---|---:|---:|---:|---:|")
    base = None
    for name, fn in impls.items():
        fwd = bench(lambda fn=fn: fn(h, w, labels))
        both = bench(lambda fn=fn: fn(h, w, labels).backward(), grad_to_none=[h, w])
        h.grad = w.grad = None
        peak = _peak_gb(lambda fn=fn: fn(h, w, labels).backward(), device)
        h.grad = w.grad = None
        base = base or both
        gb = "-" if peak is None else f"{peak:.2f}"
        print(f"| {name} | {fwd:.3f} | {both:.3f} | {base / both:.2f} | {gb} |", flush=True)


def _time_ce_only(compiled, h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, bench: Callable  # noqa: ANN001
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The cross-entropy alone on materialised logits: the compiled region vs the kernel (in place).
    Returns the kernel's arguments and the bytes of one read + one write of the logits (for --sweep)."""
    from k3.ops.cross_entropy.triton_ce import ce_rows

    with torch.no_grad():
        logits = F.linear(h, w.to(h.dtype))
    N, V = logits.shape
    x = logits.detach().requires_grad_()
    scale = torch.full((1,), 1.0 / N, device=h.device)
    loss = torch.empty(N, device=h.device)
    nbytes = 2 * logits.numel() * logits.element_size()
    ind = bench(lambda: compiled.cross_entropy(x, labels).backward(), grad_to_none=[x])
    ker = bench(lambda: ce_rows(logits, labels, scale, loss, True))
    print(f"\n| cross-entropy only, [{N}, {V}] {str(logits.dtype)[6:]} | fwd+bwd ms | GB/s (1 read + 1 write) "
          "| of HBM |\n|---|---:|---:|---:|")
    for name, ms in (("inductor (fwd + bwd)", ind), ("k3 kernel (loss + in-place gradient)", ker)):
        print(f"| {name} | {ms:.3f} | {nbytes / ms / 1e6:,.0f} | {nbytes / (ms * 1e-3) / HBM:.2f} |", flush=True)
    return logits, scale, loss, nbytes


def main(argv=None) -> int:  # noqa: ANN001
    args, bench, compiled = _args(argv)
    from k3.config import get_preset
    from k3.ops.cross_entropy import linear_cross_entropy

    tc = get_preset("k3-small").text_config
    N, d, V = (64, 32, 300) if args.tiny else (args.tokens, tc.hidden_size, tc.vocab_size)
    dev = args.device
    torch.manual_seed(0)
    h = torch.randn(N, d, device=dev, dtype=torch.bfloat16).requires_grad_()
    w = (torch.randn(V, d, device=dev) * d ** -0.5).requires_grad_()  # the fp32 master weight
    labels = torch.randint(0, V, (N,), device=dev)
    labels[::50] = -100

    impls = {"inductor": lambda h, w, y: compiled.cross_entropy(F.linear(h, w), y),
             "eager torch": lambda h, w, y: F.cross_entropy(F.linear(h, w).float(), y, ignore_index=-100)}
    for c in args.chunks:
        impls[f"k3 fused, chunk {c}"] = lambda h, w, y, c=c: linear_cross_entropy(h, w, y, chunk_rows=c)

    print(f"# lm_head + cross-entropy, {N} x {d} x {V}, bf16 autocast, fp32 weight, {device_name(dev)}, "
          f"torch {torch.__version__}")
    with torch.autocast(dev, dtype=torch.bfloat16):
        _check(impls, h, w, labels)
        _time_paths(impls, h, w, labels, bench, dev)
    logits, scale, loss, nbytes = _time_ce_only(compiled, h, w, labels, bench)
    if args.sweep:
        from k3.ops.cross_entropy.triton_ce import ce_rows

        sweep("k3.ops.cross_entropy.triton_ce", ("BV", "WARPS"), [(1024, 4), (2048, 4), (2048, 8), (4096, 8), (4096, 16), (8192, 8),
                                         (8192, 16)],
              lambda: ce_rows(logits, labels, scale, loss, True), [], nbytes, bench)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
