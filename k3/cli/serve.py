"""`k3 serve`: the OpenAI-compatible server (FastAPI + uvicorn) on a checkpoint or a random preset."""

from __future__ import annotations

import argparse
import os
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a checkpoint over an OpenAI-compatible HTTP API")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="checkpoint directory (official layout + tokenizer files)")
    src.add_argument("--preset", help="a preset with random weights (smoke tests; needs --tokenizer)")
    p.add_argument("--tokenizer", help="tokenizer directory (default: the checkpoint directory)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", help="model id(s) clients send, comma-separated "
                   "(default: the checkpoint directory name or the preset name)")
    p.add_argument("--seed", type=int, default=0, help="weight seed for --preset")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--memory-budget-mb", type=float, default=None,
                   help="cache memory for MLA pages, KDA slots and prefix checkpoints "
                        "(default: 50%% of free GPU memory, 1024 MB on cpu)")
    p.add_argument("--page-size", type=int, default=128, help="tokens per MLA page")
    p.add_argument("--unit-size", type=int, default=512, help="prefix-cache hash unit in tokens")
    p.add_argument("--checkpoint-every-units", type=int, default=8)
    p.add_argument("--no-prefix-cache", action="store_true")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-running", type=int, default=64)
    p.add_argument("--max-waiting", type=int, default=1024)
    p.add_argument("--prefill-budget", type=int, default=2048, help="prefill tokens per step for each of the "
                   "short and the long class")
    p.add_argument("--default-max-tokens", type=int, default=4096)
    p.add_argument("--clamp-max-tokens", action="store_true",
                   help="lower a max_tokens / max_completion_tokens that does not fit the context left to what fits "
                        "(reported in the x-k3-max-tokens-clamped response header) instead of answering 400")
    p.add_argument("--no-strict-tools", action="store_true",
                   help="do not grammar-enforce tool_choice auto when every tool is strict (tool_choice required / "
                        "named and JSON response formats stay enforced)")
    p.add_argument("--no-cuda-graphs", action="store_true", help="decode eagerly on CUDA (no CUDA graphs)")
    p.add_argument("--cuda-graph-max-len", type=int, default=16384,
                   help="contexts up to this many tokens decode in CUDA graphs, longer ones eagerly")
    p.add_argument("--speculative-ngram", type=int, default=0, metavar="K",
                   help="speculative decoding with K prompt-lookup (n-gram) draft tokens per step; 0 = off")
    p.add_argument("--speculative-min-match", type=int, default=2,
                   help="shortest context suffix (tokens) an n-gram draft must match")
    p.add_argument("--speculative-max-match", type=int, default=4,
                   help="longest context suffix (tokens) tried for an n-gram draft")
    p.add_argument("--draft", default=None, help="an EAGLE-3 draft directory (`k3 train-draft` OUT/final) for "
                   "learned speculative decoding (greedy: exact match; sampling: lossless rejection sampling)")
    p.add_argument("--spec-tokens", type=int, default=4, metavar="K", help="draft tokens per step with --draft")
    p.add_argument("--spec-max-batch", type=int, default=None, metavar="N",
                   help="speculate (--draft or --speculative-ngram) only in steps with at most N decoding requests; "
                        "larger steps decode plainly, where verifying costs more than it saves (0: always; "
                        "default: 8 on CUDA, 4 on CPU, measured: docs/draft.md)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the elementwise regions (fused norms, activations, AttnRes, router); "
                        "on CUDA the compiled kernels are captured in the decode graphs")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU serving)")
    p.add_argument("--max-image-mb", type=float, default=20.0,
                   help="largest encoded image (or video frame) accepted in a request (vision models)")
    p.add_argument("--no-local-media", action="store_true",
                   help="refuse local file paths as image sources (only data: URIs)")
    p.add_argument("--log-level", default="warning")
    p.add_argument("--packed-experts", action="store_true",
                   help="keep the routed experts packed MXFP4 in memory (4.25 bits/weight; the CUDA path runs the "
                        "MXFP4 grouped GEMM); BF16 checkpoints are quantised on load")
    p.set_defaults(func=run)


