"""k3-small acceptance run of learned-draft speculative decoding (issue #30, docs/draft.md): a target
trained here for a short time, a draft distilled from the target's own greedy outputs, then decode
tokens/s and the mean acceptance length tau at batch 1, 8 and 32 for plain decoding, n-gram speculation
and the draft, with the engine's speculation batch policy (`draft`, `ngram`) and without it
(`draft-all`: speculate at every batch). One GPU, about four minutes; every phase prints progress.

* Data: bytes of the interpreter's standard-library sources (`k3.data.corpus`, `k3 train`'s default
  corpus); token id = byte value (ids 0-255 of the preset's vocabulary, so the device needs no
  tokenizer), documents split into train / held-out by id.
* Target: the preset with fresh weights, trained for --target-seconds (AdamW, bf16 autocast, fp32 master
  weights) on windows of the train bytes, then cast to bf16 for serving. A random target is no use for
  acceptance: nothing about its outputs is learnable.
* Draft: `bench.draft.train_on_rows` (the training-time test of `k3 train-draft`) on the target's greedy
  continuations (the serving engine, --new-tokens each) of --draft-prompts train-byte prompts, for
  --draft-seconds.
* Measured rows (`bench.draft.measure`): held-out prompts, --new-tokens greedy tokens each, each row's
  workload run once untimed first (CUDA-graph captures), outputs compared with plain decoding.

    python bench/spec.py --markdown           # GPU: k3-small
    python bench/spec.py --tiny --markdown    # CPU smoke run: k3-tiny, seconds of training
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from bench.draft import engine, measure, train_on_rows  # noqa: E402
from k3.config import get_preset  # noqa: E402
from k3.data.corpus import iter_documents, split_documents  # noqa: E402
from k3.model.causal_lm import K3ForCausalLM  # noqa: E402
from k3.serve.sampling import SamplingParams  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="CPU smoke sizes with k3-tiny")
    p.add_argument("--preset", default=None, help="model preset (default k3-small, k3-tiny with --tiny)")
    p.add_argument("--device", default=None)
    p.add_argument("--target-seconds", type=float, default=None, help="target training time (default 40; tiny 3)")
    p.add_argument("--seq-len", type=int, default=None, help="target training window (default 512; tiny 64)")
    p.add_argument("--train-batch", type=int, default=None, help="target training rows per step (default 32; tiny 2)")
    p.add_argument("--lr", type=float, default=1e-3, help="target AdamW learning rate (20 warm-up steps)")
    p.add_argument("--draft-seconds", type=float, default=None, help="draft training time (default 100: a draft trained 25 s reached tau 2.1-2.3, 100 s tau 3.7-4.1; tiny 2)")
    p.add_argument("--draft-prompts", type=int, default=None, help="prompts the target continues for the draft's "
                   "data (default 256; tiny 8)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt bytes (default 64; tiny 8)")
    p.add_argument("--new-tokens", type=int, default=None, help="greedy tokens per request (default 128; tiny 8)")
    p.add_argument("--batches", default=None, help="comma list of batch sizes (default 1,8,32; tiny 1,2)")
    p.add_argument("--spec-tokens", type=int, default=4)
    p.add_argument("--spec-max-batch", type=int, default=None, help="EngineConfig.speculative_max_batch for the "
                   "draft / ngram modes (default: the engine's)")
    p.add_argument("--modes", default="plain,ngram,draft,draft-all", help="comma list of: plain, draft, ngram, "
                   "draft-all, ngram-all (-all: no speculation batch limit; skipped where the limit allows the batch)")
    p.add_argument("--budget-seconds", type=float, default=None, help="skip the measured rows still left this long "
                   "after the start (default: none)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="serving dtype of the target and "
                   "draft (default bfloat16 on GPU, float32 on CPU); float32 on GPU separates bf16 near-tie flips "
                   "from real output differences")
    p.add_argument("--markdown", action="store_true")
    a = p.parse_args(argv)
    a.preset = a.preset or ("k3-tiny" if a.tiny else "k3-small")
    a.device = a.device or ("cpu" if a.tiny or not torch.cuda.is_available() else "cuda")
    pick = lambda v, small, big: v if v is not None else (small if a.tiny else big)  # noqa: E731
    a.target_seconds = pick(a.target_seconds, 3.0, 40.0)
    a.seq_len, a.train_batch = pick(a.seq_len, 64, 512), pick(a.train_batch, 2, 32)
    a.draft_seconds, a.draft_prompts = pick(a.draft_seconds, 2.0, 100.0), pick(a.draft_prompts, 8, 256)
    a.prompt_len, a.new_tokens = pick(a.prompt_len, 8, 64), pick(a.new_tokens, 8, 128)
    a.batches = [int(x) for x in (a.batches or ("1,2" if a.tiny else "1,8,32")).split(",")]
    # what bench.draft's engine / measure read
    a.dtype = a.dtype or ("float32" if a.device == "cpu" else "bfloat16")
    a.static_decode, a.warmup, a.profile, a.requests, a.checkpoint = False, "full", None, None, None
    return a


def byte_corpus(a: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """(train bytes, held-out bytes) as uint8 tensors: the corpus documents, each followed by a newline."""
    docs = list(iter_documents(None))
    if a.tiny:
        docs = docs[:200]
    train, held = split_documents(docs, 0.05, seed=0)
    join = lambda ds: torch.frombuffer(bytearray(b"\n".join(d.text.encode() for d in ds)), dtype=torch.uint8)  # noqa: E731
    tr, he = join(train), join(held)
    print(f"# corpus: {len(train)} train / {len(held)} held-out documents, {tr.numel() / 1e6:.1f} / "
          f"{he.numel() / 1e6:.2f} MB", flush=True)
    return tr, he


def windows(data: torch.Tensor, n: int, length: int, seed: int) -> list[list[int]]:
    """n windows of `length` bytes at random offsets (seeded) -> token id lists."""
    rng = random.Random(seed)
    starts = [rng.randrange(data.numel() - length) for _ in range(n)]
    return [data[s: s + length].tolist() for s in starts]


def train_target(a: argparse.Namespace, data: torch.Tensor) -> K3ForCausalLM:
    """The preset, fresh weights, trained for a.target_seconds on byte windows -> bf16 (CPU: fp32), eval."""
    torch.manual_seed(0)
    model = K3ForCausalLM(get_preset(a.preset)).init_weights(seed=0).to(a.device).train()
    total, active = model.num_parameters()
    print(f"# target {a.preset}: {total / 1e9:.3f}B parameters ({active / 1e9:.3f}B active)", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    t0, step = time.perf_counter(), 0
    while True:
        starts = torch.randint(data.numel() - a.seq_len - 1, (a.train_batch,), generator=gen)
        rows = torch.stack([data[s: s + a.seq_len + 1] for s in starts.tolist()]).long().to(a.device)
        for g in opt.param_groups:
            g["lr"] = a.lr * min(1.0, (step + 1) / 20)
        with torch.autocast(a.device, torch.bfloat16, enabled=a.device == "cuda"):
            loss = model(rows[:, :-1], labels=rows[:, 1:], return_logits=False).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step == 1:
            print(f"# target step 1 (kernel compilation): {time.perf_counter() - t0:.1f}s, loss {loss.item():.3f}",
                  flush=True)
            t0 = time.perf_counter()
        spent = time.perf_counter() - t0
        if step % 50 == 0 or spent > a.target_seconds:
            tok_s = (step - 1) * a.train_batch * a.seq_len / max(spent, 1e-9)
            print(f"# target step {step}: loss {loss.item():.3f} nats/byte, {tok_s:,.0f} tok/s, {spent:.0f}s", flush=True)
        if spent > a.target_seconds:
            break
    del opt
    model.zero_grad(set_to_none=True)
    model = model.to_dtype(a.dtype).eval()
    if a.device == "cuda":
        torch.cuda.empty_cache()
    return model


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    start = time.perf_counter()
    train_bytes, held_bytes = byte_corpus(a)
    target = train_target(a, train_bytes)
    t0 = time.perf_counter()
    ps = windows(train_bytes, a.draft_prompts, a.prompt_len, seed=1)
    outs = engine(a, target, batch=64).generate(ps, SamplingParams(temperature=0, max_tokens=a.new_tokens,
                                                                   ignore_eos=True))
    rows = torch.tensor([p + o.token_ids for p, o in zip(ps, outs)], device=a.device)
    gc.collect()  # the generating engine's cache pool
    sample = bytes(b for b in outs[0].token_ids if b < 256).decode("utf-8", "replace")
    print(f"# target continuations for the draft: {len(ps)} x {a.new_tokens} tokens in {time.perf_counter() - t0:.1f}s;"
          f" one: {bytes(ps[0]).decode('utf-8', 'replace')!r} -> {sample!r}", flush=True)
    draft = train_on_rows(target, rows, a.prompt_len, a.spec_tokens, steps=100_000, seconds=a.draft_seconds,
                          batch_size=4 if a.tiny else 16, log_every=100)
    print(f"# setup done at {time.perf_counter() - start:.0f}s", flush=True)
    deadline = start + a.budget_seconds if a.budget_seconds else None
    held = lambda batch: windows(held_bytes, batch, a.prompt_len, seed=2)  # noqa: E731
    measure(a, target, draft, a.modes.split(","), held, deadline=deadline)
    print(f"# total {time.perf_counter() - start:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
