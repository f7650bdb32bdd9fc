"""Serving with compiled elementwise regions (`k3 serve --compile`): the static decode step (what CUDA
graphs capture) and prefill give the same tokens / logits as the eager model."""

from __future__ import annotations

import random

import pytest
import torch

from k3.config import k3_tiny
from k3.model.causal_lm import K3ForCausalLM
from k3.model.compile import compile_model, uncompile_model
from k3.serve.engine import Engine, EngineConfig
from k3.serve.sampling import SamplingParams
from tests.serve.conftest import random_prompt
from tests.serve.test_model_runner import Seqs, _twin_pools

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _engine(model, tokenizer, **overrides) -> Engine:
    cfg = dict(memory_budget_bytes=32 << 20, page_size=8, unit_size=8, checkpoint_every_units=4,
               checkpoint_min_gap=2, max_model_len=4096, max_running=4)
    cfg.update(overrides)
    return Engine(model, tokenizer, EngineConfig(**cfg))


def test_engine_greedy_tokens_identical_with_compiled_regions(tokenizer):
    """aot_eager traces the same regions the Inductor build compiles (graph breaks are errors) without
    code generation, so the fp32 tokens must match exactly; prefill and static decode both run them."""
    torch.manual_seed(0)
    model = K3ForCausalLM(k3_tiny()).init_weights(seed=0).eval()
    rng = random.Random(5)
    prompts = [random_prompt(rng, n, tokenizer.base_size) for n in (4, 19, 33)]
    ref = _engine(model, tokenizer, static_decode=True).generate(prompts, GREEDY)
    compile_model(model, backend="aot_eager")
    try:
        got = _engine(model, tokenizer, static_decode=True).generate(prompts, GREEDY)
    finally:
        uncompile_model(model)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]


@pytest.mark.gpu
def test_cuda_graph_decode_with_inductor_regions_matches_eager():
    """bf16 CUDA graphs over Inductor-compiled regions vs the eager graphs: logits agree to bf16 precision
    over several steps (fused kernels round differently, so not bitwise)."""
    from k3.serve.model_runner import DecodeRunner

    torch.manual_seed(0)
    model = K3ForCausalLM(k3_tiny()).init_weights(seed=0).to_dtype("bfloat16").cuda().eval()
    model.set_kda_backend("triton")
    rng = random.Random(6)
    prompts = [random_prompt(rng, n, 4000) for n in (5, 40, 77)]
    results = []
    for compiled in (False, True):
        if compiled:
            compile_model(model)
        pool, _ = _twin_pools(model, 16)
        seqs = Seqs(pool, prompts)
        logits = []
        with torch.inference_mode():
            seqs.prefill(model)
            runner = DecodeRunner(model, pool, max_batch=4, max_len=256, use_graphs=True)
            for _ in range(4):
                out = runner.decode(*seqs.decode_args()).float().clone()
                logits.append(out)
                seqs.push(out.argmax(-1).tolist() if not compiled else results[0][len(logits) - 1].argmax(-1).tolist())
        results.append(logits)
    uncompile_model(model)
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, atol=5e-2 * a.abs().max().item(), rtol=5e-2)
