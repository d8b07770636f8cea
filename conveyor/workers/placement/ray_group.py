"""Worker groups on Ray: the ranks of a role as Ray actors, with `torch.distributed` inside the role.

`RayWorkerGroup` starts one actor per rank, joins the ranks into a process
group (gloo on CPU, nccl on GPU; rank 0 picks its node's IP and a free port),
then builds the worker in every rank from the role's `WorkerSpec` (the same
spec a `LocalWorkerGroup` builds from, see `conveyor.workers.placement.roles`). A call
splits the handle over the ranks (`split_for_ranks`), runs every rank at once
and merges what they return with `BatchData.concat`, so per-rank metrics
arrive as lists, one entry per rank. A failure in any rank is reported at once
as one `WorkerError` naming the role, the rank and the endpoint, with the
original exception's type and message; the other ranks of that role are
stopped (they may be waiting in a collective that will never complete).
Ranks on this machine whose every batch is one call (the asynchronous
rollout's replicas) can take those calls over a Unix socket each instead of
a Ray task per call (`RayRanks.open_links`, `conveyor.workers.placement.link`), with the
same errors.

Placement: the roles on the actor's ranks (the actor, and those the run plan
places with it: reference, critic, teachers, reward model) share their ranks
(`RayRanks`): rank i of every role is built in one Ray actor, so in one
process, on one GPU (the whole of it) and in one process group; the placement
group holds one bundle per rank. No role starts a process of its own per
device: a frozen reference costs its parameters, not
a second interpreter, CUDA context and allocator per GPU.
Ranks are numbered node by node. Resources that the cluster cannot provide are
a `ValueError` at once (or after `ray.timeout_s` when they exist but are
busy), never a silent wait.

This module is the driver's side. What runs in each rank's process (the process group, the
workers, the endpoints) is `conveyor.workers.placement.ray_rank`; reserving the bundles and
numbering the ranks is `conveyor.workers.placement.ray_placement`.

What it deliberately does not do: restart failed ranks, decide how the ranks
hold a model (the role's strategy does: `conveyor.workers.training.strategy`), or start
Ray (`conveyor.ray_utils.ensure_ray`).
"""

from __future__ import annotations

import functools
import logging
import math
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import ray

from conveyor.protocol import BatchData, KVBatchMeta
from conveyor.workers.placement.group import (
    Endpoint,
    WorkerGroup,
    WorkerSpec,
    split_for_ranks,
    split_metrics,
    wrap_worker_error,
)
from conveyor.workers.placement.ray_placement import RayPlacement
from conveyor.workers.placement.ray_rank import remote_rank_class

__all__ = [
    "Pending",
    "RankDied",
    "RankHung",
    "RayWorkerGroup",
    "RayRanks",
    "RayPlacement",
    "build_ray_worker_groups",
    "build_ray_rollout_groups",
    "gather_together",
    "gather_with_local",
    "ray_worker_device",
]

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- a rank's failure
class RankDied(RuntimeError):
    """A rank's process ended in a call (a crash, the kernel's OOM killer, a signal): Ray's report and its last
    words."""


def _original(err: BaseException, ranks: RayRanks | None = None, rank: int = 0) -> BaseException:
    """The exception a rank raised, out of Ray's wrapper; a dead rank's process adds the end of its stderr."""
    if isinstance(err, ray.exceptions.RayTaskError):
        cause = getattr(err, "cause", None)
        if isinstance(cause, BaseException):
            return cause
    if isinstance(err, ray.exceptions.ActorDiedError) and ranks is not None:
        tail = _stderr_tail(ranks, rank)
        if tail:
            return RankDied(f"{type(err).__name__}: {err}\n{tail}")
    return err


