"""A synthetic visual task: two numbers drawn into an image, the answer their sum.

Each record is in verl's multimodal layout (what its geometry3k
preprocessing writes): the prompt's content holds `<image>` where the image
goes, and an `images` column holds one `{"bytes": PNG, "path": None}` struct.
The text says only `<image>=`: the numbers are in the pixels alone, so a
policy that ignores the image cannot do better than guess. The digits are
drawn with PIL's built-in bitmap font (no font files), black on white, on a
56 x 56 canvas: what the tiny VLMs' processors resize to anyway.

The answer is scored by the arithmetic task's reward (exact, or partial credit per digit) (its
`data_source` is `synthetic/arithmetic/visual`, under the longest registered
prefix `synthetic/arithmetic`). Train and test never share a pair of numbers
(`arithmetic_split`).

It deliberately does not tokenize nor process the images (stage 1 does, once
per sample: `conveyor.models.vision`).
"""

from __future__ import annotations

import io
import random
from collections.abc import Sequence

from conveyor.tasks.synthetic import ARITHMETIC_DATA_SOURCE, arithmetic_split

__all__ = ["VISUAL_DATA_SOURCE", "draw_numbers", "make_visual_sum_records"]

#: The `data_source` of every record: scored by the arithmetic task's reward.
VISUAL_DATA_SOURCE = f"{ARITHMETIC_DATA_SOURCE}/visual"

_SIDE = 56


def draw_numbers(a: int, b: int, side: int = _SIDE) -> bytes:
    """A PNG of `a` over `b`, black on white, `side` pixels square, scaled up from PIL's bitmap font."""
    from PIL import Image, ImageDraw

    small = Image.new("L", (side // 2, side // 2), 255)
    draw = ImageDraw.Draw(small)
    draw.text((2, 1), str(a), fill=0)
    draw.text((2, 14), str(b), fill=0)
    # The bitmap font is 11 pixels tall; doubled, each digit spans about two 14-pixel patches.
    image = small.resize((side, side), Image.NEAREST).convert("RGB")
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def make_visual_sum_records(
    n: int,
    *,
    seed: int,
    max_operand: int = 9,
    ops: Sequence[str] = ("+",),
    split: str = "train",
) -> list[dict]:
    """`n` distinct problems `a + b` (0 <= a, b <= `max_operand`) from `split`, each drawn into an image."""
    if list(ops) != ["+"] and tuple(ops) != ("+",):
        raise ValueError(f"the visual task draws sums only; set data.synthetic.ops=[+] (got {list(ops)})")
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    pool = [
        (a, b) for a in range(max_operand + 1) for b in range(max_operand + 1) if arithmetic_split(a, "+", b) == split
    ]
    if n > len(pool):
        raise ValueError(
            f"n={n} asks for more distinct problems than the {split} split holds ({len(pool)} with "
            f"max_operand={max_operand}); raise data.synthetic.max_operand or lower data.synthetic.num_train/num_val"
        )
    pairs = random.Random(seed).sample(pool, n)
    return [
        {
            "data_source": VISUAL_DATA_SOURCE,
            "prompt": [{"role": "user", "content": "<image>="}],
            "images": [{"bytes": draw_numbers(a, b), "path": None}],
            "ability": "visual_arithmetic",
            "reward_model": {"style": "rule", "ground_truth": str(a + b)},
            "extra_info": {"split": split, "index": i, "a": a, "b": b},
        }
        for i, (a, b) in enumerate(pairs)
    ]
