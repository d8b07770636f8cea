"""The `transferqueue` data plane: an adapter onto the TransferQueue package (`pip install 'conveyor[transferqueue]'`).

TransferQueue keeps samples in storage processes (by default its
`SimpleStorage` units, Ray actors reached over ZMQ) under a controller actor
that maps user keys to sample slots and tracks which fields each sample has.
This adapter starts that controller and storage with the package's own config
(passed through unchanged from `transfer_queue.transferqueue.*`), or attaches
to a running one, and implements conveyor's `DataPlane` on top with conveyor's
guarantees, which the package alone does not give:

- the package returns every multi-dimensional tensor field as a jagged nested
  tensor and may cast a list of tensors to one dtype; the adapter records each
  field's kind (dense, ragged, list), dtype and row shape per partition and
  rebuilds exactly what was put (dense stays dense, without a copy where the
  returned buffer allows it);
- list columns are stored pickled, one value per sample, so any Python value
  (and tensors of mixed dtypes) comes back as it was;
- a missing key or field is a `FieldNotFoundError` naming what is missing and
  the partition; the package's own "not found" errors are translated;
- a put whose field kind, row shape or dtype differs from what the partition
  holds is refused before anything is written.

The per-partition field record lives in the controller itself (as the tags of
a shadow partition named `__conveyor_schema__/<partition>`), so every process
that attaches to the same controller sees it.

The controller and storage are started, attached to and stopped by
`TransferQueueLauncher` (conveyor.data_plane.transferqueue_launch), which
also says where they listen and what they ask of Ray.

It deliberately does not: expose the package's samplers, consumption tracking
or streaming dataloader; move tensors between devices; or manage Mooncake or
Yuanrong binaries (their bootstrap is the package's, started and stopped as the
package does it, with the processes it starts stopped on `close()`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import pickle
import threading
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import ray
import torch
from tensordict import NonTensorStack, TensorDict
from transfer_queue.client import AsyncTransferQueueClient
from transfer_queue.storage import StorageKeyNotFoundError

from conveyor.data_plane.base import DENSE, LIST, NESTED, Column, DataPlane, FieldNotFoundError, empty_column
from conveyor.data_plane.schema import dtype_name, dtype_of, incompatibility
from conveyor.data_plane.transferqueue_launch import AUTO_HOST, NAMESPACE, TransferQueueLauncher, resolve_config

__all__ = ["TransferQueueDataPlane", "SCHEMA_PREFIX", "NAMESPACE"]

logger = logging.getLogger(__name__)

SCHEMA_PREFIX = "__conveyor_schema__/"  # shadow partitions holding each partition's field record


# -- the per-partition field record -------------------------------------------
# One record per field (schema.py), kept as the tags of a shadow partition: plain
# strings and lists, because the package sends tags through msgpack.


def _foreign_spec(schema: dict) -> dict:
    """A record for a field written by another TransferQueue user (not through conveyor), from the package's schema."""
    if schema.get("is_non_tensor"):
        return {"kind": "foreign", "dtype": None, "trailing": None}
    dtype = schema.get("dtype")
    name = dtype_name(dtype) if isinstance(dtype, torch.dtype) else None
    if schema.get("is_nested"):
        return {"kind": NESTED, "dtype": name, "trailing": None}
    return {"kind": DENSE, "dtype": name, "trailing": None}


# -- converting what the package returns back to what was put ---------------------


def _rows(value: Any) -> list:
    """The per-sample values of a column as the package returned it (nested tensor, tensor, stack or list)."""
    if isinstance(value, NonTensorStack):
        return value.tolist()
    if isinstance(value, torch.Tensor):
        return list(value.unbind(0))
    return list(value)


