"""Generated image-caption data: determinism, ranges, and that every caption states the image's fact."""

from __future__ import annotations

import ast
from collections import Counter

import numpy as np
import pytest

from k3.data.synth_vision import (
    COLOURS,
    COUNTS,
    HELDOUT_SEED,
    KINDS,
    SHAPES,
    TRAIN_SEED,
    VisionExample,
    chance_level,
    generate_examples,
)

SHAPE_AREA_RANGE = (20, 90)  # pixels of one count object (radius 4.5: a circle is ~64)


def _foreground(img) -> np.ndarray:
    """Mask of object pixels: anything clearly darker or more saturated than the grey background."""
    a = np.asarray(img).astype(np.int32)
    bg = np.median(a[[0, -1]].reshape(-1, 3), axis=0)  # border rows are background (objects keep a margin)
    return np.abs(a - bg).sum(-1) > 90


def _components(mask: np.ndarray) -> int:
    """8-connected components (anti-aliased star tips can touch only diagonally)."""
    seen = np.zeros_like(mask)
    h, w = mask.shape
    n = 0
    for y0, x0 in zip(*np.nonzero(mask)):
        if seen[y0, x0]:
            continue
        n += 1
        stack = [(y0, x0)]
        seen[y0, x0] = True
        while stack:
            y, x = stack.pop()
            for dy, dx in ((1, 0), (-1, 0), (0, 1), (0, -1), (1, 1), (1, -1), (-1, 1), (-1, -1)):
                yy, xx = y + dy, x + dx
                if 0 <= yy < h and 0 <= xx < w and mask[yy, xx] and not seen[yy, xx]:
                    seen[yy, xx] = True
                    stack.append((yy, xx))
    return n


def test_deterministic_per_seed_and_prefix_stable():
    a = generate_examples(12, 5)
    b = generate_examples(12, 5)
    c = generate_examples(5, 5)
    for x, y in zip(a, b):
        assert x.image.tobytes() == y.image.tobytes()
        assert (x.question, x.answer, x.kind) == (y.question, y.answer, y.kind)
    for x, y in zip(a, c):
        assert x.image.tobytes() == y.image.tobytes()


def test_heldout_seed_differs_from_train():
    train = generate_examples(20, TRAIN_SEED)
    held = generate_examples(20, HELDOUT_SEED)
    assert TRAIN_SEED != HELDOUT_SEED
    assert {x.image.tobytes() for x in train}.isdisjoint(x.image.tobytes() for x in held)


def test_sizes_kinds_and_choices():
    ex = generate_examples(60, 1, size=(56, 112))
    kinds = Counter(e.kind for e in ex)
    assert set(kinds) == set(KINDS)
    aspects = set()
    for e in ex:
        assert isinstance(e, VisionExample) and e.image.mode == "RGB"
        w, h = e.image.size
        assert 56 <= w <= 112 and 56 <= h <= 112
        aspects.add(round(w / h, 1))
        assert e.question and e.answer
        if e.kind in ("colour", "shape", "count"):
            assert e.answer in e.choices
        else:
            assert e.choices is None
    assert len(aspects) > 5
    only = generate_examples(10, 2, kinds=["shape"], size=(30, 40))
    assert all(e.kind == "shape" and 30 <= min(e.image.size) <= max(e.image.size) <= 40 for e in only)


def test_colour_caption_matches_pixels():
    for e in generate_examples(40, 3, kinds=["colour"]):
        a = np.asarray(e.image).astype(np.float64)
        fg = _foreground(e.image)
        assert fg.sum() > 0.02 * fg.size  # one clearly visible object
        mean = a[fg].mean(0)
        nearest = min(COLOURS, key=lambda c: np.square(np.subtract(COLOURS[c], mean)).sum())
        assert nearest == e.answer


def test_count_caption_matches_connected_components():
    ex = generate_examples(40, 4, kinds=["count"])
    assert {e.answer for e in ex} == set(COUNTS)
    for e in ex:
        assert _components(_foreground(e.image)) == int(e.answer)


def test_count_objects_share_one_size_on_the_patch_grid():
    # 56 x 56: a 4 x 4 grid of 14-px cells, one object per chosen cell, every object the same size,
    # so the count is the number of cells (patches) holding an object
    for e in generate_examples(30, 8, kinds=["count"], size=(56, 56)):
        fg = _foreground(e.image)
        cells = fg.reshape(4, 14, 4, 14).any((1, 3))
        assert cells.sum() == int(e.answer) == _components(fg)
        area = fg.sum() / int(e.answer)
        assert SHAPE_AREA_RANGE[0] < area < SHAPE_AREA_RANGE[1]


def test_single_shapes_are_large():
    for e in generate_examples(24, 9, kinds=["shape", "colour"], size=(56, 56)):
        ys, xs = np.nonzero(_foreground(e.image))
        assert max(ys.max() - ys.min(), xs.max() - xs.min()) + 1 >= 28  # at least 2 patches across


def test_shape_caption_single_object_and_all_shapes():
    ex = generate_examples(48, 6, kinds=["shape"])
    assert {e.answer for e in ex} == set(SHAPES)
    for e in ex:
        assert _components(_foreground(e.image)) == 1
    # circles fill ~pi/4 of their bounding box, squares ~all of it: the caption is in the pixels
    fill = {}
    for e in ex:
        fg = _foreground(e.image)
        ys, xs = np.nonzero(fg)
        box = (ys.max() - ys.min() + 1) * (xs.max() - xs.min() + 1)
        fill.setdefault(e.answer, []).append(fg.sum() / box)
    assert min(fill["square"]) > 0.9 and max(fill["circle"]) < 0.85


def test_plot_and_code_captions_are_code():
    for e in generate_examples(6, 7, kinds=["plot"]):
        assert e.answer.startswith("x = np.linspace(-3, 3, 100)\nplt.plot(x, ")
        assert _foreground(e.image).any()
    for e in generate_examples(6, 7, kinds=["code"]):
        lines = e.answer.splitlines()
        assert len(lines) == 3 and lines[-1].startswith("print(")
        ast.parse(e.answer)  # the snippet is valid Python
        assert (np.asarray(e.image).min(-1) < 100).any()  # dark glyphs were drawn


def test_messages_and_chance():
    e = generate_examples(1, 0, kinds=["colour"])[0]
    msgs = e.messages()
    assert msgs[0]["content"][0] == {"type": "image"} and msgs[1]["content"] == e.answer
    assert chance_level("colour") == 1 / len(COLOURS) and chance_level("count") == 1 / 6
    with pytest.raises(ValueError, match="kind"):
        chance_level("plot")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"n": -1, "seed": 0}, "n must"),
        ({"n": 1, "seed": -2}, "seed must"),
        ({"n": 1, "seed": 0, "size": (10, 20)}, "size must"),
        ({"n": 1, "seed": 0, "size": (90, 60)}, "size must"),
        ({"n": 1, "seed": 0, "kinds": ["video"]}, "kinds must"),
        ({"n": 1, "seed": 0, "kinds": ["shape"], "weights": [-1.0]}, "weights must"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        generate_examples(**kwargs)
