"""The data-plane interface: a key-value store of samples, in partitions, one column per field.

A backend stores what it is given and returns exactly that: dense tensors stay
dense (same dtype and shape), ragged per-sample tensors stay ragged, Python
values stay Python values. It never fills in a missing key or field. Where the
storage lives (this process, Ray actors, another package) is the backend's
business; callers see only these operations.
"""

from __future__ import annotations

import abc
import contextlib
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from tensordict import NonTensorStack, TensorDict

from conveyor.data_plane.schema import DENSE, LIST, NESTED, dtype_of, record_of
from conveyor.protocol import KVBatchMeta

__all__ = ["DataPlane", "FieldNotFoundError", "Fields", "tensor_to_numpy", "tensor_from_numpy"]

# What `kv_batch_put` accepts: a TensorDict, or a mapping of field name to a
# (B, ...) tensor, a jagged nested tensor, a list of per-sample tensors of
# different shapes, or a list of per-sample Python values.
Fields = "TensorDict | Mapping[str, Any]"


class FieldNotFoundError(KeyError):
    """A requested key or field is not in the partition; the message names what is missing and where."""

    def __init__(self, partition_id: str, fields: Sequence[str] = (), keys: Sequence[str] = ()):
        self.partition_id = partition_id
        self.fields = list(fields)
        self.keys = list(keys)
        parts = []
        if self.fields:
            parts.append(f"field(s) {self.fields}")
        if self.keys:
            shown = self.keys[:5]
            more = f" and {len(self.keys) - 5} more" if len(self.keys) > 5 else ""
            parts.append(f"key(s) {shown}{more}")
        what = " and ".join(parts) or "nothing"
        super().__init__(f"{what} not found in partition {partition_id!r}")

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return self.args[0]

    def __reduce__(self) -> tuple:
        # Rebuild from the parts, not the formatted message, so the error survives pickling (out of a Ray worker).
        return (type(self), (self.partition_id, self.fields, self.keys))