def _stderr_tail(ranks: RayRanks, rank: int, lines: int = 40) -> str:
    """The last `lines` lines of rank `rank`'s Ray worker stderr file (where a native crash's traceback lands:
    Ray's workers enable `faulthandler`), with its path; empty when it cannot be read (another node, no file)."""
    try:
        pid = ranks.where[rank]["pid"]
        logs = ray._private.worker.global_worker.node.get_logs_dir_path()
        paths = [
            os.path.join(logs, f) for f in os.listdir(logs) if f.startswith("worker-") and f.endswith(f"-{pid}.err")
        ]
        if not paths:
            return ""
        with open(paths[0], errors="replace") as f:  # faulthandler's list of loaded extension modules says nothing
            text = [line for line in f.readlines() if not line.startswith("Extension modules:")][-lines:]
    except Exception:  # a diagnosis only: never hide the failure it comes with
        return ""
    return f"the end of its stderr ({paths[0]}):\n" + "".join(text).rstrip()


class RankHung(RuntimeError):
    """A rank answered no call within its deadline (a stopped or deadlocked process)."""


def _process_alive(where: dict[str, Any] | None) -> bool:
    """Whether the rank process `where` describes still runs (True when it is on another node: Ray tells then)."""
    if where is None or where.get("node_ip") not in (None, ray.util.get_node_ip_address()):
        return True
    import psutil

    try:
        return psutil.Process(int(where["pid"])).status() != psutil.STATUS_ZOMBIE
    except (psutil.Error, KeyError, ValueError):
        return False


def _kill_process(where: dict[str, Any] | None) -> None:
    """SIGKILL a rank's process on this node (a stopped process ends too, which Ray's graceful kill would wait for)."""
    if where is None or where.get("node_ip") != ray.util.get_node_ip_address():
        return
    import signal

    try:
        os.kill(int(where["pid"]), signal.SIGKILL)
    except (OSError, KeyError, ValueError):
        pass


