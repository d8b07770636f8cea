"""Micro-batches of a rank's rows: a fixed number of sequences, or as many as fit a token budget.

With a role's `use_dynamic_bsz` on, a micro-batch holds sequences up to a
number of tokens rather than a fixed count: short sequences share a pass, a
long one gets a pass of its own. The tokens counted are those the forward
processes: a micro-batch drops the columns that are padding in all of its rows
(`take`), so it costs rows x (its longest prompt + its longest response). Rows
of like lengths go together (`token_micro_batches`, first fit by decreasing
length), so that cost stays close to the rows' real tokens (prompt + response,
the masks' sums) and the budget bounds a pass's activations. The ranks agree
on the number of passes; a rank that needs fewer splits its own rows into as
many (no dummy pass unless it has fewer rows than passes). A micro-batch is a
tensor of row indices, not in row order; its `Window` widens a forward's
outputs back to the batch's columns and `in_row_order` restores the rows.

The losses are normalised by token and sequence counts of the whole
mini-batch (the caller computes them), so the grouping changes the summation
order only: the gradient is the fixed-size micro-batches' one.

With packed forwards (`conveyor.models.packing`) a micro-batch costs its
rows' real tokens, and the budget bounds what a pass computes exactly.

What it deliberately does not do: run forwards, or pack the rows itself
(`conveyor.models.packing.PackedRows` does, inside the forward).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
from tensordict import TensorDict

from conveyor.algos.trajectory import span_lengths

__all__ = [
    "TokenBudget",
    "Window",
    "token_budget",
    "token_micro_batches",
    "micro_batches",
    "plan_micro_batches",
    "take",
    "in_row_order",
]

# A micro-batch: a slice of rows (fixed size, in order) or a tensor of row indices (token budget).
MicroBatch = slice | torch.Tensor

# The fields laid out over prompt columns and over prompt + response columns; every other field of two or more
# dimensions whose second is the response width is laid out over response columns.
_PROMPT_FIELDS = ("prompts", "prompt_mask")
_SEQUENCE_FIELDS = ("routed_experts",)


@dataclasses.dataclass(frozen=True)
class TokenBudget:
    """At most `max_tokens` tokens per micro-batch; `key` is the setting a user raises when a row exceeds it."""

    max_tokens: int
    key: str


def token_budget(
    enabled: bool | None,
    max_tokens: int | None,
    key: str,
    *,
    enabled_default: bool,
    max_tokens_default: int,
    default_key: str,
) -> TokenBudget | None:
    """A role's budget from its keys, null meaning the key it defaults to (verl's interpolations); None when off."""
    on = enabled_default if enabled is None else bool(enabled)
    if not on:
        return None
    if max_tokens is None:
        return TokenBudget(int(max_tokens_default), default_key)
    return TokenBudget(int(max_tokens), key)


def _cost(rows: int, prompt: int, response: int) -> int:
    # At least one response column stays (the forwards need one).
    return rows * (prompt + max(response, 1))


class _Bin:
    """A micro-batch being filled: padded, it costs rows x (longest prompt + longest response); packed, its tokens."""

    __slots__ = ("rows", "prompt", "response", "tokens", "packed")

    def __init__(
        self, rows: list[int], prompt_lengths: Sequence[int], response_lengths: Sequence[int], packed: bool = False
    ):
        self.rows = rows
        self.prompt = max(prompt_lengths[i] for i in rows)
        self.response = max(response_lengths[i] for i in rows)
        self.tokens = sum(_cost(1, prompt_lengths[i], response_lengths[i]) for i in rows)
        self.packed = packed

    def cost_with(self, p: int, r: int) -> int:
        if self.packed:
            return self.tokens + _cost(1, p, r)
        return _cost(len(self.rows) + 1, max(self.prompt, p), max(self.response, r))

    def add(self, i: int, p: int, r: int) -> None:
        self.rows.append(i)
        self.prompt, self.response = max(self.prompt, p), max(self.response, r)
        self.tokens += _cost(1, p, r)

    @property
    def cost(self) -> int:
        return self.tokens if self.packed else _cost(len(self.rows), self.prompt, self.response)


def token_micro_batches(
    prompt_lengths: Sequence[int],
    response_lengths: Sequence[int],
    budget: TokenBudget,
    agree: Callable[[int], int] | None = None,
    packed: bool = False,
) -> list[list[int]]:
    """Row indices of micro-batches whose rows x (longest prompt + longest response) fit `budget.max_tokens`.

    `packed`: the forwards run on packed rows (`conveyor.models.packing`), so a micro-batch costs the sum of
    its rows' tokens and the budget bounds exactly what a pass computes.

    First fit by decreasing length: like lengths share a micro-batch, so little of it is padding (prompts of 100
    to 600 tokens and responses of up to 4096, long-tailed: 1.34 tokens processed per real one, 7 passes of a
    16k budget for 64 rows where their real tokens need at least 5; benchmarks/token_balance.py). `agree` (a
    collective: every rank calls it) turns this rank's count into the count every rank uses, the largest; a
    rank then splits its costliest micro-batches in two until it has that many (or one row in each).
    """
    n = len(prompt_lengths)
    limit = budget.max_tokens
    if n:
        longest = max(range(n), key=lambda i: _cost(1, prompt_lengths[i], response_lengths[i]))
        tokens = _cost(1, prompt_lengths[longest], response_lengths[longest])
        if tokens > limit:
            raise ValueError(
                f"a sequence of {tokens} tokens (prompt + response) exceeds {budget.key}={limit}; set "
                f"{budget.key} to at least {tokens} (verl's advice: at least 2 x "
                "(data.max_prompt_length + data.max_response_length))"
            )
    # Longest response first (responses vary most), then longest prompt: neighbours pad each other least.
    order = sorted(range(n), key=lambda i: (-response_lengths[i], -prompt_lengths[i], i))
    bins: list[_Bin] = []
    for i in order:
        p, r = prompt_lengths[i], response_lengths[i]
        for b in bins:
            if b.cost_with(p, r) <= limit:
                b.add(i, p, r)
                break
        else:
            bins.append(_Bin([i], prompt_lengths, response_lengths, packed))
    if agree is not None:
        target = agree(len(bins))
        while len(bins) < target:
            splittable = [b for b in bins if len(b.rows) > 1]
            if not splittable:
                break  # one row each: `TrainedModel.passes` pairs the rest with dropped repeats
            b = max(splittable, key=lambda x: x.cost)
            half = len(b.rows) // 2
            bins.remove(b)
            bins += [
                _Bin(b.rows[:half], prompt_lengths, response_lengths, packed),
                _Bin(b.rows[half:], prompt_lengths, response_lengths, packed),
            ]
    return [b.rows for b in bins]


def micro_batches(n: int, size: int) -> list[slice]:
    """Slices of at most `size` rows covering `n` rows, in order."""
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def plan_micro_batches(
    prompt_mask: torch.Tensor,
    response_mask: torch.Tensor,
    size: int,
    budget: TokenBudget | None,
    agree: Callable[[int], int] | None = None,
    packed: bool = False,
) -> list[MicroBatch]:
    """The micro-batches of rows (B,): slices of `size` rows without a budget, index tensors under one.

    `packed`: a micro-batch's cost is its tokens (packed forwards), not its rows x its widest row.
    """
    n = prompt_mask.shape[0]
    if budget is None:
        return micro_batches(n, size)
    prompt_lengths = prompt_mask.bool().sum(-1).tolist()
    response_lengths = span_lengths(response_mask).tolist()
    device = prompt_mask.device
    return [
        torch.tensor(rows, dtype=torch.long, device=device)
        for rows in token_micro_batches(prompt_lengths, response_lengths, budget, agree, packed)
    ]


@dataclasses.dataclass(frozen=True)
class Window:
    """The columns a micro-batch keeps: prompt columns from `start` of `prompt_width`, response ones before `stop`."""

    start: int
    prompt_width: int
    stop: int
    response_width: int

    def responses(self, x: torch.Tensor, value: float = 0.0) -> torch.Tensor:
        """(b, stop, ...) response-column outputs widened to (b, response_width, ...) with `value`."""
        extra = self.response_width - x.shape[1]
        if extra == 0:
            return x
        pad = x.new_full((x.shape[0], extra, *x.shape[2:]), value)
        return torch.cat([x, pad], dim=1)

    def sequence(self, x: torch.Tensor, value: int = -1) -> torch.Tensor:
        """(b, kept prompt + stop, ...) outputs over prompt and response columns widened to the batch's."""
        left = x.new_full((x.shape[0], self.start, *x.shape[2:]), value)
        right = x.new_full((x.shape[0], self.response_width - self.stop, *x.shape[2:]), value)
        return torch.cat([left, x, right], dim=1)


