"""The `ray` data-plane backend: sample data in Ray's object store, indexed by storage actors.

A put turns each column into numpy buffers and `ray.put`s them (one object per
field per storage shard); the storage actors keep only the index (which object
and row holds each key's value) and the object references that keep the data
alive. A get asks the shards where its rows are, fetches those objects
straight from the object store (on the same node numpy buffers are mapped,
not copied or unpickled) and gathers the rows in the order asked for, which is
the one copy a read makes. Tensors are never pickled: dense and ragged
columns travel as numpy arrays (dtypes numpy lacks, such as bfloat16, as an
integer view of the same bytes); only per-sample Python values are pickled.

Keys are assigned to storage actors by a stable hash (CRC32), so every process
agrees on where a key lives. The plane is picklable: worker actors on any node
receive it as an argument and talk to the same shards. Only the process that
created it kills the shards on `close()`.

What it deliberately does not do: outlive its writers (Ray ties each object to
the process that put it, so data written by a worker is lost if that worker
dies, and the run fails anyway), evict, persist, or start Ray (the caller
does, see `conveyor.ray_utils.ensure_ray`).
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
import torch
from tensordict import NonTensorStack, TensorDict

from conveyor.data_plane import schema
from conveyor.data_plane.base import (
    DENSE,
    NESTED,
    Column,
    DataPlane,
    FieldNotFoundError,
    empty_column,
    tensor_from_numpy,
    tensor_to_numpy,
)
from conveyor.data_plane.prometheus import DataPlaneMetrics
from conveyor.data_plane.schema import dtype_name, dtype_of, incompatibility

__all__ = ["RayDataPlane", "shard_of"]

logger = logging.getLogger(__name__)


def shard_of(key: str, num_shards: int) -> int:
    """The storage actor that holds `key` (a stable hash: the same in every process and run)."""
    return zlib.crc32(key.encode("utf-8")) % num_shards


@dataclass
class _TensorValue:
    """A per-sample tensor inside a list column, carried as numpy so it is not pickled."""

    array: np.ndarray
    dtype: str

    def to_tensor(self) -> torch.Tensor:
        return tensor_from_numpy(self.array, dtype_of(self.dtype)).clone()


def _encode_list_value(v: Any) -> Any:
    return _TensorValue(tensor_to_numpy(v), dtype_name(v.dtype)) if isinstance(v, torch.Tensor) else v


def _decode_list_value(v: Any) -> Any:
    return v.to_tensor() if isinstance(v, _TensorValue) else v


# --------------------------------------------------------------------------- the storage actor
def _make_shard_class() -> type:
    """The storage actor's class, built here so Ray ships it by value.

    A class defined inside a function is pickled with its code rather than by
    module name, so a storage process never imports torch or conveyor: it
    starts in about a second and stays small (the import alone is ~300 MB of
    resident memory). It only ever handles strings, tuples, dicts and ObjectRefs,
    and applies the one put rule of schema.py (`incompatibility`), which
    travels by value too.
    """
    import itertools as _itertools
    import os as _os

    class StorageShard:
        """The index of one shard of keys: which object and row holds each (key, field), and the refs that keep them.

        A partition is {"order": key -> first-written sort key, "tags": key -> dict,
        "columns": field -> {"kind", "dtype", "trailing" (its record, see schema.py),
        "blocks": id -> ObjectRef, "loc": key -> (id, row)}}.

        Shard 0 also holds each partition's field records (partition -> field ->
        record) for all shards: a field's record belongs to the partition, not to
        the keys one shard happens to hold, so it outlives the clearing of those keys.
        """

        def __init__(self) -> None:
            self._parts: dict = {}
            self._records: dict = {}
            self._next_block = _itertools.count()

        def ready(self) -> int:
            return _os.getpid()

        def claim(self, partition_id: str, records: dict) -> str | None:
            """Check a put's field records against the partition's and keep the new ones; why it is refused, or None."""
            known = self._records.get(partition_id, {})
            why = incompatibility(partition_id, known, records)
            if why is None:
                self._records[partition_id] = {**records, **known}
            return why

        def put(
            self, partition_id: str, keys: list, order: list, tags: list | None, columns: dict, claim: bool
        ) -> tuple:
            """Index one put (columns: field -> (record, [ref])); (error or None, fields every key has, tags, live
            keys).

            With `claim` (a plane of one shard) the records are checked here, in the same call.
            """
            why = claim and self.claim(partition_id, {n: c[0] for n, c in columns.items()})
            if why:
                return why, [], [], 0
            part = self._parts.setdefault(partition_id, {"order": {}, "tags": {}, "columns": {}})
            for k, o in zip(keys, order):
                part["order"].setdefault(k, o)  # a key written again keeps its place
            if tags is not None:
                for k, t in zip(keys, tags):
                    part["tags"][k] = dict(t)
            for name, (record, wrapped_ref) in columns.items():
                col = part["columns"].get(name)
                if col is None:
                    col = part["columns"][name] = {**record, "blocks": {}, "loc": {}}
                block = next(self._next_block)
                col["blocks"][block] = wrapped_ref[0]
                col["loc"].update((k, (block, row)) for row, k in enumerate(keys))
            present = [f for f, c in part["columns"].items() if all(k in c["loc"] for k in keys)]
            return None, present, [dict(part["tags"].get(k, {})) for k in keys], len(part["order"])

        def locate(self, partition_id: str, keys: list, fields: list) -> dict:
            """Where each (key, field) lives, or what is missing; refs go back nested, so the caller borrows them."""
            part = self._parts.get(partition_id)
            order, cols = (part["order"], part["columns"]) if part else ({}, {})
            records = self._records.get(partition_id, {})  # on shard 0: every field the partition has
            out = {
                "known": part is not None,
                "missing_keys": [k for k in keys if k not in order],
                "absent": [f for f in fields if f not in cols and f not in records],
                "lacking": {},
                "columns": {},
            }
            if out["missing_keys"]:
                return out
            for name in fields:
                col = cols.get(name)
                lacking = [k for k in keys if col is None or k not in col["loc"]]
                if lacking:
                    out["lacking"][name] = lacking
                    continue
                record = col or records.get(name)  # a read of no keys still learns the field's kind
                if record is None:
                    continue
                locs = [col["loc"][k] for k in keys] if col else []
                used = sorted({b for b, _ in locs})
                slot = {b: i for i, b in enumerate(used)}
                out["columns"][name] = {
                    "kind": record["kind"],
                    "trailing": record["trailing"],
                    "dtype": record["dtype"],
                    "refs": [col["blocks"][b] for b in used],
                    "blocks": [slot[b] for b, _ in locs],
                    "rows": [r for _, r in locs],
                }
            return out

        def keys(self, partition_id: str) -> list:
            part = self._parts.get(partition_id)
            return [(o, k) for k, o in part["order"].items()] if part else []

        def partitions(self) -> list:
            return list(self._parts)

        def clear(self, partition_id: str, keys: list | None) -> int:
            """Drop keys (or the partition, with its records) and the refs only they used; the live key count left."""
            if keys is None:
                self._parts.pop(partition_id, None)
                self._records.pop(partition_id, None)
                return 0
            part = self._parts.get(partition_id)
            if part is None:
                return 0
            for k in keys:
                part["order"].pop(k, None)
                part["tags"].pop(k, None)
                for col in part["columns"].values():
                    col["loc"].pop(k, None)
            for col in part["columns"].values():
                used = {b for b, _ in col["loc"].values()}
                for b in [b for b in col["blocks"] if b not in used]:
                    del col["blocks"][b]  # the object store frees it once no reader holds it either
            if not part["order"]:
                del self._parts[partition_id]
                return 0
            return len(part["order"])

    return StorageShard


_REMOTE_SHARD: Any = None


def _remote_shard_class() -> Any:
    global _REMOTE_SHARD
    if _REMOTE_SHARD is None:
        # The shards apply schema.py's rule; shipped by value, its functions need no conveyor (or torch) import there.
        ray.cloudpickle.register_pickle_by_value(schema)
        _REMOTE_SHARD = ray.remote(_make_shard_class())
    return _REMOTE_SHARD


# --------------------------------------------------------------------------- the client
def _encode_column(kind: str, rows: Any) -> Any:
    """The payload to ray.put of one shard's rows of a column."""
    if kind == DENSE:
        return tensor_to_numpy(rows)
    if kind == NESTED:
        if not rows:
            return np.zeros((0,)), np.zeros(1, dtype=np.int64)
        lengths = [r.shape[0] for r in rows]
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        values = torch.cat(rows) if len(rows) > 1 else rows[0]
        return tensor_to_numpy(values), offsets
    return [_encode_list_value(v) for v in rows]


