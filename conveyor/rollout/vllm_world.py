"""The process and world plumbing of the vllm rollout engine: its ranks, its launcher's environment, its shutdown.

Without a torch.distributed group (one trainer rank) vLLM makes a
one-rank group for itself and `close` removes it. In a trainer's world (FSDP2
ranks), every rank builds an engine at the same point, as TRL's colocate mode
does: vLLM's `external_launcher` executor takes the world as it is and lays it
out as (replicas, TP) with TP innermost, so each run of
`tensor_model_parallel_size` consecutive ranks is one replica (`replica`,
`replica_ranks`) that must be fed the same prompts and the same weights, and
replicas are independent of each other (with TP 1, every rank is one). Each
replica gets its own engine seed (`seed + replica`). vLLM's groups are its
own (`new_group`s over the same ranks), so the trainer's collectives on its
default group do not meet them; `close` removes them and leaves the trainer's
group as it was (vLLM's own shutdown would destroy it).

It deliberately does not build or drive an engine (conveyor.rollout.vllm does): these are the pieces that
decide where an engine sits in the trainer's world and keep that world intact around vLLM.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["cpu_shm_segments", "launcher_env", "replica_layout", "shutdown_keeping_trainer_world", "trainer_world"]


def trainer_world() -> tuple[int, int] | None:
    """(rank, world size) of the torch.distributed world the caller made, or None when there is none."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return None


def replica_layout(rank: int, world_size: int, tensor_parallel_size: int) -> tuple[int, list[int]]:
    """(replica index, that replica's trainer ranks) of `rank` when engines are colocated on `world_size` ranks.

    vLLM lays an existing world out as (replicas, DP, PP, PCP, TP) with TP innermost
    (vllm/distributed/parallel_state.py, initialize_model_parallel): here DP = PP = PCP = 1, so each run of
    `tensor_parallel_size` consecutive ranks is one tensor-parallel group, i.e. one replica.
    """
    tp = int(tensor_parallel_size)
    if tp < 1 or world_size % tp:
        raise ValueError(
            f"the vllm rollout's tensor_model_parallel_size {tp} must divide the trainer's "
            f"{world_size} ranks: each run of that many consecutive ranks serves one replica"
        )
    replica = rank // tp
    return replica, list(range(replica * tp, (replica + 1) * tp))


@contextlib.contextmanager
def launcher_env(rank: int, local_rank: int) -> Iterator[None]:
    """RANK and LOCAL_RANK as vLLM's external launcher reads them while it builds; the caller's own afterwards."""
    saved = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK")}
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(local_rank)})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _keepingtrainer_world() -> Iterator[None]:
    """While vLLM shuts its engine down: remove only vLLM's own groups, not the trainer's default group.

    EngineCore.shutdown ends with cleanup_dist_env_and_memory (vllm/v1/engine/core.py), whose
    destroy_distributed_environment (vllm/distributed/parallel_state.py) destroys vLLM's world group and then
    calls torch.distributed.destroy_process_group() on the default group, the trainer's.
    """
    from vllm.distributed import parallel_state

    def destroy_vllm_world() -> None:
        if parallel_state._WORLD is not None:
            parallel_state._WORLD.destroy()
        parallel_state._WORLD = None
        parallel_state._NODE_COUNT = None

    original = parallel_state.destroy_distributed_environment
    parallel_state.destroy_distributed_environment = destroy_vllm_world
    try:
        yield
    finally:
        parallel_state.destroy_distributed_environment = original


def cpu_shm_segments() -> set[str]:
    """The shared-memory segments of vLLM's CPU all-reduce on this machine (paths under /dev/shm)."""
    try:
        return {os.path.join("/dev/shm", n) for n in os.listdir("/dev/shm") if "cpushm" in n}
    except OSError:  # no /dev/shm (not Linux)
        return set()


def shutdown_keeping_trainer_world(engine_core: Any) -> None:
    """Shut vLLM's in-process EngineCore down, removing its groups but not the trainer's default group."""
    if not torch.distributed.is_initialized():
        # The trainer destroyed its world, and vLLM's groups with it (an engine never closed, at exit):
        # vLLM's shutdown would fail destroying them again.
        return
    with _keepingtrainer_world():
        engine_core.shutdown()
