"""Field records and the one rule every data-plane backend applies to a put.

Each (partition, field) has a record: its kind (`dense`, `nested` or `list`)
and, for tensor columns, the dtype name and the row shape after the batch
dimension (for a ragged field, after the ragged dimension). The first put of
a field writes its record, which then holds while the partition holds data.
A record is a plain dict ``{"kind", "dtype", "trailing"}`` (dtype and shape
``None`` for a list column), because the backends keep records in places that
hold only plain data (Ray actors, the TransferQueue controller's msgpack tags).

The rule, `incompatibility`, uses no torch: the `ray` backend ships it by value
to its storage actors, which never import torch or conveyor. This module
deliberately stores nothing; each backend keeps the records next to its data.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["DENSE", "NESTED", "LIST", "dtype_name", "dtype_of", "record_of", "incompatibility"]

# How a column given to kv_batch_put is stored and returned: a dense (B, ...)
# tensor, a jagged nested tensor (rows of different lengths), or a list of
# per-sample values (Python objects or tensors of any shapes).
DENSE, NESTED, LIST = "dense", "nested", "list"

_REMEDY = (
    ". A field keeps its kind, dtype and row shape while its partition holds data: "
    "clear the partition (kv_clear) or write the new values under a new field name"
)


def dtype_name(dtype: torch.dtype) -> str:
    """The name a dtype is recorded and sent under: 'float32' for torch.float32."""
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str | None) -> torch.dtype | None:
    """The dtype a name from `dtype_name` stands for (None for None)."""
    return None if name is None else getattr(torch, name)


def record_of(kind: str, rows: Any) -> dict:
    """The record of a column classified by `column_kind` (rows: a (B, ...) tensor or a list of rows)."""
    if kind == DENSE:
        return {"kind": kind, "dtype": dtype_name(rows.dtype), "trailing": tuple(rows.shape[1:])}
    if kind == NESTED and rows:
        return {"kind": kind, "dtype": dtype_name(rows[0].dtype), "trailing": tuple(rows[0].shape[1:])}
    return {"kind": kind, "dtype": None, "trailing": None}


def _shape(record: Mapping) -> str:
    trailing = tuple(record["trailing"])
    if record["kind"] == NESTED:  # '*' stands for the ragged dimension
        return "(" + ", ".join(["*", *map(str, trailing)]) + ")"
    return str(trailing)


def incompatibility(partition_id: str, stored: Mapping[str, Mapping], new: Mapping[str, Mapping]) -> str | None:
    """Why the partition's records `stored` refuse a put of records `new` (by field name), or None to allow it.

    A field keeps its kind; a tensor field keeps its dtype and row shape.
    `stored` may map to mappings with more keys than a record (they are ignored).
    """
    for name, rec in new.items():
        old = stored.get(name)
        if old is None:
            continue
        if old["kind"] != rec["kind"]:
            return (
                f"field {name!r} in partition {partition_id!r} was stored as {old['kind']}; "
                f"this put gives {rec['kind']}{_REMEDY}"
            )
        if rec["kind"] == LIST:
            continue  # any values
        if (old["dtype"], tuple(old["trailing"])) != (rec["dtype"], tuple(rec["trailing"])):
            rows = "ragged rows" if rec["kind"] == NESTED else "rows"
            return (
                f"field {name!r} in partition {partition_id!r} holds {rows} of shape {_shape(old)} and dtype "
                f"{old['dtype']}; this put gives {_shape(rec)} {rec['dtype']}{_REMEDY}"
            )
    return None
