"""Generated image-caption data: small random programs rendered locally, captioned with their facts.

Every example is one image plus a question and its answer, produced by a tiny random "program":

- ``colour``: one filled shape; the answer is its colour name (8 choices).
- ``shape``:  one filled shape of a random colour; the answer is the shape name (6 choices).
- ``count``:  1-6 copies of one small shape; the answer is the number as a digit (6 choices).
- ``plot``:   a function drawn with matplotlib; the answer is the code that drew it.
- ``code``:   a short Python snippet rendered in a monospace font; the answer is the snippet.

This is the report's "code paired with rendered visuals" at toy scale: no downloads, fully
deterministic per seed, and small images (default sides 56-112 px, i.e. 4-16 media tokens;
`k3-tiny-vl` trains on 56 x 56) so a tiny vision-language model trains on a couple of CPU cores.
colour/shape/count carry exactly one clear fact per image: a single large object (36-44 px
across, several patches), or 1-6 equal small objects one per 14-px grid cell; image sizes,
aspect ratios, positions, rotations and colours vary. ``choices`` lists the candidate answers
for multiple-choice scoring (chance = 1 / len(choices)).

Held-out split: `TRAIN_SEED` and `HELDOUT_SEED` are the conventional seeds; examples are
generated from independent random streams per (seed, index), so different seeds never share
a stream.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from PIL import Image, ImageDraw, ImageFont

KINDS = ("colour", "shape", "count", "plot", "code")
TRAIN_SEED = 0
HELDOUT_SEED = 1_000_003

# Saturated, well-separated colours; each drawn with a small per-channel jitter.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (215, 30, 35),
    "green": (35, 160, 55),
    "blue": (35, 75, 220),
    "yellow": (240, 205, 25),
    "orange": (245, 130, 25),
    "purple": (135, 50, 180),
    "black": (25, 25, 25),
    "pink": (245, 120, 185),
}
SHAPES = ("circle", "square", "triangle", "star", "cross", "diamond")
COUNTS = tuple(str(k) for k in range(1, 7))
_COUNT_SHAPES = ("circle", "square", "triangle")

_QUESTIONS = {
    "colour": ("What colour is the shape?", "Which colour is the object in the image?"),
    "shape": ("Which shape is this?", "What shape is in the image?"),
    "count": ("How many shapes are there?", "How many objects are in the image?"),
    "plot": ("What code produced this plot?", "Write the code that draws this plot."),
    "code": ("What code is shown in the image?", "Transcribe the code in the image."),
}
_SUPERSAMPLE = 2  # draw at 2x and downsample: anti-aliased edges without a slow renderer
# Object sizes in pixels, not relative to the canvas: a tiny tower learns shapes far faster when
# a single object spans 3 or more 14-px patches (radius 18-22: 36-44 px across), and counting
# is easier when every counted object has the same size (see docs/vision.md, "Results").
SHAPE_RADIUS = (18.0, 22.0)  # single-object images; capped at 0.42 * the shorter side
COUNT_RADIUS = 4.5  # every counted object; capped at 0.11 * the shorter side
# Counted objects sit one per cell of a 14-px grid (the patch size), jittered by up to 1 px, so
# objects never touch and one patch never holds two of them; canvases with too few cells fall
# back to free placement with a gap.
COUNT_CELL = 14
_COUNT_JITTER = 1.0


@dataclass
class VisionExample:
    """One image-question-answer example.

    image: PIL RGB image (width, height within the requested size range).
    question / answer: plain text; answer is one of `choices` when choices is not None.
    kind: one of KINDS.
    choices: candidate answers for colour/shape/count (multiple-choice scoring), else None.
    """

    image: Image.Image
    question: str
    answer: str
    kind: str
    choices: list[str] | None = None

    def messages(self) -> list[dict]:
        """The example as an OpenAI-style chat: a user turn (image, then question) and the answer."""
        return [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": self.question}]},
            {"role": "assistant", "content": self.answer},
        ]


# ----------------------------------------------------------------------------- helpers


def _check_size(size: Sequence[int]) -> tuple[int, int]:
    if len(size) != 2 or not all(isinstance(s, int) for s in size):
        raise ValueError(f"size must be a (min_side, max_side) pair of ints, got {size!r}")
    lo, hi = size
    if not 28 <= lo <= hi <= 3584:
        raise ValueError(f"size must satisfy 28 <= min_side <= max_side <= 3584, got {size!r}")
    return lo, hi


def _canvas_size(rng: np.random.Generator, lo: int, hi: int) -> tuple[int, int]:
    # sides drawn independently: aspect ratios from lo/hi to hi/lo
    return int(rng.integers(lo, hi + 1)), int(rng.integers(lo, hi + 1))


def _background(rng: np.random.Generator) -> tuple[int, int, int]:
    g = int(rng.integers(225, 256))
    return (g, g, g)


def _jitter(rng: np.random.Generator, rgb: tuple[int, int, int], amount: int = 14) -> tuple[int, int, int]:
    return tuple(int(np.clip(c + rng.integers(-amount, amount + 1), 0, 255)) for c in rgb)  # type: ignore[return-value]


def _shape_points(shape: str, cx: float, cy: float, r: float, angle: float) -> list[tuple[float, float]]:
    """Polygon vertices of a shape of circumradius-ish size r centred at (cx, cy)."""
    if shape == "square":
        s = r / math.sqrt(2) * 1.15
        return [(cx - s, cy - s), (cx + s, cy - s), (cx + s, cy + s), (cx - s, cy + s)]
    if shape == "diamond":
        return [(cx, cy - r), (cx + r * 0.8, cy), (cx, cy + r), (cx - r * 0.8, cy)]
    if shape == "triangle":
        angles = [angle + k * 2 * math.pi / 3 for k in range(3)]
        return [(cx + r * math.cos(a), cy + r * math.sin(a)) for a in angles]
    if shape == "star":
        pts = []
        for k in range(10):
            rad = r if k % 2 == 0 else r * 0.5
            a = angle + k * math.pi / 5
            pts.append((cx + rad * math.cos(a), cy + rad * math.sin(a)))
        return pts
    if shape == "cross":
        a, b = r, r * 0.34
        return [
            (cx - b, cy - a), (cx + b, cy - a), (cx + b, cy - b), (cx + a, cy - b), (cx + a, cy + b), (cx + b, cy + b),
            (cx + b, cy + a), (cx - b, cy + a), (cx - b, cy + b), (cx - a, cy + b), (cx - a, cy - b), (cx - b, cy - b),
        ]  # fmt: skip
    raise ValueError(f"shape: unknown shape {shape!r}")


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, cx: float, cy: float, r: float, angle: float, fill) -> None:
    k = _SUPERSAMPLE
    if shape == "circle":
        draw.ellipse([(cx - r) * k, (cy - r) * k, (cx + r) * k, (cy + r) * k], fill=fill)
        return
    draw.polygon([(x * k, y * k) for x, y in _shape_points(shape, cx, cy, r, angle)], fill=fill)


def _new_canvas(w: int, h: int, bg) -> tuple[Image.Image, ImageDraw.ImageDraw]:
    img = Image.new("RGB", (w * _SUPERSAMPLE, h * _SUPERSAMPLE), bg)
    return img, ImageDraw.Draw(img)


def _finish(img: Image.Image, w: int, h: int) -> Image.Image:
    return img.resize((w, h), Image.Resampling.LANCZOS)


def _single_shape_image(rng: np.random.Generator, lo: int, hi: int, shape: str, rgb) -> Image.Image:
    w, h = _canvas_size(rng, lo, hi)
    img, draw = _new_canvas(w, h, _background(rng))
    m = min(w, h)
    r = min(float(rng.uniform(*SHAPE_RADIUS)), 0.42 * m)
    cx = float(rng.uniform(r + 1, w - r - 1))
    cy = float(rng.uniform(r + 1, h - r - 1))
    _draw_shape(draw, shape, cx, cy, r, float(rng.uniform(0, 2 * math.pi)), _jitter(rng, rgb))
    return _finish(img, w, h)


# ----------------------------------------------------------------------------- the five kinds


def _colour(rng: np.random.Generator, lo: int, hi: int) -> VisionExample:
    names = list(COLOURS)
    colour = names[int(rng.integers(len(names)))]
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    img = _single_shape_image(rng, lo, hi, shape, COLOURS[colour])
    return VisionExample(img, _question(rng, "colour"), colour, "colour", names)


def _shape(rng: np.random.Generator, lo: int, hi: int) -> VisionExample:
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    rgb = list(COLOURS.values())[int(rng.integers(len(COLOURS)))]
    img = _single_shape_image(rng, lo, hi, shape, rgb)
    return VisionExample(img, _question(rng, "shape"), shape, "shape", list(SHAPES))


def _place_disjoint(rng: np.random.Generator, n: int, w: int, h: int, r: float) -> list[tuple[float, float]] | None:
    centres: list[tuple[float, float]] = []
    for _ in range(400):
        x = float(rng.uniform(r + 1, w - r - 1))
        y = float(rng.uniform(r + 1, h - r - 1))
        # a clear gap between objects so they never touch or merge visually
        if all((x - a) ** 2 + (y - b) ** 2 > (2.5 * r) ** 2 for a, b in centres):
            centres.append((x, y))
            if len(centres) == n:
                return centres
    return None


def _place_grid(rng: np.random.Generator, n: int, w: int, h: int, r: float) -> list[tuple[float, float]] | None:
    """Centres of n distinct cells of a COUNT_CELL grid centred on the canvas (None if it has fewer
    than n cells or the cells are too small for a gap between objects)."""
    cols, rows = w // COUNT_CELL, h // COUNT_CELL
    if cols * rows < n or COUNT_CELL < 2 * r + 2 * _COUNT_JITTER + 2:
        return None
    ox, oy = (w - cols * COUNT_CELL) / 2, (h - rows * COUNT_CELL) / 2
    cells = rng.choice(cols * rows, size=n, replace=False)
    return [(ox + (c % cols + 0.5) * COUNT_CELL + float(rng.uniform(-_COUNT_JITTER, _COUNT_JITTER)),
             oy + (c // cols + 0.5) * COUNT_CELL + float(rng.uniform(-_COUNT_JITTER, _COUNT_JITTER)))
            for c in (int(c) for c in cells)]


def _count(rng: np.random.Generator, lo: int, hi: int) -> VisionExample:
    n = int(rng.integers(1, len(COUNTS) + 1))
    shape = _COUNT_SHAPES[int(rng.integers(len(_COUNT_SHAPES)))]
    rgb = _jitter(rng, list(COLOURS.values())[int(rng.integers(len(COLOURS)))])
    w, h = _canvas_size(rng, lo, hi)
    r = min(COUNT_RADIUS, 0.11 * min(w, h))
    centres = _place_grid(rng, n, w, h, r)
    if centres is None:
        centres = _place_disjoint(rng, n, w, h, r)
    while centres is None:  # crowded canvas: shrink the objects until they fit
        r *= 0.85
        centres = _place_disjoint(rng, n, w, h, r)
    img, draw = _new_canvas(w, h, _background(rng))
    angle = float(rng.uniform(0, 2 * math.pi))
    for cx, cy in centres:
        _draw_shape(draw, shape, cx, cy, r, angle, rgb)
    return VisionExample(_finish(img, w, h), _question(rng, "count"), str(n), "count", list(COUNTS))


_PLOT_FUNCS = (
    ("np.sin({a} * x)", lambda x, a: np.sin(a * x)),
    ("np.cos({a} * x)", lambda x, a: np.cos(a * x)),
    ("{a} * x", lambda x, a: a * x),
    ("x ** 2 / {a}", lambda x, a: x**2 / a),
    ("np.exp(-x ** 2 / {a})", lambda x, a: np.exp(-(x**2) / a)),
    ("np.abs(x) - {a}", lambda x, a: np.abs(x) - a),
)
_PLOT_COLOURS = ("red", "green", "blue", "orange", "purple", "black")


@lru_cache(maxsize=1)
def _figure():
    # one reusable Agg figure per process: creating figures dominates matplotlib's cost
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    fig = Figure(dpi=100)
    ax = fig.add_axes((0.04, 0.04, 0.92, 0.92))
    return fig, ax


def _plot(rng: np.random.Generator, lo: int, hi: int) -> VisionExample:
    template, fn = _PLOT_FUNCS[int(rng.integers(len(_PLOT_FUNCS)))]
    a = int(rng.integers(2, 4))  # 2 or 3: no degenerate `1 * x` in the code text
    colour = _PLOT_COLOURS[int(rng.integers(len(_PLOT_COLOURS)))]
    expr = template.format(a=a)
    code = f"x = np.linspace(-3, 3, 100)\nplt.plot(x, {expr}, color=\"{colour}\")"
    w, h = _canvas_size(rng, lo, hi)
    fig, ax = _figure()
    fig.set_size_inches(w / 100, h / 100)
    ax.clear()
    x = np.linspace(-3, 3, 100)
    ax.plot(x, fn(x, a), color=colour, linewidth=1.5)
    ax.set_xticks([])
    ax.set_yticks([])
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, facecolor="white")
    img = Image.open(buf).convert("RGB")
    if img.size != (w, h):  # savefig may round the inch size by a pixel
        img = img.resize((w, h), Image.Resampling.BILINEAR)
    return VisionExample(img, _question(rng, "plot"), code, "plot", None)


_NAMES = ("x", "y", "n", "a", "b", "k")
_OPS = ("+", "-", "*")


def _program(rng: np.random.Generator) -> str:
    first, second = (str(v) for v in rng.choice(_NAMES, size=2, replace=False))
    lines = [f"{first} = {int(rng.integers(0, 10))}"]
    lines.append(f"{second} = {first} {_OPS[int(rng.integers(len(_OPS)))]} {int(rng.integers(1, 10))}")
    lines.append(f"print({second})")
    return "\n".join(lines)


@lru_cache(maxsize=8)
def _mono_font(px: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    # matplotlib ships DejaVu Sans Mono: the same glyphs on every machine
    import matplotlib

    path = os.path.join(os.path.dirname(matplotlib.__file__), "mpl-data", "fonts", "ttf", "DejaVuSansMono.ttf")
    return ImageFont.truetype(path, px)


def _code(rng: np.random.Generator, lo: int, hi: int) -> VisionExample:
    code = _program(rng)
    w, h = _canvas_size(rng, lo, hi)
    img = Image.new("RGB", (w, h), _background(rng))
    draw = ImageDraw.Draw(img)
    px = 16
    while px > 6:  # largest font that fits the canvas
        box = draw.multiline_textbbox((0, 0), code, font=_mono_font(px), spacing=2)
        if box[2] + 4 <= w and box[3] + 4 <= h:
            break
        px -= 1
    font = _mono_font(px)
    box = draw.multiline_textbbox((0, 0), code, font=font, spacing=2)
    x = int(rng.integers(2, max(3, w - box[2] - 1)))
    y = int(rng.integers(2, max(3, h - box[3] - 1)))
    draw.multiline_text((x, y), code, font=font, fill=(20, 20, 20), spacing=2)
    return VisionExample(img, _question(rng, "code"), code, "code", None)


_MAKERS = {"colour": _colour, "shape": _shape, "count": _count, "plot": _plot, "code": _code}


def _question(rng: np.random.Generator, kind: str) -> str:
    options = _QUESTIONS[kind]
    return options[int(rng.integers(len(options)))]


# ----------------------------------------------------------------------------- entry point


def generate_examples(
    n: int,
    seed: int,
    *,
    size: Sequence[int] = (56, 112),
    kinds: Sequence[str] = KINDS,
    weights: Sequence[float] | None = None,
) -> list[VisionExample]:
    """Generate `n` examples deterministically from `seed`.

    size: (min_side, max_side) in pixels; width and height are drawn independently in that range.
    kinds: which kinds to generate (subset of KINDS); weights: their relative frequencies
        (default uniform). Example i uses its own random stream seeded by (seed, i), so the
        first k examples of a larger n are the same as generate_examples(k, seed).
    """
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    lo, hi = _check_size(size)
    kinds = list(kinds)
    if not kinds or any(k not in KINDS for k in kinds):
        raise ValueError(f"kinds must be a non-empty subset of {KINDS}, got {kinds!r}")
    if weights is None:
        p = np.full(len(kinds), 1.0 / len(kinds))
    else:
        p = np.asarray(weights, dtype=np.float64)
        if p.shape != (len(kinds),) or (p < 0).any() or p.sum() <= 0:
            raise ValueError(f"weights must be {len(kinds)} non-negative numbers with a positive sum, got {weights!r}")
        p = p / p.sum()
    out = []
    for i in range(n):
        rng = np.random.default_rng([seed, i])
        kind = kinds[int(rng.choice(len(kinds), p=p))]
        out.append(_MAKERS[kind](rng, lo, hi))
    return out


def chance_level(kind: str) -> float:
    """Multiple-choice chance accuracy for a kind with choices (colour/shape/count)."""
    sizes = {"colour": len(COLOURS), "shape": len(SHAPES), "count": len(COUNTS)}
    if kind not in sizes:
        raise ValueError(f"kind must be one of {tuple(sizes)}, got {kind!r}")
    return 1.0 / sizes[kind]