# --------------------------------------------------------------------------- the ranks and the groups
class RayRanks:
    """One Ray actor (process) per rank hosting rank i of every colocated role, in one process group.

    Each role's `RayWorkerGroup` is a view of these ranks (`group(role)`). A
    failure of any rank stops all of them: every role's ranks share the
    processes, and the others may be waiting in a collective. `concurrency`: calls a rank runs at once (the
    rollout replicas take 2: a weight sync beside a generation; their caller keeps everything else in order).
    """

    def __init__(
        self,
        specs: Sequence[WorkerSpec],
        *,
        world_size: int = 1,
        num_cpus: float = 0.5,
        num_gpus: float = 0.0,
        placement: RayPlacement | None = None,
        nnodes: int = 1,
        timeout_s: float = 60.0,
        process_group: bool = True,
        concurrency: int = 1,
    ):
        self.roles = [s.role for s in specs]
        self.name = "+".join(self.roles)
        if world_size < 1:
            raise ValueError(f"{self.name}: world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.actors: list[Any] = []
        self.where: list[dict[str, Any]] = []
        self.closed = False
        self.links: list[Any] | None = None  # `open_links`: one per rank
        self._link_lock = threading.Lock()
        self._users = set(self.roles)
        self.placement: RayPlacement | None = None
        if placement is None:
            bundle = {"CPU": num_cpus, "GPU": math.ceil(num_gpus)}
            placement = RayPlacement(self.name, world_size, bundle, nnodes=nnodes, timeout_s=timeout_s)
        elif placement.world_size != world_size:
            raise ValueError(
                f"{self.name}: world_size {world_size} differs from the placement's {placement.world_size}"
            )
        placement.acquire(self.name)
        self.placement = placement
        self._specs = list(specs)
        self._options = {"num_cpus": num_cpus, "num_gpus": num_gpus, "concurrency": concurrency}
        self._process_group = process_group
        # (timeout_s, interval_s) of a linked call: an answer later than timeout_s is a hung rank (`LinkTimeout`),
        # and its process is looked at every interval_s while the call is outstanding. None: wait as long as it takes.
        self.deadline: tuple[float, float] | None = None
        try:
            self._start()
        except BaseException:
            self.kill()
            raise
        logger.info(
            "%s: %d rank(s) on %d node(s), one process per rank",
            self.name,
            world_size,
            len({w["node_id"] for w in self.where}),
        )

    def _start(self) -> None:
        """Start one actor per rank on the placement's bundles, join them into a process group, build the workers."""
        assert self.placement is not None
        opts, first, world_size = self._options, self.roles[0], self.world_size
        remote = remote_rank_class()
        extra: dict[str, Any] = {}
        if opts["num_gpus"] > 0:
            from conveyor.workers.ranks.perf import allocator_env_defaults

            # Set before the process's first CUDA allocation, whatever runs first in it; the user's own
            # PYTORCH_CUDA_ALLOC_CONF (inherited from the driver's environment) is left alone.
            env = allocator_env_defaults()
            if env:
                extra["runtime_env"] = {"env_vars": env}
        self.actors = [
            remote.options(
                num_cpus=opts["num_cpus"],
                num_gpus=opts["num_gpus"],
                scheduling_strategy=self.placement.strategy_for(r),
                max_concurrency=opts["concurrency"],
                **extra,
            ).remote(self.name, r, world_size, int(round(opts["num_cpus"])))
            for r in range(world_size)
        ]
        self.where = self.gather(first, "start", [a.where.remote() for a in self.actors])
        if world_size > 1 and self._process_group:
            addr, port = self.gather(first, "init_process_group", [self.actors[0].master_address.remote()])[0]
            device_type = "cuda" if opts["num_gpus"] > 0 else "cpu"
            self.gather(
                first,
                "init_process_group",
                [a.init_process_group.remote(addr, port, device_type) for a in self.actors],
            )
        for spec in self._specs:  # in order, each role's ranks together (a strategy's wrap is a collective)
            self.gather(spec.role, "__init__", [a.build.remote(spec) for a in self.actors])

    def restart(self) -> None:
        """Kill every rank's process (dead, hung or alive) and start them again on the same bundles, built from the
        same specs, with their links when they had them: fresh workers holding the model their spec loads."""
        if self.placement is None or not self._users:
            raise RuntimeError(f"the {self.name} ranks were shut down; they cannot be restarted")
        linked = self.links is not None
        for link in self.links or ():
            link.close()
        self.links = None
        for rank, a in enumerate(self.actors):
            _kill_process(self.where[rank] if rank < len(self.where) else None)  # a stopped one too (SIGKILL)
            try:
                ray.kill(a, no_restart=True)
            except Exception as err:  # already dead
                logger.debug("%s rank %d already gone: %s", self.name, rank, err)
        self.closed = False
        try:
            self._start()
            if linked:
                self.open_links()
        except BaseException:
            self.kill()
            raise

    def group(self, role: str) -> RayWorkerGroup:
        """The worker group of `role` on these ranks."""
        if role not in self.roles:
            raise KeyError(f"{role!r} is not hosted on the {self.name} ranks")
        return RayWorkerGroup._view(self, role)

    def open_links(self) -> None:
        """From now on `call` and `call_chain` reach the ranks over a Unix socket each
        (`conveyor.workers.placement.link`), not a
        Ray task per call: for ranks on this machine whose every batch is one call (the asynchronous rollout's
        replicas in processes of their own). Other calls stay Ray's."""
        from conveyor.workers.placement.link import Link

        if self.links is None:
            ends = self.gather(self.roles[0], "open_link", [a.open_link.remote() for a in self.actors])
            self.links = [Link(address, key) for address, key in ends]

    def call_linked(self, role: str, method: str, requests: Sequence[tuple]) -> list[Any]:
        """One request per rank over the links (in rank order; `method` names the call in an error), their answers;
        the first rank to fail is raised as `gather` raises it, once every rank has answered."""
        from conveyor.workers.placement.link import LinkClosed, LinkTimeout

        assert self.links is not None, "open_links first"
        answers: list[Any] = []
        failure: tuple[int, BaseException, BaseException] | None = None
        with self._link_lock:
            sent = []
            for rank, (link, request) in enumerate(zip(self.links, requests)):
                try:
                    link.request(*request)
                    sent.append(rank)
                except LinkClosed as err:  # gone before the call: no answer to wait for
                    failure = failure or (rank, self._why_gone(rank, err), err)
            for rank in sent:  # every answer read, so each link stays in step with its requests
                try:
                    answers.append(self._answer(rank))
                except LinkClosed as err:  # the rank's process ended: Ray says why, as a task's failure would
                    failure = failure or (rank, self._why_gone(rank, err), err)
                except LinkTimeout as err:  # hung: the link is out of step with its requests from now on
                    self.links[rank].close()
                    failure = failure or (rank, RankHung(f"rank {rank} (pid {self._pid(rank)}): {err}"), err)
                except Exception as err:
                    failure = failure or (rank, err, err)
        if failure is not None:
            rank, cause, err = failure
            if self.world_size > 1 and self._process_group:
                self.kill()  # as `gather`: the others may wait in a collective with the failed one
            role, method = getattr(cause, "conveyor_step", (role, method))
            raise wrap_worker_error(role, rank, method, cause) from err
        return answers

    def _pid(self, rank: int) -> Any:
        return self.where[rank].get("pid", "?") if rank < len(self.where) else "?"

    def _answer(self, rank: int) -> Any:
        """Rank `rank`'s answer on its link, within `deadline` when one is set (its process looked at meanwhile)."""
        assert self.links is not None
        if self.deadline is None:
            return self.links[rank].answer()
        timeout, interval = self.deadline
        where = self.where[rank]

        def check() -> None:
            if not _process_alive(where):
                from conveyor.workers.placement.link import LinkClosed

                raise LinkClosed(f"its process (pid {where.get('pid')}) is gone")

        return self.links[rank].answer(timeout=timeout, check=check, interval=interval)

    def _why_gone(self, rank: int, err: BaseException) -> BaseException:
        """Why rank `rank`'s link closed: Ray's report of its death (with the end of its stderr), or `err`."""
        try:
            ray.get(self.actors[rank].where.remote(), timeout=30)
        except Exception as death:
            return _original(death, self, rank)
        return err

    def gather(self, role: str, method: str, refs: Sequence[Any]) -> list[Any]:
        """Results of `refs` (one per rank, in rank order); the first rank to fail stops the ranks and is raised."""
        pending = {ref: rank for rank, ref in enumerate(refs)}
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    ray.get(ref)
                except Exception as err:
                    cause = _original(err, self, rank)
                    if self.world_size > 1:
                        # The other ranks may be blocked in a collective with the failed one: stop them all.
                        self.kill()
                    # A chained call names the step that failed (`ray_rank`'s `call_chain`).
                    role, method = getattr(cause, "conveyor_step", (role, method))
                    raise wrap_worker_error(role, rank, method, cause) from err
        return ray.get(list(refs))

    def release(self, role: str) -> None:
        """`role` is done with the ranks; they stop when no role is left."""
        if self.closed:
            return
        try:
            ray.get([a.close.remote(role) for a in self.actors], timeout=30)
        except Exception as err:  # a dead rank, or Ray shut down first
            logger.debug("%s: closing %s failed: %s", self.name, role, err)
        self._users.discard(role)
        if not self._users:
            self.kill()

    def kill(self) -> None:
        """Kill the ranks' processes and give back their placement (safe to call twice)."""
        self.closed = True
        for link in self.links or ():
            link.close()
        if self.placement is None:
            return
        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception as err:  # already dead, or Ray shut down first
                logger.debug("%s rank already gone: %s", self.name, err)
        self.placement.release(self.name)
        self.placement = None


class RayWorkerGroup(WorkerGroup):
    """The ranks of one role as Ray actors, each built by `spec.build(rank, world_size)`.

    Built from one spec it starts ranks of its own; `RayRanks.group(role)` is
    the same interface over ranks that host several roles.
    """

    def __init__(
        self,
        spec: WorkerSpec,
        *,
        world_size: int = 1,
        num_cpus: float = 0.5,
        num_gpus: float = 0.0,
        placement: RayPlacement | None = None,
        nnodes: int = 1,
        timeout_s: float = 60.0,
    ):
        ranks = RayRanks(
            [spec],
            world_size=world_size,
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            placement=placement,
            nnodes=nnodes,
            timeout_s=timeout_s,
        )
        self._attach(ranks, spec.role)

    @classmethod
    def _view(cls, ranks: RayRanks, role: str) -> RayWorkerGroup:
        group = cls.__new__(cls)
        group._attach(ranks, role)
        return group

    def _attach(self, ranks: RayRanks, role: str) -> None:
        self.ranks, self.role, self.world_size = ranks, role, ranks.world_size
        self._released = False

    @property
    def placement(self) -> RayPlacement | None:
        """The placement the role's ranks hold; None once they are stopped or the role shut down."""
        return None if self._released or self.ranks.closed else self.ranks.placement

    # -- calls ----------------------------------------------------------
    def call(self, endpoint: Endpoint, meta: KVBatchMeta) -> KVBatchMeta:
        """Run `endpoint` on every rank over its share of `meta`; the merged handle (extra_info: lists per rank)."""
        method = endpoint.__name__  # the rank actor looks the method up on its own worker
        return self._scatter(method, meta, lambda chunk: ("call", self.role, method, chunk))

    def call_chain(self, steps: Sequence[tuple[str, Endpoint]], meta: KVBatchMeta) -> KVBatchMeta:
        """`call` of several endpoints of roles colocated on these ranks, one after another on every rank's share of
        `meta` in one call per rank (`(role, endpoint)` pairs, the first this group's): the merged handle."""
        names = [(role, endpoint.__name__) for role, endpoint in steps]
        for role, name in names:
            if role not in self.ranks.roles:
                raise ValueError(f"{role} is not hosted on the {self.ranks.name} ranks: cannot chain {name}")
        return self._scatter(names[0][1], meta, lambda chunk: ("call_chain", names, chunk))

    def _scatter(self, method: str, meta: KVBatchMeta, request: Callable[[KVBatchMeta], tuple]) -> KVBatchMeta:
        """`request(its share of meta)` (the rank actor's method and arguments) on every rank, over the links when the
        ranks have them, else as Ray tasks; the merged handle (a failure named `method`)."""
        self._check_open(method)
        chunks = split_for_ranks(meta, self.world_size)
        requests = [request(c) for c in chunks]
        if self.ranks.links is not None:
            merged = BatchData(self.ranks.call_linked(self.role, method, requests)).concat()
        else:
            refs = [getattr(a, op).remote(*args) for a, (op, *args) in zip(self.ranks.actors, requests)]
            self.ranks.gather(self.role, method, refs)
            merged = BatchData(refs).concat()
        merged.extra_info.update(split_metrics(chunks, method))
        return merged

    def call_all(self, method: Endpoint, *args: Any, **kwargs: Any) -> list[Any]:
        """Run `method` with the same arguments on every rank; one result per rank."""
        name = method.__name__
        self._check_open(name)
        # One copy in the object store for all ranks (a state dict is large), not one per call;
        # Ray resolves top-level refs before the method runs.
        args_ref, kwargs_ref = ray.put(args), ray.put(kwargs)
        return self.ranks.gather(
            self.role, name, [a.call_args.remote(self.role, name, args_ref, kwargs_ref) for a in self.ranks.actors]
        )

    def submit_all(self, method: Endpoint, *args: Any, **kwargs: Any) -> Pending:
        """Start `method` on every rank without waiting (two roles' halves of one exchange must run together)."""
        name = method.__name__
        self._check_open(name)
        return Pending(self, name, [a.call_args.remote(self.role, name, args, kwargs) for a in self.ranks.actors])

    def rank_info(self) -> list[dict[str, Any]]:
        """Per rank: `pid`, `node_id`, `node_ip` of its process (shared by every role colocated there)."""
        return [dict(w) for w in self.ranks.where]

    def _check_open(self, method: str) -> None:
        if self._released or self.ranks.closed:
            raise RuntimeError(f"the {self.role} worker group was shut down; cannot call {method}")

    # -- teardown -------------------------------------------------------
    def shutdown(self) -> None:
        """This role is done; the ranks' processes stop and give back their placement with the last role."""
        if self._released:
            return
        self._released = True
        self.ranks.release(self.role)


class Pending:
    """Calls started on every rank of a group (`RayWorkerGroup.submit_all`), waited for by `gather_together`."""

    def __init__(self, group: RayWorkerGroup, method: str, refs: list[Any]):
        self.group, self.method, self.refs = group, method, refs

    def together(self, *others: Pending) -> list[list[Any]]:
        """These calls' results and those of `others`, run together (`gather_together`): one list per group."""
        return gather_together([self, *others])

    def beside(self, local: Callable[[], Any], local_role: str, local_method: str) -> tuple[Any, list[Any]]:
        """`local()` here while these calls run on Ray (`gather_with_local`); (its result, the Ray results)."""
        return gather_with_local(self, local, local_role, local_method)


def gather_together(pending: Sequence[Pending]) -> list[list[Any]]:
    """The results of calls that run together on several groups; the first failure stops every group in them.

    A failed half of an exchange (a sender that died) leaves the other half waiting in a collective that
    never completes: all of them are killed, and the failure is raised naming its role, rank and method.
    """
    owner = {ref: (p, rank) for p in pending for rank, ref in enumerate(p.refs)}
    left = list(owner)
    while left:
        ready, left = ray.wait(left, num_returns=1)
        for ref in ready:
            p, rank = owner[ref]
            try:
                ray.get(ref)
            except Exception as err:
                for other in pending:
                    other.group.ranks.kill()
                raise wrap_worker_error(p.group.role, rank, p.method, _original(err, p.group.ranks, rank)) from err
    return [ray.get(p.refs) for p in pending]


def gather_with_local(
    pending: Pending,
    local: Callable[[], Any],
    local_role: str,
    local_method: str,
) -> tuple[Any, list[Any]]:
    """`local()` here while `pending` runs on Ray (the two halves of one exchange); (its result, the Ray results).

    The local half runs on a thread of its own so that a failed Ray half is seen at once: its ranks are killed,
    which ends the local half's collective too, and the failure is raised naming its role, rank and method.
    """
    import concurrent.futures

    owner = {ref: rank for rank, ref in enumerate(pending.refs)}
    left = list(owner)
    mine = _local_halves().submit(local)
    try:
        while left or not mine.done():
            if mine.done() and mine.exception() is not None:
                pending.group.ranks.kill()
                raise wrap_worker_error(local_role, 0, local_method, mine.exception()) from mine.exception()
            if not left:
                concurrent.futures.wait([mine])
                continue
            ready, left = ray.wait(left, num_returns=1, timeout=0.05)
            for ref in ready:
                try:
                    ray.get(ref)
                except Exception as err:
                    pending.group.ranks.kill()
                    raise wrap_worker_error(
                        pending.group.role, owner[ref], pending.method, _original(err, pending.group.ranks, owner[ref])
                    ) from err
        return mine.result(), ray.get(pending.refs)
    finally:
        # Raising, the local half is let finish first (the killed ranks end its collective), as it always was.
        concurrent.futures.wait([mine])


@functools.cache
def _local_halves() -> Any:
    """The threads that run the local halves of exchanges (weight-channel sends and joins), kept for the process: an
    asynchronous run has an exchange every step, which started and joined a thread of its own each time."""
    import concurrent.futures

    from conveyor.weights import THREAD_PREFIX

    return concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix=f"{THREAD_PREFIX}-exchange")


