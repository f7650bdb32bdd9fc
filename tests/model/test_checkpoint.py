"""Official-checkpoint adapter: inventory, bit-exact round trips, MXFP4 experts, named errors.

The model is a plain nn.Module built from `internal_shapes(cfg)` (the naming contract), so these
tests do not depend on k3.model's layers.
"""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from k3.config import K3Config, apply_overrides, k3_tiny, kimi_k3
from k3.model import checkpoint as ckpt
from k3.model import safetensors_io
from k3.model.checkpoint import (
    INDEX_FILE,
    CheckpointError,
    internal_shapes,
    load_checkpoint,
    official_shapes,
    save_checkpoint,
)
from k3.quant.mxfp4 import decode_mxfp4, quantize_dequantize_mxfp4

P = "language_model."


# ---------------------------------------------------------------------------------------------
# helpers


def _mxfp4_cfg() -> K3Config:
    """k3-tiny with MXFP4 experts (moe dims 128, multiples of 32); 8 experts keep it fast."""
    return apply_overrides(k3_tiny(), {"quantization_config": kimi_k3().quantization_config,
                                       "text_config": {"num_experts": 8, "num_experts_per_token": 2}})


def build(cfg: K3Config, dtype=torch.bfloat16, device=None, seed: int | None = 0, grid: bool = False) -> nn.Module:
    """Module tree with exactly the internal names; random values when seed is given.
    grid=True puts the routed experts on the MXFP4 grid (as if decoded from a checkpoint)."""
    root = nn.Module()
    gen = torch.Generator().manual_seed(seed or 0)
    for name, (shape, fp32) in internal_shapes(cfg).items():
        *path, leaf = name.split(".")
        mod = root
        for p in path:
            if p not in mod._modules:
                mod.add_module(p, nn.Module())
            mod = mod._modules[p]
        dt = torch.float32 if fp32 else dtype
        if seed is None or device == "meta":
            t = torch.zeros(shape, dtype=dt, device=device)
        else:
            t = torch.randn(shape, generator=gen)
            if grid and name.endswith(("experts.w1", "experts.w2", "experts.w3")):
                t = quantize_dequantize_mxfp4(t)
            t = t.to(dt)
        if leaf == "e_score_correction_bias":
            mod.register_buffer(leaf, t)
        else:
            mod.register_parameter(leaf, nn.Parameter(t))
    return root


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_bit_equal(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype, k
        assert torch.equal(bits(sa[k]), bits(sb[k])), k


def rewrite(path: str, edit) -> None:
    """Apply `edit(name -> tensor dict)` to every shard and keep the index consistent."""
    with open(os.path.join(path, INDEX_FILE)) as f:
        index = json.load(f)
    for fn in sorted(set(index["weight_map"].values())):
        tensors = load_file(os.path.join(path, fn))
        tensors = edit(fn, tensors)
        save_file(tensors, os.path.join(path, fn), metadata={"format": "pt"})
        index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != fn}
        index["weight_map"].update({k: fn for k in tensors})
    with open(os.path.join(path, INDEX_FILE), "w") as f:
        json.dump(index, f)


def edit_one(name: str, fn_edit):
    def edit(fn, tensors):
        if name in tensors:
            fn_edit(tensors)
        return tensors

    return edit


@pytest.fixture(scope="module")
def bf16_ckpt(tmp_path_factory):
    cfg = k3_tiny()
    model = build(cfg, seed=1)
    path = str(tmp_path_factory.mktemp("ck") / "bf16")
    save_checkpoint(model, cfg, path, max_shard_bytes=4 << 20)
    return cfg, model, path


@pytest.fixture()
def ck_copy(bf16_ckpt, tmp_path):
    import shutil

    cfg, model, path = bf16_ckpt
    dst = str(tmp_path / "copy")
    shutil.copytree(path, dst)
    return cfg, model, dst


# ---------------------------------------------------------------------------------------------
# inventory


