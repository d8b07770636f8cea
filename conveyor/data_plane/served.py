"""A data plane served to workers in other processes of the same machine.

The embedded `memory` store lives in the trainer's process. When a run puts
one role in a process of its own on the same machine (the asynchronous
rollout worker group, `trainer.v1.separate_async.rollout_process=own`), that
role still reads and writes the one store: `DataPlaneServer(plane)` serves
the plane on a Unix socket, and `server.client()` is a `ServedDataPlane`,
a picklable `DataPlane` whose operations run on the served plane. The trainer
keeps using the plane itself, at in-process cost; only the other processes'
reads and writes cross the socket.

Transport: `multiprocessing.connection` from the standard library (a Unix
socket, in Linux's abstract namespace so that a killed trainer leaves no file
behind; connections authenticated with a random key, so another user's process
cannot read samples), one connection per client thread, served by one thread
each on the trainer's side. A request and its answer are one pickle (protocol
5): tensors as numpy buffers (as the `ray` backend carries them; torch's own
reduction costs ten times more for the small tensors of a batch), list
columns as lists; the answer of a read is rebuilt as the TensorDict the plane
returned. An error on the served side
(`FieldNotFoundError`, a refused put) is raised in the caller as itself.

Deferred writes. A chain of endpoints over one batch in a worker's process
(a rollout replica generates, then its reward worker scores) would cross the
socket four times: read the prompts, write the responses, read them back,
write the scores. Inside `deferred_writes()` a thread's puts of one batch
(the same partition and keys) are held and merged, reads of fields they hold
are answered in the worker, and the merged put is sent once, at the end of
the block: a replica that also renders its prompts writes a batch in a
single request. A put that rewrites a held field, a put or read of other
keys, and `kv_list` / `kv_clear` first send what is held, so every read sees
every earlier write.

What it deliberately does not do: cross machines (a Unix socket; multi-node
runs use the `ray` backend), serve any backend but a thread-safe one (the
memory store is), or outlive the server: a client whose server is gone fails
with a message saying so.
"""

from __future__ import annotations

import contextlib
import copyreg
import io
import logging
import os
import pickle
import secrets
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterable, Iterator, Sequence
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

import torch
from tensordict import TensorDict

from conveyor.data_plane.base import DataPlane, columns_tensordict, plain_columns, tensor_from_numpy, tensor_to_numpy
from conveyor.data_plane.schema import dtype_name, dtype_of
from conveyor.protocol import KVBatchMeta

__all__ = ["DataPlaneServer", "ServedDataPlane", "THREAD_PREFIX", "deferred_writes", "local_socket_address"]

# The names of the server's threads start with it (what the asynchronous source's CPU metrics group them by).
THREAD_PREFIX = "conveyor-data-plane"

logger = logging.getLogger(__name__)


