"""Balanced partitions of sequences by their token counts, and the `seq_len` tags they read.

`balanced_partition` splits weights (a sequence's real tokens, prompt plus
response) into k parts whose sums are close: Karmarkar-Karp's largest
differencing method, optionally with every part holding the same number of
items (within one), followed by a few swaps between the heaviest and the
lightest part. The worker groups use it to give every rank about the same
number of tokens (`conveyor.workers.placement.group.split_for_ranks`).

`seq_len` is the tag a handle carries per sample: the prompt's length when the
prompts are written, the prompt plus the response once the rollout has run
(`with_seq_lens`, called by the generation endpoint).

What it deliberately does not do: look at tensors other than the masks it is
handed, or move data (a partition is lists of row indices).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

import torch

from conveyor.algos.trajectory import response_span
from conveyor.protocol import KVBatchMeta

__all__ = ["balanced_partition", "imbalance", "sequence_lengths", "with_seq_lens", "SEQ_LEN_TAG"]

SEQ_LEN_TAG = "seq_len"


def sequence_lengths(prompt_mask: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(B,) long: the tokens a forward attends to per row, prompt (B, P) plus the response's span (B, R)."""
    # The span, not the mask: a multi-turn response's tool tokens are fed too (response_mask 0 there).
    return prompt_mask.bool().sum(-1) + response_span(response_mask).sum(-1)


def with_seq_lens(meta: KVBatchMeta, lengths: Sequence[int] | torch.Tensor) -> KVBatchMeta:
    """A copy of `meta` whose tags hold each sample's `seq_len` (its other tags kept)."""
    values = lengths.tolist() if isinstance(lengths, torch.Tensor) else list(lengths)
    assert len(values) == len(meta), (len(values), len(meta))
    tags = [{**t, SEQ_LEN_TAG: int(v)} for t, v in zip(meta.tags, values)]
    return KVBatchMeta(meta.keys, meta.partition_id, list(meta.fields), tags, dict(meta.extra_info))


def imbalance(sums: Sequence[float]) -> float:
    """max / mean of the parts' sums: 1.0 is perfectly even (also for no load at all)."""
    mean = sum(sums) / len(sums) if sums else 0.0
    return max(sums) / mean if mean > 0 else 1.0


class _State:
    """A partial solution of the differencing method: k parts, each (sum, items), heaviest first."""

    __slots__ = ("parts",)

    def __init__(self, parts: list[tuple[int, list[int]]]):
        self.parts = sorted(parts, key=lambda p: -p[0])

    @property
    def spread(self) -> int:
        return self.parts[0][0] - self.parts[-1][0]

    def merge(self, other: _State) -> _State:
        # The heaviest part of one with the lightest of the other: the difference of the two spreads remains.
        k = len(self.parts)
        return _State(
            [
                (self.parts[i][0] + other.parts[k - 1 - i][0], self.parts[i][1] + other.parts[k - 1 - i][1])
                for i in range(k)
            ]
        )


def _karmarkar_karp(weights: Sequence[int], k: int, equal_size: bool) -> list[list[int]]:
    """The largest differencing method: repeatedly merge the two partial solutions with the largest spreads."""
    order = sorted(range(len(weights)), key=lambda i: (weights[i], i))
    heap: list[tuple[int, int, _State]] = []
    tie = itertools.count()
    if equal_size:
        # Every start state places k items, one per part: merged states keep all parts the same size.
        assert len(order) % k == 0
        starts = [_State([(weights[i], [i]) for i in order[j : j + k]]) for j in range(0, len(order), k)]
    else:
        starts = [_State([(weights[i], [i])] + [(0, []) for _ in range(k - 1)]) for i in order]
    for s in starts:
        heapq.heappush(heap, (-s.spread, next(tie), s))
    while len(heap) > 1:
        a = heapq.heappop(heap)[2]
        b = heapq.heappop(heap)[2]
        merged = a.merge(b)
        heapq.heappush(heap, (-merged.spread, next(tie), merged))
    if not heap:
        return [[] for _ in range(k)]
    return [items for _, items in heap[0][2].parts]


def _polish(
    weights: Sequence[int], parts: list[list[int]], equal_size: bool, real: int, rounds: int = 64
) -> list[list[int]]:
    """Swap (or, without equal sizes, move) items from the heaviest part to the lightest while that lowers the max.

    Items from `real` on are fillers: they never move, so no part gets a second one.
    """
    sums = [sum(weights[i] for i in p) for p in parts]
    for _ in range(rounds):
        hi = max(range(len(parts)), key=lambda j: sums[j])
        lo = min(range(len(parts)), key=lambda j: sums[j])
        gap = sums[hi] - sums[lo]
        if gap <= 0:
            break
        # The exchange that brings the two closest together: moving d = w_hi - w_lo with 0 < d < gap helps.
        best, best_gap = None, gap
        for a in (i for i in parts[hi] if i < real):
            for b in ([None] if not equal_size else []) + [i for i in parts[lo] if i < real]:
                d = weights[a] - (weights[b] if b is not None else 0)
                if 0 < d < gap and abs(gap - 2 * d) < best_gap:
                    best, best_gap = (a, b), abs(gap - 2 * d)
        if best is None:
            break
        a, b = best
        parts[hi].remove(a)
        parts[lo].append(a)
        d = weights[a]
        if b is not None:
            parts[lo].remove(b)
            parts[hi].append(b)
            d -= weights[b]
        sums[hi] -= d
        sums[lo] += d
    return parts


def balanced_partition(weights: Sequence[int], k: int, equal_size: bool = False) -> list[list[int]]:
    """Indices of `weights` in `k` parts (each sorted) whose sums are close; `equal_size`: sizes within one."""
    if k <= 0:
        raise ValueError(f"a partition needs a positive number of parts, got {k}")
    w = [int(x) for x in weights]
    if any(x < 0 for x in w):
        raise ValueError(f"weights must be non-negative, got {min(w)}")
    n = len(w)
    if equal_size and n % k:
        # Zero-weight fillers: they sort first, so they land in one start state, one per part.
        w = w + [0] * (k - n % k)
    parts = _polish(w, _karmarkar_karp(w, k, equal_size), equal_size, n)
    return [sorted(i for i in p if i < n) for p in parts]
