"""`k3 eval`: run agents against the practice worlds (`k3 eval worlds`) or BFCL (`k3 eval bfcl`).

The agent is an OpenAI-compatible endpoint (`--base-url URL --model M`: k3 serve, vLLM, the Kimi
API), a checkpoint run in-process by k3's engine (`--checkpoint DIR`), or a built-in agent
(`--agent oracle|random` for worlds, `--replay` for BFCL's ground truth). Prints a table; `--json`
prints the full report as JSON instead, `--json PATH` writes it to PATH as well as the table.
"""

from __future__ import annotations

import argparse
import json
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="evaluate an agent on the practice worlds or BFCL")
    esub = p.add_subparsers(dest="suite", metavar="SUITE", required=True)
    w = esub.add_parser("worlds", help="per-world success on held-out practice-world tasks")
    _agent_args(w, builtin=True)
    w.add_argument("--tasks", type=int, default=10, help="episodes per world (held-out seeds)")
    w.add_argument("--worlds", default=None, help="comma-separated world names (default: all)")
    w.add_argument("--harness", default=None, help="harness profile name, or 'random' (sampled per episode)")
    w.add_argument("--max-turns", type=int, default=24)
    w.add_argument("--split", default="heldout", choices=["heldout", "train"])
    w.add_argument("--transcripts", default=None, metavar="PATH", help="write every episode's messages (JSONL)")
    w.set_defaults(func=run_worlds)
    b = esub.add_parser("bfcl", help="BFCL function-calling accuracy (bfcl-eval data, k3's checkers)")
    _agent_args(b, builtin=False)
    b.add_argument("--category", default="simple", choices=["simple", "multi_turn_base"])
    b.add_argument("--limit", type=int, default=None, help="first N entries only")
    b.add_argument("--replay", action="store_true", help="replay the ground truth (must score 100%%)")
    b.set_defaults(func=run_bfcl)


def _agent_args(p: argparse.ArgumentParser, builtin: bool) -> None:
    p.add_argument("--base-url", default=None, help="OpenAI-compatible API base, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--model", default=None, help="model id sent to the endpoint")
    p.add_argument("--api-key", default=None)
    p.add_argument("--checkpoint", default=None, help="run this checkpoint in-process with k3's engine")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory for --checkpoint (default: the checkpoint)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--memory-budget-mb", type=float, default=1024.0, help="engine cache memory for --checkpoint")
    if builtin:
        p.add_argument("--agent", default=None, choices=["oracle", "random"], help="a built-in agent")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-tokens", type=int, default=None, help="per assistant turn (default: endpoint's; 1024 "
                   "in-process)")
    p.add_argument("--effort", default=None, choices=["low", "medium", "high", "max"], help="thinking effort")
    p.add_argument("--no-thinking", action="store_true", help="non-thinking mode")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per endpoint request")
    p.add_argument("--concurrency", type=int, default=8, help="episodes / entries in flight")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help="print the report as JSON (or write it to PATH)")


def _fail(msg: str) -> int:
    print(f"k3 eval: error: {msg}", file=sys.stderr)
    return 2


def make_agent(args: argparse.Namespace) -> object:
    """The endpoint or in-process agent the arguments name (ValueError for bad combinations)."""
    sources = [bool(args.base_url), bool(args.checkpoint), bool(getattr(args, "agent", None) or
                                                                getattr(args, "replay", False))]
    if sum(sources) != 1:
        raise ValueError("give exactly one agent: --base-url URL --model M, --checkpoint DIR, or a built-in agent")
    if args.base_url:
        return _endpoint(args)
    from k3.envs.llm_agent import AgentConfig, EngineAgent
    from k3.serve.engine import EngineConfig

    cfg = AgentConfig(temperature=args.temperature, max_new_tokens=args.max_tokens or 1024,
                      thinking=not args.no_thinking, thinking_effort=args.effort or "low")
    return EngineAgent.from_checkpoint(args.checkpoint, cfg, tokenizer=args.tokenizer, device=args.device,
                                       dtype=args.dtype, engine_config=EngineConfig(
                                           memory_budget_bytes=int(args.memory_budget_mb * (1 << 20)),
                                           max_running=max(1, args.concurrency)))


