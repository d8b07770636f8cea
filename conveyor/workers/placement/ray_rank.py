"""What runs inside each Ray rank's process: the rank actor that joins the process group and hosts the workers.

One actor per rank (`remote_rank_class`) is started by `conveyor.workers.placement.ray_group.RayRanks`: it
joins the ranks' `torch.distributed` process group (rank 0 offers its node's IP and a free port), builds
rank i of every colocated role in its process (`ColocatedWorker`, from each role's `WorkerSpec`), freezes
the heap once they are built, and runs the endpoints the driver calls, one at a time or chained, as Ray
tasks or over a Unix socket (`conveyor.workers.placement.link`).

What it deliberately does not do: start, place, stop or call the ranks, split or merge a batch, or turn a
rank's failure into the driver's error; that is the driver side's (`ray_group`, `ray_placement`).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import ray
import torch

from conveyor.protocol import KVBatchMeta
from conveyor.workers.placement.group import ColocatedWorker, WorkerSpec
from conveyor.workers.ranks.perf import freeze_heap

__all__ = ["remote_rank_class"]


class _RankActor:
    """One rank: joins the ranks' process group, then hosts the rank's workers (one per colocated role)."""

    def __init__(self, name: str, rank: int, world_size: int, num_threads: int):
        self.name, self.rank, self.world_size = name, rank, world_size
        self.host = ColocatedWorker(rank, world_size)
        # Every rank's model-loading progress bars would interleave in the driver's console.
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        # A rank reserves a fraction of the node's CPUs; letting torch use them all oversubscribes the node.
        torch.set_num_threads(max(1, num_threads))

    def where(self) -> dict[str, Any]:
        """This rank's process id, node id and node IP."""
        ctx = ray.get_runtime_context()
        return {"pid": os.getpid(), "node_id": ctx.get_node_id(), "node_ip": ray.util.get_node_ip_address()}

    def master_address(self) -> tuple[str, int]:
        """(this node's IP, a free TCP port) for the process group's rendezvous (called on rank 0)."""
        from conveyor.weights import free_address

        return free_address()

    def init_process_group(self, master_addr: str, master_port: int, device_type: str) -> None:
        """Join the ranks' process group on `device_type` ("cuda" or "cpu"; all ranks call this at once)."""
        import torch.distributed as tdist

        from conveyor.workers.training.strategy import process_group_backend

        os.environ.update(
            {
                "MASTER_ADDR": master_addr,
                "MASTER_PORT": str(master_port),
                "RANK": str(self.rank),
                "WORLD_SIZE": str(self.world_size),
            }
        )
        if device_type == "cuda":
            torch.cuda.set_device(0)  # Ray exposes exactly this rank's GPU
        tdist.init_process_group(
            backend=process_group_backend(device_type),
            init_method="env://",
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(minutes=30),
        )

    def build(self, spec: WorkerSpec) -> None:
        """Construct this rank's worker of `spec.role` in this process, next to the roles built before it."""
        self.host.add(spec)
        freeze_heap()  # the worker lives as long as the actor: no garbage collection walks it again

    def call(self, role: str, method: str, meta: KVBatchMeta) -> KVBatchMeta:
        """Run one endpoint of `role`'s worker over this rank's share of a handle."""
        return getattr(self.host.worker(role), method)(meta)

    def call_chain(self, steps: list[tuple[str, str]], meta: KVBatchMeta) -> KVBatchMeta:
        """Run endpoints of roles hosted here one after another over this rank's share, each on the handle the one
        before returned; the last handle, with every step's `extra_info` (a later step's key wins)."""
        from conveyor.data_plane.served import deferred_writes

        info: dict[str, Any] = {}
        # The steps' writes to a served plane leave as one put, and a step reads what the one before wrote here.
        with deferred_writes() as writes:
            for i, (role, method) in enumerate(steps):
                try:
                    meta = getattr(self.host.worker(role), method)(meta)
                    if i == len(steps) - 1:
                        writes.send()  # a refused write is the last step's failure
                except Exception as err:
                    err.conveyor_step = (role, method)  # which step failed: the caller's error names it
                    raise
                info.update(meta.extra_info)
        return meta.with_extra_info(**info)

    def open_link(self) -> tuple[str, bytes]:
        """Answer `call` and `call_chain` over a Unix socket too, on a thread of this process
        (`conveyor.workers.placement.link`:
        the hot path of a group whose every batch is one call); (address, key) to reach it."""
        from conveyor.workers.placement.link import serve

        def handle(op: str, *args: Any) -> Any:
            if op not in ("call", "call_chain"):
                raise ValueError(f"a link carries call and call_chain, not {op!r}")
            return getattr(self, op)(*args)

        return serve(handle)

    def call_args(self, role: str, method: str, args: tuple, kwargs: dict[str, Any]) -> Any:
        """Run `method(*args, **kwargs)` on `role`'s worker."""
        return getattr(self.host.worker(role), method)(*args, **kwargs)

    def close(self, role: str) -> None:
        """Let `role`'s worker release what it holds outside Python."""
        self.host.close(role)


_REMOTE_RANK: Any = None


def remote_rank_class() -> Any:
    """The rank actor as a Ray actor class (made once per process; a rank is not restarted by Ray)."""
    global _REMOTE_RANK
    if _REMOTE_RANK is None:
        _REMOTE_RANK = ray.remote(max_restarts=0)(_RankActor)
    return _REMOTE_RANK
