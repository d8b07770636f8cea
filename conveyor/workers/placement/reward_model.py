"""Where the reward model's and the teachers' ranks run when placed apart from the actor, and where the judge runs.

Colocated (the default), the reward model is one of the model roles (`MODEL_ROLES`): rank i lives in the
actor's rank-i process, here or in a Ray actor, and shares its device. Placed apart, it gets ranks of its own:
`reward_model.num_workers` Ray actors (a GPU each on a GPU run) with their own process group, so its fsdp2
shards are spread over them; a run in one process builds its single rank beside the others. The generative judge
(`reward_model.judge.enable`) always runs apart: one worker with its engine, here or in one Ray actor (a GPU of
its own on a GPU run). On-policy distillation's teachers (`distillation.placement=separate`) are placed apart the
same way, on `distillation.num_workers` ranks of their own.

What it deliberately does not do: build the worker (`conveyor.workers.ranks.reward_model`) or decide the
placement (`conveyor.trainer.reward_plan`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from conveyor.workers.placement.group import LocalWorkerGroup, WorkerGroup, WorkerSpec

if TYPE_CHECKING:
    from conveyor.config.plan import RunPlan

__all__ = [
    "separate_reward_model",
    "build_separate_reward_model",
    "build_judge",
    "separate_teacher",
    "build_separate_teacher",
]


def separate_reward_model(
    plan: RunPlan, specs: dict[str, WorkerSpec]
) -> tuple[dict[str, WorkerSpec], WorkerSpec | None]:
    """(`specs` without the reward model's when it is placed apart, that spec or None)."""
    if "rm" not in specs or plan.reward_model_placement != "separate":
        return specs, None
    rest = dict(specs)
    return rest, rest.pop("rm")


def separate_teacher(plan: RunPlan, specs: dict[str, WorkerSpec]) -> tuple[dict[str, WorkerSpec], WorkerSpec | None]:
    """(`specs` without the teachers' when they are placed apart, that spec or None)."""
    if "teacher" not in specs or plan.teacher_placement != "separate":
        return specs, None
    rest = dict(specs)
    return rest, rest.pop("teacher")


def build_separate_teacher(cfg: Any, spec: WorkerSpec | None, *, ray: bool) -> dict[str, WorkerGroup]:
    """{"teacher": its group} for teachers placed apart (Ray actors of their own, or one rank here); {} otherwise."""
    if spec is None:
        return {}
    return {"teacher": _apart(cfg, spec, ray=ray, world_size=cfg.distillation.num_workers)}


def build_separate_reward_model(cfg: Any, spec: WorkerSpec | None, *, ray: bool) -> dict[str, WorkerGroup]:
    """{"rm": its group} for a reward model placed apart (Ray actors of its own, or one rank here); {} otherwise."""
    if spec is None:
        return {}
    return {"rm": _apart(cfg, spec, ray=ray, world_size=cfg.reward_model.num_workers)}


def build_judge(cfg: Any, spec: WorkerSpec | None, *, ray: bool) -> dict[str, WorkerGroup]:
    """{"judge": its group} when the run has a judge (one worker, here or in a Ray actor); {} otherwise."""
    if spec is None:
        return {}
    return {"judge": _apart(cfg, spec, ray=ray, world_size=1)}


def _apart(cfg: Any, spec: WorkerSpec, *, ray: bool, world_size: int) -> WorkerGroup:
    """`spec`'s ranks on their own: one here, or `world_size` Ray actors (a GPU each on a GPU run)."""
    if not ray:
        return LocalWorkerGroup(spec)
    from conveyor.workers.placement.ray_group import RayWorkerGroup

    gpu = cfg.trainer.n_gpus_per_node > 0
    return RayWorkerGroup(
        spec,
        world_size=world_size,
        num_cpus=cfg.ray.worker_cpus,
        num_gpus=1.0 if gpu else 0.0,
        nnodes=1,
        timeout_s=cfg.ray.timeout_s,
    )
