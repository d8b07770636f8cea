"""Weights kept for later: copies of a sync that an engine loads when the rollout's thread says so.

Asynchronous runs sync beside a generation in progress, whose weights must not change under it, so the new
weights wait as a copy: in the trainer's process in a `WeightInbox` (the newest offer wins), in a replica of
its own in `StagedWeights` (by version, loaded in order with the batches).

A sync that arrives delta-coded (`conveyor.weights.delta`, through Ray's object store) is decoded on staging
against the replica's own copy, so every staged copy is whole and any of them may be loaded (or skipped).

What it deliberately does not do: receive the weights (the transports) or load them into an engine (the worker).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch

from conveyor.weights.delta import DeltaDecoder
from conveyor.weights.shared import map_shared

__all__ = ["WeightInbox", "StagedWeights", "staged_copy", "LOAD_STAGED", "LOAD_SHARED"]

# The call parameter that has a replica load the weights staged as that version before it generates.
LOAD_STAGED = "load_staged_weights"
# ...and, beside it, where in shared memory they are (`SharedSlots.handle`) when they were not staged by a call.
LOAD_SHARED = "load_shared_weights"

Named = list[tuple[str, torch.Tensor]]


def staged_copy(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A copy of `tensor` that the actor's next update cannot change, at the engine's `dtype` where it is floating."""
    tensor = tensor.detach()
    if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
        return tensor.to(dtype)  # a new tensor already: no second copy
    return tensor.clone()


class WeightInbox:
    """The newest staged weights, (label, tensors), for the rollout's thread to take; a newer offer replaces an older
    one (weights only get newer, so a batch that starts with them is fresher than scheduled, never staler)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._staged: tuple[int, Named] | None = None

    def offer(self, label: int, tensors: Named) -> None:
        """Stage `tensors` as version `label`."""
        with self._lock:
            self._staged = (label, tensors)

    def take(self) -> tuple[int, Named] | None:
        """The staged weights, once (None when nothing new is staged)."""
        with self._lock:
            staged, self._staged = self._staged, None
        return staged


class StagedWeights:
    """A replica's staged copies of syncs, by version, in host memory at the engine's dtype; thread-safe (a sync
    arrives beside the generation that will not load it)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self._copies: dict[int, Named] = {}
        self._lock = threading.Lock()
        self._shared: tuple[str, torch.Tensor] | None = None  # the trainer's `SharedSlots` file, mapped
        # Delta syncs are decoded against this replica's copy of the weights (a plain sync passes through it).
        self.decoder = DeltaDecoder("cpu")

    def stage(self, version: int, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Keep copies of a sync's tensors (views of a buffer that is reused or shared) as `version`."""
        # Not on the replica's device: beside an engine that fills it (vLLM's KV cache), a whole model arriving in
        # the trainer's float32 would not fit; the engine converts to its dtype on loading anyway.
        tensors = [
            (name, t.to("cpu", self.dtype if t.is_floating_point() else t.dtype, copy=True))
            for name, t in self.decoder.decode(named)
        ]
        with self._lock:
            self._copies[version] = tensors

    def delta_metrics(self) -> dict[str, float]:
        """The latest staged sync's delta metrics: its checksum mismatches (the sender sends whole after any)."""
        return {"rollout/weight_sync/checksum_mismatches": float(self.decoder.mismatches)}

    def pop(self, version: int) -> Named | None:
        """Remove and return the copy of `version` (None if it is not there) and drop the older ones."""
        with self._lock:
            return self._pop(version)

    def newest_after(self, served: int) -> tuple[int, Named] | None:
        """The newest copy newer than `served`, removed with the older ones; None if there is none."""
        with self._lock:
            newer = [v for v in self._copies if v > served]
            if not newer:
                return None
            version = max(newer)
            return version, self._pop(version)

    def _pop(self, version: int) -> Named | None:
        """`pop` under the lock."""
        tensors = self._copies.pop(version, None)
        for older in [v for v in self._copies if v < version]:
            del self._copies[older]
        return tensors

    def shared(self, path: str, size: int, offset: int, nbytes: int) -> torch.Tensor:
        """Bytes [offset, offset + nbytes) of the trainer's shared-memory file, mapped once (the file is removed
        after the first load, so the mapping is kept)."""
        if self._shared is None or self._shared[0] != path:
            self._shared = (path, map_shared(path, size))
        return self._shared[1][offset : offset + nbytes]
