"""Parameter grouping: every k3 parameter name gets the right Muon block spec or AdamW group."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from k3.optim.muon import BlockSpec, PerHeadMuon
from k3.optim.param_groups import HeadGeometry, build_param_groups, layer_mixers, muon_block_spec

# Tiny geometry with all head sizes different so a wrong rule cannot pass by accident.
d, V, H, K = 48, 64, 3, 8            # hidden, vocab, heads, KDA head dim
NOPE, ROPE, VH = 6, 2, 10            # MLA dims: q block 8, kv_b block 16, v 10
QL, KVL, R = 20, 12, 4               # q_lora, kv_lora, forget-gate rank
E, I, L, IDENSE, SH = 4, 12, 24, 40, 16
GEOM = HeadGeometry(kda_head_dim=K, mla_qk_head_dim=NOPE + ROPE, mla_kv_b_block=NOPE + VH, mla_v_head_dim=VH)

COMMON = {
    "input_layernorm.weight": ((d,), None), "post_attention_layernorm.weight": ((d,), None),
    "self_attention_res_norm.weight": ((d,), None), "self_attention_res_proj.weight": ((1, d), None),
    "mlp_res_norm.weight": ((d,), None), "mlp_res_proj.weight": ((1, d), None),
}
KDA = {
    "self_attn.q_proj.weight": ((H * K, d), BlockSpec.rows(K)),
    "self_attn.k_proj.weight": ((H * K, d), BlockSpec.rows(K)),
    "self_attn.v_proj.weight": ((H * K, d), BlockSpec.rows(K)),
    "self_attn.q_conv1d.weight": ((H * K, 1, 4), None), "self_attn.k_conv1d.weight": ((H * K, 1, 4), None),
    "self_attn.v_conv1d.weight": ((H * K, 1, 4), None),
    "self_attn.A_log": ((H,), None), "self_attn.dt_bias": ((H * K,), None),
    "self_attn.f_a_proj.weight": ((R, d), BlockSpec.whole()),
    "self_attn.f_b_proj.weight": ((H * K, R), BlockSpec.rows(K)),
    "self_attn.b_proj.weight": ((H, d), BlockSpec.whole()),
    "self_attn.o_norm.weight": ((K,), None),
    "self_attn.g_proj.weight": ((H * K, d), BlockSpec.rows(K)),
    "self_attn.o_proj.weight": ((d, H * K), BlockSpec.cols(K)),
}
MLA = {
    "self_attn.q_a_proj.weight": ((QL, d), BlockSpec.whole()),
    "self_attn.q_a_layernorm.weight": ((QL,), None),
    "self_attn.q_b_proj.weight": ((H * (NOPE + ROPE), QL), BlockSpec.rows(NOPE + ROPE)),
    "self_attn.kv_a_proj_with_mqa.weight": ((KVL + ROPE, d), BlockSpec.whole()),
    "self_attn.kv_a_layernorm.weight": ((KVL,), None),
    "self_attn.kv_b_proj.weight": ((H * (NOPE + VH), KVL), BlockSpec.rows(NOPE + VH)),
    "self_attn.g_proj.weight": ((H * VH, d), BlockSpec.rows(VH)),
    "self_attn.o_proj.weight": ((d, H * VH), BlockSpec.cols(VH)),
}
DENSE = {f"mlp.{n}.weight": (s, BlockSpec.whole()) for n, s in
         [("gate_proj", (IDENSE, d)), ("up_proj", (IDENSE, d)), ("down_proj", (d, IDENSE))]}
MOE = {
    "block_sparse_moe.gate.weight": ((E, d), BlockSpec.whole()),
    "block_sparse_moe.routed_expert_down_proj.weight": ((L, d), BlockSpec.whole()),
    "block_sparse_moe.routed_expert_up_proj.weight": ((d, L), BlockSpec.whole()),
    "block_sparse_moe.routed_expert_norm.weight": ((L,), None),
    "block_sparse_moe.shared_experts.gate_proj.weight": ((SH, d), BlockSpec.whole()),
    "block_sparse_moe.shared_experts.up_proj.weight": ((SH, d), BlockSpec.whole()),
    "block_sparse_moe.shared_experts.down_proj.weight": ((d, SH), BlockSpec.whole()),
    "block_sparse_moe.experts.w1": ((E, I, L), BlockSpec.experts()),
    "block_sparse_moe.experts.w3": ((E, I, L), BlockSpec.experts()),
    "block_sparse_moe.experts.w2": ((E, L, I), BlockSpec.experts()),
}
GLOBAL = {
    "model.embed_tokens.weight": ((V, d), None), "lm_head.weight": ((V, d), None),
    "model.norm.weight": ((d,), None), "model.output_attn_res_norm.weight": ((d,), None),
    "model.output_attn_res_proj.weight": ((1, d), None),
}
NO_DECAY_ADAMW = ("norm.weight", "_res_proj.weight", "A_log", "dt_bias")


def _expected() -> dict[str, tuple[tuple[int, ...], BlockSpec | None]]:
    """Layer 0: KDA + dense MLP; layer 1: KDA + MoE; layer 2: MLA + MoE."""
    table = dict(GLOBAL)
    for i, parts in enumerate([(KDA, DENSE), (KDA, MOE), (MLA, MOE)]):
        for part in (COMMON,) + parts:
            table.update({f"model.layers.{i}.{k}": v for k, v in part.items()})
    return table


def _build(table) -> nn.Module:
    """Module tree whose named_parameters() are exactly the table's names."""
    root = nn.Module()
    for name, (shape, _) in table.items():
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, nn.Parameter(torch.randn(*shape) * 0.02))
    for i in (1, 2) if "model.layers.1.block_sparse_moe.gate.weight" in table else ():
        root.model.layers.get_submodule(f"{i}.block_sparse_moe.gate").register_buffer(
            "e_score_correction_bias", torch.zeros(E))
    return root


