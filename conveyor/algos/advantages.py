"""Advantage estimators and the masked statistics they are built from.

Every estimator maps response-aligned token rewards ``(B, T)`` (plus values or
group ids when it needs them) to ``(advantages, returns)``, both ``(B, T)`` and
zero wherever ``response_mask`` is 0. Estimators live in a name -> function
registry so a new one is added by writing a function, not by editing a branch.

Conventions shared by all estimators:

- Positions where ``response_mask`` is 0 are *skipped*: their rewards and
  values are ignored (so whatever sits there, even NaN, changes nothing) and
  discounting counts only valid tokens. With right padding this is the usual
  behaviour; with masked tokens inside a response (tool output in multi-turn
  rollouts) the recursion jumps over them.
- Everything is computed in float32 (float64 inputs stay float64).

This module deliberately knows nothing about configs, the data plane or
distributed training: advantages are computed once over the whole batch by the
caller, and whitening statistics are batch-wide for that reason.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from conveyor.registry import registrar

logger = logging.getLogger(__name__)

__all__ = [
    "ADV_ESTIMATORS",
    "NEEDS_CRITIC",
    "register_adv_estimator",
    "get_adv_estimator",
    "compute_advantage",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "compute_gae_advantage",
    "compute_grpo_advantage",
    "compute_rloo_advantage",
    "compute_reinforce_plus_plus_advantage",
]

AdvEstimator = Callable[..., tuple[torch.Tensor, torch.Tensor]]

ADV_ESTIMATORS: dict[str, AdvEstimator] = {}
# Estimators that read ``values``: choosing one turns the critic on (``Config.use_critic``).
NEEDS_CRITIC: set[str] = set()


def register_adv_estimator(name: str, *, needs_critic: bool = False) -> Callable[[AdvEstimator], AdvEstimator]:
    """Decorator registering ``fn`` as the advantage estimator called ``name`` (``needs_critic``: it reads values)."""

    register = registrar(ADV_ESTIMATORS, name, "advantage estimator")

    def decorator(fn: AdvEstimator) -> AdvEstimator:
        register(fn)
        if needs_critic:
            NEEDS_CRITIC.add(name)
        return fn

    return decorator


def get_adv_estimator(name: str) -> AdvEstimator:
    """Return the estimator registered as ``name``; ValueError listing valid names otherwise."""
    try:
        return ADV_ESTIMATORS[name]
    except KeyError:
        valid = ", ".join(sorted(ADV_ESTIMATORS))
        raise ValueError(f"unknown adv_estimator {name!r}; valid names: {valid}") from None


def compute_advantage(
    name: str,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    values: torch.Tensor | None = None,
    group_index: torch.Tensor | Sequence[Hashable] | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std: bool = True,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch to estimator ``name``; returns ``(advantages (B, T), returns (B, T))``."""
    fn = get_adv_estimator(name)
    return fn(
        token_level_rewards,
        response_mask,
        values=values,
        group_index=group_index,
        gamma=gamma,
        lam=lam,
        norm_adv_by_std=norm_adv_by_std,
        epsilon=epsilon,
    )


# --------------------------------------------------------------------------- helpers


def _as_bool_mask(mask: torch.Tensor) -> torch.Tensor:
    """Turn a bool or 0/1 mask into a bool tensor."""
    return mask if mask.dtype == torch.bool else mask != 0


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float32, except float64 stays float64 (keeps gradcheck-style tests exact)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _check_same_shape(name: str, x: torch.Tensor, mask: torch.Tensor) -> None:
    """Raise ValueError unless ``x`` has the shape of ``response_mask``."""
    if x.shape != mask.shape:
        raise ValueError(
            f"{name} has shape {tuple(x.shape)} but response_mask has shape {tuple(mask.shape)}"
        )


def masked_mean(
    values: torch.Tensor, mask: torch.Tensor, dim: int | None = None
) -> torch.Tensor:
    """Mean of ``values`` over positions where ``mask`` is set (all dims, or ``dim``); 0 when empty."""
    m = _as_bool_mask(mask)
    # where() rather than values * mask so NaN/inf under the mask cannot leak in.
    total = torch.where(m, values, torch.zeros((), dtype=values.dtype, device=values.device))
    count = m.sum() if dim is None else m.sum(dim)
    total = total.sum() if dim is None else total.sum(dim)
    return total / count.clamp_min(1).to(total.dtype)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``values`` over masked positions (Bessel-corrected when ``unbiased``); 0 with < 2 items."""
    m = _as_bool_mask(mask)
    mean = masked_mean(values, m)
    var = masked_mean((values - mean) ** 2, m)
    if unbiased:
        n = m.sum().to(var.dtype)
        # With a single item the unbiased estimate is undefined; 0 keeps whitening finite.
        var = torch.where(n > 1, var * n / (n - 1).clamp_min(1), torch.zeros_like(var))
    return var


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True
) -> torch.Tensor:
    """Whiten ``values`` (B, T) over the mask (unit variance, zero mean if ``shift_mean``); 0 off it."""
    m = _as_bool_mask(mask)
    mean = masked_mean(values, m)
    var = masked_var(values, m)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(m, whitened, torch.zeros_like(whitened))


def _group_ids(group_index: Any, batch_size: int, device: torch.device) -> torch.Tensor:
    """Map ``group_index`` (B,) ints or hashables to dense ids 0..G-1 as a long tensor on ``device``."""
    if group_index is None:
        raise ValueError("group_index is required by group-based estimators (grpo, rloo)")
    if isinstance(group_index, torch.Tensor):
        if group_index.dim() != 1 or group_index.shape[0] != batch_size:
            raise ValueError(
                f"group_index must have shape ({batch_size},), got {tuple(group_index.shape)}"
            )
        _, inverse = torch.unique(group_index.to(device), return_inverse=True)
        return inverse
    items = list(group_index)
    if len(items) != batch_size:
        raise ValueError(f"group_index has {len(items)} entries, expected {batch_size}")
    dense: dict[Hashable, int] = {}
    ids = [dense.setdefault(item, len(dense)) for item in items]
    return torch.tensor(ids, dtype=torch.long, device=device)


def _outcome_scores(token_level_rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence outcome score (B,): sum of token rewards over the response mask."""
    dtype = _compute_dtype(token_level_rewards)
    zero = torch.zeros((), dtype=dtype, device=token_level_rewards.device)
    r = torch.where(mask, token_level_rewards.to(dtype), zero)
    return r.sum(-1)