# --------------------------------------------------------------------------- a run's roles
def ray_worker_device(cfg: Any, device: str) -> str:
    """The device of Ray worker ranks: cuda when the run asks for GPUs per node, else cpu (with a warning if cuda was
    meant)."""
    t = cfg.trainer
    gpu = t.n_gpus_per_node > 0
    if gpu and t.device == "cpu":
        raise ValueError(
            f"trainer.device=cpu contradicts trainer.n_gpus_per_node={t.n_gpus_per_node}; "
            "set trainer.device=auto (or cuda), or trainer.n_gpus_per_node=0 for CPU workers"
        )
    if not gpu and device == "cuda":
        logger.warning(
            "trainer.n_gpus_per_node=0: the Ray workers get no GPU and run on CPU; "
            "set trainer.n_gpus_per_node to train on GPUs"
        )
    return "cuda" if gpu else "cpu"


# The roles `build_ray_rollout_groups` builds: the replicas, and the reward worker in their processes.
BESIDE_REPLICAS_ROLES = ("rollout", "reward")


def build_ray_rollout_groups(cfg: Any, specs: dict[str, WorkerSpec], *, gpu: bool) -> dict[str, RayWorkerGroup]:
    """The reward worker and, when `specs` has one, the rollout group's replicas, as Ray worker groups.

    With replicas, the reward worker is colocated with them (rank i of both in replica i's process): a batch is
    scored where it was generated, and no process of its own waits for a core beside them.
    """
    cpus = cfg.ray.worker_cpus
    if "rollout" not in specs:
        return {
            "reward": RayWorkerGroup(
                specs["reward"], world_size=1, num_cpus=cpus, nnodes=1, timeout_s=cfg.ray.timeout_s
            )
        }
    ro = cfg.actor_rollout_ref.rollout
    # Replicas of their own: a bundle each (tensor_model_parallel_size GPUs, or a CPU share), no process
    # group between them; the weights come over the channel from the actor's rank 0.
    gpus = float(ro.tensor_model_parallel_size) if gpu else 0.0
    ranks = RayRanks(
        [specs["rollout"], specs["reward"]],
        world_size=ro.replicas,
        num_cpus=cpus,
        num_gpus=gpus,
        nnodes=1,
        timeout_s=cfg.ray.timeout_s,
        process_group=False,
        concurrency=2,
    )
    return {"rollout": ranks.group("rollout"), "reward": ranks.group("reward")}


