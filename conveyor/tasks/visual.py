"""A synthetic visual task: two numbers drawn into an image, the answer their sum.

Each record is in verl's multimodal layout (what its geometry3k
preprocessing writes): the prompt's content holds `<image>` where the image
goes, and an `images` column holds one `{"bytes": PNG, "path": None}` struct.
The text says only `<image>=`: the numbers are in the pixels alone, so a
policy that ignores the image cannot do better than guess. The digits are
drawn with Pillow's built-in scalable font (no font files), black on white,
on a 56 x 56 canvas (what the tiny VLMs' processors resize to anyway), each
number in its own quarter of the image.

The answer is scored by the arithmetic task's reward (exact, or partial credit per digit) (its
`data_source` is `synthetic/arithmetic/visual`, under the longest registered
prefix `synthetic/arithmetic`). Train and test never share a pair of numbers:
`VISUAL_TEST_FRACTION` (0.3) of the pairs are held out, fixed by hashing the
pair, so that with operands up to 9 a held-out accuracy is measured on 33
problems, where the arithmetic task's 0.1 would leave 9.

It deliberately does not tokenize nor process the images (stage 1 does, once
per sample: `conveyor.models.vision`).
"""

from __future__ import annotations

import io
import random
from collections.abc import Sequence

from conveyor.tasks.synthetic import ARITHMETIC_DATA_SOURCE, split_of

__all__ = [
    "COUNT_GRID",
    "VISUAL_DATA_SOURCE",
    "VISUAL_TEST_FRACTION",
    "draw_discs",
    "make_visual_count_records",
    "draw_numbers",
    "make_visual_sum_records",
    "visual_sum_split_size",
]

#: The `data_source` of every record: scored by the arithmetic task's reward.
VISUAL_DATA_SOURCE = f"{ARITHMETIC_DATA_SOURCE}/visual"

_SIDE = 56


def _png(image: object) -> bytes:
    """The PNG bytes of a Pillow image, as RGB (what the image processors expect)."""
    buf = io.BytesIO()
    image.convert("RGB").save(buf, format="PNG")  # type: ignore[attr-defined]
    return buf.getvalue()


def _record(png: bytes, answer: int, ability: str, extra_info: dict) -> dict:
    """One record in verl's multimodal layout: the image where `<image>` stands, `answer` its ground truth."""
    return {
        "data_source": VISUAL_DATA_SOURCE,
        "prompt": [{"role": "user", "content": "<image>="}],
        "images": [{"bytes": png, "path": None}],
        "ability": ability,
        "reward_model": {"style": "rule", "ground_truth": str(answer)},
        "extra_info": extra_info,
    }


#: The share of (a, b) pairs held out for testing.
VISUAL_TEST_FRACTION = 0.3