def take(td: TensorDict, batch: MicroBatch) -> tuple[TensorDict, Window]:
    """The micro-batch's rows, without the columns that are padding in all of them under a budget (index batches).

    A slice (fixed-size micro-batches) keeps every column.
    """
    mb = td[batch]
    prompt_width, response_width = td["prompts"].shape[1], td["responses"].shape[1]
    if isinstance(batch, slice):
        return mb, Window(0, prompt_width, response_width, response_width)
    # Prompts are left-padded, responses right-padded: the kept columns are one block each.
    start = prompt_width - int(mb["prompt_mask"].bool().sum(-1).max())
    stop = max(int(span_lengths(mb["response_mask"]).max()), 1)
    window = Window(start, prompt_width, stop, response_width)
    if start == 0 and stop == response_width:
        return mb, window
    out = {}
    for key, value in mb.items():
        if key in _PROMPT_FIELDS:
            out[key] = value[:, start:]
        elif key in _SEQUENCE_FIELDS:
            out[key] = value[:, start : prompt_width + stop]
        elif value.dim() >= 2 and value.shape[1] == response_width:
            out[key] = value[:, :stop]
        else:
            out[key] = value
    return TensorDict(out, batch_size=mb.batch_size, device=mb.device), window


def in_row_order(parts: list[torch.Tensor], batches: Sequence[MicroBatch]) -> torch.Tensor:
    """The rows of `parts` (one tensor per micro-batch, rows first) back in the batch's order."""
    out = torch.cat(parts)
    if all(isinstance(b, slice) for b in batches):
        return out  # slices in order cover the rows in order
    index = torch.cat([b if isinstance(b, torch.Tensor) else torch.arange(b.start, b.stop) for b in batches])
    restored = torch.empty_like(out)
    restored[index.to(out.device)] = out
    return restored