def test_official_inventory_kimi_k3():
    cfg = kimi_k3()
    off = official_shapes(cfg)
    # spec 3.7: 497,052 text tensors + 168 vision/projector tensors = the 497,220 of the K3 index
    assert len(off) == 497_220
    assert sum(not n.startswith(P) for n in off) == 168
    assert len(official_shapes(cfg.text_config, "mxfp4")) == 497_052
    L = "language_model.model.layers."
    assert off[L + "1.self_attn.A_log"] == ((128,), "F32")
    assert off[L + "1.self_attn.q_conv1d.weight"] == ((12288, 1, 4), "F32")
    assert off[L + "1.self_attn.o_norm.weight"] == ((128,), "F32")
    assert off[L + "5.block_sparse_moe.gate.e_score_correction_bias"] == ((896,), "F32")
    assert off[L + "5.block_sparse_moe.experts.895.w1.weight_packed"] == ((3072, 1792), "U8")
    assert off[L + "5.block_sparse_moe.experts.895.w1.weight_scale"] == ((3072, 112), "U8")
    assert off[L + "5.block_sparse_moe.experts.0.w2.weight_packed"] == ((3584, 1536), "U8")
    assert off[L + "5.block_sparse_moe.experts.0.w2.weight_scale"] == ((3584, 96), "U8")
    assert off[L + "5.block_sparse_moe.shared_experts.gate_proj.weight"] == ((6144, 7168), "BF16")
    assert off[L + "0.mlp.down_proj.weight"] == ((7168, 33792), "BF16")
    for i in (91, 92):  # the last two layers are both MLA
        assert off[L + f"{i}.self_attn.q_b_proj.weight"] == ((18432, 1536), "BF16")
        assert off[L + f"{i}.self_attn.kv_a_proj_with_mqa.weight"] == ((576, 7168), "BF16")
    assert off[P + "model.output_attn_res_proj.weight"] == ((1, 7168), "BF16")
    # total parameters (logical, A_log unpadded) = 2,779.5 B (spec §6)
    total = sum(torch.Size(s).numel() for s, _ in internal_shapes(cfg).values())
    assert abs(total / 2779.5e9 - 1) < 1e-3, total
    assert len(official_shapes(cfg, "bf16")) == 497_220 - 92 * 896 * 3


def test_internal_shapes_variants():
    cfg = apply_overrides(k3_tiny(), {"text_config": {"q_lora_rank": None}})
    sh = internal_shapes(cfg)
    t = cfg.text_config
    assert sh["model.layers.2.self_attn.q_proj.weight"] == ((t.num_attention_heads * t.qk_head_dim, 256), False)
    assert "model.layers.2.self_attn.q_a_proj.weight" not in sh
    assert sh["model.layers.0.self_attn.A_log"] == ((4,), True)
    assert sh["model.layers.1.block_sparse_moe.experts.w2"] == ((32, 128, 128), False)
    assert official_shapes(cfg)[P + "model.layers.0.self_attn.A_log"] == ((128,), "F32")


# ---------------------------------------------------------------------------------------------
# round trips


def test_bf16_round_trip_bit_exact(bf16_ckpt):
    cfg, model, path = bf16_ckpt
    with open(os.path.join(path, INDEX_FILE)) as f:
        index = json.load(f)
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert sorted(index["weight_map"]) == sorted(official_shapes(cfg, "bf16"))
    sizes = 0
    for fn in shards:
        for name, t in load_file(os.path.join(path, fn)).items():
            shape, dt = official_shapes(cfg, "bf16")[name]
            assert tuple(t.shape) == shape and t.dtype == {"BF16": torch.bfloat16, "F32": torch.float32}[dt], name
            sizes += t.numel() * t.element_size()
    assert index["metadata"]["total_size"] == sizes
    assert K3Config.load(path).to_dict() == cfg.to_dict() | {"dtype": "bfloat16"}
    fresh = build(cfg, seed=None)
    report = load_checkpoint(fresh, path)
    assert report.experts_format == "bf16" and not report.missing and not report.unexpected
    assert_bit_equal(model, fresh)
    assert not [n for n, t in fresh.state_dict().items() if ckpt.is_fp32_name(n) and t.dtype != torch.float32]


