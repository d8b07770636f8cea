"""Where a role's Ray ranks run: a placement group of one bundle per rank, shared by the roles colocated on it.

`RayPlacement` refuses at once what the cluster can never hold, reserves the bundles (PACK on one node,
SPREAD over several), raises after `ray.timeout_s` when the resources exist but stay busy, numbers the ranks
node by node, and removes the placement group when the last role using it is done. Its errors name what was
asked, what the cluster has (in total, free and per node) and the settings that change either.

What it deliberately does not do: start the rank actors or call them (`conveyor.workers.placement.ray_group`),
or start Ray (`conveyor.ray_utils.ensure_ray`).
"""

from __future__ import annotations

import logging

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

__all__ = ["RayPlacement"]

logger = logging.getLogger(__name__)

# Ray refuses a bundle whose every resource is zero; with ray.worker_cpus=0 a
# CPU rank's bundle holds this token amount instead.
_MIN_BUNDLE_CPU = 0.001


def _fmt(resources: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in sorted(resources.items()) if k in ("CPU", "GPU") or v) or "nothing"


def _cpu_gpu(resources: dict[str, float]) -> dict[str, float]:
    return {"CPU": resources.get("CPU", 0.0), "GPU": resources.get("GPU", 0.0)}


def _cluster_summary() -> str:
    total, free = _cpu_gpu(ray.cluster_resources()), _cpu_gpu(ray.available_resources())
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    per_node = "; ".join(_fmt(_cpu_gpu(n["Resources"])) for n in nodes)
    return f"{_fmt(total)} in total ({_fmt(free)} free) on {len(nodes)} node(s) [{per_node}]"


_HOW_TO_FIX = (
    "lower trainer.n_gpus_per_node, trainer.num_cpu_workers, trainer.nnodes or ray.worker_cpus, "
    "or give the cluster more (ray.num_cpus for a locally started Ray, more nodes with `ray start`)"
)


class RayPlacement:
    """A placement group of one bundle per data-parallel rank, shared by the roles colocated on it."""

    def __init__(
        self, name: str, world_size: int, bundle: dict[str, float], *, nnodes: int = 1, timeout_s: float = 60.0
    ):
        self.name = name
        self.world_size = world_size
        self.bundle = {k: v for k, v in bundle.items() if v > 0} or {"CPU": _MIN_BUNDLE_CPU}
        self.strategy = "PACK" if nnodes == 1 else "SPREAD"
        self.nnodes = nnodes
        self._users: set[str] = set()
        self._check_feasible()
        self.pg = placement_group([dict(self.bundle) for _ in range(world_size)], strategy=self.strategy)
        try:
            ready = ray.get(self.pg.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            ready = None
        if not ready:
            remove_placement_group(self.pg)
            raise ValueError(
                f"Ray could not reserve {world_size} x {{{_fmt(self.bundle)}}} for the {name} ranks within "
                f"ray.timeout_s={timeout_s:g}s; the cluster has {_cluster_summary()}. Free resources, raise "
                f"ray.timeout_s, or {_HOW_TO_FIX}"
            )
        # Number ranks node by node (neighbouring ranks share a node, as NCCL rings want).
        nodes = placement_group_table(self.pg).get("bundles_to_node_id", {})
        first_seen: dict[str, int] = {}
        for b in range(world_size):
            first_seen.setdefault(nodes.get(b, ""), len(first_seen))
        self.bundle_of_rank = sorted(range(world_size), key=lambda b: (first_seen[nodes.get(b, "")], b))
        used = len(first_seen)
        if used != nnodes:
            logger.warning(
                "%s ranks were placed on %d node(s), not trainer.nnodes=%d (Ray puts bundles where they fit)",
                name,
                used,
                nnodes,
            )

    def _check_feasible(self) -> None:
        """Refuse at once what the cluster cannot ever hold (waiting would only end in a timeout)."""
        total = ray.cluster_resources()
        need = {k: v * self.world_size for k, v in self.bundle.items()}
        short = {k: v for k, v in need.items() if v > total.get(k, 0) + 1e-9}
        nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
        fits_a_node = any(all(r.get(k, 0) + 1e-9 >= v for k, v in self.bundle.items()) for r in nodes)
        if short or not fits_a_node:
            raise ValueError(
                f"the {self.name} ranks need {_fmt(need)} ({self.world_size} bundle(s) of {{{_fmt(self.bundle)}}}, "
                f"placement {self.strategy} over trainer.nnodes={self.nnodes}), but the Ray cluster has "
                f"{_cluster_summary()}; {_HOW_TO_FIX}"
            )

    def strategy_for(self, rank: int) -> PlacementGroupSchedulingStrategy:
        """Where rank `rank` of any role on this placement runs."""
        return PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=self.bundle_of_rank[rank])

    def acquire(self, user: str) -> None:
        """Record that `user` (a role) has ranks here."""
        self._users.add(user)

    def release(self, user: str) -> None:
        """`user` is done; the placement group is removed when nobody is left."""
        self._users.discard(user)
        if not self._users and self.pg is not None:
            try:
                remove_placement_group(self.pg)
            except Exception as err:  # Ray already shut down
                logger.debug("placement group %s already gone: %s", self.name, err)
            self.pg = None
