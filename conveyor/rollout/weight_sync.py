"""Streaming the trainer's weights to a rollout engine: one tensor at a time, in buckets, never the whole model at once.

A weight sync here is a pipeline of lazy iterators over `(name, tensor)`:

    iter_weights(model)                     one full tensor at a time (an FSDP2 DTensor is gathered
                                            when it is reached: `full_tensor` is a collective, so every
                                            rank iterates in the same order)
    -> cast_weights(..., dtype)             each at the dtype the engine holds (bf16 from fp32 masters)
    -> engine_names(..., layout=...)        fused 3-D MoE experts (transformers 5) as the engine loads
                                            them: fused, or per expert in the checkpoint's names (views)
    -> buckets(..., bucket_bytes)           lists of at most `bucket_bytes`
    -> stream_to(load) | send_buckets(...)  in this process, or over a torch.distributed group to
                                            `receive_buckets(load)` / `iter_received()` on another rank

What travels. Over a group, each bucket is one `broadcast_object_list` of its metadata (names,
dtypes, shapes, offsets) and one `broadcast` of a flat byte buffer; a bucket of one tensor is
broadcast from the tensor's own memory (no packing copy). The receiver rebuilds views into the
buffer it received and hands them on before it receives the next bucket: it holds one bucket at a
time, plus whatever the engine keeps.

vLLM (0.32). Its in-place `reload_weights` (vllm/model_executor/model_loader/reload/layerwise.py)
moves every layer to the meta device at the start of a call and, at its end, rebuilds any layer
whose weights arrived only in part from uninitialised memory (meta.py, `torch.empty_strided`). A call
per bucket therefore breaks every layer that straddles two buckets (q/k/v fuse into one qkv_proj,
gate_up and down into one expert layer): measured on the tiny Qwen3-MoE with 16 KiB buckets, the
engine's greedy tokens then differ from the trainer's (and, in that run, stayed wrong after a later
one-call reload).
So such an engine takes ONE call per sync over a lazy iterator (`iter_received` from another
process, `conveyor.rollout.vllm.reload_vllm` in process), which vLLM consumes layer by layer, keeping a layer's tensors
only until that layer is complete. Per-bucket `load` callbacks suit engines that copy each tensor
into its parameter at once (the benchmark's model: `copy_into`).

Memory. `Staging` keeps one bucket-sized buffer per side between buckets and syncs (new pages are
what makes a CPU transport slow); it is reused only while no view of it is alive, so a consumer that
keeps tensors (vLLM, until a layer is complete) gets new memory instead of overwritten tensors.

It deliberately does not decide when to sync, wake or sleep an engine, or track weight versions:
the actor worker and the engine adapter (conveyor/rollout/vllm.py) do.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal

import torch
from torch import Tensor

__all__ = [
    "ExpertNames", "Layout", "Staging", "SyncStats", "EXPERT_NAMES", "expert_names_for", "iter_weights", "cast_weights",
    "engine_names",
    "split_experts", "buckets", "stream_to", "send_buckets", "receive_buckets", "iter_received", "copy_into", "pack",
    "unpack", "layout", "Table", "SharedSlots", "map_shared",
]

#: How the engine takes MoE experts: "fused", as transformers 5 holds them (one 3-D tensor per projection and
#: layer), or "per_expert", one 2-D tensor per expert under the checkpoint's names (what every engine's
#: checkpoint loader reads, since transformers saves that way).
Layout = Literal["fused", "per_expert"]

# Wrappers that insert a name component into the state dict (activation checkpointing, torch.compile); the
# engine knows the unwrapped names.
_WRAPPER_PARTS = re.compile(r"(^|\.)(_checkpoint_wrapped_module|_orig_mod|_fsdp_wrapped_module)\.")

# Offsets into a bucket's flat buffer are aligned so that every tensor's view of it is aligned for its dtype.
_ALIGN = 64


@dataclasses.dataclass(frozen=True)
class ExpertNames:
    """The checkpoint names of one model family's per-expert tensors, which transformers 5 fuses on load.

    transformers holds `<block>.experts.gate_up_proj` (E, 2I, H), the gate rows then the up rows, and
    `<block>.experts.down_proj` (E, H, I); a checkpoint holds `<ckpt_block>.experts.{e}.<gate|up|down>.weight`.
    `block` is renamed to `ckpt_block` in every name under it (Mixtral's router too).
    """

    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"
    block: str = "mlp"
    ckpt_block: str = "mlp"


#: Per model_type, where transformers' conversion mapping (transformers/conversion_mapping.py, "mixtral" and
#: "qwen2_moe") says the checkpoint differs from the default; families it maps to qwen2_moe use the default.
EXPERT_NAMES: dict[str, ExpertNames] = {
    "mixtral": ExpertNames(gate="w1", up="w3", down="w2", block="mlp", ckpt_block="block_sparse_moe"),
    "minimax": ExpertNames(gate="w1", up="w3", down="w2", block="mlp", ckpt_block="block_sparse_moe"),
}


def expert_names_for(model_type: str | None) -> ExpertNames:
    """The per-expert checkpoint names of `model_type` (the qwen2_moe family's gate_proj/up_proj/down_proj by default)."""
    return EXPERT_NAMES.get(model_type or "", ExpertNames())


@dataclasses.dataclass
class SyncStats:
    """What one sync moved: tensors, bytes, buckets, the largest bucket, and seconds."""

    tensors: int = 0
    bytes: int = 0
    buckets: int = 0
    max_bucket_bytes: int = 0
    seconds: float = 0.0

    def add(self, bucket: list[tuple[str, Tensor]]) -> None:
        """Count one bucket."""
        size = sum(_nbytes(t) for _, t in bucket)
        self.tensors += len(bucket)
        self.bytes += size
        self.buckets += 1
        self.max_bucket_bytes = max(self.max_bucket_bytes, size)


class Staging:
    """One flat byte buffer kept between buckets and syncs, so its memory is allocated (and its pages touched) once.

    Fresh memory is what makes a CPU transport slow: on the 2-core machine of docs/BENCHMARKS.md, writing
    232 MB into new pages took 0.3-2 s, into touched ones 0.1 s. The buffer is reused only while no view of
    it is alive (a consumer such as vLLM's reload may keep a bucket's tensors); otherwise a new one is made
    and the old one is left to whoever holds it. It grows to the largest bucket seen, so it holds one bucket.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._buffer: Tensor | None = None

    def get(self, nbytes: int) -> Tensor:
        """A uint8 tensor of `nbytes` on the device that nothing else references."""
        buffer = self._buffer
        if buffer is None or buffer.numel() < nbytes or not self._unshared(buffer):
            buffer = self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return buffer[:nbytes]

    def release(self) -> None:
        """Free the buffer (between syncs, where memory matters more than the next sync's speed)."""
        self._buffer = None

    @staticmethod
    def _unshared(buffer: Tensor) -> bool:
        # The buffer's own reference and the temporary Python storage object are the only owners of its memory.
        use_count = getattr(torch._C, "_storage_Use_Count", None)
        return use_count is not None and use_count(buffer.untyped_storage()._cdata) <= 2


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _full(t: Tensor) -> Tensor:
    """`t` whole: an FSDP2 DTensor gathered (a collective), anything else as it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def iter_weights(model: torch.nn.Module, *, device: torch.device | str | None = None) -> Iterator[tuple[str, Tensor]]:
    """(name, whole tensor) of each state-dict entry of `model`, in order, gathering one FSDP2 DTensor at a time.

    Every rank must consume the iterator to the end in step: each DTensor's `full_tensor` is a collective.
    The state dict holds references to the (sharded) parameters, so nothing is gathered before it is
    reached, and a gathered tensor lives only while its consumer holds it. `device` moves each tensor
    there (e.g. "cpu" for a gloo group); names lose wrapper components (`_orig_mod.`, checkpoint wrappers).
    """
    for name, value in model.state_dict(keep_vars=False).items():
        tensor = _full(value).detach()
        if device is not None:
            tensor = tensor.to(device)
        yield _WRAPPER_PARTS.sub(r"\1", name), tensor


def cast_weights(named: Iterable[tuple[str, Tensor]], dtype: torch.dtype | None) -> Iterator[tuple[str, Tensor]]:
    """`named` with every floating-point tensor at `dtype` (None: as they are), one tensor at a time, lazily.

    On the sending side of a sync: an engine that holds bf16 takes fp32 master weights at half the bytes on the
    wire and in its staging, and the full-precision copy of a gathered tensor is dropped as soon as it is cast.
    Integer tensors (counters, indices) keep their dtype; a tensor already at `dtype` is passed as it is (no copy).
    """
    for name, tensor in named:
        tensor = tensor.detach()
        if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
            tensor = tensor.to(dtype)
        yield name, tensor


def split_experts(name: str, tensor: Tensor, names: ExpertNames) -> Iterator[tuple[str, Tensor]] | None:
    """The per-expert tensors (views) of one fused expert tensor in checkpoint names; None if `name` is not one.

    gate_up_proj (E, 2I, H) gives `experts.{e}.<gate>.weight` = rows [:I] and `<up>` = rows [I:] of expert e;
    down_proj (E, H, I) gives `experts.{e}.<down>.weight` = expert e. Both are already (out, in), the
    orientation of the checkpoint's linear layers, so no transpose is needed.
    """
    for fused, parts in (("gate_up_proj", (names.gate, names.up)), ("down_proj", (names.down,))):
        suffix = f".experts.{fused}"
        if not name.endswith(suffix) or tensor.dim() != 3:
            continue
        prefix = _rename_block(name[: -len(suffix)], names)
        if tensor.shape[1] % len(parts):
            raise ValueError(f"{name}: a fused gate/up tensor of shape {tuple(tensor.shape)} has an odd row count")
        rows = tensor.shape[1] // len(parts)
        return ((f"{prefix}.experts.{e}.{part}.weight", tensor[e, i * rows:(i + 1) * rows])
                for e in range(tensor.shape[0]) for i, part in enumerate(parts))
    return None


def _rename_block(name: str, names: ExpertNames) -> str:
    """`name` with its MoE block's module renamed to the checkpoint's (Mixtral: mlp -> block_sparse_moe)."""
    if names.block == names.ckpt_block:
        return name
    return re.sub(rf"(\.layers\.\d+\.){re.escape(names.block)}(\.|$)", rf"\1{names.ckpt_block}\2", name)


def engine_names(named: Iterable[tuple[str, Tensor]], *, layout: Layout = "per_expert",
                 model_type: str | None = None) -> Iterator[tuple[str, Tensor]]:
    """`named` as the engine loads it: fused experts passed through ("fused") or split per expert in checkpoint names.

    With "per_expert" the MoE block's other tensors are renamed too (Mixtral's `mlp.gate` is the checkpoint's
    `block_sparse_moe.gate`); a dense model's tensors pass through unchanged either way.
    """
    if layout not in ("fused", "per_expert"):
        raise ValueError(f"weight sync layout must be 'fused' or 'per_expert', got {layout!r}")
    names = expert_names_for(model_type)
    for name, tensor in named:
        if layout == "fused":
            yield name, tensor
            continue
        split = split_experts(name, tensor, names)
        if split is not None:
            yield from split
        else:
            yield _rename_block(name, names), tensor


def buckets(named: Iterable[tuple[str, Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, Tensor]]]:
    """Consecutive groups of `named` of at most `bucket_bytes` each; a tensor larger than that travels alone.

    Lazy: a bucket is yielded as soon as the next tensor would overflow it, so at most one bucket's tensors
    (and, under FSDP2, the gathered tensor that did not fit) are alive at once on the caller's side.
    """
    if int(bucket_bytes) <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket: list[tuple[str, Tensor]] = []
    size = 0
    for name, tensor in named:
        n = _nbytes(tensor)
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += n
    if bucket:
        yield bucket


def stream_to(named: Iterable[tuple[str, Tensor]], load: Callable[[list[tuple[str, Tensor]]], Any], *,
              bucket_bytes: int) -> SyncStats:
    """In-process sync: each bucket of `named` straight to `load` (no copy beyond what produced the tensors)."""
    stats, t0 = SyncStats(), time.perf_counter()
    for bucket in buckets(named, bucket_bytes):
        stats.add(bucket)
        load(bucket)
    stats.seconds = time.perf_counter() - t0
    return stats


# A flat buffer's table: each tensor's (name, dtype, shape, byte offset).
Table = list[tuple[str, str, tuple[int, ...], int]]


def layout(bucket: list[tuple[str, Tensor]]) -> tuple[Table, int]:
    """Each tensor's (name, dtype, shape, byte offset) in a bucket's flat buffer, and the buffer's size."""
    meta, offset = [], 0
    for name, tensor in bucket:
        offset = -(-offset // _ALIGN) * _ALIGN
        meta.append((name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset))
        offset += _nbytes(tensor)
    return meta, offset


def pack(named: Iterable[tuple[str, Tensor]]) -> tuple[Tensor, Table]:
    """Copies of `named` in one flat CPU byte buffer, and its table of (name, dtype, shape, byte offset): the
    weights as one object another process takes whole (Ray's object store); `unpack` reads them back."""
    named = list(named)
    table, total = layout(named)
    buffer = torch.empty(total, dtype=torch.uint8)
    _pack_into(buffer, named, table)
    return buffer, table


def _pack_into(buffer: Tensor, named: list[tuple[str, Tensor]], table: Table) -> None:
    """Copy each tensor of `named` to its place in `buffer` (its `layout` entry)."""
    for (_, tensor), (_, dtype, shape, offset) in zip(named, table):
        _view(buffer, dtype, shape, offset).copy_(tensor)


def unpack(buffer: Tensor, table: Table) -> Iterator[tuple[str, Tensor]]:
    """The (name, tensor) pairs of a flat buffer and its table (`pack`'s, a received bucket's), as views of it."""
    for name, dtype, shape, offset in table:
        yield name, _view(buffer, dtype, shape, offset)


class SharedSlots:
    """Packed copies of the weights in a file in shared memory that processes on this machine map (`map_shared`).

    `slots` copies: the trainer packs a sync into a free one (`write`, one copy, no message of its own: the version and
    `handle` ride on the call that loads it) and frees it once every replica has loaded it (`release`). When no slot is
    free, `write` says so and the caller sends the weights another way: it never waits. The file is removed once
    the replicas have mapped it (`unlink`, after the first load), so a trainer killed after that leaves nothing behind
    in /dev/shm; the mappings stay valid until every process lets go of them.
    """

    def __init__(self, table: Table, nbytes: int, slots: int = 2):
        directory = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, self.path = tempfile.mkstemp(prefix="conveyor-weights-", dir=directory)
        try:
            os.ftruncate(fd, nbytes * slots)
        finally:
            os.close(fd)
        self.table, self.nbytes, self.size = table, nbytes, nbytes * slots
        self.memory = map_shared(self.path, self.size)
        self._free = list(range(slots))
        self._lock = threading.Lock()
        self._linked = True
        # Each slot's tensors as views of the file, made once: a sync is then one batched copy into them.
        self._views = [[view for _, view in unpack(self.memory[i * nbytes:(i + 1) * nbytes], table)]
                       for i in range(slots)]

    def write(self, named: list[tuple[str, Tensor]], table: Table) -> int | None:
        """Copy `named` (laid out as `table`) into a free slot and return its index; None when every slot is taken
        or the layout is not this file's."""
        if table != self.table:
            return None
        with self._lock:
            if not self._free:
                return None
            slot = self._free.pop(0)
        torch._foreach_copy_(self._views[slot], [tensor for _, tensor in named])
        return slot

    def release(self, slot: int) -> None:
        """Slot `slot` may be written again (its weights were loaded, or will never be)."""
        with self._lock:
            if slot not in self._free:
                self._free.append(slot)

    def handle(self, slot: int) -> tuple[str, int, int, int, Table]:
        """What a replica needs to read slot `slot`: (path, file size, byte offset, bytes, table)."""
        return self.path, self.size, slot * self.nbytes, self.nbytes, self.table

    def unlink(self) -> None:
        """Remove the file (the mappings stay valid); safe to call twice."""
        if self._linked:
            self._linked = False
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


def map_shared(path: str, size: int) -> Tensor:
    """The whole of a `SharedSlots` file, mapped (shared, so the trainer's later writes show) as uint8."""
    return torch.from_file(path, shared=True, size=size, dtype=torch.uint8)


def _bytes_of(tensor: Tensor) -> Tensor:
    """A contiguous tensor's memory as a flat uint8 tensor (no copy)."""
    flat = tensor.reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8, device=tensor.device)


def _nbytes_of(dtype: str, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of `dtype` (its name in torch) and `shape`."""
    numel = 1
    for size in shape:
        numel *= size
    return numel * getattr(torch, dtype).itemsize


def _view(buffer: Tensor, dtype: str, shape: tuple[int, ...], offset: int) -> Tensor:
    """The tensor of `dtype` and `shape` that starts `offset` bytes into `buffer` (a view)."""
    return buffer[offset:offset + _nbytes_of(dtype, shape)].view(getattr(torch, dtype)).view(shape)


def send_buckets(named: Iterable[tuple[str, Tensor]], *, bucket_bytes: int, group: Any = None, src: int = 0,
                 device: torch.device | str = "cpu", staging: Staging | None = None) -> SyncStats:
    """Broadcast `named` from rank `src` of `group` in buckets: their metadata, then one flat buffer each.

    `group` is a torch.distributed group, or a standalone channel with `broadcast_tensor(tensor, src)` and
    `broadcast_object(obj, src)` (conveyor.workers.weight_channel).

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
            buffer = _bytes_of(only)  # a lone tensor travels from its own memory
        else:
            buffer = staging.get(total)
            _pack_into(buffer, bucket, meta)
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
    total = max((offset + _nbytes_of(dtype, shape) for _, dtype, shape, offset in meta), default=0)
    # Reused only if the consumer kept no view of the previous bucket (Staging.get checks).
    buffer = staging.get(total)
    _broadcast(buffer, src, group)
    return list(unpack(buffer, meta))


def iter_received(*, group: Any = None, src: int = 0, device: torch.device | str = "cpu",
                  stats: SyncStats | None = None, staging: Staging | None = None) -> Iterator[tuple[str, Tensor]]:
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


def receive_buckets(load: Callable[[list[tuple[str, Tensor]]], Any], *, group: Any = None, src: int = 0,
                    device: torch.device | str = "cpu", staging: Staging | None = None) -> SyncStats:
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


def copy_into(model: torch.nn.Module) -> Callable[[list[tuple[str, Tensor]]], None]:
    """A `load` callback that copies each received tensor into `model`'s parameter or buffer of that name, in place."""
    targets = dict(model.state_dict(keep_vars=True))

    def load(bucket: list[tuple[str, Tensor]]) -> None:
        with torch.no_grad():
            for name, tensor in bucket:
                if name not in targets:
                    raise KeyError(f"weight sync: the receiving model has no tensor named {name!r}")
                targets[name].copy_(tensor)

    return load
