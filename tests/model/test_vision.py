"""MoonViT encoder: media-token counts, config parsing, packing, video pooling, projector, gradients."""

from __future__ import annotations

import math

import pytest
import torch

from k3.config import kimi_k3
from k3.model.vision import (
    MoonViTEncoder,
    PatchMergerV2,
    VisionConfig,
    encoder_param_count,
    merge_windows,
    num_media_tokens,
    num_video_tokens,
    patchify,
    rope_2d,
    tiny_vision_config,
)

FULL = VisionConfig()
TEXT_H = 32


def _tiny() -> VisionConfig:
    return tiny_vision_config(text_hidden_size=TEXT_H)


@pytest.fixture(scope="module")
def enc() -> MoonViTEncoder:
    torch.manual_seed(0)
    return MoonViTEncoder(_tiny()).eval()


# --- config ---------------------------------------------------------------------------------

def test_config_from_official_dict():
    d = kimi_k3().vision_config
    cfg = VisionConfig.from_dict(d)
    assert (cfg.patch_size, cfg.merge_kernel_size, cfg.num_hidden_layers) == (14, (2, 2), 27)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.intermediate_size) == (1024, 12, 4096)
    assert cfg.text_hidden_size == 7168 and cfg.head_dim * cfg.num_attention_heads == 1536
    back = cfg.to_dict()
    assert all(back[k] == v for k, v in d.items())
    # Extra keys survive a round trip; text_hidden_size falls back to the argument.
    d2 = {k: v for k, v in d.items() if k != "text_hidden_size"} | {"foo": 1}
    cfg2 = VisionConfig.from_dict(d2, text_hidden_size=256)
    assert cfg2.text_hidden_size == 256 and cfg2.to_dict()["foo"] == 1


def test_full_size_param_count():
    # Tower without projector ~397M; the report's ~401M also counts a learned position table
    # (see docs/vision.md). Projector 4096->4096->7168 is ~46M.
    cfg = FULL
    m = 4096
    proj = 1024 + m * m + m + m * 7168 + 7168
    tower = encoder_param_count(cfg) - proj
    assert 390e6 < tower < 402e6


@pytest.mark.parametrize("field,value", [
    ("patch_size", 0), ("hidden_size", -1), ("num_hidden_layers", 2.5), ("head_dim", 6),
    ("mm_projector_type", "mlp"), ("merge_kernel_size", [2]), ("rope_theta", 0), ("text_hidden_size", True),
])
def test_config_errors_name_field(field, value):
    d = dict(kimi_k3().vision_config)
    d[field] = value
    with pytest.raises(ValueError, match=f"vision_config.{field}"):
        VisionConfig.from_dict(d)


def test_config_not_a_dict():
    with pytest.raises(ValueError, match="vision_config"):
        VisionConfig.from_dict(None)


# --- token counts ---------------------------------------------------------------------------

