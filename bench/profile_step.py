"""Where the time goes: torch.profiler tables for one training step and for serving decode steps.

    python bench/profile_step.py                 # k3-small on CUDA: train step (T 8192), optimizer, decode
    python bench/profile_step.py --tiny --device cpu

Prints, per phase, wall time (with and without the profiler), the summed device-kernel time (if
wall and kernels differ a lot the phase is bound by host overhead, not by the GPU) and the top
operators by self device time; `--host` adds them by host time, `--by-shape` by input shapes,
`--trace DIR` writes a Chrome/Perfetto timeline per phase, `--gaps` charges the GPU's idle gaps to
the host code that launched the kernel after each (`bench/gaps.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._harness import sync  # noqa: E402
from k3.config import get_preset  # noqa: E402
from k3.model.causal_lm import K3ForCausalLM  # noqa: E402
from k3.optim import HeadGeometry, PerHeadMuon, build_param_groups  # noqa: E402


_sync = sync


def _report(name: str, prof, wall: float, device: torch.device, rows: int, by_shape: bool = False,
            host: bool = False) -> None:
    on_device = device.type == "cuda" and not host
    key = "self_device_time_total" if on_device else "self_cpu_time_total"
    events = prof.key_averages(group_by_input_shape=by_shape)
    if on_device:  # kernel rows only: operator and compiled-graph rows report their kernels' time again
        total = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA)
    else:
        total = sum(e.self_cpu_time_total for e in events)
    print(f"\n## {name}: wall {wall * 1e3:.1f} ms, summed {'kernel' if on_device else 'host (CPU)'} "
          f"self time {total / 1e3:.1f} ms")
    print(events.table(sort_by=key, row_limit=rows, max_name_column_width=60))


NODE = "autograd::engine::evaluate_function: "


def by_node(prof, device: torch.device) -> dict[tuple[str, str], list[float]]:
    """{(autograd node, operator): [self ms, calls]}: each operator's self time (kernels on CUDA, host
    on CPU) charged to the backward node whose evaluation ran it ("forward" outside the backward).
    Gradient accumulation (a tensor read by several consumers) runs inside the node that produced the
    gradient, so an `add_` row names the consumer whose gradient was summed."""
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    out: dict[tuple[str, str], list[float]] = {}
    for e in prof.events():
        if e.device_type != DeviceType.CPU or not getattr(e, key):
            continue
        node, p = "forward", e.cpu_parent
        if e.name.startswith(NODE):  # the engine's own time around a node
            node, p = e.name[len(NODE):], None
        while p is not None:
            if p.name.startswith(NODE):
                node = p.name[len(NODE):]
                break
            p = p.cpu_parent
        row = out.setdefault((node, e.name), [0.0, 0])
        row[0] += getattr(e, key) / 1e3
        row[1] += 1
    return out


def _report_by_node(name: str, prof, device: torch.device, rows: int) -> None:
    table = sorted(by_node(prof, device).items(), key=lambda kv: -kv[1][0])
    what = "kernel" if device.type == "cuda" else "host"
    print(f"\n## {name} (by autograd node: {what} self time)\n| node | operator | ms | calls |\n|---|---|---:|---:|")
    for (node, op), (ms, n) in table[:rows]:
        print(f"| {node[:70]} | {op[:60]} | {ms:.3f} | {n} |")


def profile_phase(name: str, fn, device: torch.device, rows: int, by_shape: bool = False, host: bool = False,
                  trace: str | None = None, nodes: bool = False, gaps: bool = False) -> None:
    fn()
    _sync(device)  # warm-up (Triton compiles, allocator)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    plain = time.perf_counter() - t0
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts, record_shapes=by_shape) as prof:
        t0 = time.perf_counter()
        fn()
        _sync(device)
        wall = time.perf_counter() - t0
    print(f"\n{name}: {plain * 1e3:.1f} ms wall without the profiler")
    if trace:  # a Chrome / Perfetto timeline: where the GPU waits on the host, kernel by kernel
        prof.export_chrome_trace(trace)
        print(f"trace: {trace}")
    if gaps and device.type == "cuda":
        from bench.gaps import analyse, print_report

        with tempfile.TemporaryDirectory() as tmp:
            path = trace or os.path.join(tmp, "trace.json")
            if not trace:
                prof.export_chrome_trace(path)
            with open(path) as f:
                print_report(analyse(json.load(f)), rows)
    _report(name, prof, wall, device, rows)
    if by_shape:
        _report(name + " (by input shape)", prof, wall, device, rows, by_shape=True)
    if host:
        _report(name + " (by host time: what the CPU spends issuing the work)", prof, wall, device, rows, host=True)
    if nodes:
        _report_by_node(name, prof, device, rows)


def _trace_path(folder: str | None, phase: str) -> str | None:
    if folder is None:
        return None
    os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, f"{phase}.json")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="k3-small")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument("--decode-batch", type=int, default=32)
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--phases", default="train,optim,decode", help="comma list of: train, optim, decode, prefill")
    ap.add_argument("--prefix-len", type=int, default=None, help="prefill phase: cached shared prefix (default 10240)")
    ap.add_argument("--new-len", type=int, default=None, help="prefill phase: new tokens per request (default 730)")
    ap.add_argument("--compile", action="store_true", help="compiled elementwise regions (training and decode)")
    ap.add_argument("--doc-mean", type=int, default=0,
                    help="train phase: documents of random lengths with this mean packed in the rows (0 = one per row)")
    ap.add_argument("--by-shape", action="store_true", help="also a table grouped by operator input shapes")
    ap.add_argument("--host", action="store_true", help="also a table sorted by host (CPU) self time")
    ap.add_argument("--by-node", action="store_true",
                    help="train phase: also a table of operator time per autograd node (who causes each add_ / cat)")
    ap.add_argument("--trace", default=None, help="folder for a Chrome trace (.json) of each phase")
    ap.add_argument("--gaps", action="store_true",
                    help="CUDA: idle gaps between kernels charged to the host code launching after them")
    args = ap.parse_args()
    device = torch.device(args.device)
    preset = "k3-tiny" if args.tiny else args.preset
    T = args.seq_len or (128 if args.tiny else 8192)
    tokens = args.tokens or (256 if args.tiny else 16384)
    torch.manual_seed(0)
    model = K3ForCausalLM(get_preset(preset)).init_weights(seed=0).to(device)
    if device.type == "cuda":
        model.set_kda_backend("triton")
    if args.compile:
        from k3.model.compile import compile_model

        compile_model(model)
    opt = PerHeadMuon(build_param_groups(model, HeadGeometry.from_config(model.config.text_config), lr=1e-3,
                                         weight_decay=0.1))
    B = max(1, tokens // T)
    vocab = model.config.text_config.vocab_size
    ids = torch.randint(0, vocab, (1, B * T + 1), device=device)
    cu = torch.arange(0, B * T + 1, T, dtype=torch.int32)  # host offsets, as the trainer passes
    if args.doc_mean:  # documents of random lengths, as a real corpus packs them
        from bench.train import document_offsets

        cu = document_offsets(B, T, args.doc_mean)
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    phases = args.phases.split(",")

    def fwd_bwd() -> None:
        with amp:
            loss = model(ids[:, :-1], labels=ids[:, 1:], cu_seqlens=cu, return_logits=False).loss  # as the trainer
        loss.backward()

    if "train" in phases:
        # inside one step_weights() as `k3 train` on one GPU: the weights' bf16 copies come from the warm-up
        # call, so the profiled forward+backward is a micro-batch after a step's first
        with model.step_weights():
            profile_phase(f"{preset} forward+backward, {B}x{T} tokens, {len(cu) - 1} documents", fwd_bwd, device,
                          args.rows, args.by_shape, args.host, _trace_path(args.trace, "train"), args.by_node,
                          args.gaps)
    if "optim" in phases:
        fwd_bwd()
        profile_phase("optimizer step (Per-Head Muon + AdamW)", opt.step, device, args.rows,
                      trace=_trace_path(args.trace, "optim"), gaps=args.gaps)
    opt.zero_grad(set_to_none=True)
    if "decode" in phases:
        from k3.serve.engine import Engine, EngineConfig
        from k3.serve.sampling import SamplingParams

        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model.to(dtype)  # with --compile the decode graphs capture the compiled regions (k3 serve --compile)
        eng = Engine(model, None, EngineConfig(memory_budget_bytes=8 << 30 if device.type == "cuda" else 256 << 20))
        prompts = [torch.randint(0, vocab, (200 + 7 * i,)).tolist() for i in range(args.decode_batch)]
        for p in prompts:
            eng.add_request(p, SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True))
        while any(r.num_computed < r.prompt_len - 1 for r in eng.scheduler.running) or eng.num_waiting:
            eng.step()

        def decode_steps() -> None:
            for _ in range(8):
                eng.step()

        profile_phase(f"serving: 8 decode steps at batch {args.decode_batch}", decode_steps, device, args.rows)
    if "prefill" in phases:
        profile_prefill_hits(model, args, device, vocab)


def profile_prefill_hits(model: K3ForCausalLM, args: argparse.Namespace, device: torch.device, vocab: int) -> None:
    """Serving prefill after a prefix-cache hit (an agent's next turn): `--decode-batch` requests share a
    cached `--prefix-len` prefix and each brings `--new-len` new tokens; profiles the engine steps that
    prefill them (and sample one token)."""
    from k3.serve.engine import Engine, EngineConfig
    from k3.serve.sampling import SamplingParams

    tiny = args.tiny or device.type == "cpu"
    prefix_len = args.prefix_len or (300 if tiny else 10240)
    new_len = args.new_len or (40 if tiny else 730)
    model.to(torch.bfloat16 if device.type == "cuda" else torch.float32)
    eng = Engine(model, None, EngineConfig(memory_budget_bytes=(40 << 30) if device.type == "cuda" else 256 << 20,
                                           page_size=256 if not tiny else 16, unit_size=512 if not tiny else 32,
                                           short_prefill_budget=8192, long_prefill_budget=8192))
    gen = torch.Generator().manual_seed(1)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    shared = torch.randint(0, vocab, (prefix_len,), generator=gen).tolist()
    eng.generate([shared], one)  # the prefix is cached (and its KDA state checkpointed) from here on

    def next_turns() -> None:
        prompts = [shared + torch.randint(0, vocab, (new_len,), generator=gen).tolist()
                   for _ in range(args.decode_batch)]
        eng.generate(prompts, one)

    profile_phase(f"serving: prefill of {args.decode_batch} x {new_len} new tokens after a {prefix_len}-token "
                  f"prefix hit", next_turns, device, args.rows)
    m = eng.metrics.snapshot()
    print(f"engine: {m['prefill_forwards']} prefill forwards {m['prefill_seconds']:.3f} s, "
          f"{m['decode_forwards']} decode forwards {m['decode_seconds']:.3f} s, cached tokens {m['cached_tokens']}")


if __name__ == "__main__":
    main()