def _to_dense(name: str, value: Any, n: int, spec: dict) -> torch.Tensor:
    """A (n, *trailing) tensor of the recorded dtype from the package's jagged/dense/list column."""
    dtype = dtype_of(spec["dtype"])
    trailing = tuple(spec["trailing"]) if spec["trailing"] is not None else None
    if isinstance(value, torch.Tensor) and value.is_nested and value.layout == torch.jagged:
        # Rows of one shape packed back to back: the buffer is the dense batch, no copy needed.
        values = value.values()
        if trailing is None:
            trailing = tuple(value.unbind(0)[0].shape) if n else ()
        if values.is_contiguous() and values.numel() == n * _numel(trailing):
            out = values.view(n, *trailing)
        else:
            out = torch.stack(value.unbind(0))
    elif isinstance(value, torch.Tensor) and not value.is_nested:
        out = value
    else:
        out = torch.stack(_rows(value))
    if trailing is not None and tuple(out.shape) != (n, *trailing):
        # Key-value backends give 1-D fields back as (n, 1); the record says what was put.
        if out.numel() != n * _numel(trailing):
            raise RuntimeError(
                f"transferqueue returned field {name!r} with shape {tuple(out.shape)}; "
                f"it was put with rows of shape {trailing}"
            )
        out = out.reshape(n, *trailing)
    if dtype is not None and out.dtype != dtype:
        raise RuntimeError(f"transferqueue returned field {name!r} as {out.dtype}; it was put as {dtype}")
    return out


def _numel(shape: tuple) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def _to_nested(name: str, value: Any, spec: dict) -> torch.Tensor:
    """A jagged nested tensor of the recorded dtype from the package's column."""
    dtype = dtype_of(spec["dtype"])
    if isinstance(value, torch.Tensor) and value.is_nested and value.layout == torch.jagged:
        out = value  # the package packs rows exactly as the memory backend does
    else:
        out = torch.nested.as_nested_tensor(_rows(value), layout=torch.jagged)
    if dtype is not None and out.dtype != dtype:
        raise RuntimeError(f"transferqueue returned field {name!r} as {out.dtype}; it was put as {dtype}")
    return out