class DataPlane(abc.ABC):
    """Interface every data-plane backend implements."""

    backend: str = "abstract"

    def kv_batch_put(
        self,
        keys: Sequence[str],
        partition_id: str,
        fields: Any,
        tags: Sequence[dict] | None = None,
    ) -> KVBatchMeta:
        """Write `fields` (one row per key) for `keys` in `partition_id` and return a handle to them.

        A key written again has its values replaced; its tags are replaced only when `tags` is given.
        The returned handle lists the fields every one of `keys` now has, and their tags.

        Within a partition a field keeps the kind it was first written with
        (dense, ragged or list) and, for tensors, its dtype and row shape (for
        a ragged field: the shape after the ragged dimension), as long as the
        partition holds data: a put that changes any of them is refused with a
        ValueError naming the field, the partition, the stored and the given
        dtype and shape (also when it would overwrite every stored row; clear
        the partition or use a new field name). A refused put writes nothing:
        none of its fields, keys or tags. List columns take any values. A put
        of no keys writes and checks nothing; its handle lists the given fields.
        """
        self._check_open()
        keys, columns = prepare_put(keys, fields, tags)
        if not keys:
            # A rank given no samples writes nothing, so it can conflict with nothing: its zero-row
            # outputs (often (0, 0)-shaped) must neither fail nor fix a field's shape for the ranks with rows.
            return KVBatchMeta(keys=[], partition_id=partition_id, fields=[c.name for c in columns], tags=[])
        with self._timed("put"):
            present, out_tags, live = self._put(keys, partition_id, columns, tags)
        if self.metrics:
            self.metrics.record_put(len(keys), sum(_column_nbytes(c) for c in columns))
            self.metrics.set_live(partition_id, live)
        return KVBatchMeta(keys=keys, partition_id=partition_id, fields=present, tags=out_tags)

    @abc.abstractmethod
    def _put(
        self, keys: list[str], partition_id: str, columns: list[Column], tags: Sequence[dict] | None
    ) -> tuple[list[str], list[dict], int]:
        """The backend's part of kv_batch_put (at least one key): check the records (`schema.incompatibility`), then
        write.

        Returns the fields every one of `keys` now has, the keys' tags, and the
        number of keys in the partition (read only when metrics are on, so a
        backend may return 0 when metrics are off and counting costs a round trip).
        """

    def kv_batch_get(self, keys: Sequence[str], partition_id: str, select_fields: Sequence[str]) -> TensorDict:
        """Read `select_fields` for `keys` (rows in the order of `keys`); missing ones raise FieldNotFoundError."""
        out = self._read(self._get, keys, partition_id, select_fields)
        if self.metrics:
            self.metrics.record_get(len(keys), _batch_nbytes(out))
        return out

    def _read(self, read: Any, keys: Sequence[str], partition_id: str, select_fields: Sequence[str]) -> Any:
        """`read(keys, partition_id, select_fields)` on an open plane, timed as a get."""
        self._check_open()
        with self._timed("get"):
            return read([str(k) for k in keys], partition_id, list(select_fields))

    @abc.abstractmethod
    def _get(self, keys: list[str], partition_id: str, select_fields: list[str]) -> TensorDict:
        """The backend's part of kv_batch_get: the rows of `select_fields` for `keys`, or FieldNotFoundError."""

    def kv_batch_get_columns(
        self, keys: Sequence[str], partition_id: str, select_fields: Sequence[str]
    ) -> dict[str, Any]:
        """`kv_batch_get` as plain columns, `{field: tensor, or list of per-sample values}`: what a transport to
        another process carries (a list column costs a fraction of its TensorDict form to build and to pickle)."""
        columns = self._read(self._get_columns, keys, partition_id, select_fields)
        if self.metrics:
            self.metrics.record_get(len(keys), sum(map(_read_nbytes, columns.values())))
        return columns

    def _get_columns(self, keys: list[str], partition_id: str, select_fields: list[str]) -> dict[str, Any]:
        """The backend's part of kv_batch_get_columns (by default, `_get`'s TensorDict taken apart)."""
        return plain_columns(self._get(keys, partition_id, select_fields))

    @abc.abstractmethod
    def kv_list(self, partition_id: str) -> list[str]:
        """The keys stored in `partition_id`, in first-written order (empty if the partition is unknown)."""

    @abc.abstractmethod
    def kv_clear(self, partition_id: str, keys: Iterable[str] | None = None) -> None:
        """Drop `keys` from `partition_id`, or the whole partition when `keys` is None."""

    metrics_server: Any = None  # set by make_data_plane when metrics are served
    metrics: Any = None  # a DataPlaneMetrics when Prometheus metrics are on

    def _timed(self, op: str) -> Any:
        """A context timing one operation for the latency histogram (a no-op without metrics)."""
        return self.metrics.time(op) if self.metrics is not None else contextlib.nullcontext()

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("the data plane is closed; create a new one with make_data_plane()")

    @abc.abstractmethod
    def _release(self) -> None:
        """Free the backend's storage (called once by close)."""

    def close(self) -> None:
        """Release storage and stop any metrics server; safe to call twice."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        try:
            self._release()
        finally:
            if self.metrics_server is not None:
                self.metrics_server.shutdown()
                self.metrics_server = None

    @property
    def closed(self) -> bool:
        """Whether close() was called."""
        return getattr(self, "_closed", False)

    def get(self, meta: KVBatchMeta, select_fields: Sequence[str]) -> TensorDict:
        """Read `select_fields` for the samples a handle points at."""
        return self.kv_batch_get(keys=meta.keys, partition_id=meta.partition_id, select_fields=list(select_fields))

    def put(self, meta: KVBatchMeta, fields: Any) -> KVBatchMeta:
        """Write `fields` for the samples a handle points at; returns the handle with the new fields listed."""
        out = self.kv_batch_put(keys=meta.keys, partition_id=meta.partition_id, fields=fields)
        return meta.with_fields(out.fields)

    def __enter__(self) -> DataPlane:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def field_items(fields: Any) -> list[tuple[str, Any]]:
    """The (name, column) pairs of a TensorDict or mapping given to kv_batch_put."""
    if isinstance(fields, TensorDict) or hasattr(fields, "batch_size"):
        out = []
        for name in fields.keys():
            out.append((name, fields.get(name)))
        return out
    if isinstance(fields, Mapping):
        return list(fields.items())
    raise TypeError(
        f"kv_batch_put takes a TensorDict or a mapping of field name to column, got {type(fields).__name__}"
    )


def column_kind(name: str, value: Any, n: int) -> tuple[str, Any]:
    """(kind, rows) of a column given to kv_batch_put: DENSE (B, ...) tensor, NESTED jagged tensor, or LIST of
    values."""
    if isinstance(value, NonTensorStack):
        value = value.tolist()
    if isinstance(value, torch.Tensor):
        if value.is_nested:
            rows = list(value.unbind(0))
            kind = NESTED
        else:
            if value.dim() == 0:
                raise ValueError(f"field {name!r} is a 0-d tensor; give one row per key (shape ({n}, ...))")
            rows = value
            kind = DENSE
    elif isinstance(value, (list, tuple)):
        rows = list(value)
        kind = LIST
    else:
        raise ValueError(
            f"field {name!r} has type {type(value).__name__}; give a tensor with one row per key, "
            "a jagged nested tensor, or a list with one value per key"
        )
    if len(rows) != n:
        raise ValueError(f"field {name!r} has {len(rows)} rows for {n} keys; give one row per key")
    return kind, rows


def empty_column(record: Mapping) -> Any:
    """The zero-row column of a field's record (schema.py) that a get of no keys returns: dense, jagged or a list."""
    if record["kind"] not in (DENSE, NESTED):
        return NonTensorStack(batch_size=[0])
    values = torch.empty((0, *(record["trailing"] or ())), dtype=dtype_of(record["dtype"]))
    if record["kind"] == DENSE:
        return values
    return torch.nested.nested_tensor_from_jagged(values, offsets=torch.zeros(1, dtype=torch.long))


