"""The object-store transport: a sync packed into one buffer and handed to replicas through Ray's object store.

Replicas on the trainer's node read it in place from shared memory; others get it over Ray's transfer. Used when
the actor is in the trainer's process on CPUs and no shared-memory slot is free (or the replicas are elsewhere).

What it deliberately does not do: pack the buffer (`buckets.pack`) or keep the replica's copy (`staged`).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor

__all__ = ["put_packed", "get_packed"]


def put_packed(buffer: Tensor) -> list[Any]:
    """`buffer` (a packed sync) in Ray's object store: a one-element list, so that Ray passes the reference on."""
    import ray

    return [ray.put(buffer.numpy())]  # freed when the last reference, the caller's, goes


def get_packed(refs: list[Any]) -> Tensor:
    """The packed buffer `put_packed` stored, as a uint8 tensor (read-only shared memory on the same node)."""
    import ray

    array = ray.get(refs[0])
    with warnings.catch_warnings():  # read-only shared memory: only read, into the replica's staged copies
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)
