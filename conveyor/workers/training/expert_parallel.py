"""Expert parallelism for the fsdp2 strategy: the expert sharding, its checks and its token counts.

A role's ranks are laid out on two views of the same world (`conveyor.workers.training.mesh`):

- dense  `("fsdp",)`: attention, norms, routers, embeddings and the LM head are
  FSDP2-sharded over every rank, as under plain fsdp2;
- expert `("efsdp", "ep")`: the experts of each MoE layer are split whole over
  the `ep` ranks of a group (`Shard(0)` on the expert dimension) and FSDP2-
  sharded over the `efsdp = world / ep` groups that hold the same experts.

The expert sharding and the token exchange are transformers' own
(`apply_expert_parallelism` with its `ep_dispatch_experts`/`grouped_gemm`
plan and its `AllToAllEP`: an all-to-all to each expert's rank and back, whose
backward returns the gradients); conveyor applies them to the model it already
holds instead of loading through `from_pretrained(distributed_config=...)`,
because its roles load on rank 0 and broadcast (`conveyor.workers.training.loading`),
wrap the layers themselves (activation checkpointing, LoRA, the value model)
and need the meshes for their own collectives. What transformers does not do,
and this module does: check the EP size against the model, count the tokens
each EP rank receives per layer (`CountingAllToAll`, registered as
`ep_implementation="conveyor_all_to_all"`), and tell expert parameters apart
for the memory figures. The experts' FSDP2 unit and the clipping over both
meshes are the strategy's (`conveyor.workers.training.strategy.FSDP2`).

It deliberately does not combine with HSDP (a `dp_replicate` dimension), and
does not cover tensor parallelism or experts not kept as fused parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn

from conveyor.workers.training.mesh import Meshes, collective_device

__all__ = [
    "check_expert_parallel",
    "expert_modules",
    "apply_expert_parallel",
    "CountingAllToAll",
    "tokens_received_metrics",
]

IMPLEMENTATION = "conveyor_all_to_all"


def expert_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The experts module of every sparse MoE layer, by its full name (empty for a dense model)."""
    from conveyor.models.moe_routing import moe_layers

    blocks = {id(layer.block) for layer in moe_layers(model)}
    out: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        experts = getattr(module, "experts", None)
        if id(module) in blocks and isinstance(experts, nn.Module):
            out[f"{name}.experts" if name else "experts"] = experts
    return out


def check_expert_parallel(model: nn.Module, ep_size: int, world_size: int) -> dict[str, nn.Module]:
    """The experts modules EP shards, after checking that `ep_size` fits this model and world (ValueError if not)."""
    key = "fsdp_config.expert_parallel_size"
    if world_size % ep_size:
        raise ValueError(f"{key}={ep_size} must divide the role's {world_size} ranks")
    experts = expert_modules(model)
    if not experts:
        raise ValueError(
            f"{key}={ep_size} needs a Mixture-of-Experts model; {type(model).__name__} has no sparse "
            f"MoE layers: set {key}=1"
        )
    for name, module in experts.items():
        n = int(getattr(module, "num_experts", 0))
        if n % ep_size:
            raise ValueError(f"{key}={ep_size} must divide the {n} experts of {name}; set it to a divisor of {n}")
        missing = [p for p in ("gate_up_proj", "down_proj") if not isinstance(getattr(module, p, None), nn.Parameter)]
        if missing:
            raise ValueError(
                f"{key}: {name} ({type(module).__name__}) does not keep its experts as fused "
                f"gate_up_proj/down_proj parameters, which expert parallelism shards; set {key}=1"
            )
    return experts


class _Counts:
    """Tokens received per EP rank per layer since the last read: (token, expert) pairs, summed over passes."""

    def __init__(self) -> None:
        self.per_layer: dict[int, int] = {}

    def add(self, layer: int, n: int) -> None:
        self.per_layer[layer] = self.per_layer.get(layer, 0) + n


def _counting_class() -> type:
    """`AllToAllEP` that also counts the rows it receives (transformers' exchange, unchanged otherwise)."""
    from transformers.distributed.expert_parallel import AllToAllEP

    class CountingAllToAll(AllToAllEP):
        """transformers' all-to-all token exchange, noting the rows this rank's experts receive per layer."""

        counts: _Counts | None = None
        layer: int = -1

        def _dispatch_tokens(self, hidden_states, top_k_index, top_k_weights):
            tokens, ids, weights, state = super()._dispatch_tokens(hidden_states, top_k_index, top_k_weights)
            if self.counts is not None:
                self.counts.add(self.layer, int(sum(state.recv_sizes)))
            return tokens, ids, weights, state

    return CountingAllToAll


