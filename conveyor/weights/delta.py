"""Delta weight sync: after a full sync, only the elements that changed in the engine's dtype travel.

The sender (`DeltaEncoder`) keeps the last copy it shipped of every tensor, at the dtype it travels in (the
engine's). A sync compares each new tensor with that copy bit for bit and sends whichever of three forms is
smallest, measured per tensor:

    whole     the tensor as it is                                       numel * itemsize bytes
    indices   the changed elements' flat indices (int32) and values     changed * (4 + itemsize)
    bitmap    one bit per element (changed or not) and the values       numel / 8 + changed * itemsize

so for bf16 `indices` wins below about 3% changed, `bitmap` up to about 94%, and `whole` above: the rule that
picks delta or full follows from the changed fraction, tensor by tensor, and a sync where every tensor went
whole counts as full. A sync is sent whole on purpose on the first sync, every `full_every` syncs, and after a
receiver reported a checksum mismatch.

An encoded sync is still a stream of (name, tensor) pairs, so every transport (in process, the weight channel,
a torch.distributed group, shared memory, Ray's object store) carries it unchanged: a tensor sent whole keeps
its name; a delta-coded one travels as `<name>\\x1f<part>` tensors (`idx` or `bits`, `val`) and ends with its
`sum`, the sender's checksum of the tensor after the update (a tensor that did not change travels as its `sum`
alone). The receiver (`DeltaDecoder`) keeps its own copy of every tensor, applies each delta to it, checks the
checksum and hands the engine whole tensors, so engines load as they always do (vLLM needs every part of a
layer in one call). A mismatch is counted (`mismatches`); the caller tells the sender, whose next sync is full.

Memory: the sender holds one copy of the model at the engine's dtype (`DeltaEncoder.held_bytes`), and so does
each receiver (`DeltaDecoder.held_bytes`), beside the engine's own weights.

What it deliberately does not do: move anything (the transports), or decide when to sync (the shipper).
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Iterable, Iterator

import torch
from torch import Tensor

__all__ = ["DeltaSettings", "DeltaStats", "DeltaEncoder", "DeltaDecoder", "checksum", "is_encoded", "SEP", "HEADER"]

# Separates a tensor's name from the part of its delta an entry carries; no module or parameter name holds it.
SEP = "\x1f"
_IDX, _BITS, _VAL, _SUM = "idx", "bits", "val", "sum"
# The first entry of a sync from an encoder that keeps copies: the receiver keeps its own (a plain stream, with no
# such entry, passes through a decoder untouched and costs it no memory).
HEADER = f"{SEP}delta"

# Integer views of each element size: deltas compare and checksum the bits, so -0.0 != 0.0 and NaNs compare.
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_BIT_WEIGHTS = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclasses.dataclass(frozen=True)
class DeltaSettings:
    """When a sync sends only what changed (actor_rollout_ref.rollout.delta_sync)."""

    enable: bool = True
    full_every: int = 10  # every this many syncs one is sent whole (1: always whole)


@dataclasses.dataclass
class DeltaStats:
    """What one encoded sync sent: elements compared and changed, bytes sent and what whole tensors would take."""

    elements: int = 0
    changed: int = 0
    bytes: int = 0
    full_bytes: int = 0
    full: bool = True  # every tensor went whole (forced, or the changed fraction made whole the smallest)
    forced: str = ""  # why the sync was whole on purpose: "first", "every", "mismatch" or "" (not forced)
    held_bytes: int = 0  # the sender's copies after the sync (one model at the engine's dtype)

    @property
    def changed_frac(self) -> float:
        """Changed elements over compared ones (1.0 for a sync with no earlier copy to compare with)."""
        return self.changed / self.elements if self.elements else 1.0

    def metrics(self) -> dict[str, float]:
        """The sync's `rollout/weight_sync/*` metrics."""
        return {
            "rollout/weight_sync/changed_frac": self.changed_frac,
            "rollout/weight_sync/bytes": float(self.bytes),
            "rollout/weight_sync/full_bytes": float(self.full_bytes),
            "rollout/weight_sync/full": float(self.full),
            "rollout/weight_sync/sender_copy_gb": self.held_bytes / 1e9,
        }


def _words(t: Tensor) -> Tensor:
    """A contiguous tensor's elements as integers of the same size (a view)."""
    flat = t.reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    return flat.view(_WORDS[flat.element_size()])


