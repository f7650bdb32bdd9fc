"""Latency and density of the agent sandboxes (k3.envs.sandbox), per backend.

    PYTHONPATH=$PWD python bench/envs.py --n 10 [--backends bwrap runsc] [--idle 20]

Columns (median ms over --n repetitions): create (start to first usable exec not included),
exec round trip (`true`), pause, resume, checkpoint (runsc: memory image + workspace copy; bwrap:
workspace copy), restore, fork, close; then the memory of --idle idle sandboxes (sum of their
cgroup memory charge) as MiB per sandbox and sandboxes per GiB.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from k3.envs.sandbox import Sandbox


def _ms(fn, n: int) -> float:
    """Median wall time of ``fn()`` in milliseconds."""
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def _ms_closing(make, n: int) -> float:  # noqa: ANN001
    """Median ms of ``make()`` (returns a Sandbox), closing each result outside the timed region."""
    times = []
    for _ in range(n):
        t = time.perf_counter()
        sb = make()
        times.append((time.perf_counter() - t) * 1e3)
        sb.close()
    return statistics.median(times)


def _pause_resume_ms(sb: Sandbox, n: int) -> tuple[float, float]:
    """Median pause and resume latency (ms) of a sandbox with a running process."""
    pause, resume = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        sb.pause()
        t1 = time.perf_counter()
        sb.resume()
        t2 = time.perf_counter()
        pause.append((t1 - t0) * 1e3)
        resume.append((t2 - t1) * 1e3)
    return statistics.median(pause), statistics.median(resume)


def bench_backend(backend: str, n: int, idle: int) -> dict[str, float]:
    row: dict[str, float] = {}
    made: list[Sandbox] = []
    row["create"] = _ms(lambda: made.append(Sandbox.create(backend=backend)), n)
    row["close"] = _ms(lambda: made.pop().close(), n)
    tmp = Path(tempfile.mkdtemp(prefix="k3-bench-"))
    try:
        with Sandbox.create(backend=backend) as sb:
            sb.write_file("data.bin", b"x" * (1 << 20))
            sb.exec("while :; do sleep 0.1; done >/dev/null 2>&1 &")  # live processes to freeze / save
            row["exec"] = _ms(lambda: sb.exec(["true"]), n)
            row["pause"], row["resume"] = _pause_resume_ms(sb, n)
            row["checkpoint"] = _ms(lambda: sb.checkpoint(tmp / "ck"), n)
            row["restore"] = _ms_closing(lambda: Sandbox.restore(tmp / "ck"), n)
            row["fork"] = _ms_closing(sb.fork, n)
        boxes = [Sandbox.create(backend=backend) for _ in range(idle)]
        time.sleep(1.0)
        total = sum(b.memory_bytes() for b in boxes)
        for b in boxes:
            b.close()
        row["MiB/sandbox"] = total / idle / 2**20
        row["per GiB"] = 2**30 * idle / total
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return row


def _fmt(v: float) -> str:
    return f"{v:.2f}" if v < 1 else f"{v:.1f}" if v < 100 else f"{v:.0f}"


def table(rows: dict[str, dict[str, float]]) -> str:
    cols = ["create", "exec", "pause", "resume", "checkpoint", "restore", "fork", "close", "MiB/sandbox", "per GiB"]
    head = "| backend | " + " | ".join(c if c in ("MiB/sandbox", "per GiB") else f"{c} ms" for c in cols) + " |"
    lines = [head, "|" + "---|" * (len(cols) + 1)]
    for name, row in rows.items():
        lines.append(f"| {name} | " + " | ".join(_fmt(row[c]) for c in cols) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:  # noqa: ANN001
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=10, help="repetitions per latency (median)")
    ap.add_argument("--idle", type=int, default=20, help="idle sandboxes for the memory column")
    ap.add_argument("--backends", nargs="+", default=["bwrap", "runsc"], choices=["bwrap", "runsc"])
    args = ap.parse_args(argv)
    rows = {b: bench_backend(b, args.n, args.idle) for b in args.backends}
    print(table(rows))


if __name__ == "__main__":
    main()
