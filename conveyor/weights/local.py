"""The in-process transport: the trainer's stream handed straight to an engine in the same process.

No copy beyond what produced the tensors: each bucket goes to a `load` callback (`stream_to`), or the whole
stream to one engine call. `copy_into` is the `load` of an engine that copies each tensor into its parameter
at once (the benchmark's model), and `into_model` lets a collective receiver put large tensors there directly.

What it deliberately does not do: cross a process boundary (`collective`, `shared`, `object_store`) or keep
copies for later (`conveyor.weights.staged`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from conveyor.weights.buckets import SyncStats, buckets

__all__ = ["stream_to", "copy_into", "into_model", "place"]


def stream_to(
    named: Iterable[tuple[str, Tensor]], load: Callable[[list[tuple[str, Tensor]]], Any], *, bucket_bytes: int
) -> SyncStats:
    """In-process sync: each bucket of `named` straight to `load` (no copy beyond what produced the tensors)."""
    stats, t0 = SyncStats(), time.perf_counter()
    for bucket in buckets(named, bucket_bytes):
        stats.add(bucket)
        load(bucket)
    stats.seconds = time.perf_counter() - t0
    return stats


def copy_into(model: torch.nn.Module) -> Callable[[list[tuple[str, Tensor]]], None]:
    """A `load` callback that copies each received tensor into `model`'s parameter or buffer of that name, in place
    (a tensor already received there, through `into_model`, is left as it is)."""
    targets = dict(model.state_dict(keep_vars=True))

    def load(bucket: list[tuple[str, Tensor]]) -> None:
        with torch.no_grad():
            for name, tensor in bucket:
                if name not in targets:
                    raise KeyError(f"weight sync: the receiving model has no tensor named {name!r}")
                place(targets[name], tensor)

    return load


def into_model(model: torch.nn.Module) -> Callable[[str, torch.dtype, tuple[int, ...]], Tensor | None]:
    """An `into` for `receive_buckets`: a large tensor is received straight into `model`'s tensor of that name."""
    targets = model.state_dict()  # detached: the collective writes into the parameters' memory, outside autograd
    return lambda name, dtype, shape: targets.get(name)


def place(target: Tensor, tensor: Tensor) -> None:
    """Copy `tensor` into `target` in place, unless it was received there already (the same memory)."""
    if tensor.data_ptr() == target.data_ptr() and tensor.shape == target.shape and tensor.dtype == target.dtype:
        return
    target.copy_(tensor)
