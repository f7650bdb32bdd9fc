"""Shared fixtures of the SFT tests: a tiny model + tokenizer saved as a base checkpoint, the fixture world."""

import pytest

from k3.config import apply_overrides, get_preset
from k3.data.tokenizer import train_bpe_tokenizer
from k3.model.causal_lm import K3ForCausalLM
from k3.sft import sources
from tests.sft import fixture_world

MODEL = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "q_lora_rank": 64, "kv_lora_rank": 32,
         "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16, "num_experts": 8,
         "num_experts_per_token": 2, "moe_intermediate_size": 32, "routed_expert_hidden_size": 32,
         "linear_attn_config": {"num_heads": 2, "head_dim": 16}}
TEXTS = ["def lookup(key): return store[key]", '{"key": "k1", "value": 42}', "What is stored under k3? Submit it.",
         "Rivers are calm and quiet.", "- Owls are small.\n- Owls are rare.", "You are an agent. Use the tools."] * 20


@pytest.fixture(scope="session")
def tokenizer():
    return train_bpe_tokenizer(TEXTS, 512)


@pytest.fixture(scope="session")
def base_dir(tmp_path_factory, tokenizer):
    """An official-format checkpoint of a randomly initialised tiny model with its tokenizer."""
    d = tmp_path_factory.mktemp("base")
    b = 512 - 256
    mc = apply_overrides(get_preset("k3-tiny"), dict(MODEL, bos_token_id=b, eos_token_id=b + 2, pad_token_id=b + 255,
                                                     media_placeholder_token_id=b + 21))
    mc.dtype = "float32"
    K3ForCausalLM(mc.validate()).init_weights(seed=0).save_pretrained(d, dtype="float32")
    tokenizer.save(d)
    return d


@pytest.fixture
def worlds(monkeypatch):
    """Point k3.sft.sources at the fixture world."""
    mod = fixture_world.module()
    monkeypatch.setattr(sources, "_worlds", lambda: mod)
    return mod