def build_ray_worker_groups(cfg: Any, specs: dict[str, WorkerSpec], data_plane: Any) -> dict[str, RayWorkerGroup]:
    """Each role of `specs` as a Ray worker group: the reward worker (and the replicas) by `build_ray_rollout_groups`,
    every other role on the actor's ranks, one rank per GPU or CPU worker."""
    if getattr(data_plane, "backend", None) == "memory":
        raise ValueError(
            "workers on Ray cannot reach the memory data plane itself (it lives in the trainer's "
            "process): pass them its DataPlaneServer's client, or use transfer_queue.backend=ray"
        )
    t = cfg.trainer
    gpu = t.n_gpus_per_node > 0
    world = t.nnodes * max(t.n_gpus_per_node, t.num_cpu_workers)
    model_roles = [r for r in specs if r not in BESIDE_REPLICAS_ROLES]
    cpus = cfg.ray.worker_cpus
    # Rank i of every model role lives in one process on bundle i: one whole GPU (or a CPU share) per rank.
    bundle = {"CPU": cpus, "GPU": 1.0 if gpu else 0.0}
    groups: dict[str, RayWorkerGroup] = {}
    placement = RayPlacement("+".join(model_roles), world, bundle, nnodes=t.nnodes, timeout_s=cfg.ray.timeout_s)
    try:
        ranks = RayRanks(
            [specs[r] for r in model_roles],
            world_size=world,
            num_cpus=cpus,
            num_gpus=1.0 if gpu else 0.0,
            placement=placement,
            timeout_s=cfg.ray.timeout_s,
        )
        for role in model_roles:
            groups[role] = ranks.group(role)
        groups.update(build_ray_rollout_groups(cfg, specs, gpu=gpu))
    except BaseException:
        for group in groups.values():
            group.shutdown()
        placement.release("build")  # removes the placement group if no role took it
        raise
    return groups
