"""The broadcast transport: a sync's buckets from one rank to every other rank of a group, streamed.

Each bucket is one `broadcast_object_list` of its table (names, dtypes, shapes, offsets) and one
`broadcast` of its flat byte buffer; a bucket of one tensor is broadcast from the tensor's own memory
(no packing copy). The receiver rebuilds views into the buffer it received and hands them on before it
receives the next bucket: it holds one bucket at a time, plus whatever the engine keeps. An end marker
(a None table) closes the stream.

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

from conveyor.weights.buckets import Staging, SyncStats, buckets, bytes_of, layout, pack_into, table_bytes, unpack

__all__ = ["send_buckets", "receive_buckets", "iter_received"]


def send_buckets(
    named: Iterable[tuple[str, Tensor]],
    *,
    bucket_bytes: int,
    group: Any = None,
    src: int = 0,
    device: torch.device | str = "cpu",
    staging: Staging | None = None,
) -> SyncStats:
    """Broadcast `named` from rank `src` of `group` in buckets: their metadata, then one flat buffer each.

    `device` is where the group's collectives run (cpu for gloo, the rank's GPU for nccl); tensors elsewhere
    are copied there a bucket at a time, into `staging` (pass one that lives across syncs to pack into
    memory already touched). Every other rank of the group runs `receive_buckets` or `iter_received`
    with the same `src`; an end marker closes the stream.
    """
    device = torch.device(device)
    staging = staging if staging is not None else Staging(device)
    stats, t0 = SyncStats(), time.perf_counter()
    for bucket in buckets(named, bucket_bytes):
        meta, total = layout(bucket)
        _broadcast_object(meta, src, group, device)
        only = bucket[0][1] if len(bucket) == 1 else None
        if only is not None and only.device == device and only.is_contiguous():
            buffer = bytes_of(only)  # a lone tensor travels from its own memory
        else:
            buffer = staging.get(total)
            pack_into(buffer, bucket, meta)
        _broadcast(buffer, src, group)
        stats.add(bucket)
        del buffer, bucket, only
    _broadcast_object(None, src, group, device)
    stats.seconds = time.perf_counter() - t0
    return stats


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


def _receive_bucket(group: Any, src: int, staging: Staging) -> list[tuple[str, Tensor]] | None:
    """The next bucket `send_buckets` broadcasts from `src`, as views of a staging buffer; None at the end marker."""
    meta = _broadcast_object(None, src, group, staging.device)
    if meta is None:
        return None
    # Reused only if the consumer kept no view of the previous bucket (Staging.get checks).
    buffer = staging.get(table_bytes(meta))
    _broadcast(buffer, src, group)
    return list(unpack(buffer, meta))


def iter_received(
    *,
    group: Any = None,
    src: int = 0,
    device: torch.device | str = "cpu",
    stats: SyncStats | None = None,
    staging: Staging | None = None,
) -> Iterator[tuple[str, Tensor]]:
    """The (name, tensor) stream `send_buckets` broadcasts from `src`, lazily: one bucket is received at a time.

    The yielded tensors are views of their bucket's buffer, so a consumer may keep them (vLLM's reload holds
    a layer's tensors until the layer is complete); the buffer is freed once no view of it is alive. Consume
    it to the end: the stream's collectives pair with the sender's.
    """
    staging = staging if staging is not None else Staging(device)
    while (bucket := _receive_bucket(group, src, staging)) is not None:
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
) -> SyncStats:
    """Receive what `send_buckets` broadcasts from `src` and call `load(bucket)` once per bucket; returns the stats.

    The receiver holds one bucket at a time: the next is received only after `load` has returned and the
    previous bucket's views are dropped (unless `load` keeps them, when the next bucket gets new memory).
    `staging` kept across syncs receives into memory already touched.
    """
    staging = staging if staging is not None else Staging(device)
    stats, t0 = SyncStats(), time.perf_counter()
    while (bucket := _receive_bucket(group, src, staging)) is not None:
        stats.add(bucket)
        load(bucket)
        del bucket
    stats.seconds = time.perf_counter() - t0
    return stats
