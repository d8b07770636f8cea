"""The role table: every role a run can have, as data, filled through the registry.

A role is one `Role` record: the worker class each of its ranks runs, what that worker is built from (its
settings builder), the handle the trainer calls it through, whether it may share the actor's ranks, how many
ranks it gets when it runs apart, the run plan's decision of whether and where it runs, and whether it scores
the responses in stage 3. `register_role` puts a record in `ROLES` (the built-in roles' records are in
`conveyor.workers.placement.handles`; a `trainer.plugins` file registers its own the same way), and the rest
reads the table: the run plan's `roles` map (`conveyor.trainer.plan`), the worker specs and groups
(`conveyor.workers.placement.roles`, one loop for this process and Ray), and the reward stage
(`Stages.compute_reward` runs every scoring role after the rule reward, in the table's order).

What it deliberately does not do: name any role, build a worker, or decide where ranks run (the plan does).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from conveyor.config.plan import BESIDE_REPLICAS, COLOCATED, IN_ACTOR, PLACEMENTS, SEPARATE
from conveyor.protocol import KVBatchMeta
from conveyor.registry import lookup, registrar
from conveyor.workers.placement.group import WorkerGroup

if TYPE_CHECKING:
    from conveyor.config import Config
    from conveyor.config.plan import RunPlan

__all__ = [
    "ROLES",
    "Role",
    "RoleHandle",
    "RoleDecision",
    "Where",
    "register_role",
    "get_role",
    "COLOCATED",
    "SEPARATE",
    "IN_ACTOR",
    "BESIDE_REPLICAS",
]

# Role name -> its record, in registration order (the built-in roles first): the order specs are built in, the
# order scoring roles score in, and the reverse of the order the groups are released in.
ROLES: dict[str, Role] = {}


@dataclasses.dataclass
class RoleDecision:
    """What a role's `decide` reads besides the config, and where it says what it decided."""

    rollout_placement: str  # where the engines run: colocated (the actor's ranks), separate (replicas) or none
    why: list[str]  # the plan's decisions in words: a role appends its own line(s)


@dataclasses.dataclass(frozen=True)
class Where:
    """Where a run's workers are built: what every settings builder may pass on to its worker."""

    model_path: str  # the policy's checkpoint directory
    data_plane: Any  # the data plane (or, for workers in processes of their own, its client)
    device: str  # cpu or cuda
    tokenizer: Any  # the policy's tokenizer

    def model_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of a worker that loads the policy's checkpoint: model_path, data_plane, device."""
        return {"model_path": self.model_path, "data_plane": self.data_plane, "device": self.device}


class RoleHandle:
    """The ranks of one role behind typed methods (each role's handle is a subclass naming its endpoints)."""

    def __init__(self, ranks: WorkerGroup):
        self.ranks = ranks

    @classmethod
    def attach(
        cls, ranks: WorkerGroup | None, *, handles: dict[str, RoleHandle], cfg: Config, plan: RunPlan
    ) -> RoleHandle:
        """The handle over the role's `ranks` (None: the role has no worker of its own, `IN_ACTOR`); `handles` holds
        the roles built before it, in the table's order."""
        assert ranks is not None, f"{cls.__name__} has no worker of its own to attach to"
        return cls(ranks)

    def score(self, meta: KVBatchMeta) -> KVBatchMeta:
        """Stage 3, after the rule reward (a scoring role's handle): its score, summed into rm_scores."""
        raise NotImplementedError(f"{type(self).__name__} does not score responses")

    @property
    def world_size(self) -> int:
        """How many ranks the role has."""
        return self.ranks.world_size

    def shutdown(self) -> None:
        """Release the role's ranks."""
        self.ranks.shutdown()


def _one_rank(cfg: Config) -> int:
    """A role's ranks when apart, unless it says otherwise: one."""
    return 1


@dataclasses.dataclass(frozen=True)
class Role:
    """One role of a run: what its ranks run, what they are built from, how it is called, and where it may run."""

    name: str  # the role's name: its spec's, its group's, the `WorkerGroups` attribute that holds its handle
    worker: type  # what each rank runs: `worker(rank=, world_size=, **settings(cfg, plan, where))`
    settings: Callable[[Config, RunPlan, Where], dict[str, Any]]  # the worker's other constructor arguments
    handle: type[RoleHandle]  # what the trainer calls it through
    # Whether and where it runs: a placement (PLACEMENTS) or None (it does not run), its reasons appended to `why`.
    decide: Callable[[Config, RoleDecision], str | None]
    colocate: bool = True  # whether it may share the actor's ranks (placement colocated)
    ranks_apart: Callable[[Config], int] = _one_rank  # its ranks on Ray when placed apart (one here)
    scores: bool = False  # its handle's `score` runs in stage 3, after the rule reward and earlier scoring roles

    def __post_init__(self) -> None:
        if not isinstance(self.handle, type) or not issubclass(self.handle, RoleHandle):
            raise ValueError(f"role {self.name!r}: its handle must be a RoleHandle subclass, got {self.handle!r}")

    def check_placement(self, placement: str) -> str:
        """`placement` when this role may run there; a ValueError naming the role otherwise."""
        if placement not in PLACEMENTS:
            raise ValueError(f"role {self.name!r}: unknown placement {placement!r}; valid: {', '.join(PLACEMENTS)}")
        if placement == COLOCATED and not self.colocate:
            raise ValueError(f"role {self.name!r} runs on ranks of its own: it cannot be placed on the actor's ranks")
        return placement


def register_role(role: Role, *, overwrite: bool = False) -> Role:
    """Put `role` in the table under its name (a plugin's roles too); a taken name is a ValueError."""
    return registrar(ROLES, role.name, "role", overwrite=overwrite)(role)


def get_role(name: str) -> Role:
    """The registered role `name`; a ValueError naming the valid roles otherwise."""
    return lookup(ROLES, name, "role")