def _group_stats(
    scores: torch.Tensor, ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample group size, group sum and unbiased group std, each (B,)."""
    num_groups = int(ids.max().item()) + 1 if ids.numel() else 0
    counts = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device)
    counts.index_add_(0, ids, torch.ones_like(scores))
    sums = torch.zeros_like(counts).index_add_(0, ids, scores)
    means = sums / counts.clamp_min(1)
    # Two-pass variance: subtracting the group mean first avoids cancellation.
    sq = torch.zeros_like(counts).index_add_(0, ids, (scores - means[ids]) ** 2)
    std = torch.sqrt(sq / (counts - 1).clamp_min(1))
    return counts[ids], sums[ids], std[ids]


# --------------------------------------------------------------------------- estimators


@register_adv_estimator("gae", needs_critic=True)
def compute_gae_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over response tokens (B, T): returns = raw advantages + values, advantages then whitened."""
    if values is None:
        raise ValueError("values is required by the 'gae' estimator (it needs a critic)")
    _check_same_shape("token_level_rewards", token_level_rewards, response_mask)
    _check_same_shape("values", values, response_mask)
    m = _as_bool_mask(response_mask)
    dtype = _compute_dtype(token_level_rewards)
    zero = torch.zeros((), dtype=dtype, device=token_level_rewards.device)
    rewards = torch.where(m, token_level_rewards.to(dtype), zero)
    vals = torch.where(m, values.detach().to(dtype), zero)

    batch, length = rewards.shape
    next_value = torch.zeros(batch, dtype=dtype, device=rewards.device)
    running = torch.zeros_like(next_value)
    adv = torch.zeros_like(rewards)
    for t in reversed(range(length)):
        valid = m[:, t]
        delta = rewards[:, t] + gamma * next_value - vals[:, t]
        candidate = delta + gamma * lam * running
        # A masked token leaves the recursion untouched: the next valid token's
        # value and advantage carry straight across it.
        running = torch.where(valid, candidate, running)
        next_value = torch.where(valid, vals[:, t], next_value)
        adv[:, t] = torch.where(valid, candidate, zero)

    returns = torch.where(m, adv + vals, zero)
    return masked_whiten(adv, m), returns


def _per_token(adv: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A per-sequence advantage (B,) on every valid response token (B, T); returns = advantages."""
    adv_tok = torch.where(mask, adv.unsqueeze(-1), torch.zeros((), dtype=adv.dtype, device=adv.device))
    return adv_tok, adv_tok.clone()


@register_adv_estimator("grpo")
def compute_grpo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    group_index: torch.Tensor | Sequence[Hashable] | None = None,
    norm_adv_by_std: bool = True,
    epsilon: float = 1e-6,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO (B, T): (score - group mean) / (group std + eps) on each response token; returns = advantages."""
    _check_same_shape("token_level_rewards", token_level_rewards, response_mask)
    m = _as_bool_mask(response_mask)
    scores = _outcome_scores(token_level_rewards, m)
    ids = _group_ids(group_index, scores.shape[0], scores.device)
    counts, sums, std = _group_stats(scores, ids)
    singleton = counts <= 1
    # A lone sample has no peers to compare with: mean 0 / std 1 keeps its raw score.
    mean = torch.where(singleton, torch.zeros_like(sums), sums / counts.clamp_min(1))
    adv = scores - mean
    if norm_adv_by_std:
        std = torch.where(singleton, torch.ones_like(std), std)
        adv = adv / (std + epsilon)
    return _per_token(adv, m)


@register_adv_estimator("rloo")
def compute_rloo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    group_index: torch.Tensor | Sequence[Hashable] | None = None,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (B, T): score minus the mean score of the other samples in its group; 0 for a lone sample."""
    _check_same_shape("token_level_rewards", token_level_rewards, response_mask)
    m = _as_bool_mask(response_mask)
    scores = _outcome_scores(token_level_rewards, m)
    ids = _group_ids(group_index, scores.shape[0], scores.device)
    counts, sums, _std = _group_stats(scores, ids)
    others_mean = (sums - scores) / (counts - 1).clamp_min(1)
    adv = torch.where(counts > 1, scores - others_mean, torch.zeros_like(scores))
    return _per_token(adv, m)


@register_adv_estimator("reinforce_plus_plus")
def compute_reinforce_plus_plus_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (B, T): discounted return-to-go over valid tokens; advantages = its masked whitening."""
    _check_same_shape("token_level_rewards", token_level_rewards, response_mask)
    m = _as_bool_mask(response_mask)
    dtype = _compute_dtype(token_level_rewards)
    zero = torch.zeros((), dtype=dtype, device=token_level_rewards.device)
    rewards = torch.where(m, token_level_rewards.to(dtype), zero)

    batch, length = rewards.shape
    running = torch.zeros(batch, dtype=dtype, device=rewards.device)
    returns = torch.zeros_like(rewards)
    for t in reversed(range(length)):
        valid = m[:, t]
        running = torch.where(valid, rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(valid, running, zero)
    return masked_whiten(returns, m), returns