def _rebuild_tensor(array: Any, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    return tensor_from_numpy(array, dtype_of(dtype)).reshape(shape).clone()


def _reduce_tensor(t: torch.Tensor) -> Any:
    """A CPU tensor as a numpy buffer (an order of magnitude cheaper to pickle than torch's own reduction)."""
    if t.is_nested or t.layout != torch.strided or t.requires_grad:
        return t.__reduce_ex__(5)
    return _rebuild_tensor, (tensor_to_numpy(t), dtype_name(t.dtype), tuple(t.shape))


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    pickler = pickle.Pickler(buf, protocol=5)
    pickler.dispatch_table = {**copyreg.dispatch_table, torch.Tensor: _reduce_tensor}
    pickler.dump(obj)
    return buf.getvalue()


def local_socket_address(prefix: str) -> tuple[str, str | None]:
    """A fresh Unix socket address named after `prefix`: abstract on Linux (no file to leave behind when the process
    is killed), else a file in a new temporary folder; (the address, that folder or None)."""
    if sys.platform.startswith("linux"):
        return f"\0{prefix}-{os.getpid()}-{secrets.token_hex(8)}", None
    folder = tempfile.mkdtemp(prefix=f"{prefix}-")
    return os.path.join(folder, "socket"), folder


class DataPlaneServer:
    """Serves `plane` to other processes on this machine until `close()`; `client()` reaches it."""

    def __init__(self, plane: DataPlane):
        self.plane = plane
        self.address, self._dir = local_socket_address("conveyor-dp")
        self._authkey = os.urandom(32)
        self._listener = Listener(self.address, family="AF_UNIX", authkey=self._authkey)
        self._conns: list[Connection] = []
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name=f"{THREAD_PREFIX}-server", daemon=True).start()

    def client(self) -> ServedDataPlane:
        """A data plane for another process (picklable: a Ray actor receives it as an argument)."""
        return ServedDataPlane(self.address, self._authkey)

    def _accept(self) -> None:
        while True:
            try:
                conn = self._listener.accept()
            except Exception:  # closed, or a client that failed authentication: stop, or keep serving the others
                if self._closed:
                    return
                logger.warning("data-plane server: a connection was refused", exc_info=True)
                continue
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), name=f"{THREAD_PREFIX}-conn", daemon=True).start()

    def _serve(self, conn: Connection) -> None:
        """Answer one client thread's requests in order until it disconnects."""
        while True:
            try:
                request = conn.recv_bytes()
            except (EOFError, OSError):
                return
            except Exception:
                if self._closed:  # `close()` shut the connection under the read
                    return
                raise
            try:
                conn.send_bytes(self.answer(request))
            except (EOFError, OSError):
                return

    def answer(self, request: bytes) -> bytes:
        """One request's answer, as the serving thread computes it (what it holds the interpreter lock for)."""
        try:
            op, args = pickle.loads(request)
            answer = ("ok", self._run(op, args))
        except BaseException as err:  # the caller's error, raised there
            answer = ("err", err)
        try:
            return _dumps(answer)
        except Exception as err:  # an error that does not pickle still reaches the caller, as text
            return _dumps(
                ("err", RuntimeError(f"{type(answer[1]).__name__}: {answer[1]} (in the served data plane; {err})"))
            )

    def _run(self, op: str, args: tuple) -> Any:
        if op in ("put", "write"):  # a write answers None: the caller wants no handle (256 keys and tags to pickle)
            keys, partition_id, fields, tags = args
            meta = self.plane.kv_batch_put(keys, partition_id, fields, tags)
            return meta if op == "put" else None
        if op == "get":  # plain columns: a list column's TensorDict form costs ten times more to build
            return len(args[0]), self.plane.kv_batch_get_columns(*args)
        if op == "list":
            return self.plane.kv_list(*args)
        if op == "clear":
            return self.plane.kv_clear(*args)
        raise ValueError(f"the served data plane has no operation {op!r}")

    def close(self) -> None:
        """Stop serving (the plane itself stays open: its owner closes it); safe to call twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns, self._conns = self._conns, []
        self._listener.close()
        for conn in conns:
            conn.close()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


class _Held:
    """The put a `deferred_writes` block holds back: one partition's keys and the fields written to them so far."""

    def __init__(self, plane: ServedDataPlane, keys: list[str], partition_id: str):
        self.plane, self.keys, self.partition_id = plane, keys, partition_id
        self.fields: dict[str, Any] = {}
        self.tags: list[dict] | None = None

    def covers(self, plane: ServedDataPlane, keys: list[str], partition_id: str) -> bool:
        """Whether `keys` of `partition_id` on `plane`'s server are exactly the held ones."""
        return plane.address == self.plane.address and partition_id == self.partition_id and keys == self.keys


class DeferredWrites:
    """A thread's `deferred_writes` block: at most one held put, sent by `send()` (or at the end of the block)."""

    def __init__(self) -> None:
        self.held: _Held | None = None

    def send(self) -> None:
        """Send the held put now (the served plane checks it then: a refused put raises here)."""
        held, self.held = self.held, None
        if held is not None and held.fields:
            # A write, not a put: no handle comes back (the block's puts have returned theirs).
            held.plane._call("write", held.keys, held.partition_id, held.fields, held.tags)


_scope = threading.local()


@contextlib.contextmanager
def deferred_writes() -> Iterator[DeferredWrites]:
    """Within the block, this thread's puts of one batch to a served plane are merged and sent once, at its end (not
    at all when the block raises), and reads of what they wrote are answered here (the module's docstring)."""
    if getattr(_scope, "writes", None) is not None:  # nested: the outer block sends
        yield _scope.writes
        return
    writes = _scope.writes = DeferredWrites()
    try:
        yield writes
        writes.send()
    finally:
        _scope.writes = None


def _held_copy(value: Any) -> Any:
    # Held until the block ends: a caller changing its tensor or list after the put must not change what is written.
    return value.clone() if isinstance(value, torch.Tensor) else list(value)


