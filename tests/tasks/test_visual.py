"""The synthetic visual task: verl's multimodal layout, through the parquet path, refused for a text policy."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from conveyor.tasks import SYNTHETIC_TASKS, get_reward_fn
from conveyor.tasks.parquet import load_parquet_records, write_parquet_records
from conveyor.tasks.visual import (
    VISUAL_TEST_FRACTION,
    make_visual_count_records,
    make_visual_sum_records,
    visual_sum_split_size,
)


def test_records_are_in_verls_multimodal_layout_and_the_numbers_are_only_in_the_image() -> None:
    """`<image>` in the content, one {"bytes", "path"} struct per image, the sum as ground truth; splits share no
    pair of numbers, the test split holding about VISUAL_TEST_FRACTION of them."""
    train = SYNTHETIC_TASKS["visual_sum"](40, seed=1, max_operand=9, ops=["+"], split="train")
    test = make_visual_sum_records(5, seed=2, max_operand=9, split="test")
    rec = train[0]
    assert rec["prompt"] == [{"role": "user", "content": "<image>="}]
    (image,) = rec["images"]
    assert set(image) == {"bytes", "path"}
    assert Image.open(io.BytesIO(image["bytes"])).size == (56, 56)
    a, b = rec["extra_info"]["a"], rec["extra_info"]["b"]
    assert rec["reward_model"]["ground_truth"] == str(a + b)
    assert get_reward_fn(rec["data_source"])(str(a + b), str(a + b)) == 1.0
    pairs = lambda rs: {(r["extra_info"]["a"], r["extra_info"]["b"]) for r in rs}  # noqa: E731
    whole_test = make_visual_sum_records(visual_sum_split_size(9, "test"), seed=0, split="test")
    whole_train = make_visual_sum_records(visual_sum_split_size(9, "train"), seed=0, split="train")
    assert not pairs(whole_train) & pairs(whole_test)
    assert pairs(train) <= pairs(whole_train) and pairs(test) <= pairs(whole_test)
    assert len(pairs(whole_train) | pairs(whole_test)) == 100
    assert abs(len(whole_test) / 100 - VISUAL_TEST_FRACTION) < 0.1
    # Different numbers draw different pixels.
    assert len({r["images"][0]["bytes"] for r in whole_train}) == len(whole_train)
    with pytest.raises(ValueError, match="more distinct problems"):
        make_visual_sum_records(visual_sum_split_size(9, "train") + 1, seed=0, max_operand=9)


def test_count_records_hold_their_discs_and_the_splits_share_no_image() -> None:
    """Each image shows as many dark discs as its answer says, one per 14-pixel cell; no held-out image equals a
    training one; every count from 1 to max_operand is drawn; an impossible ask names the keys."""
    import numpy as np

    train = SYNTHETIC_TASKS["visual_count"](3000, seed=0, max_operand=9, ops=["+"], split="train")
    test = make_visual_count_records(100, seed=0, max_operand=9, split="test")
    for rec in train[:50] + test[:50]:
        assert rec["prompt"] == [{"role": "user", "content": "<image>="}]
        pixels = np.asarray(Image.open(io.BytesIO(rec["images"][0]["bytes"])).convert("L"))
        assert pixels.shape == (56, 56)
        # A cell is dark at its centre exactly where a disc was drawn.
        dark = {(r, c) for r in range(4) for c in range(4) if pixels[r * 14 + 7, c * 14 + 7] < 128}
        assert dark == {tuple(cell) for cell in rec["extra_info"]["cells"]}
        assert rec["reward_model"]["ground_truth"] == str(len(dark)) == str(rec["extra_info"]["count"])
    images = lambda rs: {r["images"][0]["bytes"] for r in rs}  # noqa: E731
    assert len(images(train)) == len(train) and not images(train) & images(test)
    assert {r["extra_info"]["count"] for r in train} == set(range(1, 10))
    with pytest.raises(ValueError, match="more distinct images"):
        make_visual_count_records(200, seed=0, max_operand=1)
    with pytest.raises(ValueError, match="max_operand is the largest count"):
        make_visual_count_records(4, seed=0, max_operand=99)
    for make in (make_visual_count_records, make_visual_sum_records):
        with pytest.raises(ValueError, match=r"leave data.synthetic.ops at \[\+\]"):
            make(4, seed=0, ops=["+", "*"])


def test_parquet_loads_images_for_a_vlm_and_refuses_them_for_a_text_policy(tmp_path) -> None:
    """The same file: a VLM policy gets the image bytes back; a text policy's load stops naming the column."""
    records = make_visual_sum_records(4, seed=0, max_operand=9)
    write_parquet_records(records, tmp_path / "v.parquet")
    back = load_parquet_records(tmp_path / "v.parquet", media=True)
    assert [r["images"][0]["bytes"] for r in back] == [r["images"][0]["bytes"] for r in records]
    with pytest.raises(ValueError, match=r"row 0: column 'images' holds images, but the policy is a text model"):
        load_parquet_records(tmp_path / "v.parquet")
