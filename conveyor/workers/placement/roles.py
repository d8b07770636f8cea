"""The roles of a run, built from the role table in one loop, the same way in this process and on Ray.

`worker_specs` turns the config and the run plan into each running role's worker class and constructor arguments
(the role's record in `ROLES`: its worker and settings builder). `build_worker_groups` builds every role's ranks
from these specs where the plan's `roles` map puts them:

- colocated: rank i of every such role is built by one `ColocatedWorker` in one process (this one, or rank i's Ray
  actor), on one device and in one process group: the actor's ranks;
- separate: ranks of its own: one here, or the role's `ranks_apart(cfg)` Ray actors (a GPU each on a GPU run);
- replicas: where the rollout replicas run (the reward worker, and the replicas when they are apart): here, or Ray
  actors beside the trainer, rank i of both in replica i's process;
- actor: no worker of its own; the role's handle calls the actor's (the LoRA reference).

Then each role's handle is attached to its ranks, in the table's order, and `WorkerGroups` holds them by role name.
`LocalWorkerGroup` and `RayWorkerGroup` both build their ranks from the same specs, so a setting cannot reach
workers in this process and miss those on Ray (or the reverse).

What it deliberately does not do: name a role (the table does, `handles.py` for the built-in ones), decide where a
role runs (`conveyor.trainer.plan`), or define what an endpoint computes (`conveyor.workers.ranks`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from conveyor.config import Config
from conveyor.data_plane.base import DataPlane
from conveyor.protocol import KVBatchMeta
from conveyor.workers.placement.group import ColocatedWorker, LocalWorkerGroup, WorkerGroup, WorkerSpec, use_ray
from conveyor.workers.placement.handles import (  # the built-in roles' records are registered on import
    WEIGHT_ENDPOINTS,
    ActorGroup,
    CriticGroup,
    JudgeGroup,
    ReferenceGroup,
    ReplicaGroup,
    RewardGroup,
    RewardModelGroup,
    TeacherGroup,
)
from conveyor.workers.placement.role_table import (
    BESIDE_REPLICAS,
    COLOCATED,
    ROLES,
    SEPARATE,
    Role,
    RoleHandle,
    Where,
    get_role,
    register_role,
)

if TYPE_CHECKING:
    from conveyor.config.plan import RunPlan

__all__ = [
    "worker_specs",
    "build_worker_groups",
    "WorkerGroups",
    "ROLES",
    "Role",
    "RoleHandle",
    "register_role",
    "ActorGroup",
    "ReferenceGroup",
    "CriticGroup",
    "RewardGroup",
    "RewardModelGroup",
    "JudgeGroup",
    "ReplicaGroup",
    "TeacherGroup",
    "WEIGHT_ENDPOINTS",
]


def worker_specs(
    cfg: Config, plan: RunPlan, model_path: str, data_plane: DataPlane, tokenizer: Any, device: str
) -> dict[str, WorkerSpec]:
    """Each role this run builds a worker for -> its worker class and constructor arguments (rank and world size
    come later), in the table's order."""
    plugins = tuple(cfg.trainer.plugins)
    where = Where(model_path=model_path, data_plane=data_plane, device=device, tokenizer=tokenizer)
    specs = {}
    for name, placement in _placed(plan).items():
        role = get_role(name)
        if placement in (COLOCATED, SEPARATE, BESIDE_REPLICAS):  # the others have no worker of their own
            specs[name] = WorkerSpec(name, role.worker, role.settings(cfg, plan, where), plugins)
    return specs


def _placed(plan: RunPlan) -> dict[str, str]:
    """The plan's roles in the table's order (the order they are built in), each placement checked against its
    role."""
    unknown = [name for name in plan.roles if name not in ROLES]
    if unknown:
        get_role(unknown[0])  # the error names the registered roles
    return {name: role.check_placement(plan.roles[name]) for name, role in ROLES.items() if name in plan.roles}


class WorkerGroups:
    """The roles of a run: each running role's handle by name (`groups.actor`); a registered role that does not run
    reads as None."""

    def __init__(self, roles: dict[str, RoleHandle], data_plane_server: Any = None):
        self.roles = dict(roles)
        # Serves the data plane to workers in processes of their own (rollout_process=own, a Ray run on memory).
        self.data_plane_server = data_plane_server

    def __getattr__(self, name: str) -> Any:
        roles = self.__dict__.get("roles")
        if roles is None or name not in ROLES:
            raise AttributeError(name)
        return roles.get(name)

    def scorers(self) -> list[RoleHandle]:
        """The handles of the scoring roles that run, in the order they score (stage 3, after the rule reward)."""
        return [self.roles[name] for name, role in ROLES.items() if role.scores and name in self.roles]

    def generate_sequences(self, meta: KVBatchMeta) -> KVBatchMeta:
        """Stage 2 where the engines are: the separate rollout group, or the actor's ranks (colocated)."""
        return (self.rollout or self.actor).generate_sequences(meta)

    def shutdown(self) -> None:
        """Release every role's ranks, the last built first (the replicas before the actor whose weights they take)."""
        try:
            for handle in reversed(list(self.roles.values())):
                handle.shutdown()
        finally:
            if self.data_plane_server is not None:
                self.data_plane_server.close()


