"""Router balancing side by side: the same training run under each balancing method, and the
histogram estimator's quantile error against the exact order statistic vs histogram size.

For each method (TrainConfig.balancing: none, sign, quantile_exact, quantile) it trains the same
preset with the same seed and data, and reports per method: median / p90 of max_load_ratio (max over
MoE layers of max/mean load) and the mean per-layer max/mean and CV over the last `--tail` steps,
the final training loss (mean of the last `--tail` steps) and the final validation loss. Then, on
router scores captured from one training batch of the last model, the histogram estimator's
|Q_hist - u_(ceil r)| (margin units, max over layers and experts) and the load error it causes
(max over experts of |#{u > Q_hist} - m*k/E| / (m*k/E)) for each `--bins`.

CPU (k3-tiny, the default `k3 train`):   python bench/balance.py --out /tmp/balance
GPU (k3-small, a few hundred steps):      python bench/balance.py --preset k3-small --max-steps 300 \\
                                              --set data=/path/to/corpus --out /tmp/balance_small
Writes <out>/<method>/ (metrics.jsonl, balance.png, ...) and <out>/balance.json, <out>/balance.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics

import torch

from k3.optim.quantile_balance import QuantileBalancer, biased_margins, exact_bias_update
from k3.train.config import TrainConfig
from k3.train.metrics import read_metrics
from k3.train.state import load_run_config
from k3.train.trainer import Trainer

METHODS = ("none", "sign", "quantile_exact", "quantile")


def _quantile(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(p * len(xs)) - 1))] if xs else float("nan")


def summarize(metrics_path: str, tail: int) -> dict[str, float]:
    """Balance and loss numbers of one run's metrics.jsonl over its last `tail` steps."""
    recs = read_metrics(metrics_path)
    steps = [r for r in recs if "loss" in r][-tail:]
    ratios = [r["max_load_ratio"] for r in steps if "max_load_ratio" in r]
    layer_mm = [v for r in steps for v in r.get("layer_max_load", {}).values()]
    layer_cv = [v for r in steps for v in r.get("layer_load_cv", {}).values()]
    vals = [r["val_loss"] for r in recs if "val_loss" in r]
    return {"median_max_load_ratio": statistics.median(ratios) if ratios else float("nan"),
            "p90_max_load_ratio": _quantile(ratios, 0.9),
            "mean_layer_max_mean": statistics.fmean(layer_mm) if layer_mm else float("nan"),
            "mean_layer_cv": statistics.fmean(layer_cv) if layer_cv else float("nan"),
            "train_loss": statistics.fmean(r["loss"] for r in steps) if steps else float("nan"),
            "val_loss": vals[-1] if vals else float("nan")}


@torch.no_grad()
def capture_scores(trainer: Trainer) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Router scores [m, E] and biases [E] of every MoE layer on the next training batch."""
    got: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for i, moe in trainer.moe.items():
        moe.gate.score_observer = lambda s, b, i=i: got.__setitem__(i, (s.float().clone(), b.float().clone()))
    batch = next(trainer.data.loader)
    trainer.model.train()
    ids, labels = batch.input_ids.to(trainer.device), batch.labels.to(trainer.device)
    cuda = trainer.device.type == "cuda"
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda) if cuda else contextlib.nullcontext():
        trainer.model(ids, labels=labels, cu_seqlens=batch.cu_seqlens, return_logits=False)
    return got


def estimator_error(scores: dict[int, tuple[torch.Tensor, torch.Tensor]], top_k: int, bins: int) -> dict[str, float]:
    """Histogram QB (default range/spacing) vs the exact order statistic on captured scores."""
    worst_q, worst_load = 0.0, 0.0
    for s, b in scores.values():
        m, E = s.shape
        qb = QuantileBalancer(1, E, top_k, bins=bins)
        qb.observe(0, s, b)
        new = b.clone()
        qb.step([new])
        q = b - new  # rate 1: the histogram quantile Q_{1-k/E}(u) per expert
        u, _ = biased_margins(s, b, top_k)
        rank = max(math.ceil(m * (E - top_k) / E), 1)
        exact = u.sort(dim=0).values[rank - 1]
        target = m * top_k / E
        worst_q = max(worst_q, float((q - exact).abs().max()))
        worst_load = max(worst_load, float(((u > q).sum(0) - target).abs().max() / target))
    return {"bins": bins, "max_quantile_error": worst_q, "max_load_error": worst_load}


def run_method(args, method: str) -> dict[str, object]:
    out = os.path.join(args.out, method)
    over = {"preset": args.preset, "out": out, "seed": args.seed, "balancing": method}
    if args.max_steps:
        over["max_steps"] = args.max_steps
    for kv in args.set:
        k, v = kv.split("=", 1)
        over[k] = json.loads(v) if _is_json(v) else v
    if method == "sign" and args.sign_rate is not None:
        over["bias_update_rate"] = args.sign_rate
    trainer = Trainer(TrainConfig.from_dict(over))
    trainer.run()
    res: dict[str, object] = {"method": method, **summarize(os.path.join(out, "metrics.jsonl"), args.tail)}
    if method == "quantile":  # the estimator error on the final model's router scores
        scores = capture_scores(trainer)
        res["estimator"] = [estimator_error(scores, trainer.model_config.text_config.num_experts_per_token, b)
                            for b in args.bins]
    return res


def estimator_from_run(run_dir: str, bins: list[int]) -> list[dict[str, float]]:
    """The estimator error on router scores of a finished run's checkpoint (its next training batch)."""
    cfg = TrainConfig.from_dict(load_run_config(run_dir))
    trainer = Trainer(cfg, resume=True)
    scores = capture_scores(trainer)
    return [estimator_error(scores, trainer.model_config.text_config.num_experts_per_token, b) for b in bins]


