"""Where the GPU waits: idle gaps between device kernels in a torch.profiler Chrome trace, charged to
the host code that launched the kernel after each gap.

    python bench/gaps.py trace.json [--min-us 2] [--rows 30]

A gap is time on the device timeline (all streams merged) with no kernel, memcpy or memset running.
Each gap is charged to the launch that ended it: the autograd node (or "forward") and the innermost
operator enclosing that launch on its host thread. When the launch itself came after the previous
kernel had finished, the host was behind (launch-bound code, or a synchronisation before it); the
`late` column counts those. Host calls that block for long (synchronisations, pageable copies) are
listed separately.
"""

from __future__ import annotations

import argparse
import bisect
import json
from dataclasses import dataclass, field

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
NODE = "autograd::engine::evaluate_function: "


@dataclass
class GapRow:
    """Idle device time charged to one (autograd node, operator) pair."""

    ms: float = 0.0
    gaps: int = 0
    late: int = 0  # gaps whose launch was issued after the device had gone idle


@dataclass
class GapReport:
    busy_ms: float
    idle_ms: float
    span_ms: float
    kernels: int
    rows: dict[tuple[str, str], GapRow] = field(default_factory=dict)
    blocking: list[tuple[float, str, str]] = field(default_factory=list)  # (ms, host call, enclosing op)


class _Enclosing:
    """The host operators enclosing a timestamp on one thread (cpu_op intervals nest)."""

    def __init__(self, ops: list[dict]):
        self.ops = sorted(ops, key=lambda e: (e["ts"], -e["dur"]))
        self.starts = [e["ts"] for e in self.ops]
        self.parent = [-1] * len(self.ops)
        open_: list[int] = []
        for i, e in enumerate(self.ops):
            while open_ and self.ops[open_[-1]]["ts"] + self.ops[open_[-1]]["dur"] < e["ts"]:
                open_.pop()
            self.parent[i] = open_[-1] if open_ else -1
            open_.append(i)

    def stack(self, t: float) -> list[str]:
        """Names of the operators open at time t, outermost first. Every op enclosing t is an ancestor
        of (or is) the last op starting at or before t, since the intervals nest."""
        out = []
        i = bisect.bisect_right(self.starts, t) - 1
        while i >= 0:
            e = self.ops[i]
            if e["ts"] + e["dur"] >= t:
                out.append(e["name"])
            i = self.parent[i]
        return out[::-1]


def _charge(stack: list[str]) -> tuple[str, str]:
    node = "forward"
    for name in stack:
        if name.startswith(NODE):
            node = name[len(NODE):]
            break
    inner = next((n for n in reversed(stack) if not n.startswith(NODE)), "(no operator)")
    return node, inner


def analyse(trace: dict, min_us: float = 2.0, block_us: float = 500.0) -> GapReport:
    """Gap report of a Chrome trace dict ({"traceEvents": [...]}, as torch.profiler exports)."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    dev = sorted((e for e in events if e.get("cat") in DEVICE_CATS), key=lambda e: e["ts"])
    if not dev:
        raise ValueError("the trace has no device kernels (profile with ProfilerActivity.CUDA)")
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})}
    threads: dict = {}
    for e in events:
        if e.get("cat") == "cpu_op":
            threads.setdefault((e["pid"], e["tid"]), []).append(e)
    enclosing = {k: _Enclosing(v) for k, v in threads.items()}
    rep = GapReport(busy_ms=0.0, idle_ms=0.0, span_ms=0.0, kernels=len(dev))
    end = dev[0]["ts"]
    busy = 0.0
    for k in dev:
        start, stop = k["ts"], k["ts"] + k["dur"]
        busy += max(0.0, stop - max(start, end))
        gap = start - end
        if gap >= min_us:
            launch = launches.get(k.get("args", {}).get("correlation"))
            node, op = ("(unknown launch)", k["name"][:60])
            late = False
            if launch is not None:
                enc = enclosing.get((launch["pid"], launch["tid"]))
                node, op = _charge(enc.stack(launch["ts"]) if enc else [])
                late = launch["ts"] >= end
            row = rep.rows.setdefault((node, op), GapRow())
            row.ms += gap / 1e3
            row.gaps += 1
            row.late += late
            rep.idle_ms += gap / 1e3
        end = max(end, stop)
    rep.busy_ms = busy / 1e3
    rep.span_ms = (end - dev[0]["ts"]) / 1e3
    for e in events:
        if e.get("cat") in LAUNCH_CATS and e["dur"] >= block_us:
            enc = enclosing.get((e["pid"], e["tid"]))
            node, op = _charge(enc.stack(e["ts"]) if enc else [])
            rep.blocking.append((e["dur"] / 1e3, e["name"], f"{node} / {op}"))
    rep.blocking.sort(reverse=True)
    return rep


def print_report(rep: GapReport, rows: int = 30) -> None:
    print(f"\n## device gaps: span {rep.span_ms:.1f} ms, kernels busy {rep.busy_ms:.1f} ms, idle "
          f"{rep.idle_ms:.1f} ms in gaps ({rep.kernels} device events)")
    print("| autograd node | operator launching after the gap | idle ms | gaps | host late |\n|---|---|---:|---:|---:|")
    for (node, op), r in sorted(rep.rows.items(), key=lambda kv: -kv[1].ms)[:rows]:
        print(f"| {node[:60]} | {op[:60]} | {r.ms:.3f} | {r.gaps} | {r.late} |")
    if rep.blocking:
        print("\nblocking host calls (>= 0.5 ms):")
        for ms, name, where in rep.blocking[:rows]:
            print(f"  {ms:8.3f} ms  {name}  in {where}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--min-us", type=float, default=2.0, help="ignore gaps shorter than this")
    ap.add_argument("--rows", type=int, default=30)
    args = ap.parse_args()
    with open(args.trace) as f:
        print_report(analyse(json.load(f), args.min_us), args.rows)


if __name__ == "__main__":
    main()
