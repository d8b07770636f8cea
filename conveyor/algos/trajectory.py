"""Where a response ends when it holds tool tokens: the span up to its last model token.

Single-turn responses are a run of model tokens then padding, so
`response_mask` says both which tokens are the model's and which tokens
exist. A multi-turn trajectory has tool tokens (mask 0) between model
tokens; they are context that later tokens attend to, not padding. The span
of a row is every position up to and including its last model token: that
is what a forward attends over and what a reward function reads. For a
single-turn response it equals `response_mask`, so code that uses these
helpers treats both alike. Tokens after the last model token (a tool answer
cut off by the budget) are left out: no model token follows them.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["response_span", "span_lengths", "segments", "session_heads", "spread_over_sessions"]


def response_span(response_mask: Tensor) -> Tensor:
    """(B, R) bool: True at every position up to and including the row's last True of `response_mask` (B, R)."""
    m = response_mask.bool()
    if m.shape[-1] == 0:
        return m
    # A reversed running "any": position t is in the span when some t' >= t is a model token.
    return m.flip(-1).long().cummax(dim=-1).values.flip(-1).bool()


def span_lengths(response_mask: Tensor) -> Tensor:
    """(B,) long: the length of each row's span (index of its last model token + 1; 0 when it has none)."""
    return response_span(response_mask).long().sum(-1)


def segments(mask_row: list[bool] | Tensor) -> list[tuple[bool, int, int]]:
    """The runs of one row's span: (is_model, start, end) for each maximal run of equal mask values."""
    values = [bool(v) for v in (mask_row.tolist() if isinstance(mask_row, Tensor) else mask_row)]
    end = max((i + 1 for i, v in enumerate(values) if v), default=0)
    runs: list[tuple[bool, int, int]] = []
    start = 0
    for i in range(1, end + 1):
        if i == end or values[i] != values[start]:
            runs.append((values[start], start, i))
            start = i
    return runs


def session_heads(sessions: list[str]) -> tuple[list[int], list[int]]:
    """For per-sample session names (B,): the index of each session's first sample, and each sample's session
    (an index into those heads)."""
    heads: list[int] = []
    at: dict[str, int] = {}
    owner = []
    for i, name in enumerate(sessions):
        if name not in at:
            at[name] = len(heads)
            heads.append(i)
        owner.append(at[name])
    return heads, owner


def spread_over_sessions(head_values: Tensor, head_mask: Tensor, owner: list[int], mask: Tensor) -> Tensor:
    """(B, R) values of every sample from its session head's: the head's mean over its tokens (`head_values`,
    `head_mask`: (H, R')), on each of the sample's own tokens (`mask` (B, R))."""
    m = head_mask.to(head_values.dtype)
    per_head = (head_values * m).sum(-1) / m.sum(-1).clamp(min=1.0)
    return per_head[torch.tensor(owner, dtype=torch.long)].unsqueeze(-1) * mask.to(head_values.dtype)
