import json

import pytest

from k3.config import ConfigError, K3Config, apply_overrides, get_preset, k3_small, k3_tiny, kimi_k3


def test_official_round_trip_keeps_every_key(tmp_path):
    cfg = kimi_k3()
    d = cfg.to_dict()
    d["text_config"]["some_future_field"] = {"x": 1}
    d["text_config"]["linear_attn_config"]["kda_layers_extra"] = 3
    (tmp_path / "config.json").write_text(json.dumps(d))
    again = K3Config.load(tmp_path)
    assert again.to_dict() == d
    assert "rope_theta" not in json.dumps(again.to_dict())
    assert again.text_config.linear_attn_config.full_attn_layers[-2:] == [92, 93]
    assert d["model_type"] == "kimi_k3" and d["text_config"]["model_type"] == "kimi_linear"


def test_official_values():
    t = kimi_k3().text_config
    assert (t.hidden_size, t.num_hidden_layers, t.num_attention_heads, t.intermediate_size) == (7168, 93, 96, 33792)
    assert (t.num_experts, t.num_experts_per_token, t.num_shared_experts) == (896, 16, 2)
    assert (t.moe_intermediate_size, t.routed_expert_hidden_size, t.attn_res_block_size) == (3072, 3584, 12)
    assert t.linear_attn_config.gate_lower_bound == -5.0 and t.kv_lora_rank == 512 and t.q_lora_rank == 1536


@pytest.mark.parametrize("field,value,match", [
    ("num_experts_per_token", 1000, "num_experts_per_token"),
    ("hidden_act", "gelu", "hidden_act"),
    ("mla_use_nope", False, "mla_use_nope"),
    ("num_key_value_heads", 3, "num_key_value_heads"),
    ("hidden_size", "big", "hidden_size"),
])
def test_invalid_fields_are_named(field, value, match):
    d = kimi_k3().to_dict()
    d["text_config"][field] = value
    with pytest.raises(ConfigError, match=match):
        K3Config.from_dict(d)


def test_layout_must_partition_layers():
    d = kimi_k3().to_dict()
    d["text_config"]["linear_attn_config"]["full_attn_layers"].append(1)
    with pytest.raises(ConfigError, match="partition|duplicates|kda_layers"):
        K3Config.from_dict(d)
    d = kimi_k3().to_dict()
    d["text_config"]["linear_attn_config"]["gate_lower_bound"] = -6.0
    with pytest.raises(ConfigError, match="gate_lower_bound"):
        K3Config.from_dict(d)


def test_mxfp4_needs_multiples_of_32():
    with pytest.raises(ConfigError, match="moe_intermediate_size"):
        apply_overrides(kimi_k3(), {"moe_intermediate_size": 100})


def test_presets_sizes():
    from k3.cli.info import describe

    tiny = describe(k3_tiny())
    assert 5e6 <= tiny["total_params"] <= 20e6
    small = describe(k3_small())
    assert 0.5e9 <= small["total_params"] <= 1e9
    full = describe(kimi_k3())
    assert abs(full["total_params"] / 2.8e12 - 1) < 0.02 and abs(full["active_params"] / 104e9 - 1) < 0.02
    t = k3_tiny().text_config
    assert t.is_mla(t.num_hidden_layers - 1) and not t.is_moe(0) and t.num_shared_experts >= 1
    assert t.num_hidden_layers // t.attn_res_block_size >= 2
    with pytest.raises(ConfigError, match="unknown preset"):
        get_preset("nope")
