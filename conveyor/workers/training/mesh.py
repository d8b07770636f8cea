"""A role's named device meshes, built once from its strategy's settings.

The dimension names are transformers' (`transformers.distributed.utils.TransformersDeviceMesh`), since its
expert plan is what conveyor applies under expert parallelism; verl's FSDP engine names no dimensions.

- dense `("fsdp",)` over every rank (plain fsdp2), or `("dp_replicate", "fsdp")` when the role shards
  within groups of `fsdp_config.fsdp_size` ranks and replicates across them (HSDP; `dp` is the
  case of groups of one);
- expert `("efsdp", "ep")` under expert parallelism: each MoE layer's experts split whole over `ep`,
  FSDP2-sharded over `efsdp = ranks / ep`;
- sequence `("dp", "sp")` under Ulysses sequence parallelism (`ulysses_sequence_parallel_size` = sp > 1): the
  `sp` ranks of a group share their rows and split each packed micro-batch by tokens, with the all-to-alls
  around attention on `sp` (`conveyor.workers.training.sequence_parallel`); `dp = ranks / sp` groups take
  different rows. FSDP2 still shards the parameters over every rank of the dense mesh, as verl does.

Ranks are laid out row-major, so the inner dimension (`fsdp`, `ep`) groups consecutive ranks: one
node's GPUs, where the frequent collectives (all-gathers, all-to-alls) then stay.

Below the meshes, the process group itself: the backend a role's group is created with on a device, and
the device a small collective of a group runs on under that backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as tdist

__all__ = ["Meshes", "build_meshes", "process_group_backend", "collective_device"]


def process_group_backend(device_type: str) -> str:
    """The backend a role's process group is created with on `device_type` ("cuda": nccl, with gloo for CPU tensors)."""
    # Under param_offload the sharded parameters and gradients live in host memory, so FSDP2's gradient-norm
    # clipping and the weight sync's `full_tensor` run collectives on CPU tensors, which nccl rejects: the group
    # routes those to gloo by device (torchtitan's "cuda:nccl,cpu:gloo").
    return "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"


def collective_device(device: torch.device, group: Any = None) -> torch.device:
    """Where a small collective of `group` (the default one when None) runs: `device` if nccl serves it, else the
    CPU."""
    config = tdist.get_backend_config(group)  # "cpu:gloo,cuda:nccl", "cuda:nccl", "cpu:gloo,cuda:gloo", ...
    backends = dict(part.split(":", 1) for part in config.split(",") if ":" in part)
    return device if backends.get(device.type) == "nccl" else torch.device("cpu")


@dataclass
class Meshes:
    """A role's named device meshes: `dense` always, `expert` ("efsdp", "ep") under expert parallelism, `sequence`
    ("dp", "sp") under sequence parallelism."""

    dense: Any
    expert: Any = None
    ep_size: int = 1
    sequence: Any = None  # ("dp", "sp") under sequence parallelism

    @property
    def replicate(self) -> int:
        """How many replicas of the dense shards there are (1 = no `dp_replicate` dimension)."""
        names = self.dense.mesh_dim_names
        return self.dense.size(names.index("dp_replicate")) if "dp_replicate" in names else 1

    def dim_group(self, name: str) -> Any:
        """The process group of one named dimension of the dense mesh (or of the sequence mesh: "dp", "sp")."""
        if self.sequence is not None and name in self.sequence.mesh_dim_names:
            return self.sequence.get_group(name)
        return self.dense.get_group(name)

    def all_reduce(self, tensor: torch.Tensor, op: Any) -> None:
        """Reduce `tensor` in place over every rank of the role: over each dense dimension in turn."""
        for name in self.dense.mesh_dim_names:
            if self.dense.size(self.dense.mesh_dim_names.index(name)) > 1:
                tdist.all_reduce(tensor, op=op, group=self.dense.get_group(name))


def build_meshes(
    world_size: int,
    device_type: str,
    *,
    replicate: int = 1,
    ep_size: int = 1,
    expert: bool | None = None,
    sp_size: int = 1,
) -> Meshes:
    """The role's meshes over `world_size` ranks (every rank calls it, in the same order for every role).

    `replicate` > 1 adds a `dp_replicate` dimension (HSDP) outside `fsdp`; the expert mesh is built when
    `ep_size` > 1, or when `expert` asks for it at size 1; the sequence mesh when `sp_size` > 1.
    """
    from torch.distributed.device_mesh import init_device_mesh

    if replicate < 1 or world_size % replicate:
        raise ValueError(
            f"fsdp_config.fsdp_size must divide the role's {world_size} ranks (got groups of "
            f"{world_size / replicate:g}); set it to a divisor of {world_size}, or null for all of them"
        )
    if ep_size < 1 or world_size % ep_size:
        raise ValueError(
            f"fsdp_config.expert_parallel_size={ep_size} must divide the role's {world_size} ranks; "
            f"set it to a divisor of {world_size}"
        )
    if sp_size < 1 or world_size % sp_size:
        raise ValueError(
            f"ulysses_sequence_parallel_size={sp_size} must divide the role's {world_size} ranks; "
            f"set it to a divisor of {world_size}"
        )
    if replicate == 1:
        dense = init_device_mesh(device_type, (world_size,), mesh_dim_names=("fsdp",))
    else:
        dense = init_device_mesh(
            device_type, (replicate, world_size // replicate), mesh_dim_names=("dp_replicate", "fsdp")
        )
    sequence = None
    if sp_size > 1:
        sequence = init_device_mesh(device_type, (world_size // sp_size, sp_size), mesh_dim_names=("dp", "sp"))
    if not (ep_size > 1 if expert is None else expert):
        return Meshes(dense, sequence=sequence)
    expert_mesh = init_device_mesh(device_type, (world_size // ep_size, ep_size), mesh_dim_names=("efsdp", "ep"))
    return Meshes(dense, expert_mesh, ep_size, sequence)
