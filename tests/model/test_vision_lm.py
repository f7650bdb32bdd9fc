"""Vision in the language model: media splice (row-major over the batch), packed == padded, cached
chunked prefill with media, mixed image/video/text rows, errors, and checkpoint I/O with the
official `vision_tower.*` / `mm_projector.*` names."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3.config import k3_tiny, k3_tiny_vl, kimi_k3
from k3.model.causal_lm import K3ForCausalLM
from k3.model.checkpoint import (
    CheckpointError,
    internal_shapes,
    load_checkpoint,
    official_shapes,
)

ATOL = 2e-5  # fp32 logits of magnitude ~1
CFG = k3_tiny_vl()
PAD = CFG.media_placeholder_token_id
VOCAB = CFG.text_config.vocab_size


@pytest.fixture(scope="module")
def model() -> K3ForCausalLM:
    torch.manual_seed(0)
    m = K3ForCausalLM(CFG).init_weights(seed=0)
    with torch.no_grad():  # a visible position table and AttnRes vectors, so every path matters
        m.vision.vision_tower.patch_embed.pos_emb.weight.normal_(0, 0.1)
        for n, p in m.named_parameters():
            if n.endswith("res_proj.weight"):
                p.normal_(0, 0.1)
    return m.eval()


def _text(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, VOCAB - 256, (n,), generator=gen)  # ordinary tokens: never the pad id


def _row(parts: list, gen: torch.Generator) -> torch.Tensor:
    """parts: ints (that many text tokens) and ("pad", n) runs of media placeholders."""
    return torch.cat([_text(p, gen) if isinstance(p, int) else torch.full((p[1],), PAD) for p in parts])


def _media(gen: torch.Generator) -> tuple[list[list[torch.Tensor]], list[torch.Tensor]]:
    """Per-row media of a mixed batch: row 0 two images, row 1 a video, row 2 text only."""
    img_a = torch.randn(3, 30, 45, generator=gen)  # 4 tokens
    img_b = torch.randn(3, 28, 84, generator=gen)  # 3 tokens
    vid = torch.randn(3, 3, 28, 56, generator=gen)  # 2 groups x 2 tokens
    rows = [[img_a, img_b], [vid], []]
    ids = [_row([3, ("pad", 4), 5, ("pad", 3), 2], gen), _row([6, ("pad", 4), 9], gen), _text(11, gen)]
    return rows, ids


def test_splice_lands_at_pad_positions_row_major(model):
    gen = torch.Generator().manual_seed(1)
    ids = torch.stack([_row([2, ("pad", 3), 4], gen), _row([("pad", 2), 5, ("pad", 2)], gen)])
    emb = torch.randn(7, 256, generator=gen)
    with torch.no_grad():
        x = model.embed_with_media(ids, media_embeds=emb)
        plain = model.model.embed_tokens(ids)
    pads = ids == PAD
    torch.testing.assert_close(x[pads], emb, rtol=0, atol=0)  # boolean indexing is row-major
    torch.testing.assert_close(x[0, 2:5], emb[:3], rtol=0, atol=0)
    torch.testing.assert_close(x[1, 0:2], emb[3:5], rtol=0, atol=0)
    torch.testing.assert_close(x[1, 7:9], emb[5:7], rtol=0, atol=0)
    torch.testing.assert_close(x[~pads], plain[~pads], rtol=0, atol=0)


def test_media_equals_precomputed_embeds(model):
    gen = torch.Generator().manual_seed(2)
    media, ids = _media(gen)
    flat = [m for row in media for m in row]
    with torch.no_grad():
        emb = model.encode_media(flat)
        assert emb.shape == (4 + 3 + 4, 256)
        torch.testing.assert_close(emb, torch.cat(model.vision.encode(flat)))
        a = model(ids[0][None], media=media[0]).logits
        b = model(ids[0][None], media_embeds=model.encode_media(media[0])).logits
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_packed_equals_padded_mixed_batch(model):
    """Rows with images, a video and text only: packed [1, total] with cu_seqlens == right-padded
    [B, T] == each row alone, at every real position."""
    gen = torch.Generator().manual_seed(3)
    media, ids = _media(gen)
    flat = [m for row in media for m in row]
    lens = [len(r) for r in ids]
    padded = torch.full((3, max(lens)), CFG.pad_token_id)
    for i, r in enumerate(ids):
        padded[i, :len(r)] = r
    cu = torch.tensor([0, *lens]).cumsum(0)
    with torch.no_grad():
        out_pad = model(padded, media=flat).logits
        out_packed = model(torch.cat(ids)[None], cu_seqlens=cu, media=flat).logits[0]
        for i, r in enumerate(ids):
            alone = model(r[None], media=media[i] or None).logits[0]
            torch.testing.assert_close(out_pad[i, :lens[i]], alone, atol=ATOL, rtol=0)
            torch.testing.assert_close(out_packed[cu[i]:cu[i + 1]], alone, atol=ATOL, rtol=0)
        # The text-only row is exactly what a text-only call gives.
        torch.testing.assert_close(out_pad[2, :lens[2]], model(ids[2][None]).logits[0], atol=ATOL, rtol=0)
        # Media matter: other pixels change the image rows.
        other = [torch.randn(m.shape, generator=gen) for m in flat]
        assert not torch.allclose(model(padded, media=other).logits[0], out_pad[0], atol=1e-3)


def test_cached_chunked_prefill_with_media_equals_full(model):
    """Chunks cut through media runs; each call gets only the embeddings of its own pads."""
    gen = torch.Generator().manual_seed(4)
    ids = _row([3, ("pad", 4), 5, ("pad", 3), 6], gen)[None]  # 21 tokens
    media = [torch.randn(3, 30, 45, generator=gen), torch.randn(3, 28, 84, generator=gen)]
    with torch.no_grad():
        emb = model.encode_media(media)
        full = model(ids, media_embeds=emb).logits
        cache = model.new_cache(1, capacity=4)
        outs, used = [], 0
        for a, b in ((0, 5), (5, 6), (6, 13), (13, 21)):
            n = int((ids[:, a:b] == PAD).sum())
            outs.append(model(ids[:, a:b], cache=cache, media_embeds=emb[used:used + n]).logits)
            used += n
        torch.testing.assert_close(torch.cat(outs, 1), full, atol=ATOL, rtol=0)
        # logits_to_keep with media: the last positions only, same values.
        last = model(ids, media_embeds=emb, logits_to_keep=2).logits
        torch.testing.assert_close(last, full[:, -2:], atol=ATOL, rtol=0)
        # Then decode a text token from the cache.
        nxt = _text(1, gen)[None]
        step = model(nxt, cache=cache).logits
        torch.testing.assert_close(step, model(torch.cat([ids, nxt], 1), media_embeds=emb).logits[:, -1:],
                                   atol=ATOL, rtol=0)


def test_loss_gradients_reach_the_vision_encoder(model):
    gen = torch.Generator().manual_seed(5)
    media, ids = _media(gen)
    row = ids[0][None]
    model.train()
    try:
        out = model(row, labels=torch.roll(row, -1, 1), media=media[0])
        out.loss.backward()
        for name, p in model.vision.named_parameters():
            assert p.grad is not None and p.grad.abs().sum() > 0, name
    finally:
        model.zero_grad(set_to_none=True)
        model.eval()


def test_count_mismatch_and_media_errors(model):
    gen = torch.Generator().manual_seed(6)
    ids = _row([2, ("pad", 4), 3], gen)[None]
    with pytest.raises(ValueError, match=r"4 media placeholder tokens .* but 3 media embeddings"):
        model(ids, media_embeds=torch.zeros(3, 256))
    with pytest.raises(ValueError, match=r"4 media placeholder tokens .* but 5 media embeddings"):
        model(ids, media=[torch.zeros(3, 30, 45), torch.zeros(3, 28, 28)])
    with pytest.raises(ValueError, match=r"4 media placeholder tokens .* but 0 media embeddings"):
        model(ids)  # a vision model never embeds the pad as a plain token
    with pytest.raises(ValueError, match=r"0 media placeholder tokens .* but 4 media embeddings"):
        model(_text(5, gen)[None], media=[torch.zeros(3, 30, 45)])
    with pytest.raises(ValueError, match=r"media_embeds: expected \[4, 256\]"):
        model(ids, media_embeds=torch.zeros(4, 100))
    with pytest.raises(ValueError, match="not both"):
        model(ids, media=[torch.zeros(3, 30, 45)], media_embeds=torch.zeros(4, 256))
    with pytest.raises(ValueError, match=r"media\[0\]"):
        model(ids, media=[torch.zeros(1, 30, 45)])
    with pytest.raises(ValueError, match="exceeds"):
        model.encode_media([torch.zeros(3, 3600, 14)])
    model(_text(5, gen)[None], media=[])  # an empty media list is a chunk without media


def test_text_only_model_rejects_media():
    m = K3ForCausalLM(k3_tiny()).init_weights(seed=0)
    assert m.vision is None and m.num_vision_parameters() == 0
    ids = torch.tensor([[1, 2, PAD, 3]])
    for kw in ({"media": [torch.zeros(3, 28, 28)]}, {"media_embeds": torch.zeros(1, 256)}):
        with pytest.raises(ValueError, match="no vision encoder"):
            m(ids, **kw)
    with pytest.raises(ValueError, match="no vision encoder"):
        m.encode_media([torch.zeros(3, 28, 28)])
    m(ids)  # without media the pad id is an ordinary token, as before


# ---------------------------------------------------------------------------------------------
# checkpoint I/O


def test_official_vision_inventory_full_size():
    off = official_shapes(kimi_k3())
    vis = {n: v for n, v in off.items() if not n.startswith("language_model.")}
    assert len(vis) == 168 and all(dt == "BF16" for _, dt in vis.values())
    assert vis["vision_tower.patch_embed.proj.weight"] == ((1024, 3, 14, 14), "BF16")
    assert vis["vision_tower.patch_embed.pos_emb.weight"] == ((64, 64, 1024), "BF16")
    assert vis["vision_tower.encoder.blocks.26.wqkv.weight"] == ((4608, 1024), "BF16")
    assert vis["vision_tower.encoder.blocks.0.wo.weight"] == ((1024, 1536), "BF16")
    assert vis["vision_tower.encoder.blocks.3.mlp.fc0.weight"] == ((4096, 1024), "BF16")
    assert vis["vision_tower.encoder.final_layernorm.weight"] == ((1024,), "BF16")
    assert vis["mm_projector.linear_1.weight"] == ((4096, 4096), "BF16")
    assert vis["mm_projector.linear_2.weight"] == ((7168, 4096), "BF16")
    assert vis["mm_projector.post_norm.weight"] == ((7168,), "BF16")
    assert sum(torch.Size(s).numel() for n, (s, _) in vis.items() if n.startswith("vision_tower.")) == 401_214_464


def test_internal_shapes_match_the_vl_model(model):
    want = {n: s for n, (s, _) in internal_shapes(CFG).items()}
    got = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    assert got == want


@pytest.fixture(scope="module")
def saved(model, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("vl") / "ck")
    model.save_pretrained(path, dtype="float32")
    return path


def test_save_load_round_trip_official_names(model, saved):
    with open(os.path.join(saved, "model.safetensors.index.json")) as f:
        names = set(json.load(f)["weight_map"])
    assert names == set(official_shapes(CFG, "bf16"))
    vis = sorted(n for n in names if not n.startswith("language_model."))
    assert len(vis) == 6 * 2 + 3 + 3 and all(n.startswith(("vision_tower.", "mm_projector.")) for n in vis)
    assert "vision_tower.encoder.blocks.1.mlp.fc1.weight" in vis and "mm_projector.post_norm.weight" in vis
    back = K3ForCausalLM.from_pretrained(saved, dtype="float32")
    assert back.vision is not None
    sd, sd2 = model.state_dict(), back.state_dict()
    assert sd.keys() == sd2.keys()
    for n in sd:
        assert torch.equal(sd[n], sd2[n]), n  # bit-exact


def test_bf16_round_trip_bit_exact(model, tmp_path):
    m16 = K3ForCausalLM(CFG)
    m16.load_state_dict(model.state_dict())
    m16.to_dtype("bfloat16")
    m16.save_pretrained(tmp_path / "bf16")
    back = K3ForCausalLM.from_pretrained(tmp_path / "bf16")
    for n, t in m16.state_dict().items():
        assert torch.equal(t, back.state_dict()[n]), n


def _rewrite(path: str, edit) -> None:
    for fn in os.listdir(path):
        if fn.endswith(".safetensors"):
            full = os.path.join(path, fn)
            save_file(edit(load_file(full)), full, metadata={"format": "pt"})


def _copy(saved: str, tmp_path) -> str:
    import shutil

    dst = str(tmp_path / "copy")
    shutil.copytree(saved, dst)
    return dst


def test_missing_vision_tensor_is_named(saved, tmp_path):
    path = _copy(saved, tmp_path)
    gone = "vision_tower.encoder.blocks.1.wqkv.weight"
    _rewrite(path, lambda d: {k: v for k, v in d.items() if k != gone})
    idx = os.path.join(path, "model.safetensors.index.json")
    with open(idx) as f:
        index = json.load(f)
    del index["weight_map"][gone]
    with open(idx, "w") as f:
        json.dump(index, f)
    with pytest.raises(CheckpointError, match=rf"{gone}: missing from the checkpoint"):
        K3ForCausalLM.from_pretrained(path)
    m = K3ForCausalLM(CFG)
    report = load_checkpoint(m, path, strict=False)
    assert report.missing == [gone]


def test_misshaped_vision_tensor_is_named(saved, tmp_path):
    path = _copy(saved, tmp_path)
    bad = "mm_projector.linear_1.weight"
    _rewrite(path, lambda d: {k: (v[:, :10].contiguous() if k == bad else v) for k, v in d.items()})
    with pytest.raises(CheckpointError, match=rf"{bad}: shape mismatch, expected \[256, 256\], found \[256, 10\]"):
        K3ForCausalLM.from_pretrained(path)


def test_text_only_model_skips_vision_tensors(model, saved):
    m = K3ForCausalLM(k3_tiny())
    report = load_checkpoint(m, saved)
    assert len(report.skipped) == 18 and all(n.startswith(("vision_tower.", "mm_projector.")) for n in report.skipped)
    assert torch.equal(m.lm_head.weight, model.lm_head.weight)


def test_vl_model_on_text_only_checkpoint_names_missing_vision(model, tmp_path):
    text = K3ForCausalLM(k3_tiny())
    text.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("vision.")})
    text.save_pretrained(tmp_path / "text", dtype="float32")
    with pytest.raises(CheckpointError, match=r"vision_tower\.patch_embed\.pos_emb\.weight: missing"):
        load_checkpoint(K3ForCausalLM(CFG), tmp_path / "text")


def test_info_shows_vision_params():
    from k3.cli.info import describe

    d = describe(k3_tiny_vl())
    v = d["vision"]
    assert v["params"] == v["tower_params"] + v["projector_params"] > 0
    assert d["total_params"] == describe(k3_tiny())["total_params"] + v["params"]
    assert d["active_params"] == describe(k3_tiny())["active_params"]  # the encoder runs per image
    assert describe(k3_tiny())["vision"] is None
    full = describe(kimi_k3())["vision"]
    assert (full["tower_params"], full["projector_params"]) == (401_214_464, 46_144_512)


def test_token_logprobs_with_media(model):
    """token_logprobs splices the media like forward: equal to log_softmax of forward's logits."""
    gen = torch.Generator().manual_seed(5)
    media, ids = _media(gen)
    row = ids[0][None]
    with torch.no_grad():
        lp = model.token_logprobs(row, media=media[0])
        logits = model(row, media=media[0]).logits.float()
    want = torch.log_softmax(logits[:, :-1], -1).gather(-1, row[:, 1:, None])[..., 0]
    torch.testing.assert_close(lp[:, 1:], want, rtol=1e-5, atol=1e-5)
    assert (lp[:, 0] == 0).all()
