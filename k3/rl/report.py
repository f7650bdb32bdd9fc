"""PNG plots of an RL run's metrics.jsonl: reward and pass rate per step, mean thinking tokens per
effort, and the partial-rollout bookkeeping (staleness, clip fraction)."""

from __future__ import annotations

from k3.train.metrics import read_metrics, save_figure


def plot_rl(metrics_path: str, png_path: str, efforts: tuple[str, ...]) -> bool:
    """Write the plots; False without matplotlib or without training records."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    recs = [r for r in read_metrics(metrics_path) if "reward" in r and "event" not in r]
    if not recs:
        return False
    steps = [r["step"] for r in recs]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4), dpi=100)
    ax = axes[0]
    ax.plot(steps, [r["reward"] for r in recs], label="reward")
    ax.plot(steps, [r["pass_rate"] for r in recs], label="pass rate")
    for r in read_metrics(metrics_path):
        if r.get("event") == "eval":
            ax.plot([r["step"]], [r.get("reward", 0.0)], "k*", ms=9)
    ax.set_title("training batches (stars: held-out reward)")
    ax.legend()
    ax = axes[1]
    for e in efforts:
        ax.plot(steps, [r.get(f"think_{e}", float("nan")) for r in recs], label=f"think tokens ({e})")
    ax.set_title("mean thinking tokens per effort")
    ax.legend()
    ax = axes[2]
    ax.plot(steps, [r.get("staleness_mean", 0.0) for r in recs], label="mean staleness")
    ax.plot(steps, [r.get("clip_frac", 0.0) for r in recs], label="clip fraction")
    ax.plot(steps, [r.get("mask_frac", 0.0) for r in recs], label="masked fraction")
    ax.set_title("bounded updates")
    ax.legend()
    for a in axes:
        a.set_xlabel("step")
        a.grid(alpha=0.3)
    fig.tight_layout()
    save_figure(fig, png_path)
    return True