def load_model(args: argparse.Namespace):
    """(model, tokenizer, default model name) from --checkpoint or --preset."""
    import torch

    from k3.config import get_preset
    from k3.data.tokenizer import load_tokenizer
    from k3.model.causal_lm import K3ForCausalLM

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    tok_dir = args.tokenizer or args.checkpoint
    if not tok_dir:
        raise ValueError("--preset needs --tokenizer DIR (the chat format needs the special tokens)")
    tokenizer = load_tokenizer(tok_dir)
    if args.checkpoint:
        model = K3ForCausalLM.from_pretrained(args.checkpoint, dtype=dtype, device=device)
        if getattr(args, "packed_experts", False):
            from k3.model.moe import pack_routed_experts

            pack_routed_experts(model)
        name = os.path.basename(os.path.normpath(args.checkpoint))
    else:
        model = K3ForCausalLM(get_preset(args.preset)).init_weights(seed=args.seed)
        model.to_dtype(dtype).to(device)
        name = args.preset
    if getattr(args, "compile", False):
        from k3.model.compile import compile_model

        compile_model(model)
    return model, tokenizer, name


def build(args: argparse.Namespace):
    """(FastAPI app, engine) for the parsed arguments."""
    import torch

    from k3.serve.async_engine import AsyncEngine
    from k3.serve.engine import Engine, EngineConfig
    from k3.serve.server import ServerConfig, build_app

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer, name = load_model(args)
    device = model.lm_head.weight.device
    if args.memory_budget_mb is not None:
        budget = int(args.memory_budget_mb * (1 << 20))
    elif device.type == "cuda":
        budget = int(0.5 * torch.cuda.mem_get_info(device)[0])  # the rest: activations
    else:
        budget = 1 << 30
    cfg = EngineConfig(memory_budget_bytes=budget, page_size=args.page_size, unit_size=args.unit_size,
                       enable_prefix_cache=not args.no_prefix_cache, checkpoint_every_units=args.checkpoint_every_units,
                       max_running=args.max_running, max_waiting=args.max_waiting, max_model_len=args.max_model_len,
                       short_prefill_budget=args.prefill_budget, long_prefill_budget=args.prefill_budget,
                       cuda_graphs=not args.no_cuda_graphs, cuda_graph_max_len=args.cuda_graph_max_len,
                       speculative_ngram=args.speculative_ngram, speculative_min_match=args.speculative_min_match,
                       speculative_max_match=args.speculative_max_match,
                       speculative_draft_tokens=args.spec_tokens,
                       **({} if args.spec_max_batch is None else {"speculative_max_batch": args.spec_max_batch}))
    draft = None
    if args.draft:
        from k3.model.draft import load_draft

        draft = load_draft(args.draft, model)
    engine = Engine(model, tokenizer, cfg, draft=draft)
    names = tuple(n.strip() for n in (args.served_model_name or name).split(",") if n.strip())
    scfg = ServerConfig(model_names=names, default_max_tokens=args.default_max_tokens,
                        max_image_bytes=int(args.max_image_mb * (1 << 20)), allow_local_media=not args.no_local_media,
                        clamp_max_tokens=args.clamp_max_tokens, strict_tools=not args.no_strict_tools)
    app = build_app(AsyncEngine(engine), tokenizer, scfg)
    return app, engine


def _spec_label(args: argparse.Namespace, engine) -> str:
    if engine.spec is None:
        return "off"
    return f"draft k={args.spec_tokens}" if args.draft else f"ngram k={args.speculative_ngram}"


def run(args: argparse.Namespace) -> int:
    import uvicorn

    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: serving on {args.host}: the API has no authentication", file=sys.stderr)
    try:
        app, engine = build(args)
    except (ValueError, FileNotFoundError) as e:  # CheckpointError (a draft of another model) is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    names = app.state.k3.cfg.model_names
    print(f"k3 serve: model {names[0]!r} on http://{args.host}:{args.port}/v1 "
          f"(cache {engine.pool.usable} blocks x {engine.layout.block_bytes} B, "
          f"prefix cache {'on' if engine.prefix is not None else 'off'}, "
          f"speculative {_spec_label(args, engine)}, "
          f"images {'on' if engine.vision is not None else 'off'})", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                timeout_graceful_shutdown=5)
    return 0
