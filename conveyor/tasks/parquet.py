"""Prompt records from and to verl-style parquet files.

A file holds one row per prompt with the columns ``data_source`` (str),
``prompt`` (a list of ``{"role", "content"}`` chat messages),
``reward_model`` (a struct with at least ``ground_truth``) and, optionally,
``ability`` and ``extra_info``. Rows come back as the plain dicts the rest of
conveyor uses; other columns are passed through untouched.

Parquet stores a struct column with the union of the keys of all rows, so a
row whose ``extra_info`` lacked a key another row had reads back with that key
set to ``None``. A column of empty structs cannot be written at all; it is
left out on write and filled back in (``{}``) on load.

This module reads whole files into memory; it does not stream, shard or
shuffle (see ``dataset.PromptDataset``).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from typing import Union

import pyarrow as pa
import pyarrow.parquet as pq

__all__ = ["REQUIRED_COLUMNS", "OPTIONAL_COLUMNS", "MEDIA_COLUMNS", "load_parquet_records", "write_parquet_records"]

logger = logging.getLogger(__name__)

REQUIRED_COLUMNS: tuple[str, ...] = ("data_source", "prompt", "reward_model")
"""Columns every prompt file must have (`reward_model` must hold `ground_truth`)."""

OPTIONAL_COLUMNS: tuple[str, ...] = ("ability", "extra_info")
"""Columns that may be absent; a record then gets `ability=""` and `extra_info={}`."""

PathLike = Union[str, "os.PathLike[str]"]


def _as_path_list(paths: PathLike | Sequence[PathLike]) -> list[str]:
    if isinstance(paths, (str, os.PathLike)):
        return [os.fspath(paths)]
    out = list(paths)
    if not out:
        raise ValueError("paths is an empty list; give at least one parquet file")
    bad = [p for p in out if not isinstance(p, (str, os.PathLike))]
    if bad:
        raise ValueError(f"{bad[0]!r} is not a path; give parquet file paths")
    return [os.fspath(p) for p in out]


def _check_schema(path: str, schema: pa.Schema) -> None:
    present = list(schema.names)
    missing = [c for c in REQUIRED_COLUMNS if c not in present]
    if missing:
        raise ValueError(
            f"parquet file {path!r} lacks required column(s) {missing}; "
            f"it has columns {present} (required: {list(REQUIRED_COLUMNS)})"
        )
    rm_type = schema.field("reward_model").type
    if not pa.types.is_struct(rm_type) or rm_type.get_field_index("ground_truth") < 0:
        raise ValueError(
            f"parquet file {path!r}: column 'reward_model' must be a struct with a 'ground_truth' field, "
            f"got type {rm_type}"
        )


def _check_prompt(path: str, row: int, prompt: object) -> None:
    if not isinstance(prompt, list) or not all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt):
        raise ValueError(
            f"parquet file {path!r}, row {row}: 'prompt' must be a list of chat messages "
            f"({{'role': ..., 'content': ...}}), got {prompt!r:.200}"
        )
    where = f"parquet file {path!r}, row {row}"
    if not prompt:
        raise ValueError(f"{where}: 'prompt' is an empty list; every prompt needs at least one chat message")
    for j, message in enumerate(prompt):
        content, role = message["content"], message["role"]
        if not isinstance(content, str):
            # Multimodal parts or numbers would reach the model as their Python repr.
            raise ValueError(
                f"{where}: message {j} of 'prompt' has {type(content).__name__} content "
                f"{content!r:.100}, not text; conveyor trains on text prompts only"
            )
        if not isinstance(role, str) or not role:
            raise ValueError(f"{where}: message {j} of 'prompt' has role {role!r}; give a role such as 'user'")


def _check_row(path: str, row: int, rec: dict) -> None:
    """One row's prompt, data_source and ground truth are usable (a ValueError naming the file and row if not)."""
    _check_prompt(path, row, rec["prompt"])
    where = f"parquet file {path!r}, row {row}"
    source = rec["data_source"]
    if not isinstance(source, str) or not source:
        raise ValueError(
            f"{where}: 'data_source' is {source!r}; it must name the task (e.g. 'openai/gsm8k'), "
            "which chooses the reward function"
        )
    truth = rec["reward_model"].get("ground_truth") if isinstance(rec["reward_model"], dict) else None
    # A missing answer would be scored against the text "None" or "nan": every response wrong, silently.
    if truth is None or (isinstance(truth, float) and not math.isfinite(truth)):
        raise ValueError(
            f"{where}: reward_model.ground_truth is {'null' if truth is None else truth}; every "
            "prompt needs the answer its reward is computed from (drop the row or fill it in)"
        )


