"""The broadcast transport: a sync's buckets from one rank to every other rank of a group, streamed.

Each bucket is one `broadcast_object_list` of its table (names, dtypes, shapes, offsets) and one
`broadcast` of the flat byte buffer its small tensors are packed into; each large tensor (`apart_bytes` or
more, or a bucket's only tensor) follows in a broadcast of its own, from its own memory: packing it would be
a copy of its bytes on each side that a plain broadcast does not make (on the CPU that copy cost as much as
the link: benchmarks/weight_sync.py). The receiver rebuilds views into its buffer and hands them on before
it receives the next bucket: it holds one bucket at a time, plus whatever the engine keeps. A receiver that
knows where a large tensor goes (`into`: an engine whose parameters have the sender's names, dtypes and
shapes) receives it there, with no copy at all. An end marker (a None table) closes the stream.

vLLM (0.32). Its in-place `reload_weights` (vllm/model_executor/model_loader/reload/layerwise.py)
moves every layer to the meta device at the start of a call and, at its end, rebuilds any layer
whose weights arrived only in part from uninitialised memory (meta.py, `torch.empty_strided`). A call
per bucket therefore breaks every layer that straddles two buckets (q/k/v fuse into one qkv_proj,
gate_up and down into one expert layer): measured on the tiny Qwen3-MoE with 16 KiB buckets, the
engine's greedy tokens then differ from the trainer's (and, in that run, stayed wrong after a later
one-call reload).
So such an engine takes ONE call per sync over a lazy iterator (`iter_received`), which vLLM consumes
layer by layer, keeping a layer's tensors only until that layer is complete. Per-bucket `load` callbacks
(`receive_buckets`) suit engines that copy each tensor into its parameter at once (`local.copy_into`).

The group is a torch.distributed group, or a standalone one with `broadcast_tensor(tensor, src)` and
`broadcast_object(obj, src)` (`conveyor.weights.channel.WeightChannel`).

What it deliberately does not do: build the group (`channel`), or decide when to sync.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor

from conveyor.weights.buckets import (
    Staging,
    SyncStats,
    Table,
    buckets,
    bytes_of,
    layout,
    nbytes,
    pack_into,
    table_bytes,
    unpack,
)

__all__ = ["send_buckets", "receive_buckets", "iter_received", "apart_bytes_for"]


def apart_bytes_for(device: torch.device | str) -> int:
    """The smallest tensor that `send_buckets` broadcasts from its own memory on `device`'s collectives.

    On the CPU a copy (~4 GB/s here) costs as much as gloo's link, and a broadcast's fixed cost is small: 1 MiB.
    On an accelerator a device copy runs at hundreds of GB/s and a collective's fixed cost is tens of
    microseconds, so only tensors where the copy is no longer negligible go apart: 64 MiB.
    """
    return 1 << 20 if torch.device(device).type == "cpu" else 64 << 20


def send_buckets(
    named: Iterable[tuple[str, Tensor]],
    *,
    bucket_bytes: int,
    group: Any = None,
    src: int = 0,
    device: torch.device | str = "cpu",
    staging: Staging | None = None,
    apart_bytes: int | None = None,
) -> SyncStats:
    """Broadcast `named` from rank `src` of `group` in buckets: their metadata, the small tensors' flat buffer,
    then each large tensor on its own.

    `device` is where the group's collectives run (cpu for gloo, the rank's GPU for nccl); tensors elsewhere
    are copied there a bucket at a time, into `staging` (pass one that lives across syncs to pack into
    memory already touched). A contiguous tensor on `device` of `apart_bytes` or more (default:
    `apart_bytes_for(device)`), or a bucket's only one, travels from its own memory. Every other rank of the
    group runs `receive_buckets` or `iter_received` with the same `src`; an end marker closes the stream.
    """
    device = torch.device(device)
    staging = staging if staging is not None else Staging(device)
    threshold = apart_bytes_for(device) if apart_bytes is None else int(apart_bytes)
    stats, t0 = SyncStats(), time.perf_counter()
    for bucket in buckets(named, bucket_bytes):
        apart = [_alone(t, device, threshold, len(bucket) == 1) for _, t in bucket]
        meta, _ = layout(bucket, apart)
        packed = _packed_bytes(bucket, meta, apart)
        _broadcast_object((meta, packed), src, group, device)
        if packed:
            buffer = staging.get(packed)
            pack_into(buffer, [e for e, a in zip(bucket, apart) if not a], [m for m, a in zip(meta, apart) if not a])
            _broadcast(buffer, src, group)
            del buffer
        for (_, tensor), alone in zip(bucket, apart):
            if alone:
                _broadcast(bytes_of(tensor), src, group)
        stats.add(bucket)
        del bucket
    _broadcast_object(None, src, group, device)
    stats.seconds = time.perf_counter() - t0
    return stats


def _alone(tensor: Tensor, device: torch.device, threshold: int, only: bool) -> bool:
    """Whether `tensor` travels from its own memory: contiguous, on the collectives' device, not empty, and large
    (or its bucket's only tensor)."""
    usable = tensor.device == device and tensor.is_contiguous() and tensor.numel() > 0
    return usable and (only or nbytes(tensor) >= threshold)


def _packed_bytes(bucket: list[tuple[str, Tensor]], meta: Table, apart: list[bool]) -> int:
    """The size of a bucket's packed region: where its last tensor that does not travel alone ends."""
    ends = (entry[3] + nbytes(t) for (_, t), entry, alone in zip(bucket, meta, apart) if not alone)
    return max(ends, default=0)


def _broadcast(tensor: Tensor, src: int, group: Any) -> None:
    """`tensor` from `src` on every member: over a standalone channel (its own method), or a torch.distributed group."""
    if hasattr(group, "broadcast_tensor"):
        group.broadcast_tensor(tensor, src)
        return
    import torch.distributed as dist

    dist.broadcast(tensor, src=src, group=group)


def _broadcast_object(obj: Any, src: int, group: Any, device: torch.device) -> Any:
    """A picklable `obj` from `src` on every member (what the other members pass is ignored)."""
    if hasattr(group, "broadcast_object"):
        return group.broadcast_object(obj, src)
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group, device=device)
    return box[0]