class TransferQueueDataPlane(TransferQueueLauncher, DataPlane):
    """Data plane backed by the TransferQueue package (backend `transferqueue`).

    `tq_config` is the package's own config (its config.yaml keys: `controller`,
    `backend.storage_backend`, `backend.SimpleStorage`, `backend.MooncakeStore`,
    `metrics`, ...), merged over its defaults. `actor_cpus` is the logical CPU
    count each controller or storage actor reserves; `timeout_s` bounds every
    wait. `host` is the address the controller and storage units listen on
    (127.0.0.1: this machine only, the actors placed on this node; "auto": Ray's
    node address, as the package does). With `controller_name`, attach to a running controller of that name
    (in Ray namespace `transfer_queue`) instead of starting one; an attached
    plane never stops what it did not start. A plane can be pickled (e.g. sent
    to a Ray worker): the copy attaches to the same controller and storage.
    """

    backend = "transferqueue"

    def __init__(
        self,
        metrics: Any = None,
        tq_config: Mapping | None = None,
        *,
        actor_cpus: float = 0.05,
        timeout_s: float = 120.0,
        controller_name: str | None = None,
        host: str = "127.0.0.1",
    ):
        if not isinstance(host, str) or not host.strip():
            raise ValueError(f"host must be an address to listen on (or {AUTO_HOST!r}), got {host!r}")
        self._host = host
        if actor_cpus < 0:
            raise ValueError(f"actor_cpus must be >= 0, got {actor_cpus}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.metrics = metrics
        self._closed = False
        self._timeout_s = float(timeout_s)
        self._actor_cpus = float(actor_cpus)
        self._started_ray = False
        self._controller = None  # the actor handle, only when this plane started it
        self._storage: Any = None  # what the storage bootstrap started (to stop on close)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._client: AsyncTransferQueueClient | None = None
        self.tq_metrics_endpoint: str | None = None
        if controller_name is not None:
            if tq_config:
                raise ValueError(
                    "give either tq_config (start a TransferQueue) or controller_name (attach to one), not both"
                )
            if not ray.is_initialized():
                raise ValueError(
                    f"controller_name={controller_name!r} needs Ray connected to the cluster that runs it; "
                    "call ray.init(address=...) first"
                )
            self.controller_name = controller_name
            controller_info, backend, backend_conf = self._attach(controller_name)
        else:
            conf = resolve_config(tq_config)
            self.controller_name = f"conveyor-tq-{uuid.uuid4().hex[:8]}"
            try:
                controller_info, backend, backend_conf = self._start(conf)
            except BaseException:
                self._stop_started()
                raise
        self._connection = (controller_info, backend, backend_conf)
        try:
            self._connect(*self._connection)
        except BaseException:
            self._disconnect()
            self._stop_started()
            raise

    # -- this process's client; release; pickling ---------------------------
    def _connect(self, controller_info: Any, backend: str, backend_conf: Any) -> None:
        """Create this process's client (its own event-loop thread) and storage manager."""
        self._loop = asyncio.new_event_loop()
        thread = threading.Thread(target=self._loop.run_forever, name="conveyor-transferqueue", daemon=True)
        thread.start()
        self._thread = thread
        self._client = AsyncTransferQueueClient(
            client_id=f"conveyor-{uuid.uuid4().hex[:8]}", controller_info=controller_info
        )
        self._client.initialize_storage_manager(manager_type=backend, config=backend_conf)

    def _disconnect(self) -> None:
        """Stop this process's client and its event loop."""
        loop, client, thread = self._loop, self._client, self._thread
        self._loop = self._client = self._thread = None
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)
            if thread is not None:
                thread.join(timeout=5)
            if thread is None or not thread.is_alive():
                loop.close()
        if client is not None:
            try:
                client.close()
            except Exception as err:  # closing must not hide the error that led here
                logger.warning("closing the TransferQueue client failed: %s", err)

    def _release(self) -> None:
        self._disconnect()
        self._stop_started()

    def __getstate__(self) -> dict:
        """A pickled plane carries only how to reach the controller and storage; the copy owns nothing."""
        if self._closed:
            raise RuntimeError("cannot pickle a closed transferqueue data plane")
        return {
            "connection": self._connection,
            "timeout_s": self._timeout_s,
            "actor_cpus": self._actor_cpus,
            "controller_name": self.controller_name,
            "tq_metrics_endpoint": self.tq_metrics_endpoint,
            "host": self._host,
        }

    def __setstate__(self, state: dict) -> None:
        self.metrics = None  # the owner's registry stays with the owner
        self.metrics_server = None
        self._closed = False
        self._timeout_s = state["timeout_s"]
        self._actor_cpus = state["actor_cpus"]
        self.controller_name = state["controller_name"]
        self.tq_metrics_endpoint = state["tq_metrics_endpoint"]
        self._host = state.get("host", AUTO_HOST)
        self._started_ray = False
        self._controller = None
        self._storage = None
        self._loop = self._client = self._thread = None
        self._connection = state["connection"]
        self._connect(*self._connection)

    # -- running the package's coroutines -------------------------------------
    def _run(self, coro: Any, what: str) -> Any:
        """Run one coroutine on the client's loop, bounded by timeout_s."""
        self._check_open()
        threads = torch.get_num_threads()
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout=self._timeout_s)
        except concurrent.futures.TimeoutError as err:
            future.cancel()
            raise TimeoutError(
                f"transferqueue {what} did not finish within {self._timeout_s:g}s; "
                "is the TransferQueue controller and storage still running?"
            ) from err
        finally:
            # The package sets torch's process-wide thread count around each
            # transfer and restores its own import-time value, not the caller's.
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)

    @staticmethod
    def _check_partition(partition_id: str) -> None:
        if not isinstance(partition_id, str) or not partition_id:
            raise ValueError(f"partition_id must be a non-empty string, got {partition_id!r}")
        if partition_id.startswith(SCHEMA_PREFIX):
            raise ValueError(f"partition_id {partition_id!r} uses the reserved prefix {SCHEMA_PREFIX!r}")

    async def _schema(self, partition_id: str) -> dict[str, dict]:
        """The partition's field records, in first-written order."""
        pid = SCHEMA_PREFIX + partition_id
        listing = await self._client.async_kv_list(pid)
        return {f: spec for f, spec in listing.get(pid, {}).items() if spec}

    async def _register(self, partition_id: str, specs: dict[str, dict]) -> None:
        meta = await self._client.async_kv_retrieve_meta(
            keys=list(specs), partition_id=SCHEMA_PREFIX + partition_id, create=True
        )
        meta.custom_meta = [dict(s) for s in specs.values()]
        await self._client.async_set_custom_meta(meta)

    async def _unregister(self, partition_id: str, fields: list[str]) -> None:
        meta = await self._client.async_kv_retrieve_meta(keys=fields, partition_id=SCHEMA_PREFIX + partition_id)
        if meta.size:
            await self._client.async_clear_samples(meta)

    async def _keys(self, partition_id: str) -> list[str] | None:
        """The partition's keys in first-written order, None when the controller has no such partition."""
        listing = await self._client.async_kv_list(partition_id)
        return list(listing[partition_id]) if partition_id in listing else None

    # -- writes ---------------------------------------------------------------
    def _put(
        self, keys: list[str], partition_id: str, columns: list[Column], tags: Sequence[dict] | None
    ) -> tuple[list[str], list[dict], int]:
        self._check_partition(partition_id)
        records = {c.name: c.record for c in columns}
        data: dict[str, Any] = {}
        for name, kind, rows, _ in columns:
            if kind == DENSE:
                data[name] = rows
            elif kind == NESTED:
                data[name] = torch.nested.as_nested_tensor(rows, layout=torch.jagged)
            else:
                # Pickled, so the package neither packs tensors of mixed dtypes into
                # one nested tensor nor turns tuples into lists on the wire.
                blobs = [pickle.dumps(v, protocol=pickle.HIGHEST_PROTOCOL) for v in rows]
                data[name] = NonTensorStack(*blobs, batch_size=[len(keys)])
        return self._run(self._write(keys, partition_id, data, records, tags), f"put to partition {partition_id!r}")

    async def _write(self, keys: list[str], partition_id: str, data: dict, records: dict, tags: Sequence[dict] | None):
        client = self._client
        schema = await self._schema(partition_id)
        why = incompatibility(partition_id, schema, records)
        if why:
            raise ValueError(why)
        new = {name: rec for name, rec in records.items() if name not in schema}
        if new:
            # Recorded before the data, so a reader never meets a field it cannot rebuild.
            await self._register(partition_id, new)
        try:
            meta = await client.async_kv_retrieve_meta(keys=keys, partition_id=partition_id, create=True)
            if meta.size != len(keys):
                raise RuntimeError(
                    f"transferqueue registered {meta.size} of {len(keys)} keys in partition {partition_id!r}"
                )
            if tags is not None:
                meta.custom_meta = [dict(t) for t in tags]  # a put's tags replace the key's tags
            if data:
                meta = await client.async_put(TensorDict(data, batch_size=[len(keys)]), meta)
            elif tags is not None:
                await client.async_set_custom_meta(meta)
        except Exception:
            if new:
                await self._unregister(partition_id, list(new))
            raise
        order = [*schema, *new]
        got = set(meta.field_names)
        present = [f for f in order if f in got] + sorted(got.difference(order))
        live = len(await self._keys(partition_id) or []) if self.metrics else 0
        return present, [dict(t) for t in meta.custom_meta], live

    # -- reads ----------------------------------------------------------------
    def _get(self, keys: list[str], partition_id: str, select_fields: list[str]) -> TensorDict:
        self._check_partition(partition_id)
        return self._run(self._fetch(keys, partition_id, select_fields), f"get from partition {partition_id!r}")

    async def _fetch(self, keys: list[str], partition_id: str, select: list[str]) -> TensorDict:
        client = self._client
        n = len(keys)
        if not n:
            schema = await self._schema(partition_id)
            if not schema and await self._keys(partition_id) is None:
                raise FieldNotFoundError(partition_id, fields=select, keys=keys)
            missing = [f for f in select if f not in schema]
            if missing:
                raise FieldNotFoundError(partition_id, fields=missing)
            out = TensorDict(batch_size=[0])
            for f in select:
                out.set(f, empty_column(schema[f]))
            return out
        schema, meta = await asyncio.gather(
            self._schema(partition_id), client.async_kv_retrieve_meta(keys=keys, partition_id=partition_id)
        )
        if meta.size != n:
            await self._raise_missing_keys(keys, partition_id, select)
        got = set(meta.field_names)
        if any(f not in got for f in select):
            await self._raise_missing_fields(keys, partition_id, select, got, schema)
        out = TensorDict(batch_size=[n])
        if not select:
            return out
        try:
            data = await client.async_get_data(meta.select_fields(select))
        except StorageKeyNotFoundError:
            # Cleared by another process between the lookup and the read: say what is gone.
            meta = await client.async_kv_retrieve_meta(keys=keys, partition_id=partition_id)
            if meta.size != n:
                await self._raise_missing_keys(keys, partition_id, select)
            await self._raise_missing_fields(keys, partition_id, select, set(meta.field_names), schema)
            raise
        for f in select:
            spec = schema.get(f) or _foreign_spec(meta.field_schema.get(f, {}))
            value = data.get(f)
            if spec["kind"] == DENSE:
                value = _to_dense(f, value, n, spec)
            elif spec["kind"] == NESTED:
                value = _to_nested(f, value, spec)
            elif spec["kind"] == LIST:
                value = NonTensorStack(*[pickle.loads(b) for b in _rows(value)], batch_size=[n])
            out.set(f, value)
        return out

    async def _raise_missing_keys(self, keys: list[str], partition_id: str, select: list[str]) -> None:
        stored = await self._keys(partition_id)
        if not stored:
            raise FieldNotFoundError(partition_id, fields=select, keys=keys)
        stored_set = set(stored)
        raise FieldNotFoundError(partition_id, keys=list(dict.fromkeys(k for k in keys if k not in stored_set)))

    async def _raise_missing_fields(
        self, keys: list[str], partition_id: str, select: list[str], got: set[str], schema: dict
    ) -> None:
        absent = [f for f in select if f not in got and f not in schema]
        if absent:
            raise FieldNotFoundError(partition_id, fields=absent)
        for f in select:
            if f not in got:
                lacking = await self._lacking(list(dict.fromkeys(keys)), partition_id, f)
                if lacking:
                    raise FieldNotFoundError(partition_id, fields=[f], keys=lacking)

    async def _lacking(self, keys: list[str], partition_id: str, field: str) -> list[str]:
        """The keys without `field`, found by halving: one lookup per group that has the field throughout."""
        meta = await self._client.async_kv_retrieve_meta(keys=keys, partition_id=partition_id)
        if field in meta.field_names and meta.size == len(keys):
            return []
        if len(keys) == 1:
            return keys
        mid = len(keys) // 2
        left, right = await asyncio.gather(
            self._lacking(keys[:mid], partition_id, field), self._lacking(keys[mid:], partition_id, field)
        )
        return left + right

    def kv_list(self, partition_id: str) -> list[str]:
        """Keys of the partition in first-written order (empty for an unknown partition or a closed plane)."""
        if self._closed:
            return []
        self._check_partition(partition_id)
        return self._run(self._keys(partition_id), f"list of partition {partition_id!r}") or []

    def list_partitions(self) -> list[str]:
        """Names of the partitions that hold data."""
        if self._closed:
            return []
        ids = self._run(self._client.async_get_partition_list(), "list of partitions")
        return [p for p in ids if not p.startswith(SCHEMA_PREFIX)]

    def kv_clear(self, partition_id: str, keys: Iterable[str] | None = None) -> None:
        """Drop keys (or the whole partition, with its field record) from storage and the controller."""
        if self._closed:
            return
        self._check_partition(partition_id)
        keys = None if keys is None else list(dict.fromkeys(str(k) for k in keys))
        live = self._run(self._clear(partition_id, keys), f"clear of partition {partition_id!r}")
        if self.metrics:
            self.metrics.set_live(partition_id, live)

    async def _clear(self, partition_id: str, keys: list[str] | None) -> int:
        client = self._client
        if keys is not None:
            stored = await self._keys(partition_id)
            doomed = set(keys)
            left = [k for k in stored or [] if k not in doomed]
            if left:
                known = set(stored)
                gone = [k for k in keys if k in known]
                meta = await client.async_kv_retrieve_meta(keys=gone, partition_id=partition_id)
                if meta.size:
                    await client.async_clear_samples(meta)
                return len(left)
            if stored is None:
                return 0
        # A partition losing its last key is dropped whole, field record and all, so a
        # later put may give its fields another shape (as the memory backend allows).
        # (The package keeps a partition emptied key by key, and will not drop it after.)
        for pid in (partition_id, SCHEMA_PREFIX + partition_id):
            if await self._keys(pid) is not None:
                await client.async_clear_partition(pid)
        return 0