MEDIA_COLUMNS: tuple[str, ...] = ("images", "videos")
"""verl's multimodal columns: a text-only policy would train on the rows' text with the media silently gone."""


def _refuse_media(path: str, table: pa.Table) -> None:
    """Stop at load, naming the column and the first row, when a row carries images or videos for a text policy."""
    for name in MEDIA_COLUMNS:
        if name not in table.column_names:
            continue
        for row, value in enumerate(table.column(name).to_pylist()):
            if value:  # null, [] and "" carry no media: the row is text
                raise ValueError(
                    f"parquet file {path!r}, row {row}: column {name!r} holds {name}, but the policy is a text "
                    f"model: its {name} would be dropped and their placeholders (such as '<image>') read as text; "
                    f"drop the {name!r} column (or those rows) to train on the text alone"
                )


def _read_one(path: str, media: bool = False) -> list[dict]:
    if not os.path.exists(path):
        raise ValueError(f"parquet file {path!r} does not exist")
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"could not read parquet file {path!r}: {e}") from e
    _check_schema(path, table.schema)
    if not media:
        _refuse_media(path, table)
    records = table.to_pylist()
    for i, rec in enumerate(records):
        _check_row(path, i, rec)
        if rec.get("ability") is None:
            rec["ability"] = ""
        if rec.get("extra_info") is None:
            rec["extra_info"] = {}
    return records


def load_parquet_records(paths: PathLike | Sequence[PathLike], *, media: bool = False) -> list[dict]:
    """All rows of one or more verl-style parquet files, in file order, as prompt-record dicts.

    Raises `ValueError` naming the file when a file is missing or unreadable,
    lacks a required column (the message lists the columns it has), or holds
    no rows; and naming the row too when its `prompt` is not a non-empty list
    of chat messages with text content, its `data_source` is not a name, its
    `reward_model.ground_truth` is null or NaN, or it carries images or videos
    (`MEDIA_COLUMNS`) the text policy could not see. `media`: the policy sees images (a vision-language
    model): rows with an `images` column load as they are.
    """
    path_list = _as_path_list(paths)
    records: list[dict] = []
    empty: list[str] = []
    for path in path_list:
        rows = _read_one(path, media)
        if not rows:
            empty.append(path)
        records.extend(rows)
    # An empty file is almost always a broken preprocessing step, so it is an
    # error even when other files hold rows.
    if empty:
        raise ValueError(f"parquet file(s) {empty} hold no rows; a prompt dataset must not be empty")
    logger.info("loaded %d prompt records from %d parquet file(s)", len(records), len(path_list))
    return records


def _check_record(i: int, rec: object) -> None:
    if not isinstance(rec, dict):
        raise ValueError(f"records[{i}] must be a dict, got {type(rec).__name__}")
    missing = [c for c in REQUIRED_COLUMNS if c not in rec]
    if missing:
        raise ValueError(f"records[{i}] lacks required key(s) {missing}; it has keys {sorted(rec)}")
    if not isinstance(rec["reward_model"], dict) or "ground_truth" not in rec["reward_model"]:
        raise ValueError(f"records[{i}]['reward_model'] must be a dict with a 'ground_truth' key")


def write_parquet_records(records: Sequence[dict], path: PathLike) -> None:
    """Write prompt records to one parquet file readable by `load_parquet_records` (and by verl)."""
    records = list(records)
    if not records:
        raise ValueError("records is empty; a prompt file with no rows could not be loaded back")
    for i, rec in enumerate(records):
        _check_record(i, rec)
    try:
        table = pa.Table.from_pylist(records)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        # Usually one key holds values of different types in different records.
        raise ValueError(f"records cannot be stored as one parquet table: {e}") from e
    # Parquet cannot store a struct with no fields (every row had `{}`). For
    # extra_info, dropping the column loses nothing: loading fills `{}` back in.
    for name in list(table.column_names):
        typ = table.schema.field(name).type
        if pa.types.is_struct(typ) and typ.num_fields == 0:
            if name != "extra_info":
                raise ValueError(
                    f"key {name!r} is an empty dict in every record; parquet cannot store a struct with no fields"
                )
            table = table.drop_columns([name])
    path = os.fspath(path)
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    pq.write_table(table, path)
