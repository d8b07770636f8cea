"""Which faults a run survives, in words for its plan: decided from the config, the placement and the device.

The rules are those of `conveyor.workers.placement.recovery` (what it can replace) and of the checkpoints (what a
re-run resumes from); docs/RELIABILITY.md has them placement by placement. What it deliberately does not do: detect
or handle a fault.
"""

from __future__ import annotations

from typing import Any

__all__ = ["faults_survived"]

_RESUME = "re-run the same command to resume from the last complete checkpoint"


def faults_survived(cfg: Any, placement: str, process: str, device: str) -> str:
    """One line of the run plan: which rollout faults the run survives, and what stops it."""
    ft = cfg.actor_rollout_ref.rollout.fault_tolerance
    key = "actor_rollout_ref.rollout.fault_tolerance"
    if placement == "separate" and process == "own":
        if not ft.enable:
            return f"faults: {key}.enable=false: a rollout replica that dies or hangs stops the run ({_RESUME})"
        if device != "cpu" or cfg.trainer.v1.separate_async.partial_rollout:
            why = "partial rollouts" if device == "cpu" else f"an actor on {device}"
            return f"faults: a rollout replica that dies or hangs stops the run ({why}: not replaced; {_RESUME})"
        return (
            f"faults: a rollout replica that dies or answers no call within {ft.timeout_s:g} s is replaced (at most "
            f"{ft.max_restarts} times, {key}.max_restarts) and its batch generated again with the same seeds; a "
            f"fault past that, or of the trainer's process, stops the run ({_RESUME})"
        )
    where = "the trainer's process" if process == "trainer" or placement == "colocated" else "Ray actors"
    return f"faults: the rollout runs in {where}, where a replica is not replaced: a fault stops the run ({_RESUME})"
