"""Joint text + vision training: chat rows with images (render, pack, pad), the resumable loader,
candidate scoring (cached fast path == plain reference), optimizer groups, the joint loss, and a
tiny k3-tiny-vl training run end to end."""

from __future__ import annotations

import types

import pytest
import torch
from PIL import Image, ImageDraw

from k3.config import apply_overrides, k3_tiny, k3_tiny_vl
from k3.data.packing import IGNORE_INDEX
from k3.data.tokenizer import train_bpe_tokenizer
from k3.data.vision_data import (
    VisionLoader,
    collate_examples,
    pack_examples,
    render_example,
)
from k3.model.causal_lm import K3ForCausalLM
from k3.vision_config import num_media_tokens, tiny_vision_config
from k3.optim import HeadGeometry, build_param_groups
from k3.train import vision_eval
from k3.train.config import TrainConfig
from k3.train.vision import joint_loss, param_groups
from k3.train.vision_eval import (
    evaluate_vision,
    score_candidates,
    score_candidates_reference,
)

VOCAB = 512
BASE = VOCAB - 256
MODEL = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "q_lora_rank": 64, "kv_lora_rank": 32,
         "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16, "num_experts": 8,
         "num_experts_per_token": 2, "moe_intermediate_size": 32, "routed_expert_hidden_size": 32,
         "linear_attn_config": {"num_heads": 2, "head_dim": 16}}
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (30, 60, 220)}


def _model_config():
    return apply_overrides(k3_tiny_vl(), MODEL | {
        "vision_config": tiny_vision_config(64).to_dict(), "bos_token_id": BASE, "eos_token_id": BASE + 2,
        "pad_token_id": BASE + 255, "media_placeholder_token_id": BASE + 21})


@pytest.fixture(scope="module")
def tok():
    words = "what colour shape is the this how many are there red green blue square circle one two three"
    return train_bpe_tokenizer([words] * 50, VOCAB)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return K3ForCausalLM(_model_config()).init_weights(seed=0).eval()


def _example(i: int, w: int = 60, h: int = 45):
    name = list(COLOURS)[i % 3]
    img = Image.new("RGB", (w + 7 * (i % 4), h + 11 * (i % 3)), (240, 240, 240))
    ImageDraw.Draw(img).rectangle([10, 10, 30, 30], fill=COLOURS[name])
    return types.SimpleNamespace(image=img, question="What colour is the shape?", answer=name, kind="colour",
                                 choices=list(COLOURS))


def test_render_example_layout(tok, model):
    ex = _example(1)
    r = render_example(ex, tok, model.vision.cfg)
    pad = model.config.media_placeholder_token_id
    w, h = ex.image.size
    assert r.pixels.shape == (3, h, w) and r.pixels.min() >= -1 and r.pixels.max() <= 1
    assert r.ids.count(pad) == num_media_tokens(h, w, model.vision.cfg)
    # <|media_begin|>image<|media_content|> pads <|media_end|>, ids from the tokenizer's own specials
    first = r.ids.index(pad)
    assert r.ids[first - 1] == BASE + 19 and r.ids[r.ids.index(BASE + 18) + 1:first - 1] == tok.encode("image")
    assert r.ids[first + r.ids.count(pad)] == BASE + 20
    # the loss covers the assistant turn only: the answer first
    start = r.loss_mask.index(1)
    assert all(r.loss_mask[start:]) and not any(r.loss_mask[:start])
    assert tok.decode(r.ids[start:]).startswith("green")


def test_pack_equals_padded_rows(tok, model):
    rows = [render_example(_example(i), tok, model.vision.cfg) for i in range(3)]
    packed, padded = pack_examples(rows), collate_examples(rows, model.config.pad_token_id)
    lens = [len(r.ids) for r in rows]
    assert packed.cu_seqlens.tolist() == [0, lens[0], lens[0] + lens[1], sum(lens)]
    for b, r in enumerate(rows):
        a, z = packed.cu_seqlens[b], packed.cu_seqlens[b + 1]
        assert torch.equal(packed.input_ids[0, a:z], padded.input_ids[b, :lens[b]])
        assert torch.equal(packed.labels[0, a:z], padded.labels[b, :lens[b]])
        assert (padded.labels[b, lens[b] - 1:] == IGNORE_INDEX).all()
        # labels: the next token wherever that token is an assistant token
        want = [r.ids[t + 1] if r.loss_mask[t + 1] else IGNORE_INDEX for t in range(lens[b] - 1)]
        assert padded.labels[b, :lens[b] - 1].tolist() == want
    assert packed.num_targets == padded.num_targets == sum(sum(r.loss_mask[1:]) for r in rows)
    with torch.no_grad():
        lp = model(packed.input_ids, cu_seqlens=packed.cu_seqlens, labels=packed.labels, media=packed.media).loss
        lq = model(padded.input_ids, labels=padded.labels, media=padded.media).loss
    torch.testing.assert_close(lp, lq, rtol=1e-5, atol=1e-5)