def checksum(t: Tensor) -> int:
    """CRC-32 of a tensor's bytes (moved to host memory first when it lives elsewhere), the same on every device."""
    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return 0
    data = flat.contiguous().view(torch.uint8) if flat.dtype != torch.bool else flat.view(torch.uint8)
    return zlib.crc32(data.cpu().numpy())


def _pack_bits(mask: Tensor) -> Tensor:
    """A bool tensor as uint8, eight elements a byte, least significant bit first (padded with zeros)."""
    pad = (-mask.numel()) % 8
    if pad:
        mask = torch.cat([mask, mask.new_zeros(pad)])
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=mask.device)
    return (mask.view(-1, 8).to(torch.uint8) * weights).sum(1, dtype=torch.uint8)


def _unpack_bits(bits: Tensor, numel: int) -> Tensor:
    """`_pack_bits` undone: the first `numel` bits as a bool tensor."""
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    return ((bits.unsqueeze(1) >> shifts) & 1).view(-1)[:numel].bool()


def is_encoded(name: str) -> bool:
    """Whether a stream entry is part of a delta (not a whole tensor)."""
    return SEP in name


class DeltaEncoder:
    """The sending side: the last shipped copy of every tensor, and each sync encoded against it."""

    def __init__(self, settings: DeltaSettings | None = None) -> None:
        self.settings = settings or DeltaSettings()
        if self.settings.full_every < 1:
            raise ValueError(
                f"actor_rollout_ref.rollout.delta_sync.full_every must be at least 1, got {self.settings.full_every}"
            )
        self._copies: dict[str, Tensor] = {}
        self.syncs = 0  # syncs encoded so far
        self.mismatches = 0  # receiver checksum mismatches reported so far (each made the next sync whole)
        self._repair = False
        self.last = DeltaStats()

    @property
    def held_bytes(self) -> int:
        """Bytes of the copies the sender keeps between syncs (one model at the engine's dtype)."""
        return sum(t.numel() * t.element_size() for t in self._copies.values())

    def report_mismatch(self, count: int = 1) -> None:
        """A receiver's copy disagreed with the sender's checksum: the next sync is sent whole."""
        if count > 0:
            self.mismatches += count
            self._repair = True

    def forget(self) -> None:
        """Drop the copies (a receiver lost its own, e.g. replaced): the next sync is whole and starts them again."""
        self._copies.clear()

    def _forced(self) -> str:
        """Why the next sync is sent whole, or "" when it may be a delta."""
        if not self.settings.enable:
            return "disabled"
        if not self._copies:
            return "first"
        if self._repair:
            return "mismatch"
        if self.syncs % self.settings.full_every == 0:
            return "every"
        return ""

    def encode(self, named: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        """One sync of `named` (at the engine's dtype), encoded against the last one; `last` holds its stats once the
        stream is consumed to the end."""
        forced = self._forced()
        stats = self.last = DeltaStats(forced=forced)
        self._repair = False
        self.syncs += 1
        keep = self.settings.enable
        seen = set()
        if keep:
            yield HEADER, torch.ones(1, dtype=torch.int64)
            stats.bytes += 8
        for name, tensor in named:
            if SEP in name:
                raise ValueError(f"weight sync: tensor name {name!r} holds the delta separator \\x1f")
            tensor = tensor.detach()
            seen.add(name)
            size = tensor.numel() * tensor.element_size()
            stats.full_bytes += size
            stats.elements += tensor.numel()
            copy = self._copies.get(name)
            usable = copy is not None and copy.shape == tensor.shape and copy.dtype == tensor.dtype
            if forced or not usable or tensor.numel() == 0:
                # Sent whole; the changed fraction is still measured where there is a copy to measure it against.
                same = usable and tensor.numel() and copy is not None
                stats.changed += (
                    int(torch.ne(_words(tensor.contiguous()), _words(copy)).count_nonzero()) if same else tensor.numel()
                )
                stats.bytes += size
                if keep:
                    self._keep(name, tensor, copy if usable else None)
                yield name, tensor
                continue
            yield from self._delta(name, tensor, copy, stats)
        if keep:
            for gone in [n for n in self._copies if n not in seen]:  # not in the model any more
                del self._copies[gone]
        stats.held_bytes = self.held_bytes

    def _keep(self, name: str, tensor: Tensor, copy: Tensor | None) -> None:
        """Make the kept copy of `name` equal `tensor` (in place when there is one)."""
        if copy is None:
            self._copies[name] = tensor.contiguous().clone()
        else:
            copy.copy_(tensor)

    def _delta(self, name: str, tensor: Tensor, copy: Tensor, stats: DeltaStats) -> Iterator[tuple[str, Tensor]]:
        """`tensor` as the smallest of whole, indices and bitmap against `copy`, which then becomes it."""
        new = tensor.contiguous()
        mask = torch.ne(_words(new), _words(copy))
        changed = int(mask.count_nonzero())
        stats.changed += changed
        numel, item = new.numel(), new.element_size()
        whole = numel * item
        index_bytes = 4 if numel < 2**31 else 8
        sizes = {"indices": changed * (index_bytes + item), "bitmap": -(-numel // 8) + changed * item}
        form = min(sizes, key=sizes.__getitem__)
        if changed and sizes[form] + 8 >= whole:  # whole is no larger: send it so
            stats.bytes += whole
            copy.copy_(new)
            yield name, tensor
            return
        stats.full = False
        flat_new = new.reshape(-1)
        if changed:
            # Gathering by index is several times faster than by boolean mask on a CPU.
            index = mask.nonzero().squeeze(1)
            values = flat_new.index_select(0, index)
            if form == "indices":
                index = index.to(torch.int32 if index_bytes == 4 else torch.int64)
                yield f"{name}{SEP}{_IDX}", index
                stats.bytes += index.numel() * index.element_size()
            else:
                bits = _pack_bits(mask)
                yield f"{name}{SEP}{_BITS}", bits
                stats.bytes += bits.numel()
            yield f"{name}{SEP}{_VAL}", values
            stats.bytes += values.numel() * item
            copy.copy_(new)
        total = torch.tensor([checksum(copy)], dtype=torch.int64)
        stats.bytes += 8
        yield f"{name}{SEP}{_SUM}", total


class DeltaDecoder:
    """The receiving side: its own copy of every tensor, each delta applied to it, whole tensors handed on."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = torch.device(device) if device is not None else None
        self._copies: dict[str, Tensor] = {}
        self.mismatches = 0  # checksum mismatches in the latest sync
        self.total_mismatches = 0

    @property
    def held_bytes(self) -> int:
        """Bytes of the copies the receiver keeps between syncs (one model at the engine's dtype)."""
        return sum(t.numel() * t.element_size() for t in self._copies.values())

    def copy_of(self, name: str) -> Tensor:
        """The receiver's current copy of `name` (what its engine was last given)."""
        return self._copies[name]

    def decode(self, named: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        """Whole tensors from an encoded sync, each yielded once its entries are applied (views of the receiver's
        copies: the engine copies them in); `mismatches` counts the tensors whose checksum disagreed."""
        self.mismatches = 0
        parts: dict[str, Tensor] = {}
        named = iter(named)
        first = next(named, None)
        if first is None:
            return
        if first[0] != HEADER:  # a plain sync: handed on as it came, and the copies are stale from now on
            self._copies.clear()
            yield first
            yield from named
            return
        for name, tensor in named:
            if SEP not in name:
                yield name, self._store(name, tensor)
                continue
            base, part = name.split(SEP, 1)
            if part != _SUM:
                # Entries may be views of a transport's buffer that the next bucket reuses: applied at the sum.
                parts[part] = tensor
                continue
            copy = self._copies.get(base)
            if copy is None:
                raise RuntimeError(
                    f"weight sync: a delta for {base!r} arrived at a receiver without a copy of it (the sender's "
                    "first sync to it must be whole: its encoder must be told the receiver is new)"
                )
            self._apply(copy, parts)
            parts = {}
            if checksum(copy) != int(tensor.reshape(-1)[0]):
                self.mismatches += 1
                self.total_mismatches += 1
            yield base, copy

    def _store(self, name: str, tensor: Tensor) -> Tensor:
        """Keep a whole tensor as the copy of `name` (in place when the shape and dtype match); the copy."""
        copy = self._copies.get(name)
        device = self.device or tensor.device
        if copy is None or copy.shape != tensor.shape or copy.dtype != tensor.dtype:
            copy = self._copies[name] = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
        copy.copy_(tensor)
        return copy

    @staticmethod
    def _apply(copy: Tensor, parts: dict[str, Tensor]) -> None:
        """Write the changed values into `copy` by index or bitmap (nothing when the tensor did not change)."""
        if _VAL not in parts:
            return
        flat = copy.view(-1)
        values = parts[_VAL].to(copy.device)
        if _IDX in parts:
            flat.index_copy_(0, parts[_IDX].to(copy.device, torch.int64), values)
        else:
            mask = _unpack_bits(parts[_BITS].to(copy.device), flat.numel())
            flat.index_copy_(0, mask.nonzero().squeeze(1), values)
