"""Model FLOPs (the spec's k3 MFU convention) and the MFU that `k3 train` logs."""

import pytest
import torch

from k3.config import get_preset
from k3.model.causal_lm import K3ForCausalLM
from k3.train.flops import PEAK_BF16, batch_flops, flops_per_token, peak_bf16_flops


def test_k3_small_flops_per_token_and_per_document_attention():
    with torch.device("meta"):
        m = K3ForCausalLM(get_preset("k3-small"))
    tc, active = m.config.text_config, m.num_parameters()[1]
    assert flops_per_token(tc, active, 8192) == pytest.approx(1.455296e9, rel=1e-6)  # docs/benchmarks.md
    # one document per row == the per-row convention; shorter documents: less MLA work
    rows = torch.arange(0, 8 * 8192 + 1, 8192)
    assert batch_flops(tc, active, rows) == pytest.approx(8 * 8192 * flops_per_token(tc, active, 8192))
    docs = torch.tensor([0, 100, 8192, 9000, 16384])
    per_tok = batch_flops(tc, active, docs) / 16384
    assert flops_per_token(tc, active, 0, [1]) < per_tok < flops_per_token(tc, active, 8192)


def test_kimi_k3_matches_the_spec_derivation():
    """benchmarks.md: 6 N = 625.1 GFLOP/token with N = 104.19 B; KDA 69 x 96 x (6 128^2 + 3 64 128 + 64^2)."""
    with torch.device("meta"):
        m = K3ForCausalLM(get_preset("kimi-k3"))
    tc, active = m.config.text_config, m.num_parameters()[1]
    kda = 3 * 69 * 96 * (6 * 128 ** 2 + 3 * 64 * 128 + 64 ** 2)
    assert flops_per_token(tc, active, 0, [1]) - 6 * active == pytest.approx(kda + 3 * 24 * 2 * 96 * 320 * 0.5)
    assert 6 * active == pytest.approx(625.1e9, rel=2e-3)


def test_peak_lookup():
    assert peak_bf16_flops("cpu") is None
    assert PEAK_BF16["H200"] == 989e12
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        assert peak_bf16_flops("cuda") == next((v for k, v in sorted(PEAK_BF16.items(), key=lambda kv: -len(kv[0]))
                                                 if k in name), None)
