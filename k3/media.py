"""Image (and frame-list video) loading for the vision encoder: source -> normalised float tensor.

Sources: a ``data:`` URI (base64 or percent-encoded payload), a local file path (or ``file://``
URI), or raw bytes. Remote URLs (http, https, ftp, ...) are rejected: k3 never fetches from the
network. Images keep their native resolution (the encoder zero-pads to a multiple of 28 pixels; no
resize). Pixels are normalised as ``(x / 255 - 0.5) / 0.5``, i.e. to [-1, 1].

Every problem -- empty, corrupt, unsupported format, too many bytes, a side above ``max_side`` --
raises `ImageError` (a ValueError) with a message that says what is wrong and what is accepted.
The pixel-size check reads only the image header, so a decompression bomb is refused before it
is decoded.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import re
import urllib.parse
import warnings
from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image, ImageSequence, UnidentifiedImageError

MAX_IMAGE_SIDE = 3584
MAX_IMAGE_BYTES = 20 * 1024 * 1024
MAX_VIDEO_FRAMES = 64
FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP")

_SCHEME_RE = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*):")


class ImageError(ValueError):
    """An image source that cannot be used (the message is safe to return to an API client)."""


# ----------------------------------------------------------------------------- raw bytes


def _describe(source: str) -> str:
    return source if len(source) <= 80 else source[:77] + "..."


def _data_uri_bytes(uri: str, max_bytes: int) -> bytes:
    """Payload of `data:[<mediatype>][;base64],<data>`."""
    head, sep, payload = uri.partition(",")
    if not sep:
        raise ImageError("malformed data URI: expected 'data:image/png;base64,<data>' (no comma found)")
    params = [p.strip().lower() for p in head[len("data:") :].split(";")]
    mediatype = params[0]
    if mediatype and not (mediatype.startswith("image/") or mediatype == "application/octet-stream"):
        raise ImageError(f"data URI media type {mediatype!r} is not an image type "
                         "(expected image/png, image/jpeg, ...)")
    if "base64" not in params[1:]:
        data = urllib.parse.unquote_to_bytes(payload)
    else:
        compact = "".join(payload.split())  # some clients wrap base64 at 76 columns
        if len(compact) * 3 // 4 > max_bytes + 3:
            raise ImageError(f"image is larger than the {max_bytes}-byte limit "
                             f"(data URI of {len(compact)} base64 characters)")
        try:
            data = base64.b64decode(compact, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ImageError(f"data URI payload is not valid base64: {e}") from None
    return data


def _file_bytes(path: str, max_bytes: int) -> bytes:
    try:
        st = os.stat(path)
    except OSError:
        raise ImageError(f"image file not found: {_describe(path)!r} "
                         "(expected a data: URI or an existing local file path)") from None
    if not os.path.isfile(path):
        raise ImageError(f"image path is not a regular file: {_describe(path)!r}")
    if st.st_size > max_bytes:
        raise ImageError(f"image file has {st.st_size} bytes, above the {max_bytes}-byte limit")
    try:
        with open(path, "rb") as f:
            return f.read(max_bytes + 1)
    except OSError as e:
        raise ImageError(f"cannot read image file {_describe(path)!r}: {e.strerror}") from None


def read_image_bytes(source: str | bytes | bytearray | memoryview, *, max_bytes: int = MAX_IMAGE_BYTES,
                     allow_local: bool = True) -> bytes:
    """The encoded image bytes behind `source` (data: URI, local path / file:// URI, or raw bytes).

    Raises ImageError for remote URLs, unknown schemes, missing files, empty or oversize payloads.
    allow_local: False refuses file paths (a server may not want to read its own disk).
    """
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
    elif isinstance(source, str):
        src = source.strip()
        if not src:
            raise ImageError("image source is an empty string (expected a data: URI or a local file path)")
        m = _SCHEME_RE.match(src)
        scheme = m.group(1).lower() if m and len(m.group(1)) > 1 else None  # 'C:' is a drive letter
        if scheme == "data":
            data = _data_uri_bytes(src, max_bytes)
        elif scheme in (None, "file"):
            if not allow_local:
                raise ImageError("local image paths are disabled on this server; send the image as a data: URI")
            path = urllib.parse.unquote(urllib.parse.urlparse(src).path) if scheme == "file" else src
            data = _file_bytes(path, max_bytes)
        elif scheme in ("http", "https", "ftp", "ftps", "s3", "gs"):
            raise ImageError(f"remote image URLs are not supported ({scheme}:// given): k3 has no network "
                             "access; send the image inline as a base64 data: URI (data:image/png;base64,...) "
                             "or a local file path")
        else:
            raise ImageError(f"unsupported image URL scheme {scheme!r} (expected a data: URI or a local file path)")
    else:
        raise ImageError(f"image source must be a string (data: URI or path) or bytes, got {type(source).__name__}")
    if not data:
        raise ImageError("image is empty (0 bytes)")
    if len(data) > max_bytes:
        raise ImageError(f"image has {len(data)} bytes, above the {max_bytes}-byte limit")
    return data


# ----------------------------------------------------------------------------- decoding


def _open(data: bytes, max_side: int) -> Image.Image:
    """Open (header only) and check format and size; the caller decodes."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=FORMATS)
    except UnidentifiedImageError:
        raise ImageError("cannot decode the image: not a valid image in a supported format "
                         f"({', '.join(FORMATS)})") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise ImageError(f"image has too many pixels (the limit is {max_side}x{max_side})") from None
    except (OSError, ValueError, SyntaxError) as e:
        raise ImageError(f"cannot decode the image: {e}") from None
    w, h = img.size
    if w < 1 or h < 1:
        raise ImageError(f"image has an empty size {w}x{h}")
    if w > max_side or h > max_side:
        raise ImageError(f"image is {w}x{h} pixels; the largest supported side is {max_side} pixels (resize it first)")
    return img


def peek_image(data: bytes, *, max_side: int = MAX_IMAGE_SIDE) -> tuple[Image.Image, int, int, int]:
    """Read only the header of encoded image `data` -> (lazy PIL image, width, height, frames).

    Checks format and size without decoding pixels, so callers can budget before `decode_image`.
    """
    img = _open(data, max_side)
    try:
        frames = int(getattr(img, "n_frames", 1))
    except (OSError, ValueError, SyntaxError) as e:
        raise ImageError(f"cannot decode the image frames (truncated or corrupt data): {e}") from None
    return img, img.size[0], img.size[1], frames


def peek_source(source: str | bytes | bytearray | memoryview | Image.Image, *, max_side: int = MAX_IMAGE_SIDE,
                max_bytes: int = MAX_IMAGE_BYTES, allow_local: bool = True) -> tuple[Image.Image, int, int, int]:
    """`peek_image` of any source (data: URI, local path, bytes) -> (lazy image, width, height, frames);
    a PIL image is size-checked as is and counts as one frame."""
    if isinstance(source, Image.Image):
        w, h = source.size
        if not (0 < w <= max_side and 0 < h <= max_side):
            raise ImageError(f"image is {w}x{h} pixels; sides must be in [1, {max_side}]")
        return source, w, h, 1
    return peek_image(read_image_bytes(source, max_bytes=max_bytes, allow_local=allow_local), max_side=max_side)


def decode_image(img: Image.Image) -> torch.Tensor:
    """A `peek_image` result -> float32 [3, H, W] in [-1, 1] (animated images: first frame)."""
    return pil_to_tensor(_decode(img))


def decode_frames(img: Image.Image, max_frames: int = MAX_VIDEO_FRAMES) -> torch.Tensor:
    """A `peek_image` result -> all its frames as float32 [T, 3, H, W] in [-1, 1]."""
    n = int(getattr(img, "n_frames", 1))
    if n > max_frames:
        raise ImageError(f"video has {n} frames, above the limit of {max_frames}")
    try:
        frames = [pil_to_tensor(_to_rgb(f.copy())) for f in ImageSequence.Iterator(img)]
    except (OSError, ValueError, SyntaxError) as e:
        raise ImageError(f"cannot decode the video frames (truncated or corrupt data): {e}") from None
    return stack_frames(frames)


def _to_rgb(frame: Image.Image) -> Image.Image:
    """RGB; transparent pixels are composited over white (their stored colour is arbitrary)."""
    if frame.mode == "RGB":
        return frame
    if frame.mode == "P" and "transparency" in frame.info:
        frame = frame.convert("RGBA")
    if frame.mode in ("RGBA", "LA", "PA"):
        rgba = frame.convert("RGBA")
        bg = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(bg, rgba).convert("RGB")
    if frame.mode in ("I;16", "I;16B", "I;16L", "I"):
        # 16/32-bit greyscale: scale to 8 bits rather than clip
        a = np.asarray(frame, dtype=np.float64)
        top = a.max() if a.size and a.max() > 255 else 255.0
        return Image.fromarray(np.clip(a * (255.0 / top), 0, 255).astype(np.uint8)).convert("RGB")
    return frame.convert("RGB")


def _decode(img: Image.Image) -> Image.Image:
    try:
        img.load()
        return _to_rgb(img)
    except (OSError, ValueError, SyntaxError) as e:
        raise ImageError(f"cannot decode the image (truncated or corrupt data): {e}") from None


def open_image(source: str | bytes | bytearray | memoryview, *, max_side: int = MAX_IMAGE_SIDE,
               max_bytes: int = MAX_IMAGE_BYTES, allow_local: bool = True) -> Image.Image:
    """Decode `source` into a PIL RGB image at native resolution (animated images: first frame)."""
    img = _open(read_image_bytes(source, max_bytes=max_bytes, allow_local=allow_local), max_side)
    return _decode(img)


def pil_to_tensor(img: Image.Image) -> torch.Tensor:
    """PIL image -> float32 [3, H, W], normalised (x / 255 - 0.5) / 0.5 (i.e. in [-1, 1])."""
    if not isinstance(img, Image.Image):
        raise ImageError(f"expected a PIL image, got {type(img).__name__}")
    a = np.asarray(_to_rgb(img), dtype=np.uint8)
    t = torch.from_numpy(a.copy()).permute(2, 0, 1).to(torch.float32)
    return (t / 255.0 - 0.5) / 0.5


def tensor_to_pil(t: torch.Tensor) -> Image.Image:
    """Inverse of `pil_to_tensor` (rounded to 8 bits): float [3, H, W] in [-1, 1] -> PIL RGB."""
    if t.dim() != 3 or t.shape[0] != 3:
        raise ValueError(f"t must be [3, H, W], got {list(t.shape)}")
    a = ((t.detach().float().cpu() * 0.5 + 0.5) * 255.0).round().clamp(0, 255).to(torch.uint8)
    return Image.fromarray(a.permute(1, 2, 0).numpy(), "RGB")


def load_image(source: str | bytes | bytearray | memoryview | Image.Image, *, max_side: int = MAX_IMAGE_SIDE,
               max_bytes: int = MAX_IMAGE_BYTES, allow_local: bool = True) -> torch.Tensor:
    """Image source -> float32 [3, H, W] normalised to [-1, 1], native resolution.

    source: data: URI, local path / file:// URI, raw encoded bytes, or a PIL image.
    Raises ImageError (a ValueError) with a client-presentable message on any bad input.
    """
    if isinstance(source, Image.Image):
        w, h = source.size
        if not (0 < w <= max_side and 0 < h <= max_side):
            raise ImageError(f"image is {w}x{h} pixels; sides must be in [1, {max_side}]")
        return pil_to_tensor(source)
    return pil_to_tensor(open_image(source, max_side=max_side, max_bytes=max_bytes, allow_local=allow_local))


def load_video(source: str | bytes | Sequence, *, max_side: int = MAX_IMAGE_SIDE, max_bytes: int = MAX_IMAGE_BYTES,
               max_frames: int = MAX_VIDEO_FRAMES, allow_local: bool = True) -> torch.Tensor:
    """A video as frames -> float32 [T, 3, H, W] normalised to [-1, 1].

    source: a list of frame sources (each as for `load_image`), or one animated image (GIF / WebP /
    APNG) whose frames are taken in order. All frames must have the same size; at most `max_frames`.
    """
    if isinstance(source, (list, tuple)):
        if not source:
            raise ImageError("video has no frames")
        if len(source) > max_frames:
            raise ImageError(f"video has {len(source)} frames, above the limit of {max_frames}")
        frames = [load_image(f, max_side=max_side, max_bytes=max_bytes, allow_local=allow_local) for f in source]
        return stack_frames(frames)
    img = _open(read_image_bytes(source, max_bytes=max_bytes, allow_local=allow_local), max_side)
    return decode_frames(img, max_frames)


def stack_frames(frames: Sequence[torch.Tensor]) -> torch.Tensor:
    """Same-size [3, H, W] frames -> [T, 3, H, W]; ImageError when sizes differ."""
    if not frames:
        raise ImageError("video has no frames")
    shape = tuple(frames[0].shape)
    for i, f in enumerate(frames):
        if f.dim() != 3 or f.shape[0] != 3:
            raise ImageError(f"video frame {i} must be [3, H, W], got {list(f.shape)}")
        if tuple(f.shape) != shape:
            raise ImageError(f"video frames must all have the same size: frame 0 is {shape[2]}x{shape[1]}, "
                             f"frame {i} is {f.shape[2]}x{f.shape[1]}")
    return torch.stack(list(frames))


def encode_png_data_uri(img: Image.Image) -> str:
    """PIL image -> `data:image/png;base64,...` (handy for requests and tests)."""
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")
