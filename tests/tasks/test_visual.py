"""The synthetic visual task: verl's multimodal layout, through the parquet path, refused for a text policy."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from conveyor.tasks import SYNTHETIC_TASKS, get_reward_fn
from conveyor.tasks.parquet import load_parquet_records, write_parquet_records
from conveyor.tasks.visual import make_visual_sum_records


def test_records_are_in_verls_multimodal_layout_and_the_numbers_are_only_in_the_image() -> None:
    """`<image>` in the content, one {"bytes", "path"} struct per image, the sum as ground truth; splits disjoint."""
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
    assert not pairs(train) & pairs(test)
    # Different numbers draw different pixels.
    assert len({r["images"][0]["bytes"] for r in train}) == len(train)
    with pytest.raises(ValueError, match="more distinct problems"):
        make_visual_sum_records(200, seed=0, max_operand=9)


def test_parquet_loads_images_for_a_vlm_and_refuses_them_for_a_text_policy(tmp_path) -> None:
    """The same file: a VLM policy gets the image bytes back; a text policy's load stops naming the column."""
    records = make_visual_sum_records(4, seed=0, max_operand=9)
    write_parquet_records(records, tmp_path / "v.parquet")
    back = load_parquet_records(tmp_path / "v.parquet", media=True)
    assert [r["images"][0]["bytes"] for r in back] == [r["images"][0]["bytes"] for r in records]
    with pytest.raises(ValueError, match=r"row 0: column 'images' holds images, but the policy is a text model"):
        load_parquet_records(tmp_path / "v.parquet")