def _endpoint(args: argparse.Namespace) -> object:
    import httpx

    from k3.envs.llm_agent import OpenAIAgent

    if not args.model:
        raise ValueError("--base-url needs --model")
    extra = {"thinking": {"type": "disabled"}} if args.no_thinking else None
    agent = OpenAIAgent(args.base_url, args.model, args.api_key, temperature=args.temperature,
                        max_tokens=args.max_tokens, timeout=args.timeout, reasoning_effort=args.effort,
                        extra_body=extra)
    try:  # reachability only: any HTTP answer (even 404 from servers without /models) will do
        httpx.get(agent.base_url + "/models", timeout=min(args.timeout, 10.0))
    except httpx.HTTPError as e:
        agent.close()
        raise ValueError(f"cannot reach {args.base_url}: {type(e).__name__}: {e}") from None
    return agent


def _emit(report: dict, table: str, args: argparse.Namespace) -> None:
    if args.json == "-":
        print(json.dumps(report, indent=1, default=str))
        return
    print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
        print(f"report written to {args.json}")


def _close(agent: object) -> None:
    if hasattr(agent, "close"):
        agent.close()


def run_worlds(args: argparse.Namespace) -> int:
    from k3.envs import evaluate as ev

    if args.tasks < 1 or args.max_turns < 1 or args.concurrency < 1:
        return _fail("--tasks, --max-turns and --concurrency must be >= 1")
    worlds = tuple(w.strip() for w in args.worlds.split(",") if w.strip()) if args.worlds else None
    cfg = ev.WorldsEvalConfig(worlds=worlds, tasks=args.tasks, split=args.split, harness=args.harness,
                              max_turns=args.max_turns, concurrency=args.concurrency)
    try:
        registry = ev.default_registry()
    except ImportError as e:
        return _fail(f"the practice worlds are not available ({e})")
    try:
        ev.check_worlds(worlds, registry)
        if args.harness not in (None, "random"):
            ev.get_profile(args.harness)
        if args.agent:
            if args.base_url or args.checkpoint:
                raise ValueError("--agent cannot be combined with --base-url or --checkpoint")
            factory, agent = (ev.oracle_factory if args.agent == "oracle" else ev.random_factory), None
        else:
            agent = make_agent(args)
            factory = ev.shared(agent)
    except ValueError as e:
        return _fail(str(e))
    try:
        report = ev.evaluate_worlds(factory, cfg, registry, keep_messages=bool(args.transcripts))
    finally:
        _close(agent)
    if args.transcripts:
        with open(args.transcripts, "w") as f:
            for rec in report["episodes"]:
                f.write(json.dumps(rec, default=str) + "\n")
    for rec in report["episodes"]:
        rec.pop("messages", None)
    _emit(report, ev.format_table(report), args)
    return 0


def run_bfcl(args: argparse.Namespace) -> int:
    from k3.envs.bfcl import BFCLError
    from k3.envs.evaluate import evaluate_bfcl

    if args.limit is not None and args.limit < 1:
        return _fail("--limit must be >= 1")
    agent = None
    try:
        if not args.replay:
            agent = make_agent(args)
        elif args.base_url or args.checkpoint:
            raise ValueError("--replay cannot be combined with --base-url or --checkpoint")
        report = evaluate_bfcl(args.category, agent, limit=args.limit, concurrency=args.concurrency,
                               replay=args.replay)
    except (ValueError, BFCLError) as e:
        return _fail(str(e))
    finally:
        if agent is not None:
            _close(agent)
    s = report["summary"]
    table = (f"BFCL {s['category']} ({s['agent']}): {s['correct']}/{s['entries']} correct = "
             f"{100 * s['accuracy']:.1f}%  [{s['seconds']:.1f} s]")
    if s["errors"]:
        table += "\nerrors: " + ", ".join(f"{k} {v}" for k, v in sorted(s["errors"].items()))
    _emit(report, table, args)
    return 0
