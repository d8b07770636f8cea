"""How a role's ranks come to hold the checkpoint's weights.

With one rank (`none`) or replicas (`dp`) every rank loads the checkpoint
onto its device, as `conveyor.models.loading.load_causal_lm` does. Under
`fsdp2` with several ranks no rank ever holds the whole model on its device:

1. rank 0 reads the checkpoint into host memory (`from_pretrained` on the CPU);
   the other ranks build the same model on the meta device from the
   checkpoint's config (no memory at all);
2. rank 0 keeps its model's state dict and non-persistent buffers (the rotary
   tables, which no checkpoint holds) on the host and turns its model into a
   meta model too, so every rank shards the same empty skeleton;
3. every rank applies `fully_shard`, then `to_empty` allocates its shards
   (only its shards) on its device;
4. `set_model_state_dict(..., broadcast_from_rank0=True)` sends rank 0's
   tensors one by one, each rank keeping its piece; the non-persistent buffers
   are broadcast from rank 0 the same way.

So a rank's loading peak is its shards plus one tensor in flight (rank 0: plus
the checkpoint in host memory). `benchmarks/loading.py` measures it.

It deliberately does not choose the strategy or wrap the model itself: the
strategy does (`conveyor.workers.training.strategy`), between `take_host_weights` and
`fill_shards`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as tdist
from torch import nn

from conveyor.models.loading import build_causal_lm_on_meta, load_causal_lm, release_freed_host_memory
from conveyor.workers.training.mesh import collective_device

__all__ = [
    "HostWeights",
    "fill_shards",
    "load_role_model",
    "loads_from_rank0",
    "non_persistent_buffers",
    "take_host_weights",
]


def loads_from_rank0(strategy_name: str, world_size: int) -> bool:
    """Whether a role's ranks get their weights from rank 0 (fsdp2 over several ranks) instead of loading each."""
    return strategy_name == "fsdp2" and world_size > 1


def load_role_model(
    path: str | Path,
    *,
    strategy_name: str,
    world_size: int,
    rank: int,
    device: torch.device,
    dtype: str,
    trust_remote_code: bool = False,
    lm_head: bool = True,
) -> nn.Module:
    """A role's causal LM: on `device` when each rank loads; else on the host on rank 0 and on meta elsewhere.

    `lm_head`: the role reads the LM head (refuse a checkpoint without one); False for the critic."""
    if not loads_from_rank0(strategy_name, world_size):
        return load_causal_lm(path, dtype=dtype, device=device, trust_remote_code=trust_remote_code, lm_head=lm_head)
    if rank == 0:
        # Mapped: rank 0's host copy lives only until its tensors are sent (the pages go with it).
        return load_causal_lm(
            path, dtype=dtype, device="cpu", trust_remote_code=trust_remote_code, mmap=True, lm_head=lm_head
        )
    return build_causal_lm_on_meta(path, dtype=dtype, trust_remote_code=trust_remote_code)


def non_persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers no state dict holds (rotary inv_freq and the like), by their full names."""
    out: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules():
        for name in sorted(module._non_persistent_buffers_set):
            buf = module._buffers.get(name)
            if buf is not None:
                out[f"{prefix}.{name}" if prefix else name] = buf
    return out


@dataclass
class HostWeights:
    """Rank 0's copy of the weights on the host (empty on the other ranks), kept while the model is sharded."""

    state: dict[str, torch.Tensor] = field(default_factory=dict)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)


def take_host_weights(model: nn.Module, rank: int) -> HostWeights:
    """Rank 0: keep `model`'s tensors on the host and make `model` a meta skeleton, like the other ranks'."""
    if rank != 0:
        return HostWeights()
    # detach(): new tensor objects over the same storage, which survive the module's conversion to meta.
    weights = HostWeights(
        state=model.state_dict(), buffers={k: v.detach() for k, v in non_persistent_buffers(model).items()}
    )
    # The conversion gives each module a new parameter: tied ones (embeddings and LM head) are tied again after it,
    # as the other ranks' skeletons have them.
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                holders.setdefault(id(param), []).append((module, name))
    model.to("meta")
    for (module, name), *others in holders.values():
        for other, other_name in others:
            other._parameters[other_name] = module._parameters[name]
    return weights


def fill_shards(model: nn.Module, weights: HostWeights, device: torch.device) -> None:
    """Allocate the sharded `model` on `device` and fill it from rank 0's host weights (every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model.to_empty(device=device)
    set_model_state_dict(
        model, weights.state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )
    weights.state.clear()
    rank0 = tdist.get_rank() == 0
    via = collective_device(device)  # the device nccl serves, else the CPU (gloo, or the mapped cpu:gloo)
    for name, buf in non_persistent_buffers(model).items():
        tmp = buf.to(via)
        if rank0:
            tmp.copy_(weights.buffers[name])
        tdist.broadcast(tmp, src=0)
        buf.copy_(tmp)
    weights.buffers.clear()
    release_freed_host_memory()  # rank 0's host copy (and every rank's broadcast buffers), freed but kept by the heap
