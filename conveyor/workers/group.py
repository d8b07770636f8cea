"""Worker groups: where the ranks of a role run, and how one call is split across them and merged back.

The trainer calls `group.call("compute_log_prob", meta)`; the group splits the
handle across its ranks (balancing tokens when the handle's tags carry
`seq_len`), runs the endpoint on every rank, and merges the per-rank handles
with `BatchData.concat` (so `extra_info` arrives as one list entry per rank).
`LocalWorkerGroup` runs one rank in this process; `conveyor.workers.ray_group`
runs ranks as Ray actors behind the same interface.
"""

from __future__ import annotations

import abc
from typing import Any, Callable

from conveyor.protocol import BatchData, KVBatchMeta

__all__ = ["WorkerGroup", "LocalWorkerGroup", "WorkerError", "WorkerUserError", "split_for_ranks", "wrap_worker_error"]


class WorkerError(RuntimeError):
    """A worker endpoint failed; the message names the role, the rank and the stage."""

    def __init__(self, role: str, rank: int, stage: str, cause: BaseException):
        self.role, self.rank, self.stage, self.cause = role, rank, stage, cause
        super().__init__(f"{role} rank {rank} failed in {stage}: {type(cause).__name__}: {cause}")


class WorkerUserError(WorkerError, ValueError):
    """A worker failed because of the user's input (config, data, reward function): exit status 2."""


def wrap_worker_error(role: str, rank: int, stage: str, err: BaseException) -> WorkerError:
    """The WorkerError (or WorkerUserError, for a ValueError cause) that reports `err`."""
    if isinstance(err, WorkerError):
        return err
    cls = WorkerUserError if isinstance(err, ValueError) else WorkerError
    return cls(role, rank, stage, err)


def split_for_ranks(meta: KVBatchMeta, n: int) -> list[KVBatchMeta]:
    """Split a handle into `n` chunks of sizes differing by at most one, balancing `seq_len` tags when present."""
    if n == 1:
        return [meta]
    lengths = [t.get("seq_len") for t in meta.tags]
    if any(v is None for v in lengths):
        return meta.chunk(n)
    base, rest = divmod(len(meta), n)
    caps = [base + (1 if i < rest else 0) for i in range(n)]
    loads = [0] * n
    assigned: list[list[int]] = [[] for _ in range(n)]
    # Longest first onto the least-loaded rank that still has room.
    for idx in sorted(range(len(meta)), key=lambda i: -lengths[i]):
        rank = min((r for r in range(n) if len(assigned[r]) < caps[r]), key=lambda r: loads[r])
        assigned[rank].append(idx)
        loads[rank] += lengths[idx]
    return [meta.select(sorted(a)) for a in assigned]


class WorkerGroup(abc.ABC):
    """The ranks of one role."""

    role: str
    world_size: int

    @abc.abstractmethod
    def call(self, method: str, meta: KVBatchMeta) -> KVBatchMeta:
        """Run `method` on every rank over its share of `meta`; the merged handle."""

    @abc.abstractmethod
    def call_rank0(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run `method` on rank 0 only (e.g. to read a state dict)."""

    @abc.abstractmethod
    def call_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Run `method` with the same arguments on every rank; one result per rank."""

    def shutdown(self) -> None:
        """Release the ranks (no-op in process)."""


class LocalWorkerGroup(WorkerGroup):
    """One rank, in this process: no serialization, no copies."""

    def __init__(self, role: str, factory: Callable[..., Any]):
        self.role = role
        self.world_size = 1
        self.worker = factory(rank=0, world_size=1)

    def call(self, method: str, meta: KVBatchMeta) -> KVBatchMeta:
        """Run `method` on the single rank."""
        try:
            out = getattr(self.worker, method)(meta)
        except Exception as err:
            raise wrap_worker_error(self.role, 0, method, err) from err
        return BatchData([out]).concat()

    def call_rank0(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run `method` on the single rank."""
        return getattr(self.worker, method)(*args, **kwargs)

    def call_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Run `method` on the single rank."""
        return [getattr(self.worker, method)(*args, **kwargs)]