def test_vision_loader_order_and_resume(tok, model):
    rows = [render_example(_example(i), tok, model.vision.cfg) for i in range(7)]
    a = VisionLoader(rows, 3, seed=5)
    seq = [next(a).input_ids for _ in range(5)]  # 2 batches per epoch (1 row skipped), into epoch 2
    b = VisionLoader(rows, 3, seed=5)
    for _ in range(2):
        next(b)
    c = VisionLoader(rows, 3, seed=5)
    c.load_state_dict(b.state_dict())
    assert all(torch.equal(next(c).input_ids, x) for x in seq[2:])
    with pytest.raises(ValueError, match="seed"):
        VisionLoader(rows, 3, seed=6).load_state_dict(b.state_dict())
    with pytest.raises(ValueError, match="batch_size"):
        VisionLoader(rows, 8)


def test_score_candidates_fast_equals_reference(tok, model):
    exs = [_example(i) for i in range(5)]
    exs[3].choices = ["red", "blue"]  # examples may carry different numbers of choices
    exs[3].answer = "blue"
    fast = score_candidates(model, tok, exs, examples_per_chunk=2)
    ref = score_candidates_reference(model, tok, exs)
    assert [len(s) for s in fast] == [3, 3, 3, 2, 3]
    for f, r in zip(fast, ref):
        torch.testing.assert_close(torch.tensor(f), torch.tensor(r), rtol=0, atol=1e-3)


def test_evaluate_vision_accuracy_and_chance(tok, model, monkeypatch):
    exs = [_example(i) for i in range(4)] + [types.SimpleNamespace(kind="code", choices=None)]
    # answers are red, green, blue, red; fixed scores pick red, green, red, red
    fixed = [[1.0, 0.0, 0.0], [0.0, 2.0, 1.0], [3.0, 0.0, 1.0], [5.0, 4.0, 0.0]]
    monkeypatch.setattr(vision_eval, "score_candidates", lambda *a, **k: fixed)
    res = evaluate_vision(model, tok, exs)
    assert res.n == 4 and res.accuracy == 0.75 and res.chance == pytest.approx(1 / 3)
    assert res.per_kind == {"colour": {"accuracy": 0.75, "chance": pytest.approx(1 / 3), "n": 4}}
    assert "75.0%" in res.summary() and model.training is False


def test_param_groups(model):
    cfg = TrainConfig()
    geom = HeadGeometry.from_config(model.config.text_config)
    groups = param_groups(model, geom, cfg)
    seen = [id(p) for g in groups for p in g["params"]]
    assert sorted(seen) == sorted(id(p) for p in model.parameters())  # each parameter exactly once
    by_name = {n: g for g in groups for n in g["names"]}
    assert by_name["vision.vision_tower.encoder.blocks.0.wqkv.weight"]["kind"] == "muon"
    assert by_name["vision.mm_projector.linear_2.weight"]["kind"] == "muon"
    assert by_name["vision.vision_tower.patch_embed.proj.weight"]["weight_decay"] == cfg.weight_decay
    for n in ("vision.vision_tower.patch_embed.pos_emb.weight", "vision.mm_projector.post_norm.weight",
              "vision.vision_tower.encoder.blocks.1.norm0.weight"):
        assert by_name[n]["kind"] == "adamw" and by_name[n]["weight_decay"] == 0.0, n
    assert by_name["model.layers.1.self_attn.q_proj.weight"]["kind"] == "muon"
    text = K3ForCausalLM(k3_tiny())  # a text-only model: exactly the usual groups
    a = param_groups(text, HeadGeometry.from_config(text.config.text_config), cfg)
    b = build_param_groups(text, HeadGeometry.from_config(text.config.text_config), lr=cfg.lr,
                           weight_decay=cfg.weight_decay, adamw_lr=cfg.adamw_lr)
    assert [g["names"] for g in a] == [g["names"] for g in b]