class ServedDataPlane(DataPlane):
    """A data plane served by a `DataPlaneServer` in another process of this machine: every operation runs there."""

    backend = "served"

    def __init__(self, address: str, authkey: bytes):
        self.address, self._authkey = address, authkey
        self._local = threading.local()
        self._closed = False

    def __getstate__(self) -> dict[str, Any]:
        return {"address": self.address, "_authkey": self._authkey}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["address"], state["_authkey"])

    def _call(self, op: str, *args: Any) -> Any:
        self._check_open()
        conn = getattr(self._local, "conn", None)
        try:
            if conn is None:
                conn = self._local.conn = Client(self.address, family="AF_UNIX", authkey=self._authkey)
            conn.send_bytes(_dumps((op, args)))
            status, value = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError) as err:
            self._local.conn = None
            where = self.address.lstrip("\0")  # an abstract socket's name starts with a NUL byte
            raise RuntimeError(
                f"the data plane served at {where} is gone (the trainer's process ended or closed it): {err}"
            ) from err
        if status == "err":
            raise value
        return value

    # The served plane checks and times every operation; this side only forwards them.
    def kv_batch_put(
        self, keys: Sequence[str], partition_id: str, fields: Any, tags: Sequence[dict] | None = None
    ) -> KVBatchMeta:
        """`kv_batch_put` on the served plane."""
        if isinstance(fields, TensorDict) or hasattr(fields, "batch_size"):
            fields = plain_columns(fields)  # a TensorDict pickles several times slower
        keys, tags = [str(k) for k in keys], None if tags is None else list(tags)
        writes = getattr(_scope, "writes", None)
        if writes is None:
            return self._call("put", keys, partition_id, fields, tags)
        return self._hold(writes, keys, partition_id, dict(fields), tags)

    def _hold(
        self,
        writes: DeferredWrites,
        keys: list[str],
        partition_id: str,
        fields: dict[str, Any],
        tags: list[dict] | None,
    ) -> KVBatchMeta:
        """A put inside `deferred_writes`: merged into the held one (sent first when it cannot be merged)."""
        held = writes.held
        if held is not None and (
            not held.covers(self, keys, partition_id)
            or not held.fields.keys().isdisjoint(fields)
            or (tags is not None and held.tags is not None)
        ):
            writes.send()  # each rewrite is checked by the served plane, as it would be put by put
            held = None
        if held is None:
            held = writes.held = _Held(self, keys, partition_id)
        held.fields.update({name: _held_copy(value) for name, value in fields.items()})
        if tags is not None:
            held.tags = [dict(t) for t in tags]
        # The fields this block wrote to the keys (the plane's other fields of them are not asked for).
        return KVBatchMeta(
            keys=keys,
            partition_id=partition_id,
            fields=list(held.fields),
            tags=[dict(t) for t in held.tags] if held.tags is not None else [],
        )

    def kv_batch_get(self, keys: Sequence[str], partition_id: str, select_fields: Sequence[str]) -> TensorDict:
        """`kv_batch_get` on the served plane (inside `deferred_writes`, the fields held here are read here)."""
        keys, select_fields = [str(k) for k in keys], list(select_fields)
        writes = getattr(_scope, "writes", None)
        held = writes.held if writes is not None else None
        if held is None:
            return columns_tensordict(*self._call("get", keys, partition_id, select_fields))
        if not held.covers(self, keys, partition_id):
            writes.send()
            return columns_tensordict(*self._call("get", keys, partition_id, select_fields))
        rest = [f for f in select_fields if f not in held.fields]
        served = self._call("get", keys, partition_id, rest)[1] if rest else {}
        columns = {f: served[f] if f in served else _held_copy(held.fields[f]) for f in select_fields}
        return columns_tensordict(len(keys), columns)

    def _put(self, keys, partition_id, columns, tags):  # pragma: no cover - kv_batch_put forwards before this
        raise AssertionError("ServedDataPlane forwards kv_batch_put whole")

    def _get(self, keys, partition_id, select_fields):  # pragma: no cover - kv_batch_get forwards before this
        raise AssertionError("ServedDataPlane forwards kv_batch_get whole")

    def kv_list(self, partition_id: str) -> list[str]:
        """`kv_list` on the served plane."""
        self._send_held()
        return self._call("list", partition_id)

    def kv_clear(self, partition_id: str, keys: Iterable[str] | None = None) -> None:
        """`kv_clear` on the served plane."""
        self._send_held()
        self._call("clear", partition_id, None if keys is None else list(keys))

    @staticmethod
    def _send_held() -> None:
        writes = getattr(_scope, "writes", None)
        if writes is not None:
            writes.send()

    def _release(self) -> None:
        """Disconnect this thread (the served plane is its owner's to close)."""
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None
