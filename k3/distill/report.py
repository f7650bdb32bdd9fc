"""PNG plots of a distillation run's metrics.jsonl: per teacher, the reverse KL of the student to that
teacher and the student's task reward on that teacher's (domain, effort), per step."""

from __future__ import annotations

from k3.train.metrics import read_metrics, save_figure


def plot_distill(metrics_path: str, png_path: str, teachers: list[str]) -> bool:
    """Write the plots; False without matplotlib or without training records."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    recs = [r for r in read_metrics(metrics_path) if "event" not in r and "loss" in r]
    if not recs:
        return False
    fig, axes = plt.subplots(1, 3, figsize=(14, 4), dpi=100)
    for name in teachers:
        pts = [(r["step"], r[f"kl/{name}"]) for r in recs if f"kl/{name}" in r]
        axes[0].plot([p[0] for p in pts], [p[1] for p in pts], ".-", label=name)
        pts = [(r["step"], r[f"reward/{name}"]) for r in recs if f"reward/{name}" in r]
        axes[1].plot([p[0] for p in pts], [p[1] for p in pts], ".-", label=name)
        pts = [(r["step"], r[f"think/{name}"]) for r in recs if f"think/{name}" in r]
        axes[2].plot([p[0] for p in pts], [p[1] for p in pts], ".-", label=name)
    for ax, title in zip(axes, ("reverse KL per token (student || teacher)", "student task reward",
                                "student thinking tokens")):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, png_path)
    return True
