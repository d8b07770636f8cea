"""Handles to batches in the data plane, and the merge of per-rank results.

The trainer never carries sample data: it passes a `KVBatchMeta` (keys, a
partition and field names) to each stage, and the stage reads and writes the
data plane itself. `BatchData` wraps what the ranks of one worker-group call
returned and puts it back together. This module holds no tensors of its own
and knows nothing about where workers run.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["KVBatchMeta", "BatchData", "reduce_metrics", "reduce_metric"]


@dataclass
class KVBatchMeta:
    """A handle to a batch in the data plane: keys, partition, fields, tags and a side channel."""

    keys: list[str]
    partition_id: str
    fields: list[str] = field(default_factory=list)
    tags: list[dict] = field(default_factory=list)
    extra_info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.keys = list(self.keys)
        self.fields = list(self.fields)
        if not self.tags:
            self.tags = [{} for _ in self.keys]
        elif len(self.tags) != len(self.keys):
            raise ValueError(f"KVBatchMeta got {len(self.tags)} tags for {len(self.keys)} keys; give one dict per key")

    def __len__(self) -> int:
        return len(self.keys)

    def _slice(self, start: int, stop: int, extra_info: dict | None = None) -> KVBatchMeta:
        return KVBatchMeta(
            keys=self.keys[start:stop],
            partition_id=self.partition_id,
            fields=list(self.fields),
            tags=[dict(t) for t in self.tags[start:stop]],
            extra_info=copy.copy(self.extra_info) if extra_info is None else extra_info,
        )

    def chunk(self, n: int) -> list[KVBatchMeta]:
        """Split into `n` in-order chunks whose sizes differ by at most one (one per data-parallel rank)."""
        if n <= 0:
            raise ValueError(f"chunk needs a positive number of chunks, got {n}")
        base, rest = divmod(len(self), n)
        out, start = [], 0
        for i in range(n):
            stop = start + base + (1 if i < rest else 0)
            out.append(self._slice(start, stop))
            start = stop
        return out

    def select(self, indices: Sequence[int]) -> KVBatchMeta:
        """A handle to the samples at `indices`, in that order (same partition, fields and extra_info)."""
        return KVBatchMeta(
            keys=[self.keys[i] for i in indices],
            partition_id=self.partition_id,
            fields=list(self.fields),
            tags=[dict(self.tags[i]) for i in indices],
            extra_info=copy.copy(self.extra_info),
        )

    def with_fields(self, names: Iterable[str]) -> KVBatchMeta:
        """A copy whose `fields` also lists `names` (in first-written order, no duplicates)."""
        merged = list(self.fields)
        for name in names:
            if name not in merged:
                merged.append(name)
        return KVBatchMeta(self.keys, self.partition_id, merged, [dict(t) for t in self.tags], dict(self.extra_info))

    def with_extra_info(self, **info: Any) -> KVBatchMeta:
        """A copy whose `extra_info` is updated with `info` (the original is left alone)."""
        merged = dict(self.extra_info)
        merged.update(info)
        return KVBatchMeta(self.keys, self.partition_id, list(self.fields), [dict(t) for t in self.tags], merged)

    @staticmethod
    def concat(items: Sequence[KVBatchMeta]) -> KVBatchMeta:
        """One handle over `items` in order; `extra_info` merged into one list entry per item."""
        return _concat_metas(list(items))


def _concat_metas(items: list[KVBatchMeta]) -> KVBatchMeta:
    partitions = {m.partition_id for m in items}
    if len(partitions) != 1:
        raise ValueError(f"Cannot concatenate handles of different partitions: {sorted(partitions)}")
    keys: list[str] = []
    tags: list[dict] = []
    fields: list[str] = []
    for m in items:
        keys.extend(m.keys)
        tags.extend(dict(t) for t in m.tags)
        for f in m.fields:
            if f not in fields:
                fields.append(f)
    # Per-rank values legitimately differ (memory, losses): keep every one, in
    # item order, and let the caller reduce. Never reject a mismatch.
    info_keys: list[str] = []
    for m in items:
        for k in m.extra_info:
            if k not in info_keys:
                info_keys.append(k)
    extra_info = {k: [m.extra_info.get(k) for m in items] for k in info_keys}
    return KVBatchMeta(keys=keys, partition_id=items[0].partition_id, fields=fields, tags=tags, extra_info=extra_info)


class BatchData:
    """The list of per-rank outputs of one worker-group call."""

    def __init__(self, items: Sequence[Any]):
        self.items = list(items)

    def __len__(self) -> int:
        return len(self.items)

    def concat(self) -> Any:
        """Put the per-rank outputs back together (see SPEC §1 for each kind of item)."""
        if not self.items:
            raise ValueError("Cannot concatenate an empty list of data items.")
        items = self.items
        if _is_object_ref(items[0]):
            import ray

            items = ray.get(list(items))
        first = items[0]
        if isinstance(first, KVBatchMeta):
            return _concat_metas(items)
        try:
            from tensordict import TensorDictBase
        except ImportError:  # pragma: no cover - tensordict is a hard dependency
            TensorDictBase = ()  # type: ignore[assignment]
        if isinstance(first, TensorDictBase):
            import torch

            return torch.cat(list(items), dim=0)
        return type(first).concat(items)


def _is_object_ref(obj: Any) -> bool:
    # Avoid importing ray (slow, optional) unless the item might be a ref.
    if type(obj).__name__ != "ObjectRef":
        return False
    try:
        import ray
    except ImportError:
        return False
    return isinstance(obj, ray.ObjectRef)


def reduce_metric(name: str, value: Any) -> Any:
    """Reduce one metric's per-rank list: max if the name has "max", min if "min", else the mean; None ignored."""
    if not isinstance(value, (list, tuple)):
        return value
    vals = [float(v) for v in value if v is not None]
    if not vals:
        return None
    if "max" in name:
        return max(vals)
    if "min" in name:
        return min(vals)
    return math.fsum(vals) / len(vals)


def reduce_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """Reduce every per-rank list in `metrics` by `reduce_metric`; keys whose values are all None are dropped."""
    out = {}
    for name, value in metrics.items():
        reduced = reduce_metric(name, value)
        if reduced is not None:
            out[name] = reduced
    return out
