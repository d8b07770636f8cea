"""Micro-batches of a rank's rows: a fixed number of sequences, or as many as fit a token budget.

With a role's `use_dynamic_bsz` on, a micro-batch holds sequences up to a
number of real tokens (prompt plus response, the attention mask's sum) rather
than a fixed count: short sequences share a pass, a long one gets a pass of
its own, and the peak memory follows the budget rather than the longest row.
`token_micro_batches` packs the rows into the fewest micro-batches under the
budget (balanced by `conveyor.workers.balance`), after the ranks agree on how
many (each rank then splits its own rows into that many, so no rank runs a
dummy pass unless it has fewer rows than passes). A micro-batch is a list of
row indices, not in row order; `in_row_order` puts a forward's outputs back.

The losses are normalised by token and sequence counts of the whole
mini-batch (the caller computes them), so the grouping changes the summation
order only: the gradient is the fixed-size micro-batches' one.

What it deliberately does not do: run forwards, or remove padding inside a
micro-batch (its rows keep the batch's width).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import torch

from conveyor.workers.balance import balanced_partition, sequence_lengths

__all__ = ["TokenBudget", "token_budget", "token_micro_batches", "micro_batches", "plan_micro_batches", "in_row_order"]

# A micro-batch: a slice of rows (fixed size, in order) or a tensor of row indices (token budget).
MicroBatch = slice | torch.Tensor


@dataclasses.dataclass(frozen=True)
class TokenBudget:
    """At most `max_tokens` real tokens per micro-batch; `key` is the setting a user raises when a row exceeds it."""

    max_tokens: int
    key: str


def token_budget(enabled: bool | None, max_tokens: int | None, key: str, *, enabled_default: bool,
                 max_tokens_default: int, default_key: str) -> TokenBudget | None:
    """A role's budget from its keys, null meaning the key it defaults to (verl's interpolations); None when off."""
    on = enabled_default if enabled is None else bool(enabled)
    if not on:
        return None
    if max_tokens is None:
        return TokenBudget(int(max_tokens_default), default_key)
    return TokenBudget(int(max_tokens), key)


def _fits(parts: list[list[int]], lengths: Sequence[int], budget: int) -> bool:
    return all(sum(lengths[i] for i in p) <= budget for p in parts)


def token_micro_batches(lengths: Sequence[int], budget: TokenBudget,
                        agree: Callable[[int], int] | None = None) -> list[list[int]]:
    """Row indices of balanced micro-batches of at most `budget.max_tokens` real tokens, the fewest that fit.

    `agree` (a collective: every rank calls it) turns this rank's count into the
    count every rank uses, the largest; a rank then splits its rows into that many
    (fewer only when it has fewer rows), so the ranks' passes pair up.
    """
    n = len(lengths)
    limit = budget.max_tokens
    longest = max(lengths, default=0)
    if longest > limit:
        raise ValueError(f"a sequence of {longest} tokens (prompt + response) exceeds {budget.key}={limit}; set "
                         f"{budget.key} to at least {longest} (verl's advice: at least 2 x (data.max_prompt_length + "
                         "data.max_response_length))")

    def fewest_from(k: int) -> list[list[int]]:
        # Balanced parts may overflow the budget at the smallest count: one more part until they fit
        # (one row per part always does).
        parts = balanced_partition(lengths, k)
        while k < n and not _fits(parts, lengths, limit):
            k += 1
            parts = balanced_partition(lengths, k)
        return [p for p in parts if p]

    parts = fewest_from(min(n, max(1, math.ceil(sum(lengths) / limit)))) if n else []
    if agree is not None:
        target = min(agree(len(parts)), n)
        if target > len(parts):
            parts = fewest_from(target)
    return parts


def micro_batches(n: int, size: int) -> list[slice]:
    """Slices of at most `size` rows covering `n` rows, in order."""
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def plan_micro_batches(prompt_mask: torch.Tensor, response_mask: torch.Tensor, size: int,
                       budget: TokenBudget | None, agree: Callable[[int], int] | None = None) -> list[MicroBatch]:
    """The micro-batches of rows (B,): slices of `size` rows without a budget, index tensors under one."""
    n = prompt_mask.shape[0]
    if budget is None:
        return micro_batches(n, size)
    lengths = sequence_lengths(prompt_mask, response_mask).tolist()
    device = prompt_mask.device
    return [torch.tensor(p, dtype=torch.long, device=device) for p in token_micro_batches(lengths, budget, agree)]


def in_row_order(parts: list[torch.Tensor], batches: Sequence[MicroBatch]) -> torch.Tensor:
    """The rows of `parts` (one tensor per micro-batch, rows first) back in the batch's order."""
    out = torch.cat(parts)
    if all(isinstance(b, slice) for b in batches):
        return out  # slices in order cover the rows in order
    index = torch.cat([b if isinstance(b, torch.Tensor) else torch.arange(b.start, b.stop) for b in batches])
    restored = torch.empty_like(out)
    restored[index.to(out.device)] = out
    return restored
