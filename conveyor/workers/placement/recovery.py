"""Replacing rollout replicas that die or hang, and generating their batch again with the same seeds.

A rollout replica in a process of its own (`rollout_process=own`) is looked at
at every call and, while a call is outstanding, every
`actor_rollout_ref.rollout.fault_tolerance.health_check_interval_s`: a process
that is gone (a crash, the OOM killer, SIGKILL) is a death, seen at once as its
link closing or at the next look; a call unanswered after `timeout_s` (a
stopped or deadlocked process) is a hang. Either way `ReplicaRecovery` kills
what is left of the replicas, starts new ones on the same bundles, gives them
the weights their predecessors served (`WeightShipper.restore`), and issues
the same call again: the whole batch, so every group is generated whole, with
its per-request seeds, and the samples are those the dead replica would have
produced. After `max_restarts` replacements the next fault stops the run with
`RunFailed`, one `error:` line naming the replica (exit status 1).

What it deliberately does not do: restart a rank that shares the trainer's
processes (colocated: `stopped_by_fault` words the error, naming the checkpoint to
resume from), retry a call that failed for any other reason (a reward
function that raises is the user's), or replace one replica of several alone
(the whole group is restarted; its other calls are issued again too).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from conveyor.protocol import KVBatchMeta
from conveyor.tasks.prompts import uid_of

__all__ = ["RunFailed", "ReplicaRecovery", "fault_of", "fault_tolerant", "stopped_by_fault"]

logger = logging.getLogger(__name__)


class RunFailed(RuntimeError):
    """A fault the run cannot survive (a replica past its restarts, a lost trainer rank): one `error:` line, exit 1."""


def fault_of(err: BaseException) -> str | None:
    """ "died" or "hung" when `err` (a `WorkerError` or its cause) reports a rank's process gone or unanswering; None
    for any other failure."""
    cause = getattr(err, "cause", err)
    name = type(cause).__name__
    if name == "RankHung":
        return "hung"
    if name in ("RankDied", "LinkClosed", "ActorDiedError", "RayActorError", "ActorUnavailableError"):
        return "died"
    return None


def fault_tolerant(group: Any, weights: Any, settings: Any) -> ReplicaRecovery | None:
    """The recovery of a rollout worker group when `settings.enable` and its replicas can be replaced: processes of
    their own on Ray taking calls over links, weights the shipper can give new ones (`WeightShipper.can_restore`,
    which is then told to keep them); else None."""
    ranks = getattr(group, "ranks", None)
    if settings is None or not settings.enable or not hasattr(ranks, "restart") or not weights.can_restore:
        return None
    weights.retain = True
    return ReplicaRecovery(ranks, settings, weights)


class ReplicaRecovery:
    """The restart budget and the retry loop of one rollout group on Ray (`ranks`: its `RayRanks`).

    `weights.restore(meta)` runs after a restart: it gives the new replicas their weights and returns the handle to
    issue again (`weights`: the group's `WeightShipper`). `settings`: the `fault_tolerance` section (`enable`,
    `health_check_interval_s`, `timeout_s`, `max_restarts`).
    """

    def __init__(self, ranks: Any, settings: Any, weights: Any):
        self.ranks, self.weights = ranks, weights
        self.max_restarts = settings.max_restarts
        self.timeout_s = settings.timeout_s
        self.restarts = 0  # over the run
        ranks.deadline = (settings.timeout_s, settings.health_check_interval_s)

    def call(self, issue: Callable[[KVBatchMeta], KVBatchMeta], meta: KVBatchMeta) -> KVBatchMeta:
        """`issue(meta)`; on a replica's death or hang, replace the replicas and issue it again (within the budget).

        The answer's `extra_info` then carries `fault/rollout_restarts` (the run's so far), `fault/rollout_restart_s`
        (replacing and reloading, this call's), `fault/reissued_groups` and `fault/rollout_recovery_s` (from the
        fault seen to the batch generated again: the new samples).
        """
        spent, reissued, seen = 0.0, 0, None
        while True:
            try:
                out = issue(meta)
                break
            except Exception as err:
                what = fault_of(err)
                if what is None:
                    raise
                rank = getattr(err, "rank", 0)
                pid = self._pid(rank)
                how = f"answered no call within {self.timeout_s:g} s" if what == "hung" else "died"
                if not self.weights.can_restore:  # partial rollouts switch weights mid-generation
                    raise RunFailed(
                        f"rollout replica {rank} (pid {pid}) {how} ({_first_line(err)}); a replica cannot be replaced "
                        "under trainer.v1.separate_async.partial_rollout=true"
                    ) from err
                if self.restarts >= self.max_restarts:
                    raise RunFailed(
                        f"rollout replica {rank} (pid {pid}) {how} ({_first_line(err)}) after {self.restarts} "
                        f"restart(s), the most actor_rollout_ref.rollout.fault_tolerance.max_restarts="
                        f"{self.max_restarts} allows"
                    ) from err
                self.restarts += 1
                groups = len({uid_of(k) for k in meta.keys})
                logger.warning(
                    "rollout replica %d (pid %s) %s: replacing it (restart %d of at most %d) and generating its "
                    "%d group(s) again with the same seeds",
                    rank,
                    pid,
                    how,
                    self.restarts,
                    self.max_restarts,
                    groups,
                )
                t0 = time.perf_counter()
                seen = seen if seen is not None else t0
                self.ranks.restart()
                meta = self.weights.restore(meta)
                spent += time.perf_counter() - t0
                reissued += groups
                logger.warning(
                    "rollout replica %d replaced in %.1f s (pid %s); its batch is being generated again",
                    rank,
                    time.perf_counter() - t0,
                    self._pid(rank),
                )
        if reissued:
            assert seen is not None
            recovered = time.perf_counter() - seen
            logger.warning("rollout: the batch was generated again %.1f s after the fault was seen", recovered)
            n = self.ranks.world_size
            out.extra_info.update(
                {
                    "fault/rollout_restarts": [float(self.restarts)] * n,
                    "fault/rollout_restart_s": [spent] * n,
                    "fault/reissued_groups": [float(reissued)] * n,
                    "fault/rollout_recovery_s": [recovered] * n,
                }
            )
        return out

    def _pid(self, rank: int) -> Any:
        where = self.ranks.where
        return where[rank].get("pid", "?") if rank < len(where) else "?"


def stopped_by_fault(err: BaseException, checkpoint: str | None) -> RunFailed | None:
    """The one-line error of a run a fault stopped, naming the last complete checkpoint to resume from: a replica past
    its restarts (`RunFailed`), or a rank that shares the trainer's processes (colocated, or the reward worker) that
    died or hung and cannot be replaced in place. None when `err` is no such fault."""
    resume = (
        f"the last complete checkpoint is {checkpoint}: run the same command again to resume from it"
        if checkpoint
        else "no checkpoint was written yet: run the same command again to start over"
    )
    if isinstance(err, RunFailed):
        return RunFailed(f"{err}; {resume}")
    what = fault_of(err)
    if what is None or not hasattr(err, "role"):
        return None
    return RunFailed(f"{err.role} rank {err.rank} {what} in {err.stage} ({_first_line(err)}); {resume}")


def _first_line(err: BaseException) -> str:
    cause = getattr(err, "cause", err)
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[0]}" if text else type(cause).__name__
