"""Media prompts and chat media loading: token layout, counts, tokenisation and render order."""

from __future__ import annotations

import base64
import io
import math

import numpy as np
import pytest
import torch
from PIL import Image

from k3.chat import ChatFormatError, render, render_text
from k3.chat.media import (
    MEDIA_PAD,
    ChatMediaError,
    find_media_parts,
    image_prompt,
    load_chat_media,
    media_prompt,
    num_tokens_for,
    prompt_for,
    prompts_for,
    video_prompt,
)
from k3.media import encode_png_data_uri, pil_to_tensor
from k3.vision_config import tiny_vision_config

CFG = tiny_vision_config(32)


def _img(w: int, h: int, seed: int = 0) -> Image.Image:
    a = np.random.default_rng(seed).integers(0, 256, size=(h, w, 3), dtype=np.uint8)
    return Image.fromarray(a, "RGB")


def _uri(w: int, h: int, seed: int = 0) -> str:
    return encode_png_data_uri(_img(w, h, seed))


def test_layout_exact():
    assert image_prompt(2) == "<|media_begin|>image<|media_content|><|media_pad|><|media_pad|><|media_end|>"
    assert video_prompt(1) == "<|media_begin|>video<|media_content|><|media_pad|><|media_end|>"
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="num_tokens"):
            image_prompt(bad)
    with pytest.raises(ValueError, match="kind"):
        media_prompt("audio", 1)


def test_token_count_matches_formula_many_sizes():
    rng = np.random.default_rng(0)
    sizes = [(1, 1), (28, 28), (29, 28), (56, 57), (14, 3584), (3584, 1)] + [
        tuple(int(v) for v in rng.integers(1, 400, 2)) for _ in range(40)
    ]
    for h, w in sizes:
        n = math.ceil(h / 28) * math.ceil(w / 28)
        img = torch.zeros(3, h, w)
        assert num_tokens_for(img, CFG) == n
        assert prompt_for(img, CFG) == image_prompt(n)
        vid = torch.zeros(3, 3, h, w)
        assert prompt_for(vid, CFG) == video_prompt(2 * n)  # ceil(3 / 2) frame pairs
    with pytest.raises(ValueError, match="media must be"):
        num_tokens_for(torch.zeros(4, 5, 5), CFG)
    with pytest.raises(ValueError, match="exceeds"):
        num_tokens_for(torch.zeros(3, 3585, 2), CFG)


@pytest.mark.parametrize("n", [1, 2, 7, 64, 300])
def test_prompt_tokenises_to_exactly_n_pads(tok, n):
    pad = tok.special_id(MEDIA_PAD)
    ids = tok.encode(image_prompt(n), allow_special=True)
    assert ids.count(pad) == n
    assert ids[0] == tok.special_id("<|media_begin|>") and ids[-1] == tok.special_id("<|media_end|>")
    k = ids.index(tok.special_id("<|media_content|>"))
    assert tok.decode(ids[1:k]) == "image" and ids[k + 1 : -1] == [pad] * n


def test_render_with_media_has_contiguous_pads(tok):
    uris = [_uri(60, 30, 1), _uri(20, 90, 2)]
    msgs = [
        {"role": "user", "content": [
            {"type": "text", "text": "Compare "},
            {"type": "image_url", "image_url": {"url": uris[0]}},
            {"type": "text", "text": " and "},
            {"type": "image_url", "image_url": {"url": uris[1], "detail": "high"}},
        ]},
    ]  # fmt: skip
    cm = load_chat_media(msgs, CFG)
    assert [tuple(m.shape) for m in cm.media] == [(3, 30, 60), (3, 90, 20)]
    assert cm.prompts == [image_prompt(2 * 3), image_prompt(4)]
    ids, mask = render(cm.messages, tok, image_prompts=cm.prompts, add_generation_prompt=True)
    pad = tok.special_id(MEDIA_PAD)
    pos = [i for i, t in enumerate(ids) if t == pad]
    assert len(pos) == cm.num_tokens == 10
    assert pos[:6] == list(range(pos[0], pos[0] + 6)) and pos[6:] == list(range(pos[6], pos[6] + 4))
    assert not any(mask[i] for i in pos)
    torch.testing.assert_close(cm.media[0], pil_to_tensor(_img(60, 30, 1)), rtol=0, atol=0)


def test_typed_media_tokens_stay_text(tok):
    # a user typing the marker names never produces media tokens
    ids, _ = render([{"role": "user", "content": "<|media_pad|><|media_begin|>"}], tok)
    assert tok.special_id(MEDIA_PAD) not in ids and tok.special_id("<|media_begin|>") not in ids
    with pytest.raises(ChatFormatError, match="kimi_image_placeholder"):
        load_chat_media([{"role": "user", "content": "look <|kimi_image_placeholder|>"}], CFG)