def _fit(scores: torch.Tensor, top_k: int, iters: int = 6) -> torch.Tensor:
    """A bias balancing `scores` [m, E] in sample: QB iterated to its fixed point (exact quantiles)."""
    bias = torch.zeros(scores.shape[1])
    for _ in range(iters):
        bias = exact_bias_update(scores, bias, top_k)
    return bias


def _max_mean(scores: torch.Tensor, bias: torch.Tensor, top_k: int) -> float:
    loads = torch.bincount((scores + bias).topk(top_k, -1).indices.flatten(), minlength=scores.shape[1]).double()
    return float(loads.max() / loads.mean())


def floor_analysis(trainer: Trainer, seq_lens: list[int], batches: int) -> list[dict[str, float]]:
    """How balanced can the *next* batch be, with the model frozen (no router drift at all)?

    For each seq_len: `batches` consecutive training batches of the run's tokens_per_step; per MoE
    layer, batch t under a bias fitted (QB to convergence) on (a) batch t itself, (b) batch t-1, (c) all
    the other batches pooled (a population bias). Reports medians over t of the max over layers: (b)
    is the best any balancer that uses the previous step can do, (c) the best any fixed bias can do;
    both measure how much the batch's own content varies, which no causal bias can follow.
    """
    k = trainer.model_config.text_config.num_experts_per_token
    rows = []
    for seq in seq_lens:
        trainer.data.loader.set_shape(seq, trainer.cfg.tokens_per_step // seq)
        caps = [capture_scores(trainer) for _ in range(batches)]
        own, prev, pooled = [], [], []
        for t in range(1, batches):
            own.append(max(_max_mean(caps[t][i][0], _fit(caps[t][i][0], k), k) for i in caps[t]))
            prev.append(max(_max_mean(caps[t][i][0], _fit(caps[t - 1][i][0], k), k) for i in caps[t]))
            pooled.append(max(_max_mean(caps[t][i][0], _fit(torch.cat([c[i][0] for j, c in enumerate(caps) if j != t]), k),
                                        k) for i in caps[t]))
        rows.append({"seq_len": seq, "rows_per_batch": trainer.cfg.tokens_per_step // seq,
                     "in_sample": statistics.median(own), "previous_batch": statistics.median(prev),
                     "population": statistics.median(pooled)})
    return rows


def _is_json(v: str) -> bool:
    try:
        json.loads(v)
        return True
    except ValueError:
        return False


def table(results: list[dict[str, object]]) -> str:
    head = ("| method | median max/mean (max over layers) | p90 | mean per-layer max/mean | mean per-layer CV "
            "| train loss (tail) | val loss |\n|---|---|---|---|---|---|---|\n")
    rows = "".join(f"| {r['method']} | {r['median_max_load_ratio']:.3f} | {r['p90_max_load_ratio']:.3f} | "
                   f"{r['mean_layer_max_mean']:.3f} | {r['mean_layer_cv']:.3f} | {r['train_loss']:.4f} | "
                   f"{r['val_loss']:.4f} |\n" for r in results)
    est = next((r["estimator"] for r in results if "estimator" in r), None)
    if est:
        rows += ("\n| bins | max abs quantile error (margin units) | max load error (fraction of m·k/E) |\n"
                 "|---|---|---|\n" + "".join(f"| {e['bins']} | {e['max_quantile_error']:.2e} | "
                                             f"{e['max_load_error']:.4f} |\n" for e in est))
    return head + rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="k3-tiny")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {METHODS}")
    p.add_argument("--max-steps", type=int, default=None, help="default: the preset's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tail", type=int, default=50, help="steps summarised at the end of each run")
    p.add_argument("--sign-rate", type=float, default=None, help="gamma of the sign update (default 1e-3)")
    p.add_argument("--bins", type=lambda s: [int(x) for x in s.split(",")], default=[16, 64, 256, 1024])
    p.add_argument("--set", action="append", default=[], help="TrainConfig override key=value (JSON values)")
    p.add_argument("--from-run", default=None, help="only the estimator error, on a finished run's checkpoint")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if args.from_run:
        est = estimator_from_run(args.from_run, args.bins)
        md = "".join(
            f"| {e['bins']} | {e['max_quantile_error']:.2e} | {e['max_load_error']:.4f} |\n" for e in est)
        print("| bins | max abs quantile error | max load error |\n|---|---|---|\n" + md)
        return
    os.makedirs(args.out, exist_ok=True)
    results = []
    for method in args.methods.split(","):
        results.append(run_method(args, method))
        with open(os.path.join(args.out, "balance.json"), "w") as f:
            json.dump(results, f, indent=1)
    md = table(results)
    with open(os.path.join(args.out, "balance.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
