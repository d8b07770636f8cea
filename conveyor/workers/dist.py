"""The few collective operations a data-parallel rank needs, as no-ops in a single-rank world.

Workers call these instead of `torch.distributed` directly so that the same
code runs in-process (world size 1, no process group) and as Ray actors.
"""

from __future__ import annotations

import torch
import torch.distributed as tdist

__all__ = ["all_reduce_sum", "all_reduce_grads", "is_active"]


def is_active(world_size: int) -> bool:
    """Whether collectives are needed (more than one rank and a process group exists)."""
    return world_size > 1 and tdist.is_available() and tdist.is_initialized()


def all_reduce_sum(tensor: torch.Tensor, world_size: int) -> torch.Tensor:
    """Sum `tensor` over ranks in place (no-op with one rank); returns it."""
    if is_active(world_size):
        # gloo has no float64 all-reduce on some builds; float64 is fine on both backends used here.
        tdist.all_reduce(tensor, op=tdist.ReduceOp.SUM)
    return tensor


def all_reduce_grads(model: torch.nn.Module, world_size: int) -> None:
    """Sum gradients over ranks, flattened into one buffer per dtype (losses are already globally normalised)."""
    if not is_active(world_size):
        return
    # An expert no token of this rank reached has no grad here but may on
    # another rank: every rank must contribute the same buffer layout.
    grads = []
    for p in model.parameters():
        if p.requires_grad:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for group in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in group])
        tdist.all_reduce(flat, op=tdist.ReduceOp.SUM)
        offset = 0
        for g in group:
            n = g.numel()
            g.copy_(flat[offset : offset + n].view_as(g))
            offset += n
