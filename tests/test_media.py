"""Image loading: every accepted source gives the same normalised pixels; every bad one a clear ImageError."""

from __future__ import annotations

import base64
import io
import urllib.parse

import numpy as np
import pytest
import torch
from PIL import Image

from k3.media import (
    ImageError,
    encode_png_data_uri,
    load_image,
    load_video,
    open_image,
    pil_to_tensor,
    read_image_bytes,
    stack_frames,
    tensor_to_pil,
)


def _img(w: int = 37, h: int = 23, seed: int = 0) -> Image.Image:
    a = np.random.default_rng(seed).integers(0, 256, size=(h, w, 3), dtype=np.uint8)
    return Image.fromarray(a, "RGB")


def _bytes(img: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def test_normalisation_exact():
    img = _img()
    t = pil_to_tensor(img)
    ref = (torch.tensor(np.asarray(img), dtype=torch.float32).permute(2, 0, 1) / 255 - 0.5) / 0.5
    assert t.dtype == torch.float32 and t.shape == (3, 23, 37)
    torch.testing.assert_close(t, ref, rtol=0, atol=0)
    assert t.min() >= -1 and t.max() <= 1
    assert tensor_to_pil(t).tobytes() == img.tobytes()


def test_sources_agree(tmp_path):
    img = _img(50, 31)
    ref = pil_to_tensor(img)
    png = _bytes(img)
    path = tmp_path / "a b.png"
    path.write_bytes(png)
    b64 = base64.b64encode(png).decode()
    wrapped = "\n".join(b64[i : i + 76] for i in range(0, len(b64), 76))
    sources = [
        png,
        bytearray(png),
        encode_png_data_uri(img),
        "data:image/png;base64," + wrapped,
        "data:;base64," + b64,
        "data:image/png," + urllib.parse.quote_from_bytes(png),
        str(path),
        "file://" + urllib.parse.quote(str(path)),
        img,
    ]
    for s in sources:
        torch.testing.assert_close(load_image(s), ref, rtol=0, atol=0)


@pytest.mark.parametrize("w,h", [(1, 1), (13, 200), (301, 7), (28, 28), (29, 57)])
def test_native_resolution_any_aspect(w, h):
    assert load_image(_bytes(_img(w, h))).shape == (3, h, w)


@pytest.mark.parametrize("fmt", ["JPEG", "WEBP", "BMP", "GIF"])
def test_other_formats(fmt):
    img = _img(20, 12)
    t = load_image(_bytes(img, fmt))
    assert t.shape == (3, 12, 20)
    if fmt == "BMP":  # lossless
        torch.testing.assert_close(t, pil_to_tensor(img), rtol=0, atol=0)


def test_modes_convert_to_rgb():
    grey = Image.fromarray(np.full((5, 6), 128, np.uint8), "L")
    assert load_image(_bytes(grey)).shape == (3, 5, 6)
    rgba = Image.new("RGBA", (4, 4), (0, 0, 0, 0))  # fully transparent -> white
    assert torch.all(load_image(_bytes(rgba)) == 1.0)
    g16 = Image.fromarray(np.full((3, 3), 65535, np.uint16))
    assert torch.all(load_image(_bytes(g16)) == 1.0)


@pytest.mark.parametrize(
    "source, match",
    [
        (b"", "empty"),
        ("", "empty string"),
        ("data:image/png;base64,", "empty"),
        ("data:image/png;base64,@@@@", "not valid base64"),
        ("data:image/png;base64" + "QUJD", "malformed data URI"),
        ("data:text/plain;base64,QUJD", "not an image type"),
        (b"definitely not an image", "cannot decode"),
        ("https://example.com/cat.png", "remote image URLs are not supported"),
        ("http://127.0.0.1/x.png", "no network access"),
        ("ftp://host/x.png", "remote image URLs"),
        ("gopher://host/x", "unsupported image URL scheme"),
        ("/definitely/missing/file.png", "not found"),
        (123, "must be a string"),
    ],
)
def test_bad_sources(source, match):
    with pytest.raises(ImageError, match=match):
        load_image(source)


def test_error_is_value_error_and_directory(tmp_path):
    assert issubclass(ImageError, ValueError)
    with pytest.raises(ImageError, match="not a regular file"):
        load_image(str(tmp_path))


def test_truncated_and_corrupt():
    png = _bytes(_img(64, 64))
    with pytest.raises(ImageError, match="cannot decode"):
        load_image(png[: len(png) // 2])
    flipped = bytearray(png)
    flipped[len(png) // 2] ^= 0xFF  # corrupt the compressed stream (PNG CRC / zlib error)
    with pytest.raises(ImageError, match="cannot decode"):
        load_image(bytes(flipped))


def test_oversize_pixels_and_bytes(tmp_path):
    big = Image.new("RGB", (3585, 2), (1, 2, 3))
    with pytest.raises(ImageError, match="3585x2 pixels; the largest supported side is 3584"):
        load_image(_bytes(big))
    assert load_image(_bytes(Image.new("RGB", (3584, 1)))).shape == (3, 1, 3584)
    with pytest.raises(ImageError, match="largest supported side is 16"):
        load_image(_bytes(_img(17, 3)), max_side=16)
    png = _bytes(_img(40, 40))
    with pytest.raises(ImageError, match="byte limit"):
        load_image(png, max_bytes=len(png) - 1)
    with pytest.raises(ImageError, match="byte limit"):
        load_image("data:image/png;base64," + base64.b64encode(png).decode(), max_bytes=100)
    path = tmp_path / "x.png"
    path.write_bytes(png)
    with pytest.raises(ImageError, match="above the 10-byte limit"):
        load_image(str(path), max_bytes=10)
    with pytest.raises(ImageError, match="sides must be"):
        load_image(big)


def test_bomb_header_refused_before_decoding():
    # a PNG header claiming 20000 x 20000 pixels with no real data: refused from the header alone
    img = Image.new("1", (20000, 20000))
    data = _bytes(img, optimize=True)
    with pytest.raises(ImageError, match="20000x20000|too many pixels"):
        load_image(data)


def test_local_paths_can_be_disabled(tmp_path):
    path = tmp_path / "x.png"
    path.write_bytes(_bytes(_img()))
    with pytest.raises(ImageError, match="disabled"):
        read_image_bytes(str(path), allow_local=False)
    assert open_image(str(path)).size == (37, 23)


def test_video_from_frames_and_animation():
    frames = [_img(30, 20, seed=s) for s in range(3)]
    v = load_video([_bytes(f) for f in frames])
    assert v.shape == (3, 3, 20, 30)
    torch.testing.assert_close(v[1], pil_to_tensor(frames[1]), rtol=0, atol=0)
    buf = io.BytesIO()
    frames[0].save(buf, format="WEBP", save_all=True, append_images=frames[1:], lossless=True, duration=50)
    anim = load_video(buf.getvalue())
    assert anim.shape == (3, 3, 20, 30)
    torch.testing.assert_close(anim, v, rtol=0, atol=0)
    assert load_video(_bytes(frames[0])).shape == (1, 3, 20, 30)


def test_video_errors():
    with pytest.raises(ImageError, match="no frames"):
        load_video([])
    with pytest.raises(ImageError, match="same size"):
        load_video([_bytes(_img(10, 10)), _bytes(_img(11, 10))])
    with pytest.raises(ImageError, match="above the limit of 2"):
        load_video([_bytes(_img())] * 3, max_frames=2)
    with pytest.raises(ImageError, match=r"\[3, H, W\]"):
        stack_frames([torch.zeros(1, 4, 4)])
