"""Is the generated image data learnable at all? The vision path alone, without the language model.

Trains the k3-tiny-vl vision encoder (tower + patch-merger projector) with a linear classifier on
the mean of its media tokens, on one scored kind of `k3.data.synth_vision` (colour / shape /
count), and prints held-out accuracy next to chance. It separates "the images do not carry the
answer in a form a tiny tower picks up" from "the joint LM training does not get there in time":
docs/vision.md ("Results") used it to choose object sizes, canvas sizes and the count layout.

One thread, AdamW, linear warm-up then decay over the last 30% of the steps; ~5 s per 100 steps of
32 images at 56 x 56 px on one CPU core.

Usage:  python bench/vision_probe.py --kind shape [--steps 100] [--size 56 56] [--hidden 64]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F

from k3.data import synth_vision
from k3.media import pil_to_tensor
from k3.model.vision import MoonViTEncoder
from k3.vision_config import tiny_vision_config


def _encoder(hidden: int, layers: int, text_hidden: int) -> MoonViTEncoder:
    cfg = tiny_vision_config(text_hidden)
    cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size = layers, hidden, 2 * hidden
    cfg.num_attention_heads = max(1, hidden // cfg.head_dim)
    enc = MoonViTEncoder(cfg.validate())
    enc.reset_parameters(torch.Generator().manual_seed(0))
    return enc


def _tensors(examples: list, classes: list[str]) -> tuple[list[torch.Tensor], torch.Tensor]:
    return [pil_to_tensor(e.image) for e in examples], torch.tensor([classes.index(e.answer) for e in examples])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", choices=("colour", "shape", "count"), default="shape")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--size", type=int, nargs=2, default=[56, 56], help="min and max image side (px)")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--train-examples", type=int, default=4000)
    ap.add_argument("--heldout", type=int, default=300)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)

    size = tuple(args.size)
    train = synth_vision.generate_examples(args.train_examples, synth_vision.TRAIN_SEED, size=size, kinds=[args.kind])
    held = synth_vision.generate_examples(args.heldout, synth_vision.HELDOUT_SEED, size=size, kinds=[args.kind])
    classes = list(train[0].choices)
    xtr, ytr = _tensors(train, classes)
    xte, yte = _tensors(held, classes)
    enc = _encoder(args.hidden, args.layers, 256)
    head = torch.nn.Linear(256, len(classes))
    opt = torch.optim.AdamW([*enc.parameters(), *head.parameters()], lr=args.lr, weight_decay=0.01)

    def logits(images: list[torch.Tensor]) -> torch.Tensor:
        return head(torch.stack([t.mean(0) for t in enc.encode(images)]))

    @torch.no_grad()
    def accuracy(xs: list[torch.Tensor], ys: torch.Tensor) -> float:
        pred = torch.cat([logits(xs[i:i + 100]).argmax(-1) for i in range(0, len(xs), 100)])
        return float((pred == ys).float().mean())

    rng = np.random.default_rng(0)
    decay_from = 0.7 * args.steps
    t0 = time.perf_counter()
    for step in range(args.steps):
        lr = args.lr * min(1.0, (step + 1) / 20)
        if step >= decay_from:
            lr *= 1 - 0.9 * (step - decay_from) / (args.steps - decay_from)
        for g in opt.param_groups:
            g["lr"] = lr
        idx = rng.integers(0, len(xtr), args.batch)
        loss = F.cross_entropy(logits([xtr[i] for i in idx]), ytr[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(f"{args.kind}: held-out accuracy {accuracy(xte, yte):.1%} (chance {1 / len(classes):.1%}) after "
          f"{args.steps} steps x {args.batch} images of {size[0]}-{size[1]} px, tower hidden {args.hidden} x "
          f"{args.layers} layers, {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