def draw_numbers(a: int, b: int, side: int = _SIDE) -> bytes:
    """A PNG of `a` over `b`, black on white, `side` pixels square, in Pillow's built-in scalable font."""
    from PIL import Image, ImageDraw, ImageFont

    # Each number fills about a quarter of the image, the 2 x 2 patches that one image token merges, in strokes a few
    # pixels wide: thin 11-pixel bitmap digits left a tiny VLM's warm start on its plateau for thousands of steps.
    font = ImageFont.load_default(size=side * 13 // 28)
    image = Image.new("L", (side, side), 255)
    draw = ImageDraw.Draw(image)
    for number, top in ((a, -(side // 11)), (b, side // 2 - side // 11)):
        draw.text((side // 11, top), str(number), font=font, fill=0, stroke_width=1, stroke_fill=0)
    return _png(image)


def _pool(max_operand: int, split: str) -> list[tuple[int, int]]:
    """Every (a, b) problem of `split`."""
    side = range(max_operand + 1)
    return [(a, b) for a in side for b in side if split_of(f"{a}+{b}", VISUAL_TEST_FRACTION) == split]


def _check_call(ops: Sequence[str], split: str, why_plus: str) -> None:
    """Refuse operators other than the default "+" (`why_plus` says why) and an unknown split."""
    if list(ops) != ["+"]:
        raise ValueError(f"{why_plus}; leave data.synthetic.ops at [+] (got {list(ops)})")
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")


def visual_sum_split_size(max_operand: int, split: str) -> int:
    """How many distinct problems `split` holds with operands up to `max_operand`."""
    return len(_pool(max_operand, split))


def make_visual_sum_records(
    n: int,
    *,
    seed: int,
    max_operand: int = 9,
    ops: Sequence[str] = ("+",),
    split: str = "train",
) -> list[dict]:
    """`n` distinct problems `a + b` (0 <= a, b <= `max_operand`) from `split`, each an image."""
    _check_call(ops, split, "the visual sum task draws sums only")
    pool = _pool(max_operand, split)
    if n > len(pool):
        raise ValueError(
            f"n={n} asks for more distinct problems than the {split} split holds ({len(pool)} with "
            f"max_operand={max_operand}); raise data.synthetic.max_operand or lower data.synthetic.num_train/num_val"
        )
    problems = random.Random(seed).sample(pool, n)
    return [
        _record(draw_numbers(a, b), a + b, "visual_arithmetic", {"split": split, "index": i, "a": a, "b": b})
        for i, (a, b) in enumerate(problems)
    ]


#: The grid the counting task places its discs on: one cell per 14-pixel patch of the 56-pixel image.
COUNT_GRID = 4


def draw_discs(cells: Sequence[tuple[int, int]], side: int = _SIDE) -> bytes:
    """A PNG of black discs on white, `side` pixels square, one in each (row, column) cell of a `COUNT_GRID` grid."""
    from PIL import Image, ImageDraw

    image = Image.new("L", (side, side), 255)
    draw = ImageDraw.Draw(image)
    cell = side // COUNT_GRID
    margin = max(1, cell // 5)
    for row, col in cells:
        x, y = col * cell + margin, row * cell + margin
        draw.ellipse((x, y, x + cell - 2 * margin, y + cell - 2 * margin), fill=0)
    return _png(image)


def make_visual_count_records(
    n: int,
    *,
    seed: int,
    max_operand: int = 9,
    ops: Sequence[str] = ("+",),
    split: str = "train",
) -> list[dict]:
    """`n` distinct images of 1 to `max_operand` discs on a 4 x 4 grid from `split`, the answer their count.

    The count is drawn uniformly, then the cells; an arrangement belongs to one split, fixed by hashing its cells
    (the arithmetic task's 0.1 held out), so a held-out image is one no training image equals."""
    _check_call(ops, split, "the visual count task has no operators")
    if not 1 <= max_operand <= COUNT_GRID**2:
        raise ValueError(
            f"data.synthetic.max_operand is the largest count of the visual count task: 1 to {COUNT_GRID**2} "
            f"(got {max_operand})"
        )
    rng = random.Random(seed)
    grid = [(r, c) for r in range(COUNT_GRID) for c in range(COUNT_GRID)]
    seen: set[tuple[tuple[int, int], ...]] = set()
    records: list[dict] = []
    misses = 0
    while len(records) < n:
        count = rng.randint(1, max_operand)
        cells = tuple(sorted(rng.sample(grid, count)))
        if cells in seen or split_of(f"discs{cells}") != split:
            misses += 1
            # A miss streak this long means the split is (nearly) used up, not bad luck.
            if misses > 1000 + 100 * n:
                raise ValueError(
                    f"n={n} asks for more distinct images than the {split} split of the visual count task yields "
                    f"with max_operand={max_operand}; raise data.synthetic.max_operand or lower "
                    "data.synthetic.num_train/num_val"
                )
            continue
        seen.add(cells)
        extra = {"split": split, "index": len(records), "count": count, "cells": [list(c) for c in cells]}
        records.append(_record(draw_discs(cells), count, "visual_count", extra))
    return records