def test_fp32_round_trip_bit_exact(tmp_path):
    cfg = k3_tiny()
    model = build(cfg, dtype=torch.float32, seed=2)
    save_checkpoint(model, cfg, tmp_path / "f", dtype="float32", max_shard_bytes=1 << 40)
    fresh = build(cfg, dtype=torch.float32, seed=None)
    load_checkpoint(fresh, tmp_path / "f")
    assert_bit_equal(model, fresh)
    # the default dtype is the official BF16: lossy for an fp32 model, but rounds exactly
    save_checkpoint(model, cfg, tmp_path / "b")
    load_checkpoint(fresh, tmp_path / "b")
    q = fresh.state_dict()["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(q, model.state_dict()["model.layers.0.self_attn.q_proj.weight"].bfloat16().float())


def test_mxfp4_round_trip_bit_exact(tmp_path):
    cfg = _mxfp4_cfg()
    model = build(cfg, seed=3, grid=True)
    save_checkpoint(model, cfg, tmp_path / "m")
    off = official_shapes(cfg)
    with open(tmp_path / "m" / INDEX_FILE) as f:
        assert sorted(json.load(f)["weight_map"]) == sorted(off)
    assert K3Config.load(tmp_path / "m").experts_mxfp4
    fresh = build(cfg, seed=None)
    report = load_checkpoint(fresh, tmp_path / "m")
    assert report.experts_format == "mxfp4"
    assert_bit_equal(model, fresh)
    assert fresh._k3_mxfp4_scales["model.layers.1.block_sparse_moe.experts.w2"].shape == (8, 128, 4)


def test_mxfp4_off_grid_weights_are_quantised(tmp_path):
    cfg = _mxfp4_cfg()
    model = build(cfg, dtype=torch.float32, seed=4)  # experts not on the grid
    save_checkpoint(model, cfg, tmp_path / "m", dtype="float32")
    fresh = build(cfg, dtype=torch.float32, seed=None)
    load_checkpoint(fresh, tmp_path / "m")
    name = "model.layers.3.block_sparse_moe.experts.w3"
    assert torch.equal(fresh.state_dict()[name], quantize_dequantize_mxfp4(model.state_dict()[name]))


def _craft_experts(path: str, seed: int) -> dict[str, torch.Tensor]:
    """Replace every packed expert by crafted bytes whose scales the OCP rule would NOT choose
    (magnitudes <= 1.5 in some blocks, -0.0 codes), returning the crafted tensors."""
    gen = torch.Generator().manual_seed(seed)
    crafted = {}

    def edit(fn, tensors):
        for name in list(tensors):
            if name.endswith(".weight_packed"):
                p = torch.randint(0, 256, tensors[name].shape, dtype=torch.uint8, generator=gen)
                p[:, : p.shape[1] // 2] &= 0xBB  # first half of the columns: magnitudes <= 1.5
                p[0, :16] = 0x88  # row 0, block 0: all -0.0
                sname = name.replace(".weight_packed", ".weight_scale")
                s = torch.randint(110, 140, tensors[sname].shape, dtype=torch.uint8, generator=gen)
                tensors[name], tensors[sname] = p, s
                crafted[name], crafted[sname] = p, s
        return tensors

    rewrite(path, edit)
    return crafted


def test_mxfp4_hand_values_and_byte_identical_resave(tmp_path):
    cfg = _mxfp4_cfg()
    src = str(tmp_path / "src")
    save_checkpoint(build(cfg, seed=5, grid=True), cfg, src, max_shard_bytes=1 << 20)
    crafted = _craft_experts(src, seed=6)
    e = P + "model.layers.2.block_sparse_moe.experts.7.w1"
    crafted[e + ".weight_packed"][3, 20] = 0x2F  # col 40 = nibble 0xF = -6, col 41 = nibble 2 = 1.0
    crafted[e + ".weight_scale"][3, 1] = 126  # block 1 (cols 32..63) x 0.5
    rewrite(src, lambda fn, t: {k: crafted.get(k, v) for k, v in t.items()})

    model = build(cfg, seed=None)
    load_checkpoint(model, src)
    w1 = model.state_dict()["model.layers.2.block_sparse_moe.experts.w1"]
    assert w1[7, 3, 40].item() == -3.0 and w1[7, 3, 41].item() == 0.5
    assert torch.signbit(w1[0, 0, :32]).all() and (w1[0, 0, :32] == 0).all()
    for layer in range(1, 6):
        for w in ("w1", "w2", "w3"):
            base = f"{P}model.layers.{layer}.block_sparse_moe.experts"
            p = torch.stack([crafted[f"{base}.{e}.{w}.weight_packed"] for e in range(8)])
            s = torch.stack([crafted[f"{base}.{e}.{w}.weight_scale"] for e in range(8)])
            got = model.state_dict()[f"model.layers.{layer}.block_sparse_moe.experts.{w}"]
            assert torch.equal(bits(got), bits(decode_mxfp4(p, s))), (layer, w)
    dst = str(tmp_path / "dst")
    save_checkpoint(model, cfg, dst)
    again = {}
    for fn in set(json.load(open(os.path.join(dst, INDEX_FILE)))["weight_map"].values()):
        again.update(load_file(os.path.join(dst, fn)))
    for name, t in crafted.items():
        assert torch.equal(again[name], t), name

    # Modify one block: only that block gets a fresh (OCP) scale; the others keep their bytes.
    with torch.no_grad():
        w1[7, 3, :32] = torch.linspace(-5, 7, 32)
    save_checkpoint(model, cfg, dst)
    new_scale = load_file(os.path.join(dst, json.load(open(os.path.join(dst, INDEX_FILE)))["weight_map"][
        e + ".weight_scale"]))[e + ".weight_scale"]
    old = crafted[e + ".weight_scale"]
    assert new_scale[3, 0].item() == 127 + 2 - 2  # OCP: floor(log2 7) - 2 = 0
    mask = torch.ones_like(old, dtype=torch.bool)
    mask[3, 0] = False
    assert torch.equal(new_scale[mask], old[mask])


# ---------------------------------------------------------------------------------------------
# loading paths


def test_single_file_and_meta_and_dtype(tmp_path, bf16_ckpt):
    cfg, model, _ = bf16_ckpt
    d = tmp_path / "single"
    save_checkpoint(model, cfg, d, max_shard_bytes=1 << 40)
    os.replace(d / "model-00001-of-00001.safetensors", d / "model.safetensors")
    os.remove(d / INDEX_FILE)
    meta = build(cfg, device="meta")
    load_checkpoint(meta, d)  # meta -> cpu
    assert_bit_equal(model, meta)
    meta32 = build(cfg, device="meta")
    load_checkpoint(meta32, d / "model.safetensors", dtype=torch.float32, device="cpu")
    for k, t in meta32.state_dict().items():
        assert t.dtype == torch.float32 and t.device.type == "cpu"
        assert torch.equal(t, model.state_dict()[k].float()), k


def test_vision_tensors_skipped(ck_copy):
    cfg, model, path = ck_copy
    rewrite(path, lambda fn, t: t | ({"vision_tower.blocks.0.w": torch.ones(2), "mm_projector.proj.weight":
                                      torch.ones(2, 2)} if fn.startswith("model-00001") else {}))
    fresh = build(cfg, seed=None)
    report = load_checkpoint(fresh, path)
    assert report.skipped == ["mm_projector.proj.weight", "vision_tower.blocks.0.w"]
    assert_bit_equal(model, fresh)


# ---------------------------------------------------------------------------------------------
# errors


def _load_err(cfg, path, **kw) -> str:
    with pytest.raises(CheckpointError) as ei:
        load_checkpoint(build(cfg, seed=None), path, **kw)
    return str(ei.value)


def test_missing_unexpected_misshaped_wrong_dtype(ck_copy):
    cfg, model, path = ck_copy
    L = P + "model.layers."
    gone = L + "1.self_attn.k_proj.weight"
    extra = L + "0.self_attn.bogus.weight"
    shaped = L + "2.self_attn.kv_b_proj.weight"
    dtyped = L + "0.self_attn.A_log"
    dtyped2 = L + "4.mlp_res_proj.weight"

    def edit(fn, t):
        if gone in t:
            del t[gone]
        if shaped in t:
            t[shaped] = t[shaped][:-1]
        if dtyped in t:
            t[dtyped] = t[dtyped].bfloat16()
        if dtyped2 in t:
            t[dtyped2] = t[dtyped2].to(torch.int16)
        if fn.startswith("model-00001"):
            t[extra] = torch.zeros(3)
        return t

    rewrite(path, edit)
    msg = _load_err(cfg, path)
    for name in (gone, extra, shaped, dtyped, dtyped2):
        assert name in msg, name
    assert "expected [512, 128], found [511, 128]" in msg
    assert "expected F32, found BF16" in msg and "found I16" in msg
    # strict=False still refuses mis-shaped tensors ...
    assert shaped in _load_err(cfg, path, strict=False)


def test_non_strict_reports(ck_copy):
    cfg, model, path = ck_copy
    gone = P + "model.layers.3.block_sparse_moe.experts.5.w2.weight"
    rewrite(path, lambda fn, t: {k: v for k, v in t.items() if k != gone})
    fresh = build(cfg, seed=None)
    report = load_checkpoint(fresh, path, strict=False)
    assert report.missing == [gone]
    w2 = fresh.state_dict()["model.layers.3.block_sparse_moe.experts.w2"]
    assert torch.equal(w2[4], model.state_dict()["model.layers.3.block_sparse_moe.experts.w2"][4])
    assert gone in _load_err(cfg, path)


def test_a_log_padding_must_be_zero(ck_copy):
    cfg, _, path = ck_copy
    name = P + "model.layers.1.self_attn.A_log"

    def bump(t):
        t[name] = t[name].clone()
        t[name][100] = 1e-3

    rewrite(path, edit_one(name, bump))
    msg = _load_err(cfg, path)
    assert name in msg and "padding" in msg


def test_truncated_and_corrupt_files(ck_copy):
    cfg, _, path = ck_copy
    with open(os.path.join(path, INDEX_FILE)) as f:
        shard = os.path.join(path, sorted(set(json.load(f)["weight_map"].values()))[1])
    data = open(shard, "rb").read()
    open(shard, "wb").write(data[: len(data) - 100])
    msg = _load_err(cfg, path)
    assert os.path.basename(shard) in msg and "truncated" in msg
    os.remove(shard)
    assert os.path.basename(shard) in _load_err(cfg, path)
    open(os.path.join(path, INDEX_FILE), "w").write("{not json")
    assert INDEX_FILE in _load_err(cfg, path)
    os.remove(os.path.join(path, INDEX_FILE))
    assert "no model.safetensors.index.json" in _load_err(cfg, path)


def test_save_is_atomic(tmp_path, bf16_ckpt, monkeypatch):
    cfg, model, _ = bf16_ckpt
    d = tmp_path / "ck"
    save_checkpoint(model, cfg, d, max_shard_bytes=4 << 20)
    other = build(cfg, seed=9)
    calls = {"n": 0}
    real = safetensors_io.write_shard

    def failing(tensors, fn):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("disk full (injected)")
        real(tensors, fn)

    monkeypatch.setattr(safetensors_io, "write_shard", failing)
    with pytest.raises(OSError, match="injected"):
        save_checkpoint(other, cfg, d, max_shard_bytes=4 << 20)
    calls["n"] = 0
    with pytest.raises(OSError, match="injected"):
        save_checkpoint(other, cfg, tmp_path / "new", max_shard_bytes=4 << 20)
    assert not (tmp_path / "new").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # no temp dirs left behind
    fresh = build(cfg, seed=None)
    load_checkpoint(fresh, d)  # the old checkpoint is intact
    assert_bit_equal(model, fresh)


def test_save_checks_model_against_config(tmp_path):
    cfg = k3_tiny()
    model = build(cfg, seed=None)
    del model.model.layers._modules["4"].self_attn.q_proj._parameters["weight"]
    with pytest.raises(CheckpointError, match=r"layers\.4\.self_attn\.q_proj\.weight"):
        save_checkpoint(model, cfg, tmp_path / "x")
    with pytest.raises(ValueError, match="experts_format"):
        save_checkpoint(build(cfg, seed=None), cfg, tmp_path / "x", experts_format="fp8")
