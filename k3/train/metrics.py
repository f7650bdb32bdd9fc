"""Training telemetry: JSONL metrics, a live one-line progress display, and the PNG loss curve."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any, TextIO


class MetricsLog:
    """Appends one JSON object per line to `path` (flushed, so a crash loses nothing written)."""

    def __init__(self, path: str, resume: bool = False) -> None:
        self.path = path
        self._f = open(path, "a" if resume else "w")

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(record, allow_nan=True) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def read_metrics(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def truncate_metrics(path: str, last_step: int) -> None:
    """Drop records past `last_step` (used on resume, so the log has no duplicated steps)."""
    if not os.path.exists(path):
        return
    keep = [r for r in read_metrics(path) if r.get("step", -1) <= last_step]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        for r in keep:
            f.write(json.dumps(r) + "\n")
    os.replace(tmp, path)


class Progress:
    """A single updating status line: step, loss, tokens/s, ETA, expert balance."""

    def __init__(self, total_steps: int, stream: TextIO | None = None) -> None:
        """stream: default the current sys.stderr (looked up here, not when this module was imported)."""
        stream = sys.stderr if stream is None else stream
        self.total, self.stream = total_steps, stream
        self.t0 = time.perf_counter()
        self.tty = stream.isatty()
        self._last_plain = 0.0

    def update(self, step: int, loss: float, tok_s: float, balance: float | None, extra: str = "") -> None:
        done = step + 1
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / max(done, 1) * (self.total - done)
        width = 24
        fill = int(width * done / self.total)
        bar = "#" * fill + "." * (width - fill)
        bal = f" bal {balance:.2f}" if balance is not None and math.isfinite(balance) else ""
        line = (f"[{bar}] {done}/{self.total} loss {loss:.4f} {tok_s:,.0f} tok/s{bal} "
                f"eta {_fmt(eta)}{(' ' + extra) if extra else ''}")
        if self.tty:
            self.stream.write("\r\x1b[K" + line)
        elif time.perf_counter() - self._last_plain > 5 or done == self.total:  # logs: one line every 5 s
            self.stream.write(line + "\n")
            self._last_plain = time.perf_counter()
        self.stream.flush()

    def message(self, text: str) -> None:
        self.stream.write(("\r\x1b[K" if self.tty else "") + text + "\n")
        self.stream.flush()


def _fmt(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 60}:{seconds % 60:02d}" if seconds < 3600 else f"{seconds // 3600}h{seconds % 3600 // 60:02d}"


def save_figure(fig: Any, png_path: str) -> None:
    """Write a matplotlib figure to `png_path` atomically (a temporary file, then a rename) and close it."""
    import matplotlib.pyplot as plt

    tmp = png_path + ".tmp.png"
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, png_path)


def plot_losses(metrics_path: str, png_path: str) -> bool:
    """Write the loss curve (training loss and validation loss vs step). Returns False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    recs = read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in recs if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in recs if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if train:
        ax.plot(*zip(*train), lw=0.8, alpha=0.8, label="train loss")
    if val:
        ax.plot(*zip(*val), "o-", lw=1.5, label="validation loss")
    for r in recs:
        if r.get("event") == "stage":
            ax.axvline(r["step"], color="grey", ls=":", lw=0.8)
            ax.text(r["step"], ax.get_ylim()[1], f" T={r['seq_len']}", va="top", fontsize=7, color="grey")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, png_path)
    return True


def balance_record(max_mean: dict[int, float], cv: dict[int, float]) -> dict[str, Any]:
    """The expert-load fields of a step record from per-layer {layer index: value} dicts:
    max_load_ratio (max over layers of max/mean load), load_cv (mean over layers of std/mean), and
    the per-layer values under layer_max_load / layer_load_cv (JSON keys: the layer index as text).
    Empty when no layer was observed."""
    if not max_mean:
        return {}
    return {"max_load_ratio": max(max_mean.values()), "load_cv": sum(cv.values()) / max(len(cv), 1),
            "layer_max_load": {str(i): v for i, v in max_mean.items()},
            "layer_load_cv": {str(i): v for i, v in cv.items()}}


def plot_balance(metrics_path: str, png_path: str) -> bool:
    """Per-layer expert balance vs step (max/mean load above, CV below; one line per MoE layer).
    Returns False without matplotlib or without per-layer records."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    recs = [r for r in read_metrics(metrics_path) if "layer_max_load" in r]
    if not recs:
        return False
    layers = sorted({k for r in recs for k in r["layer_max_load"]}, key=int)
    fig, axes = plt.subplots(2, 1, figsize=(7, 6), dpi=110, sharex=True)
    for key, ax, label in (("layer_max_load", axes[0], "max / mean load"), ("layer_load_cv", axes[1], "load CV")):
        for layer in layers:
            pts = [(r["step"], r[key][layer]) for r in recs if layer in r.get(key, {})]
            if pts:
                ax.plot(*zip(*pts), lw=0.8, label=f"layer {layer}")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].axhline(1.0, color="grey", lw=0.8)
    axes[0].legend(fontsize=7, ncol=3)
    axes[1].set_xlabel("step")
    fig.tight_layout()
    save_figure(fig, png_path)
    return True
