"""The embedded, in-process data plane: the default backend.

Columns are kept as the tensors the writer handed over (no serialization, no
copy on put); a get indexes them, which is the only copy made. Writers must not
modify a tensor in place after putting it. It deliberately has no eviction and
no persistence: a partition lives until `kv_clear` or `close`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDict

from conveyor.data_plane.base import (
    DENSE,
    NESTED,
    Column,
    DataPlane,
    FieldNotFoundError,
    columns_tensordict,
    empty_column,
)
from conveyor.data_plane.prometheus import DataPlaneMetrics
from conveyor.data_plane.schema import dtype_of, incompatibility

__all__ = ["MemoryDataPlane"]

_ROW_BITS = 40  # rows per put block < 2**40
_ROW_MASK = (1 << _ROW_BITS) - 1


@dataclass
class _Column:
    """One field of one partition: dense blocks indexed by (block, row), or per-key Python objects."""

    record: dict  # kind, dtype name, row shape (schema.py)
    # dense: the tensors as put, and key -> block index << _ROW_BITS | row.
    # One int per key rather than a (block, row) tuple: ints are not tracked by
    # the garbage collector, tuples are, and 10k keys x 20 fields of tuples
    # made full collections (hundreds of ms) fire inside puts.
    blocks: list[torch.Tensor] = field(default_factory=list)
    loc: dict[str, int] = field(default_factory=dict)
    # nested / list: key -> per-sample value (a tensor view for nested)
    values: dict[str, Any] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return self.record["kind"]

    @property
    def dtype(self) -> torch.dtype | None:
        return dtype_of(self.record["dtype"])

    @property
    def trailing(self) -> tuple | None:
        return self.record["trailing"]

    def __len__(self) -> int:
        return len(self.loc if self.kind == DENSE else self.values)

    def __contains__(self, key: str) -> bool:
        return key in (self.loc if self.kind == DENSE else self.values)

    def has_all(self, keys: Sequence[str]) -> bool:
        # map/all keep the per-key loop in C: puts and gets of 10k keys x 20
        # fields spend most of their time in these membership checks otherwise.
        return all(map((self.loc if self.kind == DENSE else self.values).__contains__, keys))

    def drop(self, key: str) -> None:
        (self.loc if self.kind == DENSE else self.values).pop(key, None)

    def compact(self) -> None:
        # Release blocks no key points at any more, so cleared data is freed.
        if self.kind != DENSE or not self.blocks:
            return
        used = {v >> _ROW_BITS for v in self.loc.values()}
        for i in range(len(self.blocks)):
            if i not in used:
                self.blocks[i] = None  # type: ignore[call-overload]


@dataclass
class _Partition:
    keys: dict[str, None] = field(default_factory=dict)  # insertion-ordered set
    tags: dict[str, dict] = field(default_factory=dict)
    columns: dict[str, _Column] = field(default_factory=dict)


class MemoryDataPlane(DataPlane):
    """In-process, thread-safe key-value sample store (backend `memory`)."""

    backend = "memory"

    def __init__(self, metrics: DataPlaneMetrics | None = None):
        self._partitions: dict[str, _Partition] = {}
        self._lock = threading.RLock()
        self.metrics = metrics
        self._closed = False

    # -- writes ---------------------------------------------------------
    def _put(
        self, keys: list[str], partition_id: str, columns: list[Column], tags: Sequence[dict] | None
    ) -> tuple[list[str], list[dict], int]:
        n = len(keys)
        with self._lock:
            part = self._partitions.get(partition_id)
            if part is not None:
                # Checked before anything is written, so a refused put leaves no partial rows behind.
                stored = {c.name: part.columns[c.name].record for c in columns if c.name in part.columns}
                why = incompatibility(partition_id, stored, {c.name: c.record for c in columns})
                if why:
                    raise ValueError(why)
            part = self._partitions.setdefault(partition_id, _Partition())
            part.keys.update(dict.fromkeys(keys))  # existing keys keep their place
            if tags is not None:
                for k, t in zip(keys, tags):
                    part.tags[k] = dict(t)
            for name, kind, rows, record in columns:
                col = part.columns.get(name)
                if col is None:
                    col = part.columns[name] = _Column(record)
                if kind == DENSE:
                    b = len(col.blocks)
                    col.blocks.append(rows)
                    col.loc.update(zip(keys, range(b << _ROW_BITS, (b << _ROW_BITS) + n)))
                else:
                    col.values.update(zip(keys, rows))
            # A column holds a subset of the partition's keys: one as long as the partition holds all of them,
            # the keys just put included, without a look-up per key (the common case: a stage's fields).
            present = [f for f, c in part.columns.items() if len(c) == len(part.keys) or c.has_all(keys)]
            out_tags = [dict(part.tags.get(k, {})) for k in keys]
            return present, out_tags, len(part.keys)

    # -- reads ----------------------------------------------------------
    def _get(self, keys: list[str], partition_id: str, select_fields: list[str]) -> TensorDict:
        return columns_tensordict(len(keys), self._get_columns(keys, partition_id, select_fields))

    def _get_columns(self, keys: list[str], partition_id: str, select_fields: list[str]) -> dict[str, Any]:
        with self._lock:
            part = self._partitions.get(partition_id)
            if part is None:
                raise FieldNotFoundError(partition_id, fields=select_fields, keys=keys)
            missing_keys = [k for k in keys if k not in part.keys]
            if missing_keys:
                raise FieldNotFoundError(partition_id, keys=missing_keys)
            missing_fields = [f for f in select_fields if f not in part.columns]
            if missing_fields:
                raise FieldNotFoundError(partition_id, fields=missing_fields)
            plan = []
            for name in select_fields:
                col = part.columns[name]
                if not col.has_all(keys):
                    lacking = [k for k in keys if k not in col]
                    raise FieldNotFoundError(partition_id, fields=[name], keys=lacking)
                if col.kind == DENSE:
                    plan.append((name, col.kind, list(map(col.loc.__getitem__, keys)), list(col.blocks), col))
                else:
                    plan.append((name, col.kind, list(map(col.values.__getitem__, keys)), None, col))
        # Indexing happens outside the lock: the references taken above stay
        # valid even if another thread clears the partition meanwhile.
        out: dict[str, Any] = {}
        for name, kind, rows, blocks, col in plan:
            if not rows:
                value = empty_column(col.record) if kind in (DENSE, NESTED) else []
            elif kind == DENSE:
                value = _gather_dense(rows, blocks, col)
            elif kind == NESTED:
                # as_nested_tensor copies the rows into one new buffer: that is the only copy.
                value = torch.nested.as_nested_tensor(rows, layout=torch.jagged)
            else:
                value = rows  # a list column: the TensorDict form is built by `_get` only
            out[name] = value
        return out

    def kv_list(self, partition_id: str) -> list[str]:
        """Keys of the partition in first-written order."""
        with self._lock:
            part = self._partitions.get(partition_id)
            return list(part.keys) if part else []

    def list_partitions(self) -> list[str]:
        """Names of the partitions that hold data."""
        with self._lock:
            return list(self._partitions)

    def kv_clear(self, partition_id: str, keys: Iterable[str] | None = None) -> None:
        """Drop keys (or the whole partition) and free what only they referenced."""
        with self._lock:
            part = self._partitions.get(partition_id)
            if part is None:
                return
            if keys is None:
                del self._partitions[partition_id]
                live = 0
            else:
                for k in keys:
                    k = str(k)
                    part.keys.pop(k, None)
                    part.tags.pop(k, None)
                    for col in part.columns.values():
                        col.drop(k)
                for col in part.columns.values():
                    col.compact()
                live = len(part.keys)
                if not live:
                    del self._partitions[partition_id]
        if self.metrics:
            self.metrics.set_live(partition_id, live)

    def _release(self) -> None:
        with self._lock:
            self._partitions.clear()


def _gather_dense(locs: list[int], blocks: list[torch.Tensor], col: _Column) -> torch.Tensor:
    """Index rows out of the blocks they were put in (locs as in `_Column.loc`, at least one), one index_select per
    block."""
    first_block = locs[0] >> _ROW_BITS
    lo, hi = first_block << _ROW_BITS, (first_block + 1) << _ROW_BITS
    if lo <= min(locs) and max(locs) < hi:
        src = blocks[first_block]
        row_ids = [v - lo for v in locs]
        # Reading back a whole block in put order is the common case: one
        # clone, which skips index_select's per-call thread-pool overhead.
        if len(row_ids) == src.shape[0] and row_ids == list(range(len(row_ids))):
            return src.clone(memory_format=torch.contiguous_format)  # contiguous, as index_select gives
        return src.index_select(0, torch.tensor(row_ids, dtype=torch.long))
    out = torch.empty((len(locs), *col.trailing), dtype=col.dtype, device=blocks[first_block].device)
    by_block: dict[int, tuple[list[int], list[int]]] = {}
    for pos, v in enumerate(locs):
        b, r = v >> _ROW_BITS, v & _ROW_MASK
        dst, src_rows = by_block.setdefault(b, ([], []))
        dst.append(pos)
        src_rows.append(r)
    for b, (dst, src_rows) in by_block.items():
        out.index_copy_(0, torch.tensor(dst), blocks[b].index_select(0, torch.tensor(src_rows)))
    return out