def test_joint_loss_equals_separate_losses(tok, model):
    g = torch.Generator().manual_seed(0)
    text_ids = torch.randint(0, BASE, (1, 40), generator=g)
    labels = torch.roll(text_ids, -1, 1)
    labels[0, 19] = labels[0, -1] = IGNORE_INDEX
    cu = torch.tensor([0, 20, 40], dtype=torch.int32)
    vb = pack_examples([render_example(_example(i), tok, model.vision.cfg) for i in range(2)])
    with torch.no_grad():
        total, text, vis = joint_loss(model, text_ids, labels, cu, vb, 0.5)
        want_text = model(text_ids, labels=labels, cu_seqlens=cu).loss
        want_vis = model(vb.input_ids, labels=vb.labels, cu_seqlens=vb.cu_seqlens, media=vb.media).loss
    torch.testing.assert_close(text, want_text, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(vis, want_vis, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(total, text + 0.5 * vis)


def test_train_config_preset_defaults_and_vision_checks():
    from k3.train.config import PRESET_DEFAULTS

    vl = TrainConfig.from_dict({"preset": "k3-tiny-vl"})
    for k, v in PRESET_DEFAULTS["k3-tiny-vl"].items():
        got = getattr(vl, k)
        assert (got if k != "stages" else [vars(s) for s in got]) == v, k
    assert TrainConfig.from_dict({"preset": "k3-tiny-vl", "max_steps": 3}).max_steps == 3  # explicit keys win
    # the k3-tiny defaults are the dataclass's, plus the CPU recipe's bf16
    assert TrainConfig.from_dict({}).to_dict() == TrainConfig(cpu_bf16=True).to_dict()
    for bad in ({"vision_kinds": {}}, {"vision_kinds": {"colour": -1}}, {"vision_batch_size": 0},
                {"vision_image_size": [20, 56]}, {"vision_train_examples": 4, "vision_batch_size": 8}):
        with pytest.raises(ValueError, match=next(iter(bad)) if len(bad) == 1 else "vision_train_examples"):
            TrainConfig.from_dict(bad).validate()


# ---------------------------------------------------------------------------------------------
# end to end


def test_tiny_vl_training_smoke(corpus, tmp_path):
    from k3.train.metrics import read_metrics
    from k3.train.trainer import Trainer

    cfg = TrainConfig.from_dict({
        "preset": "k3-tiny-vl", "data": str(corpus), "out": str(tmp_path / "run"), "max_steps": 8, "seed": 0,
        "deterministic": True, "tokens_per_step": 128, "stages": [{"seq_len": 64, "fraction": 1.0}],
        "eval_every": 8, "eval_tokens": 256, "eval_seq_len": 64, "warmup_steps": 2, "val_fraction": 0.1,
        "model": MODEL | {"vision_config": tiny_vision_config(64).to_dict()}, "cache_dir": str(tmp_path / "cache"),
        "qb_bins": 64, "vision_batch_size": 4, "vision_train_examples": 24, "vision_eval_examples": 6,
        "vision_image_size": [28, 56], "vision_kinds": {"colour": 1, "shape": 1, "count": 1}})
    result = Trainer(cfg).run()
    recs = [r for r in read_metrics(str(tmp_path / "run" / "metrics.jsonl")) if "vision_loss" in r]
    vl = [r["vision_loss"] for r in recs]
    assert len(vl) == 8 and all(torch.isfinite(torch.tensor([r["loss"] for r in recs] + vl)))
    assert sum(vl[-2:]) < sum(vl[:2])  # the answer-and-closing-tags loss falls within a few steps
    v = result.vision_eval
    assert v is not None and v["n"] == 6 and 0.0 <= v["accuracy"] <= 1.0 and 0 < v["chance"] < 1
    back = K3ForCausalLM.from_pretrained(tmp_path / "run" / "final")
    assert back.vision is not None and back.config.media_placeholder_token_id == BASE + 21
    # the checkpoint carries the vision loader position; resume restores it
    state = torch.load(tmp_path / "run" / "checkpoint" / "train_state.pt", weights_only=False)
    assert state["vision_loader"]["cursor"] == 8 * 4 % 24 and state["vision_loader"]["epoch"] == 1
    again = Trainer(cfg, resume=True)
    assert again.step == 8 and again.vision.loader.state_dict() == state["vision_loader"]


def test_compile_shapes_static_for_text_dynamic_for_vision(corpus, tmp_path, monkeypatch):
    """k3 train --compile: text micro-batches have fixed shapes (static compile, what bench/train.py
    measures); image chats change the token count every step (dynamic shapes, no recompile per step)."""
    import k3.train.trainer as trainer_mod

    seen = []
    monkeypatch.setattr(trainer_mod, "compile_model", lambda model, **kw: seen.append(kw) or model)
    common = {"data": str(corpus), "max_steps": 1, "tokens_per_step": 128, "stages": [{"seq_len": 64, "fraction": 1.0}],
              "eval_tokens": 128, "eval_seq_len": 64, "val_fraction": 0.1, "cache_dir": str(tmp_path / "cache"),
              "compile": True}
    trainer_mod.Trainer(TrainConfig.from_dict(common | {"out": str(tmp_path / "t"), "model": MODEL}))
    trainer_mod.Trainer(TrainConfig.from_dict(common | {
        "preset": "k3-tiny-vl", "out": str(tmp_path / "v"),
        "model": MODEL | {"vision_config": tiny_vision_config(64).to_dict()}, "vision_batch_size": 4,
        "vision_train_examples": 8, "vision_eval_examples": 4, "vision_image_size": [28, 56]}))
    assert seen == [{"dynamic": False}, {"dynamic": None}]