def test_all_part_kinds_and_video():
    frames = [_img(30, 20, s) for s in range(3)]
    buf = io.BytesIO()
    frames[0].save(buf, format="WEBP", save_all=True, append_images=frames[1:], lossless=True)
    anim = "data:image/webp;base64," + base64.b64encode(buf.getvalue()).decode()
    msgs = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": [
            {"type": "image", "image": frames[0]},
            {"type": "video", "video": [encode_png_data_uri(f) for f in frames]},
            {"type": "video_url", "video_url": {"url": anim}},
            {"type": "image_url", "image_url": _uri(28, 28)},
        ]},
    ]  # fmt: skip
    cm = load_chat_media(msgs, CFG)
    assert [tuple(m.shape) for m in cm.media] == [(3, 20, 30), (3, 3, 20, 30), (3, 3, 20, 30), (3, 28, 28)]
    torch.testing.assert_close(cm.media[1], cm.media[2], rtol=0, atol=0)
    assert cm.prompts == [image_prompt(2), video_prompt(4), video_prompt(4), image_prompt(1)]
    assert [p["type"] for p in cm.messages[1]["content"]] == ["image", "image", "image", "image_url"]
    assert msgs[1]["content"][1]["type"] == "video"  # the input is not modified
    text = render_text(cm.messages, image_prompts=cm.prompts)
    assert text.count("video<|media_content|>") == 2 and text.count("image<|media_content|>") == 2


def test_tool_results_follow_render_order():
    a, b = _uri(28, 28, 1), _uri(56, 28, 2)
    msgs = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}},
        ]},
        # results arrive out of call order: the renderer sorts them back to c1, c2
        {"role": "tool", "tool_call_id": "c2", "content": [{"type": "image_url", "image_url": {"url": b}}]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "image_url", "image_url": {"url": a}}]},
    ]  # fmt: skip
    parts = find_media_parts(msgs)
    assert [p.where for p in parts] == ["messages[3].content[0].image_url", "messages[2].content[0].image_url"]
    cm = load_chat_media(msgs, CFG)
    assert cm.prompts == [image_prompt(1), image_prompt(2)]
    text = render_text(cm.messages, image_prompts=cm.prompts)
    f, g = text.index('role="tool" tool="f"'), text.index('role="tool" tool="g"')
    assert f < text.index(image_prompt(1)) < g < text.index(image_prompt(2))


@pytest.mark.parametrize(
    "part, match",
    [
        ({"type": "image_url", "image_url": {"url": "https://x/y.png"}}, r"content\[0\]\.image_url: remote image URLs"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,"}}, "image is empty"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, "cannot decode"),
        ({"type": "image_url", "image_url": {}}, "must be an object"),
        ({"type": "image"}, "needs its source"),
        ({"type": "video", "video": []}, "no frames"),
    ],
)
def test_part_errors_name_the_part(part, match):
    msgs = [{"role": "user", "content": [part]}]
    with pytest.raises(ChatMediaError, match=match) as ei:
        load_chat_media(msgs, CFG)
    assert ei.value.param.startswith("messages[0].content[0]")


def test_token_budget_checked_before_decoding():
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _uri(56, 56)}}] * 3}]
    assert load_chat_media(msgs, CFG, max_total_tokens=12).num_tokens == 12
    with pytest.raises(ChatMediaError, match=r"content\[2\].*needs 4 more tokens but only 3 are left"):
        load_chat_media(msgs, CFG, max_total_tokens=11)


def test_oversize_and_frame_limits():
    big = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _uri(3585, 1)}}]}]
    with pytest.raises(ChatMediaError, match="largest supported side is 3584"):
        load_chat_media(big, CFG)
    vid = [{"role": "user", "content": [{"type": "video", "video": [_uri(8, 8)] * 3}]}]
    with pytest.raises(ChatMediaError, match="above the limit of 2"):
        load_chat_media(vid, CFG, max_frames=2)
    mixed = [{"role": "user", "content": [{"type": "video", "video": [_uri(8, 8), _uri(9, 8)]}]}]
    with pytest.raises(ChatMediaError, match="same size"):
        load_chat_media(mixed, CFG)


def test_prompts_for_and_no_media():
    assert prompts_for([torch.zeros(3, 28, 29), torch.zeros(1, 3, 2, 2)], CFG) == [image_prompt(2), video_prompt(1)]
    cm = load_chat_media([{"role": "user", "content": "hi"}], CFG)
    assert cm.media == [] and cm.prompts == [] and cm.num_tokens == 0
