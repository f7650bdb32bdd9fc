"""EngineAgent throughput: N assistant turns one at a time vs together (act_batch) vs from N threads.

    python bench/llm_agent.py --n 64 --max-new-tokens 64            # k3-tiny, random weights

Greedy decoding; a turn ends at the stop token or the token limit, so each timing prints its token
count. Uses a random-weight preset and a BPE tokenizer trained here on synthetic text (no
checkpoint needed).
"""

from __future__ import annotations

import argparse
import random
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from k3.config import get_preset
from k3.data.tokenizer import train_bpe_tokenizer
from k3.envs.llm_agent import AgentConfig, EngineAgent
from k3.model.causal_lm import K3ForCausalLM
from k3.serve.engine import EngineConfig

WORDS = "the weather in Paris file read write mail note send call tool result plan step answer".split()
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="k3-tiny")
    p.add_argument("--n", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    rng = random.Random(0)
    tok = train_bpe_tokenizer([" ".join(rng.choice(WORDS) for _ in range(60)) for _ in range(200)], 1024)
    torch.manual_seed(0)
    model = K3ForCausalLM(get_preset(args.preset)).init_weights(seed=0)
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    model.to_dtype(dtype).to(args.device)
    cfg = EngineConfig(memory_budget_bytes=1 << 30, max_running=max(args.n, 1), max_model_len=4096,
                       enable_prefix_cache=False)
    agent = EngineAgent(model, tok, AgentConfig(max_new_tokens=args.max_new_tokens), engine_config=cfg)
    convs = [([{"role": "user", "content": f"{i}: " + " ".join(rng.choice(WORDS) for _ in range(20))}], TOOLS)
             for i in range(args.n)]
    agent.generate_batch(convs[:2])  # warm-up (CUDA graphs, allocator)
    for name, run in (("one at a time", lambda: [agent.generate_batch([c])[0] for c in convs]),
                      ("act_batch", lambda: agent.generate_batch(convs)),
                      (f"{args.n} threads", lambda: list(ThreadPoolExecutor(args.n).map(
                          lambda c: agent.generate_batch([c])[0], convs)))):
        t0 = time.perf_counter()
        gens = run()
        dt = time.perf_counter() - t0
        ntok = sum(len(g.token_ids) for g in gens)
        print(f"{args.preset} {args.device} {name:>14}: {args.n} turns, {ntok} tokens in {dt:.2f} s "
              f"= {ntok / dt:.0f} tok/s")
    agent.close()


if __name__ == "__main__":
    main()
