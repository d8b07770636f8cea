"""The shared-memory transport: a sync packed into a file in /dev/shm that replicas on this machine map.

Used when the trainer is in this process on CPUs and the replicas are Ray actors on the same machine: one
copy into a slot; a whole sync needs no message of its own (the slot's `handle` rides on the generation call that
loads it), a delta sync a small one (the replicas decode every delta in order).

What it deliberately does not do: wait for a free slot (a full file says so and the caller sends another way)
or decide when a slot's weights were loaded (the caller releases it).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading

import torch
from torch import Tensor

from conveyor.weights.buckets import Table, unpack

__all__ = ["SharedSlots", "map_shared"]


class SharedSlots:
    """Packed syncs in a file in shared memory that processes on this machine map (`map_shared`).

    `slots` slots of `capacity` bytes each: the trainer packs a sync of any layout that fits into a free one
    (`write`, one copy) and frees it once every replica has read it (`release`). A whole sync rides on the
    generation call that loads it (its version and `handle`), a delta sync is read by a call of its own in order
    with the others (`conveyor.weights.shipper`). When no slot is free, or the sync does not fit, `write` says so
    and the caller sends the weights another way: it never waits. The file is removed once the replicas have
    mapped it (`unlink`, after the first load), so a trainer killed after that leaves nothing behind in /dev/shm;
    the mappings stay valid until every process lets go of them.
    """

    def __init__(self, capacity: int, slots: int = 2):
        directory = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, self.path = tempfile.mkstemp(prefix="conveyor-weights-", dir=directory)
        try:
            os.ftruncate(fd, capacity * slots)
        except BaseException:
            os.close(fd)
            raise
        # Kept open: a replica started after the file was removed (one replacing a dead one) maps it through
        # /proc/<this pid>/fd/<fd> (`handle`).
        self._fd: int | None = fd
        self.capacity, self.size = capacity, capacity * slots
        self.memory = map_shared(self.path, self.size)
        self._free = list(range(slots))
        self._lock = threading.Lock()
        self._linked = True
        # Each slot's last layout and its tensors as views of the file: a sync of the same layout (every whole one)
        # is then one batched copy into views made once.
        self._held: list[tuple[Table, int, list[Tensor]] | None] = [None] * slots

    def write(self, named: list[tuple[str, Tensor]], table: Table, nbytes: int) -> int | None:
        """Copy `named` (laid out as `table`, `nbytes` in all) into a free slot and return its index; None when every
        slot is taken or the sync is larger than a slot."""
        if nbytes > self.capacity:
            return None
        with self._lock:
            if not self._free:
                return None
            slot = self._free.pop(0)
        held = self._held[slot]
        if held is None or held[0] != table:
            start = slot * self.capacity
            held = (table, nbytes, [view for _, view in unpack(self.memory[start : start + nbytes], table)])
            self._held[slot] = held
        torch._foreach_copy_(held[2], [tensor for _, tensor in named])
        return slot

    def release(self, slot: int) -> None:
        """Slot `slot` may be written again (its weights were loaded, or will never be)."""
        with self._lock:
            if slot not in self._free:
                self._free.append(slot)

    def handle(self, slot: int) -> tuple[str, int, int, int, Table]:
        """What a replica needs to read what slot `slot` holds: (path, file size, byte offset, bytes, table)."""
        held = self._held[slot]
        if held is None:
            raise ValueError(f"shared-memory slot {slot} holds no sync yet")
        path = self.path if self._linked or self._fd is None else f"/proc/{os.getpid()}/fd/{self._fd}"
        return path, self.size, slot * self.capacity, held[1], held[0]

    def unlink(self) -> None:
        """Remove the file (the mappings stay valid); safe to call twice."""
        if self._linked:
            self._linked = False
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    def close(self) -> None:
        """Remove the file and let go of it (the mappings stay valid); safe to call twice."""
        self.unlink()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def map_shared(path: str, size: int) -> Tensor:
    """The whole of a `SharedSlots` file, mapped (shared, so the trainer's later writes show) as uint8."""
    if not os.path.exists(path):  # torch.from_file would create an empty file and load zeros from it, silently
        raise FileNotFoundError(f"the weights' shared-memory file {path} is gone")
    return torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