def build_worker_groups(
    cfg: Config, plan: RunPlan, model_path: str, data_plane: DataPlane, tokenizer: Any, device: str = "cpu"
) -> WorkerGroups:
    """Every role of the run from `worker_specs`, where the plan places it: in this process, or as Ray actors for a
    multi-rank run."""
    ray = use_ray(cfg)
    if ray:
        from conveyor.workers.placement.ray_group import ray_worker_device

        device = ray_worker_device(cfg, device)
    specs = worker_specs(cfg, plan, model_path, data_plane, tokenizer, device)
    server = None
    if ray and getattr(data_plane, "backend", None) == "memory":  # a Ray on this machine (`serves_memory_plane`)
        server, specs = _served(specs, data_plane)
    placed = _placed(plan)
    on = {p: {name: spec for name, spec in specs.items() if placed[name] == p} for p in (COLOCATED, SEPARATE)}
    beside = {name: spec for name, spec in specs.items() if placed[name] == BESIDE_REPLICAS}
    groups: dict[str, WorkerGroup] = {}
    try:
        if ray:
            from conveyor.workers.placement.ray_group import build_ray_worker_groups

            plane = server.client() if server is not None else data_plane
            groups.update(build_ray_worker_groups(cfg, {**on[COLOCATED], **beside}, plane))
        else:
            groups.update(_colocated_here(list(on[COLOCATED].values())))
        for name, spec in on[SEPARATE].items():
            groups[name] = _apart(cfg, spec, ray=ray, world_size=get_role(name).ranks_apart(cfg))
        if not ray:
            own, remote = _beside_replicas_here(cfg, plan, beside, data_plane)
            server = own or server
            groups.update(remote)
    except BaseException:
        for group in groups.values():
            group.shutdown()
        if server is not None:
            server.close()
        raise
    handles: dict[str, RoleHandle] = {}
    for name in placed:  # in the table's order: a handle may use those of the roles built before it
        handles[name] = get_role(name).handle.attach(groups.get(name), handles=handles, cfg=cfg, plan=plan)
    return WorkerGroups(handles, data_plane_server=server)


def _colocated_here(specs: list[WorkerSpec]) -> dict[str, WorkerGroup]:
    """The colocated roles in this process: one `ColocatedWorker` building them in order, as a Ray rank's does."""
    host = ColocatedWorker(0, 1, specs)
    return {role: LocalWorkerGroup.hosted(host, role) for role in host.roles}


def _apart(cfg: Config, spec: WorkerSpec, *, ray: bool, world_size: int) -> WorkerGroup:
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


def _beside_replicas_here(
    cfg: Config, plan: RunPlan, specs: dict[str, WorkerSpec], data_plane: DataPlane
) -> tuple[Any, dict[str, WorkerGroup]]:
    """The roles that run where the replicas do, for a run outside Ray: Ray actors beside this process when the
    plan gives the rollout processes of its own, else one rank each here. (The data plane's server or None, the
    groups.)"""
    if plan.rollout_process == "own":
        return _own_process_groups(cfg, specs, data_plane)
    groups: dict[str, WorkerGroup] = {}
    for name, spec in specs.items():
        if get_role(name).handle is ReplicaGroup:  # its own engine and copy of the model, here
            replicas = cfg.actor_rollout_ref.rollout.replicas
            if replicas > 1:
                raise ValueError(
                    f"actor_rollout_ref.rollout.replicas={replicas}: a run in one process holds one "
                    "replica; run on Ray (trainer.num_cpu_workers or n_gpus_per_node > 1, or "
                    "ray.address) or set replicas=1"
                )
        groups[name] = LocalWorkerGroup(spec)
    return None, groups


def _served(
    specs: dict[str, WorkerSpec],
    data_plane: DataPlane,
    roles: Iterable[str] | None = None,
) -> tuple[Any, dict[str, WorkerSpec]]:
    """`data_plane` served to the workers of `roles` (all by default) in processes of their own: (the server, which
    the run closes after the workers, their specs with a client in place of the plane)."""
    from conveyor.data_plane.served import DataPlaneServer

    server = DataPlaneServer(data_plane)
    client = server.client()
    return server, {
        role: dataclasses.replace(spec, kwargs={**spec.kwargs, "data_plane": client})
        for role, spec in specs.items()
        if roles is None or role in roles
    }


def _own_process_groups(
    cfg: Config,
    specs: dict[str, WorkerSpec],
    data_plane: DataPlane,
) -> tuple[Any, dict[str, Any]]:
    """The roles beside the replicas (the reward worker and the rollout group) as Ray actors beside this process, on
    `data_plane` served to them: (the server, which the run closes after the workers, their groups)."""
    from conveyor.workers.placement.ray_group import build_ray_rollout_groups

    server, remote = _served(specs, data_plane)
    try:
        groups = build_ray_rollout_groups(cfg, remote, gpu=False)
    except BaseException:
        server.close()
        raise
    try:
        # Every batch is one call to each replica: over a socket each, not a Ray task per batch (workers/link.py).
        for group in groups.values():
            group.ranks.open_links()
    except BaseException:
        for group in groups.values():
            group.ranks.kill()
        server.close()
        raise
    return server, groups