class Column(NamedTuple):
    """One field of a put, checked: its name, kind, rows (a (B, ...) tensor or a list) and record (see schema.py)."""

    name: str
    kind: str
    rows: Any
    record: dict


def prepare_put(keys: Sequence[str], fields: Any, tags: Sequence[dict] | None) -> tuple[list[str], list[Column]]:
    """Check kv_batch_put's arguments (unique keys, one tag and one row per key); (keys as str, columns)."""
    keys = [str(k) for k in keys]
    n = len(keys)
    if len(set(keys)) != n:
        raise ValueError("kv_batch_put got duplicate keys; each sample needs a unique key")
    if tags is not None and len(tags) != n:
        raise ValueError(f"kv_batch_put got {len(tags)} tags for {n} keys; give one dict per key")
    columns = []
    for name, value in field_items(fields):
        kind, rows = column_kind(name, value, n)
        columns.append(Column(name, kind, rows, record_of(kind, rows)))
    return keys, columns


# Byte counts for the metrics: tensor bytes of dense, ragged and tensors inside list columns; Python values count 0.
def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _values_nbytes(values: Iterable[Any]) -> int:
    return sum(_nbytes(v) for v in values if isinstance(v, torch.Tensor))


def _column_nbytes(column: Column) -> int:
    return _nbytes(column.rows) if column.kind == DENSE else _values_nbytes(column.rows)


def _read_nbytes(value: Any) -> int:
    """A read column's bytes: a tensor (dense or jagged), or a list column (a list or its NonTensorStack)."""
    if isinstance(value, torch.Tensor):
        return _nbytes(value.values() if value.is_nested else value)
    return _values_nbytes(value if isinstance(value, list) else value.tolist())


def _batch_nbytes(td: TensorDict) -> int:
    return sum(_read_nbytes(td.get(name)) for name in td.keys())


# --------------------------------------------------------------------------- a read's two forms
def plain_columns(td: TensorDict) -> dict[str, Any]:
    """A read's TensorDict as `{field: tensor, or list of per-sample values}` (what crosses a process boundary)."""
    return {name: value if isinstance(value := td.get(name), torch.Tensor) else value.tolist() for name in td.keys()}


def columns_tensordict(rows: int, columns: dict[str, Any]) -> TensorDict:
    """`plain_columns`' inverse: a list column becomes the `NonTensorStack` every read returns (empty ones too)."""
    out = TensorDict(batch_size=[rows])
    for name, value in columns.items():
        if not isinstance(value, torch.Tensor):
            value = NonTensorStack.from_list(value) if value else NonTensorStack(batch_size=[0])
        out.set(name, value)
    return out


# --------------------------------------------------------------------------- tensors as numpy buffers
# How the backends that move tensors between processes carry them (`ray`, the served plane): numpy buffers, which
# pickle and map without torch's own serialisation. numpy has no bfloat16 or float8: such tensors travel as an
# integer view of the same bytes.
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def tensor_to_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy array over `t`'s bytes (no copy when `t` is a contiguous CPU tensor)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    try:
        return t.numpy()
    except TypeError:
        return t.view(_SAME_SIZE_INT[t.element_size()]).numpy()


def tensor_from_numpy(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A tensor view of `a` as `dtype` (possibly over read-only memory: callers copy before handing it out)."""
    with warnings.catch_warnings():
        # Buffers mapped from the object store or unpickled from bytes are read-only; every caller copies.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        t = torch.from_numpy(a)
    return t if t.dtype == dtype else t.view(dtype)