def test_layer_mixers_from_names():
    assert layer_mixers(list(_expected())) == {0: "kda", 1: "kda", 2: "mla"}


def test_every_name_gets_its_spec():
    table = _expected()
    mixers = layer_mixers(list(table))
    for name, (shape, spec) in table.items():
        mixer = mixers.get(int(name.split(".")[2])) if name.startswith("model.layers.") else None
        assert muon_block_spec(name, shape, GEOM, mixer) == spec, name


def test_build_param_groups_partition():
    table = _expected()
    model = _build(table)
    groups = build_param_groups(model, GEOM, lr=0.02, weight_decay=0.1, adamw_lr=3e-3)
    assert [g["kind"] for g in groups] == ["muon", "adamw", "adamw"]
    muon, decay, no_decay = groups
    names = muon["names"] + decay["names"] + no_decay["names"]
    assert sorted(names) == sorted(table)  # each parameter exactly once, buffers excluded
    assert not any("e_score_correction_bias" in n for n in names)
    for name, spec in zip(muon["names"], muon["block_specs"]):
        assert spec == tuple(table[name][1]), name
    for name in decay["names"] + no_decay["names"]:
        assert table[name][1] is None, name
    assert set(decay["names"]) == {n for n in table if n.endswith(("embed_tokens.weight", "lm_head.weight", "_conv1d.weight"))}
    assert all(any(p in n for p in NO_DECAY_ADAMW) for n in no_decay["names"])
    assert (muon["lr"], muon["weight_decay"]) == (0.02, 0.1)
    assert (decay["lr"], decay["weight_decay"]) == (3e-3, 0.1)
    assert (no_decay["lr"], no_decay["weight_decay"]) == (3e-3, 0.0)
    named = dict(model.named_parameters())
    for g in groups:
        assert all(p is named[n] for p, n in zip(g["params"], g["names"]))


def test_groups_drive_the_optimizer():
    model = _build(_expected())
    opt = PerHeadMuon(build_param_groups(model, GEOM, lr=0.02, weight_decay=0.1), ns_dtype="float32")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    for n, p in model.named_parameters():
        assert not torch.equal(p.detach(), before[n]), n


def test_frozen_parameters_and_wrapper_prefix():
    table = _expected()
    wrapper = nn.Module()
    wrapper.add_module("module", _build(table))
    wrapper.module.lm_head.weight.requires_grad_(False)
    groups = build_param_groups(wrapper, GEOM, lr=1e-3, weight_decay=0.0)
    names = [n for g in groups for n in g["names"]]
    assert "module.lm_head.weight" not in names and len(names) == len(table) - 1
    muon = groups[0]
    spec = dict(zip(muon["names"], muon["block_specs"]))
    assert spec["module.model.layers.2.self_attn.o_proj.weight"] == ("cols", VH)


def test_geometry_from_config():
    cfg = SimpleNamespace(linear_attn_config={"head_dim": 128}, qk_nope_head_dim=128, qk_rope_head_dim=64,
                          v_head_dim=128, num_attention_heads=96)
    assert HeadGeometry.from_config(cfg) == HeadGeometry(128, 192, 256, 128)
    cfg.linear_attn_config = SimpleNamespace(head_dim=64)
    assert HeadGeometry.from_config(cfg).kda_head_dim == 64
    groups = build_param_groups(_build(GLOBAL), cfg, lr=1e-3, weight_decay=0.1)
    assert [g["kind"] for g in groups] == ["adamw", "adamw"]
    with pytest.raises(ValueError, match="head_dim"):
        HeadGeometry.from_config(SimpleNamespace(linear_attn_config={}))


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="mixer"):
        muon_block_spec("model.layers.3.self_attn.o_proj.weight", (d, H * VH), GEOM)
    with pytest.raises(ValueError, match="q_proj.*multiple of head block 8"):
        muon_block_spec("model.layers.0.self_attn.q_proj.weight", (20, d), GEOM)
    with pytest.raises(ValueError, match="experts.w1"):
        muon_block_spec("model.layers.1.block_sparse_moe.experts.w1", (I, L), GEOM)
    with pytest.raises(ValueError, match="kda_head_dim"):
        HeadGeometry(0, 8, 16, 10)
    same = HeadGeometry(8, 8, 16, 8)  # equal KDA/MLA value head dims: no mixer needed
    assert muon_block_spec("model.layers.3.self_attn.o_proj.weight", (d, 24), same) == BlockSpec.cols(8)


def test_unknown_names_fall_back_by_rank():
    assert muon_block_spec("model.extra.proj.weight", (8, 16), GEOM) == BlockSpec.whole()
    assert muon_block_spec("model.extra.stack", (2, 8, 16), GEOM) == BlockSpec.experts()
    assert muon_block_spec("model.extra.scale", (16,), GEOM) is None
    assert muon_block_spec("model.extra.vec", (16, 1), GEOM) is None
