"""The embedded, in-process data plane: the default backend.

Columns are kept as the tensors the writer handed over (no serialization, no
copy on put); a get indexes them, which is the only copy made. Writers must not
modify a tensor in place after putting it. It deliberately has no eviction and
no persistence: a partition lives until `kv_clear` or `close`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch
from tensordict import NonTensorStack, TensorDict

from conveyor.data_plane.base import DENSE, NESTED, DataPlane, FieldNotFoundError, prepare_put
from conveyor.data_plane.prometheus import DataPlaneMetrics
from conveyor.protocol import KVBatchMeta

__all__ = ["MemoryDataPlane"]

_ROW_BITS = 40  # rows per put block < 2**40
_ROW_MASK = (1 << _ROW_BITS) - 1


@dataclass
class _Column:
    """One field of one partition: dense blocks indexed by (block, row), or per-key Python objects."""

    kind: str
    # dense: the tensors as put, and key -> block index << _ROW_BITS | row.
    # One int per key rather than a (block, row) tuple: ints are not tracked by
    # the garbage collector, tuples are, and 10k keys x 20 fields of tuples
    # made full collections (hundreds of ms) fire inside puts.
    blocks: list[torch.Tensor] = field(default_factory=list)
    loc: dict[str, int] = field(default_factory=dict)
    # nested / list: key -> per-sample value (a tensor view for nested)
    values: dict[str, Any] = field(default_factory=dict)
    trailing: tuple | None = None
    dtype: torch.dtype | None = None

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


def _check_compatible(col: _Column | None, name: str, kind: str, rows: Any, partition_id: str) -> None:
    """Refuse a put whose column differs in kind, or (dense) in row shape or dtype, from what the field holds."""
    if col is None:
        return
    if col.kind != kind:
        raise ValueError(f"field {name!r} in partition {partition_id!r} was stored as {col.kind}; this put gives {kind}")
    if kind == DENSE and col.trailing is not None and (col.trailing, col.dtype) != (tuple(rows.shape[1:]), rows.dtype):
        raise ValueError(
            f"field {name!r} in partition {partition_id!r} holds rows of shape {col.trailing} "
            f"and dtype {col.dtype}; this put gives {tuple(rows.shape[1:])} {rows.dtype}"
        )


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class MemoryDataPlane(DataPlane):
    """In-process, thread-safe key-value sample store (backend `memory`)."""

    backend = "memory"

    def __init__(self, metrics: DataPlaneMetrics | None = None):
        self._partitions: dict[str, _Partition] = {}
        self._lock = threading.RLock()
        self.metrics = metrics
        self._closed = False

    # -- writes ---------------------------------------------------------
    def kv_batch_put(self, keys: Sequence[str], partition_id: str, fields: Any, tags: Sequence[dict] | None = None) -> KVBatchMeta:
        """Write one row per key of every given field into the partition; returns a handle listing its fields."""
        self._check_open()
        keys, items = prepare_put(keys, fields, tags)
        n = len(keys)
        nbytes = 0
        with self._timed("put"), self._lock:
            # Check every column before writing any, so a refused put leaves no partial rows behind.
            existing = self._partitions.get(partition_id)
            for name, kind, rows in items:
                _check_compatible(existing.columns.get(name) if existing else None, name, kind, rows, partition_id)
            part = self._partitions.setdefault(partition_id, _Partition())
            part.keys.update(dict.fromkeys(keys))  # existing keys keep their place
            if tags is not None:
                for k, t in zip(keys, tags):
                    part.tags[k] = dict(t)
            for name, kind, rows in items:
                col = part.columns.get(name)
                if col is None:
                    col = part.columns[name] = _Column(kind=kind)
                if kind == DENSE:
                    if col.trailing is None:
                        col.trailing, col.dtype = tuple(rows.shape[1:]), rows.dtype
                    b = len(col.blocks)
                    col.blocks.append(rows)
                    col.loc.update(zip(keys, range(b << _ROW_BITS, (b << _ROW_BITS) + n)))
                    nbytes += _nbytes(rows)
                else:
                    for k, v in zip(keys, rows):
                        col.values[k] = v
                        if isinstance(v, torch.Tensor):
                            nbytes += _nbytes(v)
                    if kind == NESTED and rows:
                        col.dtype = rows[0].dtype
                        if col.trailing is None:  # only to shape an empty get
                            col.trailing = tuple(rows[0].shape[1:])
            present = [f for f, c in part.columns.items() if c.has_all(keys)]
            out_tags = [dict(part.tags.get(k, {})) for k in keys]
            live = len(part.keys)
        if self.metrics:
            self.metrics.record_put(n, nbytes)
            self.metrics.set_live(partition_id, live)
        return KVBatchMeta(keys=keys, partition_id=partition_id, fields=present, tags=out_tags)

    # -- reads ----------------------------------------------------------
    def _get(self, keys: list[str], partition_id: str, select_fields: list[str]) -> tuple[TensorDict, int]:
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
        out = TensorDict(batch_size=[len(keys)])
        nbytes = 0
        for name, kind, rows, blocks, col in plan:
            if kind == DENSE:
                value = _gather_dense(rows, blocks, col)
                nbytes += _nbytes(value)
            elif kind == NESTED:
                # as_nested_tensor copies the rows into one new buffer: that is the only copy.
                value = torch.nested.as_nested_tensor(rows, layout=torch.jagged) if rows else _empty_nested(col)
                nbytes += sum(_nbytes(r) for r in rows)
            else:
                value = NonTensorStack.from_list(rows) if rows else NonTensorStack(batch_size=[0])
                nbytes += sum(_nbytes(r) for r in rows if isinstance(r, torch.Tensor))
            out.set(name, value)
        return out, nbytes

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



def _empty_nested(col: _Column) -> torch.Tensor:
    """A jagged nested tensor with no rows (a rank that got no keys), of the column's dtype."""
    values = torch.empty((0, *(col.trailing or ())), dtype=col.dtype)
    return torch.nested.nested_tensor_from_jagged(values, offsets=torch.zeros(1, dtype=torch.long))


def _gather_dense(locs: list[int], blocks: list[torch.Tensor], col: _Column) -> torch.Tensor:
    """Index rows out of the blocks they were put in (locs as in `_Column.loc`), one index_select per block."""
    if not locs:
        return torch.empty((0, *(col.trailing or ())), dtype=col.dtype)
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
