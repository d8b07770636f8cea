"""The masked and per-group statistics the advantage estimators (and the losses) are built from.

Masked statistics (`masked_mean`, `masked_var`, `masked_whiten`) skip every
position where the mask is 0, so whatever sits there, even NaN, changes
nothing. Group statistics (`group_stats`: count, sum, mean, std and whether
all scores are equal, over the samples of one prompt) are taken in float64:
in float32 the mean of eight rewards of 0.3 is one rounding step off, its std
comes out ~3e-8 rather than 0, and dividing by ``std + 1e-6`` turns that into
advantages of ~0.03 on every token. A group of two or more samples whose
scores are all equal is `flat`: it carries no signal.

What it deliberately does not do: estimate advantages (`conveyor.algos.advantages`
registers the estimators) or know about configs, the data plane or ranks.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, NamedTuple

import torch

__all__ = [
    "Groups",
    "as_bool_mask",
    "centred",
    "check_same_shape",
    "compute_dtype",
    "group_ids",
    "group_stats",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "outcome_groups",
    "outcome_scores",
    "per_group",
    "per_token",
]


def as_bool_mask(mask: torch.Tensor) -> torch.Tensor:
    """Turn a bool or 0/1 mask into a bool tensor."""
    return mask if mask.dtype == torch.bool else mask != 0


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float32, except float64 stays float64 (keeps gradcheck-style tests exact)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def check_same_shape(name: str, x: torch.Tensor, mask: torch.Tensor) -> None:
    """Raise ValueError unless ``x`` has the shape of ``response_mask``."""
    if x.shape != mask.shape:
        raise ValueError(f"{name} has shape {tuple(x.shape)} but response_mask has shape {tuple(mask.shape)}")


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` over positions where ``mask`` is set (all dims, or ``dim``); 0 when empty."""
    m = as_bool_mask(mask)
    # where() rather than values * mask so NaN/inf under the mask cannot leak in.
    total = torch.where(m, values, torch.zeros((), dtype=values.dtype, device=values.device))
    count = m.sum() if dim is None else m.sum(dim)
    total = total.sum() if dim is None else total.sum(dim)
    return total / count.clamp_min(1).to(total.dtype)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``values`` over masked positions (Bessel-corrected when ``unbiased``); 0 with < 2 items."""
    m = as_bool_mask(mask)
    mean = masked_mean(values, m)
    var = masked_mean((values - mean) ** 2, m)
    if unbiased:
        n = m.sum().to(var.dtype)
        # With a single item the unbiased estimate is undefined; 0 keeps whitening finite.
        var = torch.where(n > 1, var * n / (n - 1).clamp_min(1), torch.zeros_like(var))
    return var


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Whiten ``values`` (B, T) over the mask (unit variance, zero mean if ``shift_mean``); 0 off it."""
    m = as_bool_mask(mask)
    mean = masked_mean(values, m)
    var = masked_var(values, m)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(m, whitened, torch.zeros_like(whitened))


def group_ids(group_index: Any, batch_size: int, device: torch.device) -> torch.Tensor:
    """Map ``group_index`` (B,) ints or hashables to dense ids 0..G-1 as a long tensor on ``device``."""
    if group_index is None:
        raise ValueError("group_index is required by group-based estimators (grpo, rloo, opo, ...)")
    if isinstance(group_index, torch.Tensor):
        if group_index.dim() != 1 or group_index.shape[0] != batch_size:
            raise ValueError(f"group_index must have shape ({batch_size},), got {tuple(group_index.shape)}")
        _, inverse = torch.unique(group_index.to(device), return_inverse=True)
        return inverse
    items = list(group_index)
    if len(items) != batch_size:
        raise ValueError(f"group_index has {len(items)} entries, expected {batch_size}")
    dense: dict[Hashable, int] = {}
    ids = [dense.setdefault(item, len(dense)) for item in items]
    return torch.tensor(ids, dtype=torch.long, device=device)


def outcome_scores(token_level_rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence outcome score (B,): sum of token rewards over the response mask."""
    dtype = compute_dtype(token_level_rewards)
    zero = torch.zeros((), dtype=dtype, device=token_level_rewards.device)
    r = torch.where(mask, token_level_rewards.to(dtype), zero)
    return r.sum(-1)


class Groups(NamedTuple):
    """Float64 statistics of each sample's group, all (B,): see the module docstring for why float64."""

    ids: torch.Tensor  # dense group id, long
    scores: torch.Tensor  # the sample's own score, float64
    count: torch.Tensor  # samples in the group
    total: torch.Tensor  # sum of the group's scores
    mean: torch.Tensor
    std: torch.Tensor  # unbiased (Bessel-corrected), as torch.std; 0 for a lone sample
    flat: torch.Tensor  # bool: two or more samples, all with the same score

    @property
    def lone(self) -> torch.Tensor:
        """bool (B,): the sample is alone in its group."""
        return self.count <= 1


def per_group(values: torch.Tensor, ids: torch.Tensor, reduce: str) -> torch.Tensor:
    """``reduce`` ("sum", "amax" or "amin") of ``values`` (B,) over each group, broadcast back to (B,)."""
    num_groups = int(ids.max().item()) + 1 if ids.numel() else 0
    out = torch.zeros(num_groups, dtype=values.dtype, device=values.device)
    if reduce == "sum":
        return out.index_add_(0, ids, values)[ids]
    return out.scatter_reduce_(0, ids, values, reduce, include_self=False)[ids]


def group_stats(scores: torch.Tensor, group_index: Any) -> Groups:
    """Group ids from ``group_index`` and the float64 statistics of ``scores`` (B,) within each group."""
    ids = group_ids(group_index, scores.shape[0], scores.device)
    x = scores.to(torch.float64)
    count = per_group(torch.ones_like(x), ids, "sum")
    total = per_group(x, ids, "sum")
    mean = total / count
    # Two-pass variance: subtracting the group mean first avoids cancellation.
    sq = per_group((x - mean) ** 2, ids, "sum")
    std = torch.sqrt(sq / (count - 1).clamp_min(1))
    flat = (count > 1) & (per_group(x, ids, "amax") == per_group(x, ids, "amin"))
    return Groups(ids, x, count, total, mean, std, flat)


def centred(groups: Groups) -> torch.Tensor:
    """Score minus its group mean (B,), float64; a lone sample keeps its raw score (verl's baseline 0)."""
    return groups.scores - torch.where(groups.lone, torch.zeros_like(groups.mean), groups.mean)


def per_token(
    adv: torch.Tensor, groups: Groups, mask: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """A per-sequence advantage (B,) as ``dtype`` on every valid token (B, T), 0 for flat groups; returns = it."""
    adv = torch.where(groups.flat, torch.zeros_like(adv), adv).to(dtype)
    adv_tok = torch.where(mask, adv.unsqueeze(-1), torch.zeros((), dtype=dtype, device=adv.device))
    return adv_tok, adv_tok.clone()


def outcome_groups(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, group_index: Any
) -> tuple[torch.Tensor, Groups, torch.dtype]:
    """Shared start of the outcome estimators: the bool mask (B, T), the group statistics and the output dtype."""
    check_same_shape("token_level_rewards", token_level_rewards, response_mask)
    m = as_bool_mask(response_mask)
    scores = outcome_scores(token_level_rewards, m)
    return m, group_stats(scores, group_index), scores.dtype
