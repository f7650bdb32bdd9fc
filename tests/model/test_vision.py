"""MoonViT encoder: media-token counts, config parsing, position table, RoPE layout, packing, video
pooling, projector, gradients."""

from __future__ import annotations

import math

import pytest
import torch

from k3.config import kimi_k3
from k3.model.vision import (
    MoonViTEncoder,
    PatchMergerV2,
    PositionTable2D,
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
    e = MoonViTEncoder(_tiny()).eval()
    e.reset_parameters(torch.Generator().manual_seed(0), std=0.1)  # a non-zero position table
    return e


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
    # The released tower is ~401M (spec 2.4); the projector 4096 -> 4096 -> 7168 + RMSNorm is ~46M.
    counts = encoder_param_count(FULL)
    blocks = 27 * (2 * 1024 + 1024 * 4608 + 1536 * 1024 + 2 * 1024 * 4096)
    assert counts["tower"] == 3 * 14 * 14 * 1024 + 64 * 64 * 1024 + blocks + 1024 == 401_214_464
    assert counts["projector"] == 4096 * 4096 + 4096 * 7168 + 7168
    with torch.device("meta"):
        for cfg in (FULL, _tiny(), VisionConfig(norm_type="layernorm", attn_bias=True, linear_bias=True,
                                                patch_embed_proj_bias=True, num_hidden_layers=2)):
            enc = MoonViTEncoder(cfg)
            assert sum(p.numel() for p in enc.parameters()) == encoder_param_count(cfg)["total"]
            assert sum(p.numel() for p in enc.vision_tower.parameters()) == encoder_param_count(cfg)["tower"]


@pytest.mark.parametrize("field,value", [
    ("patch_size", 0), ("hidden_size", -1), ("num_hidden_layers", 2.5), ("head_dim", 6),
    ("mm_projector_type", "mlp"), ("merge_kernel_size", [2]), ("rope_theta", 0), ("text_hidden_size", True),
    ("norm_type", "batchnorm"), ("attn_bias", 1), ("init_pos_emb_height", 0), ("pos_emb_interpolation_mode", "area"),
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


def test_rope_2d_matches_complex_reference():
    # Kimi-VL layout: complex pair 2j turns by col * f_j, pair 2j+1 by row * f_j, f_j = theta^(-4j/d).
    torch.manual_seed(9)
    d = 16
    x = torch.randn(6, 3, d, dtype=torch.float64)
    rows, cols = torch.tensor([0, 1, 2, 5, 7, 3]), torch.tensor([3, 0, 4, 1, 2, 9])
    f = 1e4 ** (-torch.arange(0, d, 4, dtype=torch.float64) / d)
    ang = torch.stack((cols[:, None] * f, rows[:, None] * f), -1).flatten(1)  # [N, d/2]
    want = torch.view_as_real(torch.view_as_complex(x.view(6, 3, d // 2, 2)) * torch.polar(torch.ones_like(ang), ang)[:, None])
    got = rope_2d(x.float(), rows, cols, 1e4)
    torch.testing.assert_close(got, want.flatten(-2).float(), rtol=1e-5, atol=1e-5)


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
    assert proj.post_norm.weight.shape == (TEXT_H,)
    assert proj.linear_1.bias is None and proj.linear_2.bias is None
    win = torch.randn(7, 4, cfg.hidden_size)
    out = proj(win)
    assert out.shape == (7, TEXT_H)
    # Reference: flatten the window, Linear, exact GELU, Linear, RMSNorm (weight 1 here).
    y = torch.nn.functional.gelu(win.flatten(1) @ proj.linear_1.weight.T) @ proj.linear_2.weight.T
    torch.testing.assert_close(out, y * torch.rsqrt(y.square().mean(-1, keepdim=True) + cfg.rms_norm_eps))


# --- position table -------------------------------------------------------------------------

def _resample_matrix(n_out: int, n_in: int, mode: str) -> torch.Tensor:
    """[n_out, n_in] weights of 1-D align_corners=False resampling, written from the definitions:
    source coordinate (i + 0.5) * n_in / n_out - 0.5; bilinear: two taps (coordinate clamped at 0);
    bicubic: Keys kernel with a = -0.75 on four taps, indices clamped to the edge."""
    m = torch.zeros(n_out, n_in, dtype=torch.float64)
    for i in range(n_out):
        src = (i + 0.5) * n_in / n_out - 0.5
        if mode == "bilinear":
            src = max(src, 0.0)
            lo = min(int(src), n_in - 1)
            f = src - lo
            m[i, lo] += 1 - f
            m[i, min(lo + 1, n_in - 1)] += f
            continue
        fl = int(torch.floor(torch.tensor(src)))
        t = src - fl
        a = -0.75
        for off in (-1, 0, 1, 2):
            x = abs(t - off)
            w = ((a + 2) * x - (a + 3)) * x * x + 1 if x <= 1 else ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
            m[i, min(max(fl + off, 0), n_in - 1)] += w
    return m


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
@pytest.mark.parametrize("gh,gw", [(4, 4), (2, 10), (8, 3), (12, 2), (20, 9)])
def test_position_table_interpolation(mode, gh, gw):
    torch.manual_seed(10)
    cfg = VisionConfig(hidden_size=8, init_pos_emb_height=6, init_pos_emb_width=7, pos_emb_interpolation_mode=mode)
    pt = PositionTable2D(cfg)
    with torch.no_grad():
        pt.weight.normal_()
    tab = pt.weight.detach().double()
    want = torch.einsum("rh,hwd,cw->rcd", _resample_matrix(gh, 6, mode), tab, _resample_matrix(gw, 7, mode))
    torch.testing.assert_close(pt(gh, gw).double(), want.reshape(gh * gw, 8), rtol=1e-5, atol=1e-5)


def test_position_table_native_grid_and_constant():
    pt = PositionTable2D(VisionConfig(hidden_size=4, init_pos_emb_height=6, init_pos_emb_width=6))
    with torch.no_grad():
        pt.weight.normal_()
    assert pt(6, 6).data_ptr() == pt.weight.data_ptr()  # the native grid uses the table as is
    with torch.no_grad():
        pt.weight.fill_(0.5)
    torch.testing.assert_close(pt(3, 17), torch.full((51, 4), 0.5))  # resampling weights sum to 1


def test_position_table_is_added_per_grid(enc):
    # Two images with different grids: each gets the table resampled to its own grid.
    torch.manual_seed(12)
    a, b = torch.randn(3, 28, 56), torch.randn(3, 56, 28)
    pe = enc.vision_tower.patch_embed
    grids = [patchify(a, enc.cfg), patchify(b, enc.cfg)]
    with torch.no_grad():
        got = pe(grids)
        lin = torch.cat([g for g, _, _ in grids]) @ pe.proj.weight.flatten(1).T
        want = lin + torch.cat([pe.pos_emb(2, 4), pe.pos_emb(4, 2)])
    torch.testing.assert_close(got, want)
    assert not torch.allclose(pe.pos_emb(2, 4), pe.pos_emb(4, 2).view(4, 2, -1).transpose(0, 1).reshape(8, -1))
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
    with pytest.raises(ValueError, match=r"media\[1\].*\[T, 3, H, W\]"):
        enc.encode([torch.zeros(3, 14, 14), torch.zeros(2, 1, 14, 14)])
    with pytest.raises(ValueError, match="media"):
        enc.encode([])


def test_mixed_images_and_videos_packed(enc):
    torch.manual_seed(13)
    img, vid, img2 = torch.randn(3, 30, 45), torch.randn(3, 3, 28, 56), torch.randn(3, 57, 20)
    with torch.no_grad():
        out = enc.encode([img, vid, img2])
        assert [o.shape[0] for o in out] == [enc.num_tokens(x) for x in (img, vid, img2)] == [4, 4, 3]
        torch.testing.assert_close(out[0], enc([img])[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out[1], enc.encode_video(vid), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out[2], enc([img2])[0], rtol=1e-5, atol=1e-5)


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
        feats = [enc.vision_tower([patchify(f, enc.cfg)])[0] for f in frames]
        groups = [(feats[0] + feats[1]) / 2, (feats[2] + feats[3]) / 2, feats[4]]
        want = torch.cat([enc.mm_projector(merge_windows(g, 4, 4, (2, 2))) for g in groups])
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        # A single-frame clip equals the image path.
        torch.testing.assert_close(enc.encode_video(frames[:1]), enc([frames[0]])[0], rtol=1e-5, atol=1e-5)
