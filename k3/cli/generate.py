"""`k3 generate`: sample text from a checkpoint (or a preset with random weights) with the hybrid cache."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import torch


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text from a checkpoint or a randomly initialised preset")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="checkpoint directory (official layout + tokenizer files)")
    src.add_argument("--preset", help="a preset with random weights (for smoke tests)")
    p.add_argument("--tokenizer", help="tokenizer directory (default: the checkpoint directory)")
    p.add_argument("--prompt", default="", help="prompt text")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--packed-experts", action="store_true",
                   help="keep the routed experts packed MXFP4 in memory (4.25 bits/weight; the CUDA path runs the "
                        "MXFP4 grouped GEMM); BF16 checkpoints are quantised on load")
    p.add_argument("--draft", default=None, help="an EAGLE-3 draft directory (`k3 train-draft` OUT/final): "
                   "speculative decoding through the serving engine (same output distribution)")
    p.add_argument("--spec-tokens", type=int, default=4, help="draft tokens per step with --draft")
    p.add_argument("--engine", action="store_true", help="decode through the serving engine without a draft "
                   "(the baseline of --draft)")
    p.set_defaults(func=run)


class _ByteIds:
    """Fallback for a preset without a tokenizer: UTF-8 bytes are the token ids."""

    eos_id = -1

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def run(args: argparse.Namespace) -> int:
    from k3.config import get_preset
    from k3.data.tokenizer import load_tokenizer
    from k3.model.causal_lm import K3ForCausalLM
    from k3.model.generate import generate_stream
    from k3.model.sampling import SamplingParams

    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                max_tokens=args.max_new_tokens)
    except ValueError as e:  # checked before the model loads
        print(f"error: {e} (--max-new-tokens, --temperature, --top-p, --top-k)", file=sys.stderr)
        return 2
    if args.checkpoint:
        dtype = args.dtype or ("float32" if args.device == "cpu" else None)  # None: the checkpoint's dtype
        model = K3ForCausalLM.from_pretrained(args.checkpoint, dtype=dtype, device=args.device)
        if getattr(args, "packed_experts", False):
            from k3.model.moe import pack_routed_experts

            pack_routed_experts(model)
    else:
        model = K3ForCausalLM(get_preset(args.preset)).init_weights(seed=args.seed or 0)
        model.to_dtype(args.dtype or "float32").to(args.device)
    tok_dir = args.tokenizer or args.checkpoint
    tok = load_tokenizer(tok_dir) if tok_dir and _has_tokenizer(tok_dir) else _ByteIds()
    if args.checkpoint and isinstance(tok, _ByteIds):
        print(f"error: no tokenizer files in {tok_dir} (pass --tokenizer DIR)", file=sys.stderr)
        return 2
    params = dataclasses.replace(params, stop_token_ids=(tok.eos_id,) if tok.eos_id >= 0 else ())
    ids = tok.encode(args.prompt) if args.prompt else [getattr(tok, "bos_id", 0)]
    model.eval()
    print(args.prompt, end="", flush=True)
    out: list[int] = []
    shown = ""
    t0 = time.perf_counter()
    if args.draft or args.engine:
        from k3.cli.spec_generate import engine_stream

        stream, summary = engine_stream(model, tok, ids, dataclasses.replace(params, seed=args.seed), args.draft,
                                        args.spec_tokens)
    else:
        stream, summary = ((t for _, t in generate_stream(model, [ids], params, seed=args.seed)), lambda: "")
    for tok_id in stream:
        if tok_id in params.stop_token_ids:
            break
        out.append(tok_id)
        text = tok.decode(out)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            print(text[len(shown):], end="", flush=True)
            shown = text
    dt = time.perf_counter() - t0
    print(f"\n[{len(out)} tokens, {len(out) / max(dt, 1e-9):.1f} tok/s{summary()}]", file=sys.stderr)
    return 0


def _has_tokenizer(path: str) -> bool:
    return any(os.path.exists(os.path.join(path, f)) for f in ("tiktoken.model", "tokenizer.json"))
