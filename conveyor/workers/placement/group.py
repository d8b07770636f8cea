"""Worker groups: where the ranks of a role run, and how one call is split across them and merged back.

A role's handle (`conveyor.workers.placement.roles`) calls `group.call(PolicyWorker.compute_log_prob, meta)`;
the group splits the handle across its ranks (balancing tokens when the
handle's tags carry `seq_len`: prompt + response once the rollout has run;
the split's `perf/<endpoint>/rank_token_imbalance` joins the merged
`extra_info`), runs the endpoint on every rank, and merges the
per-rank handles with `BatchData.concat` (so `extra_info` arrives as one list
entry per rank). `LocalWorkerGroup` runs one rank in this process;
`conveyor.workers.placement.ray_group` runs ranks as Ray actors behind the same
interface. Both build each rank from the same `WorkerSpec`.

The roles the run plan places on the actor's ranks (colocated: the actor, and
the reference, critic, teachers or reward model when they run there) share
their ranks: rank i of every one of them is built in one process by a
`ColocatedWorker` (in this process for a local run, in rank i's Ray actor
otherwise), on one device and in one `torch.distributed` process group. Each role's group is a view of
that process's worker for the role: `LocalWorkerGroup.hosted(host, role)`.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from conveyor.plugins import load_plugins
from conveyor.protocol import BatchData, KVBatchMeta
from conveyor.workers.training.balance import SEQ_LEN_TAG, balanced_partition, imbalance

__all__ = [
    "WorkerGroup",
    "LocalWorkerGroup",
    "WorkerSpec",
    "ColocatedWorker",
    "WorkerError",
    "WorkerUserError",
    "split_for_ranks",
    "split_metrics",
    "wrap_worker_error",
    "use_ray",
]

# An endpoint is named by the worker class's own method (`PolicyWorker.update_actor`), never by a string.
Endpoint = Callable[..., Any]


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """How to build one rank of a role: `cls(rank=, world_size=, **kwargs)`, after importing the run's plugins."""

    role: str
    cls: type
    kwargs: dict[str, Any]
    plugins: tuple[str, ...] = ()

    def build(self, rank: int, world_size: int) -> Any:
        """The worker of rank `rank` (plugins first: a Ray rank is a fresh process with empty registries)."""
        load_plugins(list(self.plugins))
        return self.cls(rank=rank, world_size=world_size, **self.kwargs)


class ColocatedWorker:
    """Rank `rank` of several roles in one process: one worker per spec, built in order, sharing device and ranks.

    The roles run one call at a time (the trainer's stages are sequential), so
    their collectives use the one process group of the process in the same
    order on every rank. A role's frozen copy of the model (the reference)
    costs its own parameters only, not a second process with its own
    interpreter, libraries and allocator.
    """

    def __init__(self, rank: int, world_size: int, specs: Sequence[WorkerSpec] = ()):
        self.rank, self.world_size = rank, world_size
        self.workers: dict[str, Any] = {}
        try:
            for spec in specs:
                self.add(spec)
        except BaseException:
            self.close()
            raise

    def add(self, spec: WorkerSpec) -> Any:
        """Build this rank's worker of `spec.role` here (after the roles already hosted)."""
        if spec.role in self.workers:
            raise ValueError(f"role {spec.role!r} is hosted twice")
        self.workers[spec.role] = spec.build(rank=self.rank, world_size=self.world_size)
        return self.workers[spec.role]

    @property
    def roles(self) -> list[str]:
        """The roles hosted here, in build order."""
        return list(self.workers)

    def worker(self, role: str) -> Any:
        """The worker of `role` in this process."""
        return self.workers[role]

    def close(self, role: str | None = None) -> None:
        """Let `role`'s worker (every worker when None) release what it holds outside Python, if it says how."""
        for name in [role] if role is not None else list(self.workers):
            close = getattr(self.workers.get(name), "close", None)
            if callable(close):
                close()


