"""The optimizer and learning-rate schedule of a training worker (the actor and the critic alike).

The schedule is torch's ``LambdaLR`` over one documented multiplier,
``lr_multiplier``: linear warm-up over ``lr_warmup_steps`` optimizer steps,
then constant, or a cosine from 1 down to ``min_lr_ratio`` at the run's last
optimizer step. A worker steps the scheduler once per update call and keeps
``scheduler.state_dict()`` in its own state, so a resumed run continues the
schedule exactly.

This module deliberately knows nothing of ranks or the data plane, and does
not decide how many optimizer steps a run has beyond the one formula in
``total_optim_steps``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch.optim.lr_scheduler import LambdaLR

if TYPE_CHECKING:
    from conveyor.config import OptimConfig

__all__ = ["LR_SCHEDULERS", "lr_multiplier", "total_optim_steps", "build_optimizer", "adamw_implementation"]

# The schedules after warm-up (actor_rollout_ref.actor.optim.lr_scheduler, critic.optim.lr_scheduler).
LR_SCHEDULERS: tuple[str, ...] = ("constant", "cosine")


def lr_multiplier(step: int, *, warmup_steps: int, total_steps: int, scheduler: str, min_lr_ratio: float) -> float:
    """Learning-rate multiplier at optimizer step ``step`` (0-based): linear warm-up then constant or cosine."""
    if scheduler not in LR_SCHEDULERS:
        raise ValueError(f"unknown lr scheduler {scheduler!r}; valid: {list(LR_SCHEDULERS)}")
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if scheduler == "cosine":
        span = max(1, total_steps - warmup_steps)
        # Past the planned end (a run extended on resume) the lr stays at the floor instead of rising again.
        progress = min(1.0, (step - warmup_steps) / span)
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return 1.0


def total_optim_steps(
    total_training_steps: int, train_batch_size: int, ppo_mini_batch_size: int, ppo_epochs: int
) -> int:
    """Optimizer steps in a whole run: one per mini-batch, per PPO epoch, per training step."""
    return total_training_steps * ppo_epochs * (train_batch_size // ppo_mini_batch_size)


def adamw_implementation(params: list[torch.nn.Parameter]) -> dict[str, bool]:
    """AdamW's fused kernel where torch has one for every parameter (CPU, CUDA; float dtypes), else foreach.

    torch's default on the CPU is the single-tensor loop: one small kernel per parameter and moment, about
    3x the fused kernel's time on the tiny model (benchmarks/e2e_vs_trl.py times the whole step).
    """
    fusable = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
    if params and all(p.device.type in ("cpu", "cuda") and p.dtype in fusable for p in params):
        return {"fused": True}
    return {"foreach": True}


def build_optimizer(
    params: Iterable[torch.nn.Parameter], optim: OptimConfig, total_steps: int
) -> tuple[torch.optim.AdamW, LambdaLR]:
    """AdamW over ``params`` and its ``LambdaLR`` schedule of ``total_steps`` optimizer steps, per ``optim``."""
    params = list(params)
    optimizer = torch.optim.AdamW(
        params, lr=optim.lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay, **adamw_implementation(params)
    )
    # A closure, not a callable object: LambdaLR saves only an object's attributes, so the
    # schedule's shape always comes from the config and a checkpoint restores just its position.
    scheduler = LambdaLR(
        optimizer,
        lambda step: lr_multiplier(
            step,
            warmup_steps=optim.lr_warmup_steps,
            total_steps=total_steps,
            scheduler=optim.lr_scheduler,
            min_lr_ratio=optim.min_lr_ratio,
        ),
    )
    return optimizer, scheduler
