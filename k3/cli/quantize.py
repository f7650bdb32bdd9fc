"""`k3 quantize`: post-training quantisation of a checkpoint's routed experts to MXFP4 (or back to BF16),
and the validation loss of checkpoints on a training run's held-out split.

    k3 quantize --checkpoint runs/x/final --out runs/x/final-mxfp4 --format mxfp4
    k3 quantize --checkpoint runs/x/final --out runs/x/final-mxfp4 --format mxfp4 --eval-run runs/x
    k3 quantize --checkpoint runs/qat/final --eval-run runs/qat      # evaluate only (no --out)

MXFP4 uses the OCP rule of k3.quant.mxfp4 (FLOOR shared exponent, round-to-nearest-even, saturating);
weights already on the grid (an MXFP4 or QAT checkpoint) are kept exactly. Every other tensor is copied
in the source's dtype, and the tokenizer files come along. With --eval-run the loss is measured as the
trainer measures it (same validation batches), with MXFP4 experts kept packed (`pack_routed_experts`):
the model computes with exactly the packed weights (and, for a run trained with `--qat mxfp4,mxfp8`, with
its experts' input activations MXFP8-quantised, as served).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

_CHECKPOINT_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("quantize", help="quantise a checkpoint's routed experts to MXFP4 (post-training)")
    p.add_argument("--checkpoint", required=True, help="source checkpoint directory (official layout)")
    p.add_argument("--out", default=None, help="output checkpoint directory (omit to only evaluate)")
    p.add_argument("--format", default="mxfp4", choices=["mxfp4", "bf16"], help="routed experts' format")
    p.add_argument("--eval-run", default=None, metavar="RUN_DIR",
                   help="also print the validation loss of the source and output on this training run's "
                        "held-out split")
    p.add_argument("--device", default=None, help="device for --eval-run (default: cuda if available)")
    p.set_defaults(func=run)


def _copy_side_files(src: str, dst: str) -> None:
    """Tokenizer and other non-weight files of the source directory."""
    for name in os.listdir(src):
        path = os.path.join(src, name)
        if os.path.isfile(path) and name not in _CHECKPOINT_FILES and not name.endswith(".safetensors"):
            shutil.copy2(path, os.path.join(dst, name))


def quantize_checkpoint(src: str, dst: str, fmt: str) -> str:
    """Load `src` (either experts format), write `dst` with experts in `fmt`; returns the storage dtype."""
    from k3.config import K3Config
    from k3.model.causal_lm import K3ForCausalLM

    dtype = K3Config.load(src).dtype  # keep the non-expert tensors' precision
    model = K3ForCausalLM.from_pretrained(src, dtype="float32")
    model.save_pretrained(dst, experts_format=fmt, dtype="float32" if dtype == "float32" else None)
    _copy_side_files(src, dst)
    return dtype


def evaluate_checkpoint(path: str, run_dir: str, device: str, packed: bool) -> float:
    """Mean validation loss (nats/token) of checkpoint `path` on run `run_dir`'s validation batches
    (the trainer's: same split, length and count); packed: MXFP4 experts kept packed."""
    import torch

    from k3.config import ConfigError, K3Config
    from k3.model.causal_lm import K3ForCausalLM
    from k3.model.moe import pack_routed_experts
    from k3.quant.qat import QATConfig, apply_qat
    from k3.train.config import TrainConfig
    from k3.train.data import prepare_data
    from k3.train.state import load_run_config

    run_cfg = load_run_config(run_dir)
    if run_cfg is None:
        raise ConfigError(f"--eval-run {run_dir}: no training run there (its run config is missing)")
    cfg = TrainConfig.from_dict(run_cfg)
    data = prepare_data(cfg, K3Config.load(path), lambda msg: None)
    model = K3ForCausalLM.from_pretrained(path, dtype="float32", device=device).eval()
    if packed:
        pack_routed_experts(model)
    act = QATConfig.parse(cfg.qat).activations if cfg.qat else None
    if act is not None:  # a run trained with MXFP8 expert activations is served with them
        apply_qat(model, QATConfig(weights=None, activations=act))
    total, count = 0.0, 0
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.startswith("cuda") else torch.autocast(
        "cpu", enabled=False)
    with torch.no_grad(), autocast:
        for b in data.val_batches:
            ids, labels = b.input_ids.to(device), b.labels.to(device)
            loss = model(ids, labels=labels, cu_seqlens=b.cu_seqlens, return_logits=False).loss
            n = int((labels != -100).sum())
            total += loss.item() * n
            count += n
    return total / max(count, 1)


def _last_val_loss(run_dir: str) -> float | None:
    """The last `val_loss` the trainer logged in run_dir/metrics.jsonl (None if there is none)."""
    import json

    last = None
    path = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                rec = json.loads(line) if line.strip() else {}
                last = rec.get("val_loss", last)
    return last


def run(args: argparse.Namespace) -> int:
    import torch

    from k3.model.safetensors_io import read_weight_map

    if args.out is None and args.eval_run is None:
        print("error: nothing to do: pass --out DIR (write) and/or --eval-run RUN_DIR (evaluate)", file=sys.stderr)
        return 2
    src = args.checkpoint
    src_mxfp4 = any(n.endswith(".weight_packed") for n in read_weight_map(src))  # also checks it is a checkpoint
    if args.out is not None:
        if os.path.abspath(args.out) == os.path.abspath(src):
            print("error: --out must differ from --checkpoint", file=sys.stderr)
            return 2
        dtype = quantize_checkpoint(src, args.out, args.format)
        print(f"wrote {args.out}: routed experts {args.format}, other tensors {dtype}")
    if args.eval_run is not None:
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        rows = [(src, src_mxfp4)] + ([(args.out, args.format == "mxfp4")] if args.out else [])
        print("| checkpoint | experts | val loss |\n|---|---|---|")
        trained = _last_val_loss(args.eval_run)
        if trained is not None:  # the trainer's own evaluation of its in-memory model (fake-quant under QAT)
            print(f"| {args.eval_run} (trainer's last evaluation) | as trained | {trained:.4f} |")
        for path, packed in rows:
            loss = evaluate_checkpoint(path, args.eval_run, device, packed)
            print(f"| {path} | {'mxfp4 (packed)' if packed else 'bf16'} | {loss:.4f} |", flush=True)
    return 0
