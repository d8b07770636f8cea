"""Tests for reading and writing verl-style parquet prompt files."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conveyor.tasks.parquet import load_parquet_records, write_parquet_records
from conveyor.tasks.synthetic import make_arithmetic_records


def _gsm8k_like(i: int) -> dict:
    return {
        "data_source": "openai/gsm8k",
        "prompt": [
            {"role": "system", "content": "Answer after ####."},
            {"role": "user", "content": f"What is {i} plus {i}?"},
        ],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
        "extra_info": {"split": "train", "index": i, "answer": f"{i}+{i}={2 * i} #### {2 * i}"},
    }


def test_round_trip_with_nested_structs(tmp_path: Path) -> None:
    records = [_gsm8k_like(i) for i in range(7)]
    path = tmp_path / "train.parquet"
    write_parquet_records(records, path)
    # The file has the nested layout verl expects: prompt is a list of structs, reward_model a struct.
    schema = pq.read_schema(path)
    assert pa.types.is_list(schema.field("prompt").type)
    assert pa.types.is_struct(schema.field("prompt").type.value_type)
    assert pa.types.is_struct(schema.field("reward_model").type)
    assert load_parquet_records(str(path)) == records


def test_round_trip_synthetic_records(tmp_path: Path) -> None:
    records = make_arithmetic_records(40, seed=0, ops=("+", "*"))
    path = tmp_path / "sub" / "arith.parquet"
    write_parquet_records(records, path)
    assert load_parquet_records(path) == records


def test_multiple_files_concatenate_in_order(tmp_path: Path) -> None:
    a = [_gsm8k_like(i) for i in range(3)]
    b = [_gsm8k_like(i) for i in range(10, 12)]
    write_parquet_records(a, tmp_path / "a.parquet")
    write_parquet_records(b, tmp_path / "b.parquet")
    got = load_parquet_records([str(tmp_path / "b.parquet"), str(tmp_path / "a.parquet")])
    assert got == b + a


def test_extra_info_keys_union_and_empty(tmp_path: Path) -> None:
    recs = [_gsm8k_like(0), _gsm8k_like(1)]
    recs[0]["extra_info"] = {"x": 1}
    recs[1]["extra_info"] = {"y": "s"}
    write_parquet_records(recs, tmp_path / "u.parquet")
    got = load_parquet_records(tmp_path / "u.parquet")
    # Parquet stores the union of keys; a key a row lacked comes back as None.
    assert [r["extra_info"] for r in got] == [{"x": 1, "y": None}, {"x": None, "y": "s"}]

    for r in recs:
        r["extra_info"] = {}
    write_parquet_records(recs, tmp_path / "e.parquet")
    assert "extra_info" not in pq.read_schema(tmp_path / "e.parquet").names
    assert [r["extra_info"] for r in load_parquet_records(tmp_path / "e.parquet")] == [{}, {}]


def test_optional_columns_get_defaults_and_extra_columns_pass_through(tmp_path: Path) -> None:
    table = pa.Table.from_pylist(
        [
            {
                "data_source": "gsm8k",
                "prompt": [{"role": "user", "content": "2+2?"}],
                "reward_model": {"ground_truth": "4"},
                "question": "2+2?",
            }
        ]
    )
    pq.write_table(table, tmp_path / "min.parquet")
    (rec,) = load_parquet_records(tmp_path / "min.parquet")
    assert rec == {
        "data_source": "gsm8k",
        "prompt": [{"role": "user", "content": "2+2?"}],
        "reward_model": {"ground_truth": "4"},
        "question": "2+2?",
        "ability": "",
        "extra_info": {},
    }


def test_missing_required_column_names_file_column_and_present_columns(tmp_path: Path) -> None:
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([{"data_source": "gsm8k", "question": "q", "ability": "math"}]), path)
    with pytest.raises(ValueError) as info:
        load_parquet_records(str(path))
    msg = str(info.value)
    assert str(path) in msg
    assert "['prompt', 'reward_model']" in msg
    assert "['data_source', 'question', 'ability']" in msg


def test_reward_model_without_ground_truth(tmp_path: Path) -> None:
    path = tmp_path / "nogt.parquet"
    pq.write_table(
        pa.Table.from_pylist(
            [{"data_source": "d", "prompt": [{"role": "user", "content": "x"}], "reward_model": {"style": "rule"}}]
        ),
        path,
    )
    with pytest.raises(ValueError, match=r"nogt\.parquet.*'reward_model'.*'ground_truth'"):
        load_parquet_records(path)


def test_empty_file_is_named(tmp_path: Path) -> None:
    full = tmp_path / "full.parquet"
    write_parquet_records([_gsm8k_like(0)], full)
    empty = tmp_path / "empty.parquet"
    pq.write_table(pq.read_table(full).slice(0, 0), empty)
    with pytest.raises(ValueError) as info:
        load_parquet_records([str(full), str(empty)])
    msg = str(info.value)
    assert str(empty) in msg and "no rows" in msg
    assert str(full) not in msg
    with pytest.raises(ValueError, match="empty.parquet.*no rows"):
        load_parquet_records(str(empty))


def test_missing_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "nope" / "train.parquet"
    with pytest.raises(ValueError) as info:
        load_parquet_records([str(path)])
    assert str(path) in str(info.value) and "does not exist" in str(info.value)


def test_not_a_parquet_file(tmp_path: Path) -> None:
    path = tmp_path / "notes.parquet"
    path.write_text("not parquet at all")
    with pytest.raises(ValueError, match=r"could not read parquet file .*notes\.parquet"):
        load_parquet_records(path)


def test_prompt_must_be_chat_messages(tmp_path: Path) -> None:
    path = tmp_path / "str_prompt.parquet"
    pq.write_table(
        pa.Table.from_pylist(
            [{"data_source": "d", "prompt": [{"role": "user", "content": "ok"}], "reward_model": {"ground_truth": "1"}}]
        ),
        tmp_path / "ok.parquet",
    )
    pq.write_table(
        pa.Table.from_pylist([{"data_source": "d", "prompt": "What is 1+1?", "reward_model": {"ground_truth": "2"}}]),
        path,
    )
    assert len(load_parquet_records(tmp_path / "ok.parquet")) == 1
    with pytest.raises(ValueError, match=r"str_prompt\.parquet.*row 0.*'prompt' must be a list of chat messages"):
        load_parquet_records(path)


@pytest.mark.parametrize(
    "row, message",
    [
        ({"reward_model": {"ground_truth": None}}, r"row 1: reward_model\.ground_truth is null"),
        ({"reward_model": {"ground_truth": float("nan")}}, r"row 1: reward_model\.ground_truth is nan"),
        ({"prompt": []}, r"row 1: 'prompt' is an empty list"),
        ({"prompt": [{"role": "user", "content": None}]}, r"row 1: message 0 of 'prompt' has NoneType content"),
        ({"prompt": [{"role": None, "content": "hi"}]}, r"row 1: message 0 of 'prompt' has role None"),
        ({"data_source": None}, r"row 1: 'data_source' is None"),
        ({"data_source": ""}, r"row 1: 'data_source' is ''"),
    ],
)
def test_a_row_with_a_hole_is_named_by_file_and_row(tmp_path: Path, row: dict, message: str) -> None:
    truth = 2.0 if isinstance(row.get("reward_model", {}).get("ground_truth"), float) else "2"  # one column type
    good = {
        "data_source": "d",
        "prompt": [{"role": "user", "content": "1+1="}],
        "reward_model": {"ground_truth": truth},
    }
    pq.write_table(pa.Table.from_pylist([good, {**good, **row}]), tmp_path / "holes.parquet")
    with pytest.raises(ValueError, match=r"holes\.parquet', " + message):
        load_parquet_records(tmp_path / "holes.parquet")


def test_a_non_path_entry_is_refused() -> None:
    with pytest.raises(ValueError, match="None is not a path"):
        load_parquet_records([None])  # type: ignore[list-item]


def test_empty_path_list() -> None:
    with pytest.raises(ValueError, match="empty list"):
        load_parquet_records([])


def test_write_rejects_bad_records(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="records is empty"):
        write_parquet_records([], tmp_path / "x.parquet")
    bad = _gsm8k_like(0)
    del bad["prompt"]
    with pytest.raises(ValueError, match=r"records\[1\] lacks required key\(s\) \['prompt'\]"):
        write_parquet_records([_gsm8k_like(1), bad], tmp_path / "x.parquet")
    bad = _gsm8k_like(0)
    bad["reward_model"] = {"style": "rule"}
    with pytest.raises(ValueError, match=r"records\[0\]\['reward_model'\].*'ground_truth'"):
        write_parquet_records([bad], tmp_path / "x.parquet")
    mixed = [_gsm8k_like(0), _gsm8k_like(1)]
    mixed[1]["extra_info"]["index"] = "one"
    with pytest.raises(ValueError, match="cannot be stored as one parquet table"):
        write_parquet_records(mixed, tmp_path / "x.parquet")
    assert not (tmp_path / "x.parquet").exists()


def test_rows_with_images_or_videos_are_refused_for_a_text_policy_and_empty_media_columns_load(tmp_path):
    """verl's multimodal columns: a row carrying media stops the load naming it; null or empty lists are text."""
    from conveyor.tasks.parquet import MEDIA_COLUMNS

    records = make_arithmetic_records(3, seed=0, max_operand=9, split="train")
    image = pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    for column in MEDIA_COLUMNS:
        text_only = pa.Table.from_pylist(records).append_column(column, pa.array([None, [], None], image))
        pq.write_table(text_only, tmp_path / "text.parquet")
        assert len(load_parquet_records(tmp_path / "text.parquet")) == 3
        media = text_only.set_column(
            text_only.column_names.index(column), column, pa.array([[], None, [{"bytes": b"x", "path": "p"}]], image)
        )
        pq.write_table(media, tmp_path / "media.parquet")
        with pytest.raises(ValueError, match=rf"media.parquet'.*row 2: column '{column}' holds {column}"):
            load_parquet_records(tmp_path / "media.parquet")
