"""Packing weights for the trip: buckets of tensors, one flat byte buffer per bucket, and the buffers kept between.

A bucket is a list of at most `bucket_bytes` of (name, tensor); on the wire (or in shared memory, or in
Ray's object store) it is one flat uint8 buffer plus its table of (name, dtype, shape, byte offset), and the
receiver rebuilds the tensors as views of the buffer (`unpack`): no copy beyond the one into the buffer.

Memory. `Staging` keeps one bucket-sized buffer per side between buckets and syncs (new pages are
what makes a CPU transport slow); it is reused only while no view of it is alive, so a consumer that
keeps tensors (vLLM, until a layer is complete) gets new memory instead of overwritten tensors.

What it deliberately does not do: move a buffer anywhere (the transports: `conveyor.weights.local`,
`collective`, `shared`, `object_store`) or decide when to sync.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import Tensor

__all__ = [
    "SyncStats",
    "Staging",
    "Table",
    "buckets",
    "layout",
    "pack",
    "pack_into",
    "unpack",
    "nbytes",
    "bytes_of",
    "table_bytes",
    "ALIGN",
]

# Offsets into a bucket's flat buffer are aligned so that every tensor's view of it is aligned for its dtype.
ALIGN = 64

# A flat buffer's table: each tensor's (name, dtype, shape, byte offset).
Table = list[tuple[str, str, tuple[int, ...], int]]


def nbytes(t: Tensor) -> int:
    """Bytes of tensor `t`'s elements."""
    return t.numel() * t.element_size()


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
        size = sum(nbytes(t) for _, t in bucket)
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
        n = nbytes(tensor)
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += n
    if bucket:
        yield bucket


def layout(bucket: list[tuple[str, Tensor]], apart: Sequence[bool] = ()) -> tuple[Table, int]:
    """Each tensor's (name, dtype, shape, byte offset) in a bucket's flat buffer, and the buffer's size.

    Tensors flagged in `apart` are placed after all the others (in table order still), so the others fill one
    region at the start that travels as one piece while the flagged ones travel from their own memory.
    """
    flags = list(apart) or [False] * len(bucket)
    offsets: list[int] = [0] * len(bucket)
    offset = 0
    for last in (False, True):
        for i, (_, tensor) in enumerate(bucket):
            if flags[i] == last:
                offset = -(-offset // ALIGN) * ALIGN
                offsets[i] = offset
                offset += nbytes(tensor)
    meta = [
        (name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), at)
        for (name, tensor), at in zip(bucket, offsets)
    ]
    return meta, offset


def table_bytes(table: Table) -> int:
    """The size of the flat buffer a table describes (what a receiver allocates before the buffer arrives)."""
    return max((offset + _nbytes_of(dtype, shape) for _, dtype, shape, offset in table), default=0)


def pack(named: Iterable[tuple[str, Tensor]]) -> tuple[Tensor, Table]:
    """Copies of `named` in one flat CPU byte buffer, and its table of (name, dtype, shape, byte offset): the
    weights as one object another process takes whole (Ray's object store); `unpack` reads them back."""
    named = list(named)
    table, total = layout(named)
    buffer = torch.empty(total, dtype=torch.uint8)
    pack_into(buffer, named, table)
    return buffer, table


def pack_into(buffer: Tensor, named: list[tuple[str, Tensor]], table: Table) -> None:
    """Copy each tensor of `named` to its place in `buffer` (its `layout` entry)."""
    for (_, tensor), (_, dtype, shape, offset) in zip(named, table):
        _view(buffer, dtype, shape, offset).copy_(tensor)


def unpack(buffer: Tensor, table: Table) -> Iterator[tuple[str, Tensor]]:
    """The (name, tensor) pairs of a flat buffer and its table (`pack`'s, a received bucket's), as views of it."""
    for name, dtype, shape, offset in table:
        yield name, _view(buffer, dtype, shape, offset)


def bytes_of(tensor: Tensor) -> Tensor:
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
    return buffer[offset : offset + _nbytes_of(dtype, shape)].view(getattr(torch, dtype)).view(shape)