CountingAllToAll: Any = None  # the class, made on first use (importing transformers' EP needs torch.distributed)


def _register() -> type:
    global CountingAllToAll
    if CountingAllToAll is None:
        from transformers.distributed.expert_parallel import EPImplementationInterface

        CountingAllToAll = _counting_class()
        EPImplementationInterface.register(IMPLEMENTATION, CountingAllToAll)
    return CountingAllToAll


@dataclass
class ExpertParallelState:
    """What `apply_expert_parallel` leaves for the strategy: the experts modules and the token counts."""

    experts: dict[str, nn.Module]
    counts: _Counts = field(default_factory=_Counts)


def apply_expert_parallel(model: nn.Module, meshes: Meshes) -> ExpertParallelState:
    """Split each MoE layer's experts whole over the `ep` ranks (transformers' plan and all-to-all), in place.

    The model may be a meta skeleton (filled from rank 0 afterwards): the split allocates nothing.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    assert meshes.expert is not None
    world = meshes.dense.size()
    experts = check_expert_parallel(model, meshes.ep_size, world)
    cls = _register()
    plan: dict[str, str] = {}
    for name in experts:
        plan[f"{name}.gate_up_proj"] = plan[f"{name}.down_proj"] = "grouped_gemm"
        plan[name] = "ep_dispatch_experts"
    # transformers wants the group of ranks sharing one batch (tensor parallelism); without TP that is each
    # rank alone: a mesh of size-1 groups.
    device_type = meshes.dense.device_type
    tp = init_device_mesh(device_type, (world, 1), mesh_dim_names=("batch", "tp"))["tp"]
    state = ExpertParallelState(experts)
    names = [n for n, _ in model.named_parameters()]
    apply_expert_parallelism(model, meshes.expert["ep"], tp, plan, ep_implementation=IMPLEMENTATION)
    # Checkpoints key on the model's own names: a sharding that renamed a parameter would break them.
    assert [n for n, _ in model.named_parameters()] == names, "expert parallelism renamed parameters"
    # The implementation instance lives in the hooked forward's closure; reach it to hand it the counter.
    for index, module in enumerate(experts.values()):
        impl = _implementation_of(module, cls)
        impl.counts, impl.layer = state.counts, index
    return state


def _implementation_of(module: nn.Module, cls: type) -> Any:
    """The EP implementation object the hooked `module.forward` calls."""
    fwd = module.__dict__.get("forward")
    for cell in getattr(fwd, "__closure__", None) or ():
        if isinstance(cell.cell_contents, cls):
            return cell.cell_contents
    raise RuntimeError(f"no {cls.__name__} behind the expert-parallel forward of {type(module).__name__}")


def tokens_received_metrics(state: ExpertParallelState, meshes: Meshes, device: torch.device) -> dict[str, float]:
    """Per layer, the most tokens an EP rank received over the mean across the EP group (1 = even); resets the counts.

    A collective over the `ep` dimension: every rank of the role calls it as often as the others.
    """
    n_layers = len(state.experts)
    local = torch.tensor([float(state.counts.per_layer.get(i, 0)) for i in range(n_layers)], dtype=torch.float64)
    state.counts.per_layer.clear()
    group = meshes.expert.get_group("ep")
    via = collective_device(device, group)
    gathered = [torch.empty_like(local, device=via) for _ in range(meshes.ep_size)]
    tdist.all_gather(gathered, local.to(via), group=group)
    table = torch.stack(gathered).cpu()  # (ep, layers)
    out: dict[str, float] = {}
    worst = 0.0
    for i in range(n_layers):
        mean = float(table[:, i].mean())
        ratio = float(table[:, i].max()) / mean if mean > 0 else 1.0
        out[f"moe/ep_tokens_received_max_over_mean/layer_{i}"] = ratio
        worst = max(worst, ratio)
    out["moe/ep_tokens_received_max_over_mean"] = worst
    out["perf/ep_tokens_received_local"] = float(table.sum(dim=1)[meshes.expert.get_local_rank("ep")])
    return out