def _brute_force_tokens(h: int, w: int) -> int:
    # Pad up to a multiple of 28, count 14-px patches, divide by the 2x2 merge.
    hp = h + (-h) % 28
    wp = w + (-w) % 28
    return (hp // 14) * (wp // 14) // 4


def test_token_count_many_sizes():
    sizes = [1, 13, 14, 15, 27, 28, 29, 41, 42, 55, 56, 57, 100, 223, 224, 225, 333, 448, 512, 640,
             719, 720, 1000, 1023, 1080, 1920, 2047, 3583, 3584]
    for h in sizes:
        for w in sizes:
            n = num_media_tokens(h, w, FULL)
            assert n == _brute_force_tokens(h, w) == math.ceil(h / 28) * math.ceil(w / 28), (h, w)
    assert num_media_tokens(3584, 3584, FULL) == 128 * 128
    assert num_media_tokens(28, 2800, FULL) == 100  # extreme aspect ratio, no resize
    assert num_media_tokens(14, 14, FULL) == 1


@pytest.mark.parametrize("h,w,msg", [
    (3585, 10, "exceeds"), (10, 3585, "exceeds"), (4000, 4000, "exceeds"),
    (0, 10, "height"), (10, 0, "width"), (-5, 10, "height"), (10.5, 10, "height"),
])
def test_token_count_errors(h, w, msg):
    with pytest.raises(ValueError, match=msg):
        num_media_tokens(h, w, FULL)


def test_video_token_count():
    assert num_video_tokens(1, 56, 56, FULL) == 4
    assert num_video_tokens(4, 56, 84, FULL) == 2 * 6
    assert num_video_tokens(5, 56, 84, FULL) == 3 * 6
    with pytest.raises(ValueError, match="num_frames"):
        num_video_tokens(0, 56, 56, FULL)


# --- building blocks ------------------------------------------------------------------------

def test_patchify_matches_conv():
    torch.manual_seed(1)
    cfg = _tiny()
    img = torch.randn(3, 30, 45)
    patches, gh, gw = patchify(img, cfg)
    assert (gh, gw) == (4, 4) and patches.shape == (16, 3 * 14 * 14)
    conv = torch.nn.Conv2d(3, 8, 14, 14)
    padded = torch.nn.functional.pad(img, (0, 56 - 45, 0, 56 - 30))
    want = conv(padded[None])[0].permute(1, 2, 0).reshape(16, 8)
    got = patches @ conv.weight.flatten(1).T + conv.bias
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_rope_2d_relative():
    # Scores depend only on (row, col) offsets: shifting all positions leaves q.k unchanged.
    torch.manual_seed(2)
    q, k = torch.randn(5, 2, 16), torch.randn(5, 2, 16)
    rows, cols = torch.tensor([0, 1, 2, 3, 4]), torch.tensor([4, 0, 3, 1, 2])

    def scores(dr: int, dc: int) -> torch.Tensor:
        return torch.einsum("nhd,mhd->hnm", rope_2d(q, rows + dr, cols + dc, 1e4), rope_2d(k, rows + dr, cols + dc, 1e4))

    torch.testing.assert_close(scores(0, 0), scores(7, 3), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(rope_2d(q, rows, cols, 1e4), rope_2d(q, cols, rows, 1e4))


def test_merge_windows_groups_2x2():
    x = torch.arange(4 * 6).float()[:, None]  # grid 4 x 6, value = row * 6 + col
    m = merge_windows(x, 4, 6, (2, 2))
    assert m.shape == (2 * 3, 4, 1)
    assert m[0, :, 0].tolist() == [0, 1, 6, 7]
    assert m[4, :, 0].tolist() == [14, 15, 20, 21]


def test_projector_shapes():
    cfg = _tiny()
    proj = PatchMergerV2(cfg)
    assert proj.linear_1.weight.shape == (4 * cfg.hidden_size, 4 * cfg.hidden_size)
    assert proj.linear_2.weight.shape == (TEXT_H, 4 * cfg.hidden_size)
    assert proj(torch.randn(7, 4, cfg.hidden_size)).shape == (7, TEXT_H)
    full = VisionConfig()
    assert (4 * full.hidden_size, full.text_hidden_size) == (4096, 7168)


# --- encoder --------------------------------------------------------------------------------

SIZES = [(14, 14), (28, 28), (30, 45), (57, 20), (84, 13)]


def test_encoder_output_shapes(enc):
    torch.manual_seed(3)
    imgs = [torch.randn(3, h, w) for h, w in SIZES]
    with torch.no_grad():
        outs = enc(imgs)
    for (h, w), o in zip(SIZES, outs):
        assert o.shape == (num_media_tokens(h, w, enc.cfg), TEXT_H)
        assert torch.isfinite(o).all()


def test_packed_equals_alone(enc):
    torch.manual_seed(4)
    a, b, c = torch.randn(3, 30, 45), torch.randn(3, 57, 20), torch.randn(3, 28, 28)
    with torch.no_grad():
        packed = enc([a, b, c])
        alone = [enc([x])[0] for x in (a, b, c)]
    for p, s in zip(packed, alone):
        torch.testing.assert_close(p, s, rtol=1e-5, atol=1e-5)


def test_output_depends_on_pixels(enc):
    # Guards against a patchify/merge bug that drops real pixels: the top-left pixel must matter.
    torch.manual_seed(5)
    img = torch.randn(3, 30, 45)
    img2 = img.clone()
    img2[:, 0, 0] += 1.0
    with torch.no_grad():
        assert not torch.allclose(enc([img])[0], enc([img2])[0])


def test_encoder_bf16_close_to_fp32():
    torch.manual_seed(6)
    enc32 = MoonViTEncoder(_tiny()).eval()
    enc16 = MoonViTEncoder(_tiny()).eval()
    enc16.load_state_dict(enc32.state_dict())
    enc16.to(torch.bfloat16)
    img = torch.randn(3, 40, 50)
    with torch.no_grad():
        o32, o16 = enc32([img])[0], enc16([img])[0]
    assert o16.dtype == torch.bfloat16
    torch.testing.assert_close(o16.float(), o32, rtol=5e-2, atol=5e-2)


def test_encoder_input_errors(enc):
    with pytest.raises(ValueError, match="images"):
        enc([])
    with pytest.raises(ValueError, match=r"images\[1\]"):
        enc([torch.randn(3, 14, 14), torch.randn(1, 14, 14)])
    with pytest.raises(ValueError, match=r"images\[0\].*float"):
        enc([torch.zeros(3, 14, 14, dtype=torch.uint8)])
    with pytest.raises(ValueError, match="exceeds"):
        enc([torch.zeros(3, 3585, 1)])
    with pytest.raises(ValueError, match="frames"):
        enc.encode_video(torch.zeros(0, 3, 14, 14))


def test_gradients_flow():
    torch.manual_seed(7)
    enc = MoonViTEncoder(_tiny())
    imgs = [torch.randn(3, 30, 45, requires_grad=True), torch.randn(3, 28, 56)]
    loss = sum(o.square().mean() for o in enc(imgs))
    loss.backward()
    for name, p in enc.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name
    assert imgs[0].grad is not None and imgs[0].grad.abs().sum() > 0


# --- video ----------------------------------------------------------------------------------

def test_video_temporal_pooling(enc):
    torch.manual_seed(8)
    frames = torch.randn(5, 3, 30, 45)
    with torch.no_grad():
        out = enc.encode_video(frames)
        per = num_media_tokens(30, 45, enc.cfg)
        assert out.shape == (num_video_tokens(5, 30, 45, enc.cfg), TEXT_H) == (3 * per, TEXT_H)
        # Reference: tower features of each frame alone, averaged in pairs, then merge + project.
        feats = [enc._tower([patchify(f, enc.cfg)])[0] for f in frames]
        groups = [(feats[0] + feats[1]) / 2, (feats[2] + feats[3]) / 2, feats[4]]
        want = torch.cat([enc.mm_projector(merge_windows(g, 4, 4, (2, 2))) for g in groups])
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        # A single-frame clip equals the image path.
        torch.testing.assert_close(enc.encode_video(frames[:1]), enc([frames[0]])[0], rtol=1e-5, atol=1e-5)
