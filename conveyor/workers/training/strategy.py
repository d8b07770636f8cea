"""Training strategies: how the ranks of one role hold a model and combine their gradients.

Three strategies behind one small interface, one class each (`STRATEGY_CLASSES`; the base class
`TrainingStrategy` is `none`, and calling it with a name builds the named one), chosen by
`actor_rollout_ref.actor.strategy` (and `critic.strategy`, `actor_rollout_ref.ref.strategy`).
Each distributed strategy runs on the role's named device meshes, built once when it wraps the model
(`conveyor.workers.training.mesh.build_meshes`, transformers' dimension names): `("fsdp",)` over every
rank, `("dp_replicate", "fsdp")` under HSDP (`fsdp_config.fsdp_size`: shard within groups of that
many ranks, replicate across them) and for `dp` (groups of one), and `("efsdp", "ep")` for the
experts under expert parallelism. Its own collectives (counts and sums over every rank, one dimension
at a time; DDP's all-reduce on `dp_replicate`) run on named dimensions:

- `none`: one rank, the model as it is.
- `dp`: every rank holds a full replica; PyTorch's `DistributedDataParallel`
  all-reduces the gradients in every micro-batch's backward.
- `fsdp2`: parameters, gradients and optimizer state are sharded over the
  ranks with `torch.distributed.fsdp.fully_shard` (one unit per decoder layer
  and one at the root); each layer's parameters are all-gathered for its
  forward and backward and the gradients reduce-scattered in every
  micro-batch's backward, so a rank holds only its shard of the gradients.
  `fsdp_config.defer_grad_sync` defers the communication to the last
  micro-batch instead (fewer collectives, but a full unsharded gradient per
  rank in between).
  With `fsdp_config.expert_parallel_size` = ep > 1, each MoE layer's experts are split whole
  over the `ep` dimension (transformers' expert plan; tokens travel to them by all-to-all)
  and FSDP2-sharded over `efsdp` = world / ep; a layer's forward then gathers only this
  rank's experts. Gradient clipping sums the squared norms of both meshes' shards.

With `ulysses_sequence_parallel_size` = sp > 1 (any distributed strategy) the meshes gain `("dp",
"sp")`: the ranks of an `sp` group split each packed micro-batch by tokens
(`conveyor.workers.training.sequence_parallel`); the strategy itself shards and reduces as above.

Losses are normalised by the *global* token or sequence count (see
`conveyor.algos.losses`), so the ranks' gradients must be summed; DDP and FSDP2
average them, so the loss a rank back-propagates is scaled by the world size
(`loss_scale`). Under both, a collective happens inside the update, so every
rank must run the same number of forward/backward passes: `agree_count`
gives each rank the largest count, and a rank with fewer micro-batches runs
extra passes whose loss is multiplied by 0.

No-grad forwards (old/reference log-probs, values, routing agreement) run
inside `sharded_no_grad`: under `fsdp2` they call the sharded module's own
forward, which all-gathers one layer at a time and frees it after, so no rank
ever holds the whole model; every rank runs the same number of forwards
(`TrainedModel.passes`, in `trained_model`). The hf rollout decodes over the shards the same way,
every rank stepping until the last one is done (`all_done`), unless the whole
model is small enough to gather once for the rollout (`full_params`, below
`rollout.hf_whole_gather_max_gb`), which spares a collective per layer and
token (docs/distributed.md).
Under `dp` the replica is used directly.

A role's model under its strategy, with its optimizer, schedule and checkpoints, is
`conveyor.workers.training.trained_model.TrainedModel`.

This module deliberately knows nothing of the data plane, the losses, the optimizer or the
config objects; workers pass it plain values.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn

from conveyor.registry import lookup, registrar
from conveyor.workers.training.mesh import collective_device, process_group_backend

logger = logging.getLogger(__name__)

__all__ = [
    "STRATEGIES",
    "STRATEGY_CLASSES",
    "TrainingStrategy",
    "DataParallel",
    "FSDP2",
    "resolve_strategy",
    "decoder_layers",
    "ensure_process_group",
    "process_group_backend",
    "collective_device",
    "mixed_precision",
]

# Strategy name -> class, filled below the classes; `STRATEGIES` is a live view of its names (the config's choices).
STRATEGY_CLASSES: dict[str, type[TrainingStrategy]] = {}
STRATEGIES = STRATEGY_CLASSES.keys()

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_strategy(name: str | None, world_size: int) -> str:
    """The strategy a role runs: `fsdp2` by default with several ranks, `none` with one (what `name=null` means)."""
    if name is None:
        return "fsdp2" if world_size > 1 else "none"
    lookup(STRATEGY_CLASSES, name, "strategy")  # an unknown name is the registry's error
    if name == "dp" and world_size == 1:
        return "none"  # a replica of one is the model itself
    return name


def mixed_precision(
    strategy: str, param_dtype: str | None, reduce_dtype: str | None, device_type: str
) -> tuple[str | None, str | None]:
    """The (param_dtype, reduce_dtype) an fsdp2 role computes and reduces in; None = the model's (master) dtype.

    What is set is kept. Unset, a GPU run under fsdp2 computes in bfloat16 and reduces gradients in float32
    over float32 master weights (verl's defaults for its FSDP actor); a CPU run (and dp, none) computes in the
    model's dtype, as it always has.
    """
    if strategy != "fsdp2" or device_type != "cuda":
        return param_dtype, reduce_dtype
    return param_dtype or "bfloat16", reduce_dtype or "float32"


def ensure_process_group(device: torch.device) -> None:
    """A one-rank process group when none exists (FSDP2 needs one even on a single rank)."""
    if tdist.is_initialized():
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    tdist.init_process_group(process_group_backend(device.type), rank=0, world_size=1, timeout=timedelta(minutes=30))


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks of a causal LM or a value model (the units FSDP2 shards one by one); a
    vision-language model's vision blocks first, then its text model's layers."""
    names = (
        "model.layers",
        "backbone.layers",
        "model.model.layers",
        "model.language_model.layers",
        "backbone.language_model.layers",  # a vision-language critic: its body is the multimodal model
        "transformer.h",
    )
    for name in (*names, "layers"):
        node: Any = model
        for part in name.split("."):
            node = getattr(node, part, None)
            if node is None:
                break
        if isinstance(node, (nn.ModuleList, list)) and len(node) > 0:
            body = getattr(model, name.split(".")[0], None)  # the module holding the text layers (and the vision tower)
            vision = getattr(getattr(body, "visual", None), "blocks", None)
            return [*(vision if isinstance(vision, nn.ModuleList) else []), *node]
    raise ValueError(f"fsdp2: cannot find the decoder layers of {type(model).__name__} to shard; use strategy=dp")


def _local(t: torch.Tensor) -> torch.Tensor:
    """The part of `t` this rank holds (a DTensor's local shard, or `t` itself)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


class TrainingStrategy:
    """One role's strategy on one rank: wrap the model, run micro-batches, clip, and report local bytes.

    The base class is the `none` strategy (one rank, nothing to exchange); `DataParallel` and `FSDP2` override
    what they do differently. Calling `TrainingStrategy(name, ...)` builds the class `STRATEGY_CLASSES` names
    (after `resolve_strategy`), so callers need not know the classes.
    """

    name = "none"

    def __new__(cls, name: str | None = None, *, world_size: int = 1, **kwargs: Any) -> TrainingStrategy:
        """The class of the strategy `name` resolves to, when called on the base."""
        if cls is TrainingStrategy:
            cls = lookup(STRATEGY_CLASSES, resolve_strategy(name, world_size), "strategy")
        return super().__new__(cls)

    def __init__(
        self,
        name: str | None = None,
        *,
        world_size: int,
        device: torch.device,
        param_dtype: str | None = None,
        reduce_dtype: str | None = None,
        param_offload: bool = False,
        optimizer_offload: bool = False,
        defer_grad_sync: bool = False,
        expert_parallel_size: int = 1,
        expert_mesh: bool = False,
        fsdp_size: int | None = None,
        ulysses_sequence_parallel_size: int = 1,
    ):
        self.world_size = world_size
        self.device = device
        self.param_dtype, self.reduce_dtype = (
            _DTYPES[d] if d else None for d in mixed_precision(self.name, param_dtype, reduce_dtype, device.type)
        )
        # Offloading moves state to host memory between uses: on a CPU run it already is there.
        on_gpu = device.type == "cuda"
        self.param_offload = param_offload and on_gpu
        self.optimizer_offload = optimizer_offload and on_gpu
        if (param_offload or optimizer_offload) and not on_gpu:
            logger.info(
                "fsdp_config param_offload/optimizer_offload have no effect on a CPU run (state is in host "
                "memory already)"
            )
        if (param_dtype or reduce_dtype) and self.name != "fsdp2":
            logger.warning(
                "fsdp_config.param_dtype/reduce_dtype apply under strategy=fsdp2 only; this role runs %s", self.name
            )
        if (expert_parallel_size != 1 or expert_mesh) and self.name != "fsdp2":
            raise ValueError(
                f"fsdp_config.expert_parallel_size={expert_parallel_size} needs strategy=fsdp2 (this "
                f"role runs {self.name} on {world_size} rank(s)); set the role's strategy to fsdp2 or "
                "expert_parallel_size to 1"
            )
        self.expert_parallel_size = expert_parallel_size
        if fsdp_size not in (None, world_size) and self.name != "fsdp2":
            raise ValueError(
                f"fsdp_config.fsdp_size={fsdp_size} shards within groups under strategy=fsdp2 only "
                f"(this role runs {self.name}); set the role's strategy to fsdp2 or fsdp_size to null"
            )
        if fsdp_size is not None and (fsdp_size < 1 or world_size % fsdp_size):
            raise ValueError(
                f"fsdp_config.fsdp_size={fsdp_size} must divide the role's {world_size} ranks, or be null (all of them)"
            )
        # fsdp2 shards within groups of fsdp_size ranks and replicates across the groups (HSDP).
        self.replicate = 1 if fsdp_size is None else world_size // fsdp_size
        if self.replicate > 1 and (expert_parallel_size > 1 or expert_mesh):
            raise ValueError(
                f"fsdp_config.fsdp_size={fsdp_size} (HSDP) with expert_parallel_size="
                f"{expert_parallel_size} is not supported yet; set fsdp_size to null or "
                "expert_parallel_size to 1"
            )
        if ulysses_sequence_parallel_size < 1 or world_size % ulysses_sequence_parallel_size:
            raise ValueError(
                f"ulysses_sequence_parallel_size={ulysses_sequence_parallel_size} must divide the role's "
                f"{world_size} ranks; set it to a divisor of {world_size}"
            )
        # Ranks of one sequence-parallel group split each packed micro-batch by tokens (`sequence_parallel`).
        self.sequence_parallel_size = ulysses_sequence_parallel_size
        # The expert mesh and the all-to-all even at size 1: the one-GPU check runs the EP code path this way.
        self.expert_mesh = expert_mesh or expert_parallel_size > 1
        # False: every micro-batch's backward communicates (sharded gradients under fsdp2); True: only the last's.
        self.defer_grad_sync = defer_grad_sync
        self._meshes: Any = None

    @property
    def distributed(self) -> bool:
        """Whether ranks exchange gradients (dp or fsdp2)."""
        return self.name != "none"

    @property
    def loss_scale(self) -> float:
        """What each rank multiplies its (globally normalised) loss by: DDP and FSDP2 average, the losses need a sum."""
        return float(self.world_size) if self.distributed else 1.0

    @property
    def expert_parallel(self) -> bool:
        """Whether the experts are split whole over ranks (fsdp2 with expert_parallel_size > 1)."""
        return False

    @property
    def forward_communicates(self) -> bool:
        """Whether a forward exchanges data between ranks even with every parameter gathered (EP's all-to-all)."""
        return self.expert_parallel

    @property
    def meshes(self) -> Any:
        """The role's named device meshes (`conveyor.workers.training.mesh.Meshes`), built on first use, once."""
        if self._meshes is None:
            from conveyor.workers.training.mesh import build_meshes

            ensure_process_group(self.device)
            # dp is all replicas: its one dimension is `dp_replicate` (with `fsdp` groups of one).
            replicate = self.world_size if self.name == "dp" else self.replicate
            self._meshes = build_meshes(
                self.world_size,
                self.device.type,
                replicate=replicate,
                ep_size=self.expert_parallel_size,
                expert=self.expert_parallel,
                sp_size=self.sequence_parallel_size,
            )
        return self._meshes

    # ------------------------------------------------------------------ wrapping
    def wrap(self, model: nn.Module, *, trainable: bool = True) -> nn.Module:
        """Prepare `model` in place for this strategy; returns the module a training forward must go through."""
        return model

    # ------------------------------------------------------------------ running
    def agree_count(self, count: int) -> int:
        """The largest of every rank's `count` (every rank must run as many collective passes as the busiest)."""
        if not self.distributed or self.world_size == 1:
            return count
        t = torch.tensor([count], dtype=torch.int64, device=self._collective_device())
        self.meshes.all_reduce(t, tdist.ReduceOp.MAX)
        return int(t.item())

    def all_done(self, done: bool) -> bool:
        """Whether every rank is `done` (a collective: every rank must ask as often as the others)."""
        return self.agree_count(0 if done else 1) == 0

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks in place (a no-op on one rank)."""
        if self.distributed and self.world_size > 1:
            out = tensor.to(self._collective_device())
            self.meshes.all_reduce(out, tdist.ReduceOp.SUM)
            tensor.copy_(out.to(tensor.device))
        return tensor

    def _collective_device(self) -> torch.device:
        return collective_device(self.device)

    @contextlib.contextmanager
    def grad_sync(self, sync: bool) -> Iterator[None]:
        """Accumulate gradients locally unless `sync` (the backward inside communicates only when it is True)."""
        yield

    @property
    def sharded(self) -> bool:
        """Whether the model is held as FSDP2 shards (its forward gathers each layer in turn)."""
        return False

    @contextlib.contextmanager
    def sharded_no_grad(self) -> Iterator[None]:
        """No-grad forwards over the shards: each layer (the root too) is gathered for its forward and freed after.

        Every rank must run the same number of forwards inside (each one all-gathers); nothing is left
        gathered on exit.
        """
        yield

    @contextlib.contextmanager
    def full_params(self) -> Iterator[None]:
        """The hf rollout of a small model only: under fsdp2 gather the whole model once (no collective inside),
        re-shard after."""
        yield

    def clip_grad_norm(self, params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm (over every rank's shards) to `max_norm`; returns the norm before clipping."""
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        full = getattr(norm, "full_tensor", None)
        return full() if callable(full) else norm

    @contextlib.contextmanager
    def optimizer_on_device(self, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        """With optimizer_offload, the optimizer state lives in host memory except during its step."""
        if not self.optimizer_offload:
            yield
            return
        _move_optimizer_state(optimizer, self.device)
        try:
            yield
        finally:
            _move_optimizer_state(optimizer, torch.device("cpu"))

    # ------------------------------------------------------------------ memory
    def local_bytes(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, float]:
        """Bytes of parameters, gradients and optimizer state this rank holds (its shards under fsdp2).

        `perf/expert_*_bytes_local` count the experts of the MoE layers alone, and
        `perf/expert_param_bytes_gathered` what one MoE layer's forward materialises of its experts' weights
        (all of them under fsdp2, this rank's under EP): what expert parallelism divides by its size.
        """
        from conveyor.workers.training.expert_parallel import expert_modules

        experts = expert_modules(model).values()
        expert_ids = {id(p) for m in experts for p in m.parameters()}
        # A DTensor's numel is the whole tensor's: one layer's experts, all of them.
        layer_bytes = max((sum(p.numel() * p.element_size() for p in m.parameters()) for m in experts), default=0)
        gathered = layer_bytes // (self.expert_parallel_size if self.expert_parallel else 1)
        params = grads = optim = expert_params = expert_optim = 0
        state = optimizer.state if optimizer is not None else {}
        for p in model.parameters():
            local = _local(p)
            n = local.numel() * local.element_size()
            params += n
            if p.grad is not None:
                g = _local(p.grad)
                grads += g.numel() * g.element_size()
            moments = sum(
                _local(v).numel() * _local(v).element_size()
                for v in state.get(p, {}).values()
                if isinstance(v, torch.Tensor)
            )
            optim += moments
            if id(p) in expert_ids:
                expert_params += n
                expert_optim += moments
        return {
            "perf/param_bytes_local": float(params),
            "perf/grad_bytes_local": float(grads),
            "perf/optim_bytes_local": float(optim),
            "perf/expert_param_bytes_local": float(expert_params),
            "perf/expert_optim_bytes_local": float(expert_optim),
            "perf/expert_param_bytes_gathered": float(gathered),
        }

    def step_metrics(self) -> dict[str, float]:
        """Metrics the strategy gathered over an update (EP's tokens per rank); every rank calls it once per step."""
        return {}


class DataParallel(TrainingStrategy):
    """`dp`: a full replica per rank; DDP all-reduces the gradients over the mesh's `dp_replicate` dimension."""

    name = "dp"

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._ddp: nn.Module | None = None

    def wrap(self, model: nn.Module, *, trainable: bool = True) -> nn.Module:
        """Wrap a trained model in DDP over the role's ranks (a frozen one is used as it is)."""
        meshes = self.meshes  # built here, at the same point on every rank (creating its groups is a collective)
        if not trainable:
            return model
        from torch.nn.parallel import DistributedDataParallel

        # Every parameter of a text model takes part in every forward (transformers keeps a layer's experts in
        # fused parameters, so an expert no token reached still gets a zero gradient): no unused-parameter search.
        # A vision-language model's vision tower sits out a micro-batch without images: DDP must look for the
        # parameters a forward left unused, or one rank's reducer would wait for gradients that never come.
        # Buffers (rotary tables) are built identically on every rank: syncing them each forward would only
        # cost a collective.
        from conveyor.models.tiny_vlm import is_vlm_config

        self._ddp = DistributedDataParallel(
            model,
            device_ids=[self.device.index] if self.device.type == "cuda" else None,
            find_unused_parameters=is_vlm_config(getattr(model, "config", None) or {}),
            forward_sync_buffers=False,
            process_group=meshes.dim_group("dp_replicate"),
        )
        return self._ddp

    @contextlib.contextmanager
    def grad_sync(self, sync: bool) -> Iterator[None]:
        """Accumulate gradients locally unless `sync` (the backward inside communicates only when it is True)."""
        if self._ddp is not None and not sync:
            with self._ddp.no_sync():
                yield
            return
        yield


class FSDP2(TrainingStrategy):
    """`fsdp2`: every layer FSDP2-sharded over the mesh's `fsdp` dimension (replicated over `dp_replicate`
    under HSDP); with EP, the experts split over `ep`."""

    name = "fsdp2"

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._fsdp_units: list[nn.Module] = []
        self._root_kept = False  # whether the root stays gathered between a training forward and its backward
        self._ep: Any = None  # conveyor.workers.training.expert_parallel.ExpertParallelState under EP

    @property
    def expert_parallel(self) -> bool:
        """Whether the experts are split whole over the `ep` ranks (fsdp2 with expert_parallel_size > 1, or forced)."""
        return self.expert_mesh

    def wrap(self, model: nn.Module, *, trainable: bool = True) -> nn.Module:
        """Shard each decoder layer and the root (experts first, on their own mesh, under EP) in place."""
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        meshes = self.meshes
        kwargs: dict[str, Any] = {}
        if self.param_dtype is not None or self.reduce_dtype is not None:
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype)
        if self.param_offload:
            # Pinned host memory serves the copies to and from an accelerator; there is none to pin for otherwise.
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=self.device.type != "cpu")
        if self.expert_parallel:
            from conveyor.workers.training.expert_parallel import apply_expert_parallel

            self._ep = apply_expert_parallel(model, meshes)
            efsdp = meshes.expert["efsdp"]
            for experts in self._ep.experts.values():
                # Its own unit, so that the layer's unit does not take the expert parameters onto the dense mesh.
                fully_shard(experts, mesh=efsdp, **kwargs)
                # An expert's gradient already sums every rank's tokens (the all-to-all's backward brings them);
                # each rank's loss is scaled by the world size, so divide by it, as the dense units do.
                experts.set_gradient_divide_factor(float(self.world_size))
                if efsdp.size() > 1:
                    # A divide factor other than the group size goes through PREMUL_SUM, which gloo rejects:
                    # sum, then divide locally.
                    experts.set_force_sum_reduction_for_comms(True)
                self._fsdp_units.append(experts)
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=meshes.dense, **kwargs)
            self._fsdp_units.append(layer)
        # A trained root (embeddings, final norm, LM head) stays gathered from a training forward to its backward,
        # which needs it first; said here rather than left to torch's lazy default for the root, which the no-grad
        # passes below would otherwise switch off for good (`set_reshard_after_forward` clears it).
        self._root_kept = trainable
        fully_shard(model, mesh=meshes.dense, reshard_after_forward=not trainable, **kwargs)
        self._fsdp_units.append(model)
        return model

    def _reshard_after_forward(self, *, no_grad: bool, gathered: bool = False) -> None:
        """Set each unit's resharding after forward: the training setting, a no-grad pass's, or kept whole."""
        root = self._fsdp_units[-1] if self._fsdp_units else None
        for unit in self._fsdp_units:
            keep = gathered or (unit is root and self._root_kept and not no_grad)
            unit.set_reshard_after_forward(not keep, recurse=False)

    @contextlib.contextmanager
    def grad_sync(self, sync: bool) -> Iterator[None]:
        """Accumulate gradients locally unless `sync` (the backward inside communicates only when it is True)."""
        for unit in self._fsdp_units:
            unit.set_requires_gradient_sync(sync)
        yield

    @property
    def sharded(self) -> bool:
        """Whether the model is held as FSDP2 shards (its forward gathers each layer in turn)."""
        return bool(self._fsdp_units)

    @contextlib.contextmanager
    def sharded_no_grad(self) -> Iterator[None]:
        """No-grad forwards over the shards: each layer (the root too) is gathered for its forward and freed after.

        Every rank must run the same number of forwards inside (each one all-gathers); nothing is left
        gathered on exit.
        """
        # A no-grad pass has no backward to keep the root gathered for: every unit is freed after its forward.
        self._reshard_after_forward(no_grad=True)
        try:
            yield
        finally:
            for unit in self._fsdp_units:
                unit.reshard()
            self._reshard_after_forward(no_grad=False)

    @contextlib.contextmanager
    def full_params(self) -> Iterator[None]:
        """The hf rollout of a small model only: under fsdp2 gather the whole model once, re-shard after.

        No collective runs inside, except under EP (a rank gathers only its own experts; the forward still
        exchanges tokens: `forward_communicates`).
        """
        self._reshard_after_forward(no_grad=True, gathered=True)
        for unit in self._fsdp_units:
            unit.unshard()
        try:
            yield
        finally:
            for unit in self._fsdp_units:
                unit.reshard()
            self._reshard_after_forward(no_grad=False)

    def clip_grad_norm(self, params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm (over every rank's shards, experts included) to `max_norm`; the norm before."""
        if not self.expert_parallel:
            return super().clip_grad_norm(params, max_norm)
        # torch's clip cannot stack the norms of DTensors on two meshes (dense and expert): sum the squares per
        # mesh and layout, reduce each, then add.
        grads = [p.grad for p in params if p.grad is not None]
        total = _global_sq_norm(grads, self._collective_device()).sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            _local(g).mul_(coef.to(_local(g).device, _local(g).dtype))
        return total

    def step_metrics(self) -> dict[str, float]:
        """Under EP: the tokens each EP rank received per layer over the update, as max/mean across the EP group."""
        if self._ep is None:
            return {}
        from conveyor.workers.training.expert_parallel import tokens_received_metrics

        return tokens_received_metrics(self._ep, self.meshes, self.device)


registrar(STRATEGY_CLASSES, "none", "training strategy")(TrainingStrategy)
registrar(STRATEGY_CLASSES, "dp", "training strategy")(DataParallel)
registrar(STRATEGY_CLASSES, "fsdp2", "training strategy")(FSDP2)


def _global_sq_norm(grads: list[torch.Tensor], via: torch.device) -> torch.Tensor:
    """The squared norm of the whole gradient, every shard counted once (one reduction per mesh and layout)."""
    from torch.distributed.tensor import DTensor

    groups: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        key = (g.device_mesh.mesh_dim_names, tuple(g.placements)) if isinstance(g, DTensor) else None
        groups.setdefault(key, []).append(g)
    total = torch.zeros((), dtype=torch.float64, device=via)
    for key, members in groups.items():
        if key is None:
            for g in members:
                total += g.detach().to(via, torch.float64).pow(2).sum()
            continue
        # DTensor arithmetic: the local sums form a partial sum, which `full_tensor` reduces over exactly the
        # mesh dimensions the gradients are split on (strided expert shards included).
        sq = None
        for g in members:
            part = g.detach().to(torch.float64).pow(2).sum()
            sq = part if sq is None else sq + part
        total += sq.full_tensor().to(via)
    return total.to(torch.float32)


def _move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":
                state[key] = value.to(device, non_blocking=True)