def use_ray(cfg: Any) -> bool:
    """Whether a run's workers are Ray actors (more than one rank or node, or a Ray cluster named)."""
    t = cfg.trainer
    return t.nnodes > 1 or t.n_gpus_per_node > 1 or t.num_cpu_workers > 1 or cfg.ray.address is not None


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
    """Split a handle into `n` chunks of sizes differing by at most one, balancing `seq_len` tags when present.

    With tags, the chunks' token sums are balanced (`balanced_partition`, equal counts); each chunk keeps its
    samples in the handle's order. Results are written by key, so the reordering across ranks is harmless.
    """
    if n == 1:
        return [meta]
    lengths = [t.get(SEQ_LEN_TAG) for t in meta.tags]
    if any(v is None for v in lengths):
        return meta.chunk(n)
    return [meta.select(part) for part in balanced_partition(lengths, n, equal_size=True)]


def split_metrics(chunks: Sequence[KVBatchMeta], endpoint: str) -> dict[str, list[float]]:
    """`perf/<endpoint>/rank_token_imbalance` (max / mean of the chunks' `seq_len` sums), one entry per rank.

    Empty when there is one chunk or the tags carry no `seq_len` (nothing was balanced).
    """
    if len(chunks) < 2:
        return {}
    sums = []
    for c in chunks:
        lengths = [t.get(SEQ_LEN_TAG) for t in c.tags]
        if any(v is None for v in lengths):
            return {}
        sums.append(float(sum(lengths)))
    # The same value in every rank's entry: reduced (mean over ranks) it is the split's own figure.
    return {f"perf/{endpoint}/rank_token_imbalance": [imbalance(sums)] * len(chunks)}


class WorkerGroup(abc.ABC):
    """The ranks of one role."""

    role: str
    world_size: int

    @abc.abstractmethod
    def call(self, endpoint: Endpoint, meta: KVBatchMeta) -> KVBatchMeta:
        """Run `endpoint` on every rank over its share of `meta`; the merged handle."""

    @abc.abstractmethod
    def call_all(self, method: Endpoint, *args: Any, **kwargs: Any) -> list[Any]:
        """Run `method` with the same arguments on every rank; one result per rank."""

    def shutdown(self) -> None:
        """Release the ranks (no-op in process)."""


class LocalWorkerGroup(WorkerGroup):
    """One rank, in this process: no serialization, no copies."""

    def __init__(self, spec: WorkerSpec):
        self._init(ColocatedWorker(0, 1, [spec]), spec.role)

    @classmethod
    def hosted(cls, host: ColocatedWorker, role: str) -> LocalWorkerGroup:
        """The group of `role`, whose one rank `host` (built in this process with the other model roles) holds."""
        group = cls.__new__(cls)
        group._init(host, role)
        return group

    def _init(self, host: ColocatedWorker, role: str) -> None:
        self.host, self.role = host, role
        self.world_size = 1
        self.worker = host.worker(role)

    def shutdown(self) -> None:
        """Let the worker release what it holds outside Python (a vllm engine), if it says how."""
        self.host.close(self.role)

    def call(self, endpoint: Endpoint, meta: KVBatchMeta) -> KVBatchMeta:
        """Run `endpoint` on the single rank."""
        try:
            out = _bound(self.worker, endpoint)(meta)
        except Exception as err:
            raise wrap_worker_error(self.role, 0, endpoint.__name__, err) from err
        return BatchData([out]).concat()

    def call_all(self, method: Endpoint, *args: Any, **kwargs: Any) -> list[Any]:
        """Run `method` on the single rank."""
        return [_bound(self.worker, method)(*args, **kwargs)]


def _bound(worker: Any, method: Endpoint) -> Callable[..., Any]:
    """`worker`'s own method of that name: a subclass's override runs here as it does on a Ray rank."""
    return getattr(worker, method.__name__)