# Where a receiver would like a large tensor of (name, dtype, shape) to land: a tensor, or None for its buffer.
Into = Callable[[str, torch.dtype, tuple[int, ...]], Tensor | None]


def _receive_bucket(group: Any, src: int, staging: Staging, into: Into | None) -> list[tuple[str, Tensor]] | None:
    """The next bucket `send_buckets` broadcasts from `src`, as views of a staging buffer (a large tensor `into`
    places is received in its place); None at the end marker."""
    message = _broadcast_object(None, src, group, staging.device)
    if message is None:
        return None
    meta, packed = message
    # Reused only if the consumer kept no view of the previous bucket (Staging.get checks).
    buffer = staging.get(table_bytes(meta))
    if packed:
        _broadcast(buffer[:packed], src, group)
    bucket = []
    for (name, tensor), (_, _, _, offset) in zip(unpack(buffer, meta), meta):
        if offset >= packed and tensor.numel() > 0:  # it travels alone, after the packed region
            target = into(name, tensor.dtype, tuple(tensor.shape)) if into is not None else None
            if _fits(target, tensor):
                tensor = target
            _broadcast(bytes_of(tensor), src, group)
        bucket.append((name, tensor))
    return bucket


def _fits(target: Tensor | None, like: Tensor) -> bool:
    """Whether a receiver's `target` can take a tensor shaped and typed as `like` straight off the wire."""
    return (
        target is not None
        and target.is_contiguous()
        and target.device == like.device
        and target.dtype == like.dtype
        and target.shape == like.shape
    )


def iter_received(
    *,
    group: Any = None,
    src: int = 0,
    device: torch.device | str = "cpu",
    stats: SyncStats | None = None,
    staging: Staging | None = None,
    into: Into | None = None,
) -> Iterator[tuple[str, Tensor]]:
    """The (name, tensor) stream `send_buckets` broadcasts from `src`, lazily: one bucket is received at a time.

    The yielded tensors are views of their bucket's buffer, so a consumer may keep them (vLLM's reload holds
    a layer's tensors until the layer is complete); the buffer is freed once no view of it is alive. Consume
    it to the end: the stream's collectives pair with the sender's. `into` as for `receive_buckets`.
    """
    staging = staging if staging is not None else Staging(device)
    while (bucket := _receive_bucket(group, src, staging, into)) is not None:
        if stats is not None:
            stats.add(bucket)
        while bucket:
            yield bucket.pop(0)  # the stream keeps no reference to what it has handed on


def receive_buckets(
    load: Callable[[list[tuple[str, Tensor]]], Any],
    *,
    group: Any = None,
    src: int = 0,
    device: torch.device | str = "cpu",
    staging: Staging | None = None,
    into: Into | None = None,
) -> SyncStats:
    """Receive what `send_buckets` broadcasts from `src` and call `load(bucket)` once per bucket; returns the stats.

    The receiver holds one bucket at a time: the next is received only after `load` has returned and the
    previous bucket's views are dropped (unless `load` keeps them, when the next bucket gets new memory).
    `staging` kept across syncs receives into memory already touched. `into(name, dtype, shape)` may name the
    tensor a large one is received into (the engine's own parameter: `load` then finds it already in place).
    """
    staging = staging if staging is not None else Staging(device)
    stats, t0 = SyncStats(), time.perf_counter()
    while (bucket := _receive_bucket(group, src, staging, into)) is not None:
        stats.add(bucket)
        load(bucket)
        del bucket
    stats.seconds = time.perf_counter() - t0
    return stats