def _rows_for(kind: str, rows: Any, idx: list[int], everything: bool) -> Any:
    if everything:
        return rows
    if kind == DENSE:
        return rows.index_select(0, torch.tensor(idx, dtype=torch.long))
    return [rows[i] for i in idx]


class RayDataPlane(DataPlane):
    """Key-value sample store in Ray's object store, indexed by `num_storage_actors` storage actors (backend `ray`)."""

    backend = "ray"

    def __init__(
        self,
        metrics: DataPlaneMetrics | None = None,
        num_storage_actors: int = 1,
        actor_cpus: float = 0.05,
        timeout_s: float = 60.0,
    ):
        if num_storage_actors < 1:
            raise ValueError(f"num_storage_actors must be >= 1, got {num_storage_actors}")
        if actor_cpus < 0:
            raise ValueError(f"actor_cpus must be >= 0, got {actor_cpus}")
        if not ray.is_initialized():
            raise RuntimeError(
                "the ray data plane needs a running Ray: call ray.init() (or conveyor.ray_utils.ensure_ray(cfg)) first"
            )
        self.metrics = metrics
        self._closed = False
        self._owner = True
        self._client = uuid.uuid4().hex[:8]
        self._puts = itertools.count()
        options: dict[str, Any] = {"num_cpus": actor_cpus, "max_restarts": 0}
        if num_storage_actors > 1:
            options["scheduling_strategy"] = "SPREAD"
        self._shards = [_remote_shard_class().options(**options).remote() for _ in range(num_storage_actors)]
        try:
            ray.get([s.ready.remote() for s in self._shards], timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            self._kill_shards()
            raise ValueError(
                f"{num_storage_actors} ray data-plane storage actor(s) of {actor_cpus} CPU each did not start "
                f"within {timeout_s:.0f}s (cluster resources: {ray.cluster_resources()}); lower "
                "transfer_queue.storage_actor_cpus or transfer_queue.num_storage_actors"
            ) from None

    @property
    def num_storage_actors(self) -> int:
        """How many storage actors hold the index."""
        return len(self._shards)

    # -- pickling: a copy talks to the same shards but never kills them ----
    def __getstate__(self) -> dict[str, Any]:
        return {"shards": self._shards, "closed": self._closed}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._shards = state["shards"]
        self._closed = state["closed"]
        self._owner = False
        self.metrics = None
        self.metrics_server = None
        self._client = uuid.uuid4().hex[:8]
        self._puts = itertools.count()

    # -- writes ---------------------------------------------------------
    def _put(
        self, keys: list[str], partition_id: str, columns: list[Column], tags: Sequence[dict] | None
    ) -> tuple[list[str], list[dict], int]:
        num = len(self._shards)
        by_shard: dict[int, list[int]] = {}
        for i, k in enumerate(keys):
            by_shard.setdefault(shard_of(k, num), []).append(i)
        records = {c.name: c.record for c in columns}
        if num > 1:
            # Checked (and new fields recorded) by shard 0 before any shard writes, so a refused
            # put leaves no partial rows behind, whichever shards its keys live on.
            why = ray.get(self._shards[0].claim.remote(partition_id, records))
            if why:
                raise ValueError(why)
        stamp = (time.time_ns(), self._client, next(self._puts))
        plans = sorted(by_shard.items())
        calls = []
        for s, idx in plans:
            everything = len(plans) == 1
            # Nested in a list, the refs reach the shard as refs (borrowed), not as fetched values.
            indexed = {
                c.name: (c.record, [ray.put(_encode_column(c.kind, _rows_for(c.kind, c.rows, idx, everything)))])
                for c in columns
            }
            calls.append(
                self._shards[s].put.remote(
                    partition_id,
                    [keys[i] for i in idx],
                    [(*stamp, i) for i in idx],
                    None if tags is None else [tags[i] for i in idx],
                    indexed,
                    num == 1,
                )
            )
        results = ray.get(calls)
        present: list[str] | None = None
        out_tags: list[dict] = [{} for _ in keys]
        live = 0
        for (_store, idx), (why, fields_here, tags_here, live_here) in zip(plans, results):
            if why:
                raise ValueError(why)
            present = fields_here if present is None else [f for f in present if f in fields_here]
            for i, t in zip(idx, tags_here):
                out_tags[i] = t
            live += live_here
        if len(plans) < num and self.metrics:
            live = self._live(partition_id)  # the shards not written hold keys of the partition too
        return present or [], out_tags, live

    # -- reads ----------------------------------------------------------
    def _get(self, keys: list[str], partition_id: str, select_fields: list[str]) -> TensorDict:
        num = len(self._shards)
        by_shard: dict[int, list[int]] = {s: [] for s in range(num)}
        for i, k in enumerate(keys):
            by_shard[shard_of(k, num)].append(i)
        # Every shard is asked (even with no keys) so an empty read still learns each field's kind and dtype.
        shards = sorted(by_shard)
        answers = ray.get(
            [self._shards[s].locate.remote(partition_id, [keys[i] for i in by_shard[s]], select_fields) for s in shards]
        )
        # The same checks, in the same order, as the memory backend: partition, keys, fields, then per-field gaps.
        if not any(a["known"] for a in answers):
            raise FieldNotFoundError(partition_id, fields=select_fields, keys=keys)
        missing_keys = {k for a in answers for k in a["missing_keys"]}
        if missing_keys:
            raise FieldNotFoundError(partition_id, keys=[k for k in keys if k in missing_keys])
        missing_fields = [f for f in select_fields if all(f in a["absent"] for a in answers)]
        if missing_fields:
            raise FieldNotFoundError(partition_id, fields=missing_fields)
        for name in select_fields:
            lacking = {k for a in answers for k in a["lacking"].get(name, [])}
            if lacking:
                raise FieldNotFoundError(partition_id, fields=[name], keys=[k for k in keys if k in lacking])
        # One fetch of every object the read touches; same-node numpy buffers are mapped, not copied.
        refs, ref_pos = [], {}
        for a in answers:
            for col in a["columns"].values():
                for r in col["refs"]:
                    if r not in ref_pos:
                        ref_pos[r] = len(refs)
                        refs.append(r)
        payloads = ray.get(refs) if refs else []
        out = TensorDict(batch_size=[len(keys)])
        for name in select_fields:
            parts = [(by_shard[s], a["columns"][name]) for s, a in zip(shards, answers) if name in a["columns"]]
            out.set(name, _assemble(parts, len(keys), payloads, ref_pos))
        return out

    def kv_list(self, partition_id: str) -> list[str]:
        """Keys of the partition in first-written order."""
        self._check_open()
        pairs = [p for part in ray.get([s.keys.remote(partition_id) for s in self._shards]) for p in part]
        return [k for _, k in sorted(pairs)]

    def list_partitions(self) -> list[str]:
        """Names of the partitions that hold data."""
        self._check_open()
        names: dict[str, None] = {}
        for part in ray.get([s.partitions.remote() for s in self._shards]):
            names.update(dict.fromkeys(part))
        return list(names)

    def kv_clear(self, partition_id: str, keys: Iterable[str] | None = None) -> None:
        """Drop keys (or the whole partition); objects no key uses any more are freed by Ray."""
        self._check_open()
        num = len(self._shards)
        if keys is None:
            lives = ray.get([s.clear.remote(partition_id, None) for s in self._shards])
        else:
            by_shard: dict[int, list[str]] = {}
            for k in keys:
                by_shard.setdefault(shard_of(str(k), num), []).append(str(k))
            ray.get([self._shards[s].clear.remote(partition_id, ks) for s, ks in by_shard.items()])
            lives = [self._live(partition_id)]
            if not lives[0]:
                # The partition went with its last key: so do its field records (kept by shard 0).
                ray.get(self._shards[0].clear.remote(partition_id, None))
        if self.metrics:
            self.metrics.set_live(partition_id, sum(lives))

    def _live(self, partition_id: str) -> int:
        return sum(len(part) for part in ray.get([s.keys.remote(partition_id) for s in self._shards]))

    def _release(self) -> None:
        if self._owner:
            self._kill_shards()

    def _kill_shards(self) -> None:
        for s in self._shards:
            try:
                ray.kill(s, no_restart=True)
            except Exception as err:  # already dead, or Ray shut down first
                logger.debug("storage actor already gone: %s", err)


def _assemble(parts: list[tuple[list[int], dict]], n: int, payloads: list[Any], ref_pos: dict) -> Any:
    """One column of a read, rows in the caller's order, copied out of the fetched objects.

    `parts`: per shard, (positions in the read, the shard's locate answer for this column).
    """
    # Every shard holds the same record of a field (shard 0 checks each put against the partition's).
    record = parts[0][1]
    if n == 0:
        return empty_column(record)
    kind, dtype = record["kind"], dtype_of(record["dtype"])
    if kind == DENSE:
        out = torch.empty((n, *record["trailing"]), dtype=dtype)
        for positions, col in parts:
            if not positions:
                continue
            blocks = [tensor_from_numpy(payloads[ref_pos[r]], dtype) for r in col["refs"]]
            if len(blocks) == 1 and len(positions) == n:
                if col["rows"] == list(range(blocks[0].shape[0])):
                    return blocks[0].clone()  # the whole block in put order
                return blocks[0].index_select(0, torch.tensor(col["rows"], dtype=torch.long))
            by_block: dict[int, tuple[list[int], list[int]]] = {}
            for pos, b, r in zip(positions, col["blocks"], col["rows"]):
                dst, src = by_block.setdefault(b, ([], []))
                dst.append(pos)
                src.append(r)
            for b, (dst, src) in by_block.items():
                out.index_copy_(
                    0,
                    torch.tensor(dst, dtype=torch.long),
                    blocks[b].index_select(0, torch.tensor(src, dtype=torch.long)),
                )
        return out
    slots: list[Any] = [None] * n
    for positions, col in parts:
        blocks = [payloads[ref_pos[r]] for r in col["refs"]]
        for pos, b, r in zip(positions, col["blocks"], col["rows"]):
            if kind == NESTED:
                values, offsets = blocks[b]
                slots[pos] = tensor_from_numpy(values[offsets[r] : offsets[r + 1]], dtype)
            else:
                slots[pos] = _decode_list_value(blocks[b][r])
    if kind == NESTED:
        # as_nested_tensor copies the rows out of the read-only buffers into one new one.
        return torch.nested.as_nested_tensor(slots, layout=torch.jagged)
    return NonTensorStack(*slots, batch_size=[n])
