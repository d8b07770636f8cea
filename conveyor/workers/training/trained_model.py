"""A role's model under its training strategy: the optimizer and lr schedule, the passes, the step, the checkpoints.

`TrainedModel` is what the actor, critic and reference ranks hold: it wraps the model with the role's
`conveyor.workers.training.strategy.TrainingStrategy` (filling fsdp2 shards from rank 0's host copy,
`conveyor.workers.training.loading`), builds the optimizer over what trains, equalises the micro-batch
count over ranks, scales and synchronises the backward, clips and steps. `CheckpointEndpoints` gives a
worker that keeps one its checkpoint endpoints.

Checkpoints go through `torch.distributed.checkpoint.state_dict`, whose keys
are the model's own parameter names whatever the strategy and world size: a
checkpoint written by two `fsdp2` ranks loads into one plain rank and back.

What it deliberately does not do: decide how the ranks hold the model or exchange gradients (the strategy
does), compute a loss, or read the data plane or the config objects; workers pass it plain values.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as tdist
from torch import nn

from conveyor.workers.training.strategy import TrainingStrategy

__all__ = ["TrainedModel", "CheckpointEndpoints"]


class TrainedModel:
    """A role's model under its strategy, with its optimizer and lr schedule: what the actor and critic share.

    `forward_module` is what a training forward must call (the DDP wrapper
    under dp; the model itself otherwise). `passes(slices)` equalises the
    micro-batch count over ranks; `backward` scales and synchronises; `step`
    clips, steps and advances the schedule; `save`/`load` write and read the
    role's shards.
    """

    def __init__(
        self,
        model: nn.Module,
        strategy: TrainingStrategy,
        *,
        trainable: bool,
        optim_cfg: Any = None,
        total_steps: int = 1,
        gradient_checkpointing: bool = False,
    ):
        from conveyor.workers.training.optim import build_optimizer

        self.checkpointing = gradient_checkpointing and trainable
        if self.checkpointing:
            # transformers 5 names it activation checkpointing (the old name warns); the value model forwards
            # the call to its backbone.
            enable = getattr(model, "activation_checkpointing_enable", None) or getattr(
                model, "gradient_checkpointing_enable", None
            )
            if not callable(enable):
                raise ValueError(
                    f"actor_rollout_ref.model.enable_gradient_checkpointing: {type(model).__name__} "
                    "does not support gradient checkpointing"
                )
            # Non-reentrant: works with FSDP2 and DDP, and with inputs that need no gradient.
            kwarg = (
                "activation_checkpointing_kwargs"
                if "activation" in enable.__name__
                else "gradient_checkpointing_kwargs"
            )
            enable(**{kwarg: {"use_reentrant": False}})
        if not trainable:
            model.requires_grad_(False)
            model.eval()
        self.model = model
        self.strategy = strategy
        # fsdp2 over several ranks: the model came as rank 0's host copy and meta skeletons elsewhere
        # (conveyor.workers.training.loading); the shards are allocated after wrapping and filled from rank 0.
        from conveyor.workers.training.loading import fill_shards, loads_from_rank0, take_host_weights

        from_rank0 = loads_from_rank0(strategy.name, strategy.world_size)
        weights = take_host_weights(model, tdist.get_rank()) if from_rank0 else None
        self.forward_module = strategy.wrap(model, trainable=trainable)
        if weights is not None:
            fill_shards(model, weights, strategy.device)
        # After wrapping: FSDP2's optimizer must hold the sharded parameters.
        self.optimizer = self.scheduler = None
        if trainable:
            # Only what trains: under LoRA the adapters, so AdamW's moments are the adapters' size.
            self.optimizer, self.scheduler = build_optimizer(
                [p for p in model.parameters() if p.requires_grad], optim_cfg, total_steps
            )

    @property
    def adapters_only(self) -> bool:
        """Whether only part of a trained model trains (LoRA adapters): checkpoints then hold that part alone."""
        return self.optimizer is not None and any(not p.requires_grad for p in self.model.parameters())

    @property
    def optim_steps(self) -> int:
        """Update calls so far (the lr schedule's position); 0 for a frozen model."""
        return self.scheduler.last_epoch if self.scheduler is not None else 0

    def passes(self, slices: list[slice]) -> list[tuple[slice, bool]]:
        """(slice, real) for each forward/backward pass: every rank runs as many as the rank with the most.

        A rank with fewer micro-batches repeats its first one with `real=False`
        (its loss counts for nothing): the passes' collectives must pair up.
        """
        n = self.strategy.agree_count(len(slices))
        if n > len(slices) and not slices:
            raise ValueError(
                "this rank got no samples while others did; give every rank at least one sequence "
                "(raise actor_rollout_ref.actor.ppo_mini_batch_size or lower the number of ranks)"
            )
        return [(slices[i], True) if i < len(slices) else (slices[0], False) for i in range(n)]

    def backward(self, loss: torch.Tensor, *, real: bool, last: bool) -> None:
        """Back-propagate `loss` (globally normalised); communicates every pass, or the last only when deferred."""
        scale = self.strategy.loss_scale if real else 0.0
        with self.strategy.grad_sync(last or not self.strategy.defer_grad_sync):
            (loss * scale).backward()

    def step(self, grad_clip: float) -> tuple[float, bool, float, dict[str, float]]:
        """Clip, step (unless the norm is not finite) and advance the schedule: (norm, stepped, lr, local bytes)."""
        assert self.optimizer is not None and self.scheduler is not None, "a frozen model takes no steps"
        grad_norm = self.strategy.clip_grad_norm(list(self.model.parameters()), grad_clip)
        lr = self.scheduler.get_last_lr()[0]
        stepped = bool(torch.isfinite(grad_norm))
        if stepped:
            with self.strategy.optimizer_on_device(self.optimizer):
                self.optimizer.step()
        memory = self.strategy.local_bytes(self.model, self.optimizer)  # gradients still held: the peak
        memory.update(self.strategy.step_metrics())
        self.optimizer.zero_grad(set_to_none=True)
        # A skipped step still advances the schedule: its position counts update calls, as the run plans them.
        self.scheduler.step()
        return float(grad_norm), stepped, lr, memory

    def save(self, path: str) -> dict[str, Any]:
        """Write this rank's shards under `path`; returns the small state (the schedule) rank 0's checkpoint keeps."""
        from conveyor.workers.training.shards import save_shards

        save_shards(path, self.model, self.optimizer, trainable_only=self.adapters_only)
        extra: dict[str, Any] = {"optim_steps": self.optim_steps}
        if self.scheduler is not None:
            extra["lr_scheduler"] = self.scheduler.state_dict()
        return extra

    def load(self, path: str, extra: dict[str, Any]) -> None:
        """Read the shards under `path` (written by any number of ranks) and the schedule state `extra`."""
        from conveyor.workers.training.shards import load_shards

        load_shards(path, self.model, self.optimizer, trainable_only=self.adapters_only)
        if self.scheduler is not None:
            if "lr_scheduler" not in extra:
                raise ValueError(f"checkpoint {path} has no learning-rate schedule state for a trained role")
            self.scheduler.load_state_dict(extra["lr_scheduler"])

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's weights on rank 0, gathered from the shards (empty on the other ranks)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if self.strategy.name == "none":
            return {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return state if tdist.get_rank() == 0 else {}


class CheckpointEndpoints:
    """The checkpoint endpoints of a worker that keeps its model in `self.trained` (actor, reference, critic)."""

    trained: TrainedModel

    def save_checkpoint(self, path: str) -> dict[str, Any]:
        """Write this rank's shards of model and optimizer under `path` (every rank calls it); the schedule state."""
        return self.trained.save(path)

    def load_checkpoint(self, path: str, extra: dict[str, Any]) -> None:
        """Load shards written by any number of ranks, and the schedule state `extra` from `save_checkpoint`."""
        self.trained.load(path, extra)

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's weights, gathered on rank 0 (empty on other ranks)."""
        return self.trained.full_state_dict()
