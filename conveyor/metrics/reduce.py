"""Reducing per-rank worker results into one value per metric.

Workers report plain metrics (`name: value`, reduced by `reduce_metric`: max
for "max" names, min for "min" names, else mean) and token-weighted ones as a
pair `name@sum` / `name@count`, reduced as sum over ranks divided by count over
ranks, so a rank with more tokens weighs more. A `name@sum` without a count is
summed over ranks (a loss already divided by the global normaliser).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from conveyor.protocol import reduce_metric

__all__ = ["reduce_rank_metrics", "weighted", "mean_over_calls"]

SUM, COUNT = "@sum", "@count"


def weighted(name: str, total: float, count: float) -> dict[str, float]:
    """A token-weighted metric as the `@sum`/`@count` pair a worker returns."""
    return {name + SUM: float(total), name + COUNT: float(count)}


def _as_list(v: Any) -> list:
    return list(v) if isinstance(v, (list, tuple)) else [v]


def reduce_rank_metrics(extra_info: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Reduce merged per-rank `extra_info` (lists, one entry per rank) into floats, keys prefixed."""
    out: dict[str, float] = {}
    for key, value in extra_info.items():
        if key.endswith(COUNT):
            continue
        if key.endswith(SUM):
            name = key[: -len(SUM)]
            total = math.fsum(float(v) for v in _as_list(value) if v is not None)
            counts = extra_info.get(name + COUNT)
            if counts is not None:
                n = math.fsum(float(v) for v in _as_list(counts) if v is not None)
                if n <= 0:
                    continue
                total /= n
            reduced: Any = total
        else:
            vals = _as_list(value)
            if not vals or not all(v is None or isinstance(v, (int, float)) for v in vals):
                continue  # call parameters (temperature, flags) are not metrics
            if all(isinstance(v, bool) for v in vals if v is not None):
                continue
            reduced = reduce_metric(key, vals)
            if reduced is None:
                continue
        out[prefix + (key[: -len(SUM)] if key.endswith(SUM) else key)] = float(reduced)
    return out


def mean_over_calls(dicts: list[dict[str, float]]) -> dict[str, float]:
    """Average metrics over several calls (e.g. mini-batches): max/min names keep their extreme."""
    keys: dict[str, list[float]] = {}
    for d in dicts:
        for k, v in d.items():
            keys.setdefault(k, []).append(v)
    return {k: reduce_metric(k, v) for k, v in keys.items()}
