"""Advantage estimators: their registry, what each needs from the run, and the estimators themselves.

Every estimator maps response-aligned token rewards ``(B, T)`` (plus values or
group ids when it needs them) to ``(advantages, returns)``, both ``(B, T)`` and
zero wherever ``response_mask`` is 0. Estimators live in a name -> function
registry so a new one is added by writing a function, not by editing a branch;
what it needs from the run (a critic, a greedy baseline rollout, groups of a
minimum size) is declared with it (``EstimatorNeeds``) and asked for by name
with ``estimator_needs``.

Conventions shared by all estimators:

- Positions where ``response_mask`` is 0 are *skipped*: their rewards and
  values are ignored (so whatever sits there, even NaN, changes nothing) and
  discounting counts only valid tokens. With right padding this is the usual
  behaviour; with masked tokens inside a response (tool output in multi-turn
  rollouts) the recursion jumps over them.
- Everything is computed in float32 (float64 inputs stay float64), except
  group statistics (means, stds, baselines over the samples of one prompt),
  which are taken in float64: in float32 the mean of eight rewards of 0.3 is
  one rounding step off, its std comes out ~3e-8 rather than 0, and dividing
  by ``std + 1e-6`` turns that into advantages of ~0.03 on every token.
- A group of two or more samples whose scores are all equal carries no
  signal, so every group-based estimator gives it advantages of exactly 0
  (even for float64 inputs, whose own mean can be a rounding step off).

The masked and per-group statistics they are built from are
`conveyor.algos.group_stats` (`masked_mean`, `masked_var` and `masked_whiten`
are importable from here too).

This module deliberately knows nothing about configs, the data plane or
distributed training: advantages are computed once over the whole batch by the
caller, and whitening statistics are batch-wide for that reason.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from conveyor.algos.group_stats import (
    as_bool_mask,
    centred,
    check_same_shape,
    compute_dtype,
    group_ids,
    masked_mean,
    masked_var,
    masked_whiten,
    outcome_groups,
    outcome_scores,
    per_group,
    per_token,
)
from conveyor.registry import lookup, registrar

logger = logging.getLogger(__name__)

__all__ = [
    "ADV_ESTIMATORS",
    "NEEDS_CRITIC",
    "EstimatorNeeds",
    "register_adv_estimator",
    "get_adv_estimator",
    "estimator_needs",
    "compute_advantage",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "compute_gae_advantage",
    "compute_grpo_advantage",
    "compute_rloo_advantage",
    "compute_reinforce_plus_plus_advantage",
    "compute_reinforce_plus_plus_baseline_advantage",
    "compute_remax_advantage",
    "compute_opo_advantage",
    "compute_gpg_advantage",
    "compute_grpo_passk_advantage",
    "compute_gdpo_advantage",
    "compute_optimal_token_baseline_advantage",
    "compute_tir_optimal_token_baseline_advantage",
]

AdvEstimator = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclasses.dataclass(frozen=True)
class EstimatorNeeds:
    """What an estimator needs from the run besides rewards, declared where it is registered.

    The trainer and the config ask for these instead of naming estimators.
    """

    needs_critic: bool = False
    """It reads ``values``: choosing it turns the critic on (the run plan's ``use_critic``)."""
    greedy_baseline: bool = False
    """It reads ``reward_baselines`` (B,): the reward of one greedy rollout per prompt (ReMax)."""
    min_group_size: int = 1
    """The fewest samples per prompt (``rollout.n``) it is defined for."""
    group_baseline: bool = False
    """Its baseline is a statistic of the other samples of the same prompt: with one sample a prompt
    (``rollout.n=1``) there is none, and the advantage is the raw score (or zero, for RLOO)."""
    sum_pi_squared: bool = False
    """It reads ``old_log_probs`` and ``sum_pi_squared`` (B, T), the squared-probability mass of the old-log-prob
    forward's distribution: choosing it runs that forward (no bypass) and makes it write ``sum_pi_squared``."""


ADV_ESTIMATORS: dict[str, AdvEstimator] = {}
ADV_ESTIMATOR_NEEDS: dict[str, EstimatorNeeds] = {}
# Estimators that read ``values``, derived from their declarations (``EstimatorNeeds.needs_critic``).
NEEDS_CRITIC: set[str] = set()


def register_adv_estimator(
    name: str,
    *,
    needs_critic: bool = False,
    greedy_baseline: bool = False,
    min_group_size: int = 1,
    group_baseline: bool = False,
    sum_pi_squared: bool = False,
    overwrite: bool = False,
) -> Callable[[AdvEstimator], AdvEstimator]:
    """Decorator registering ``fn`` as the advantage estimator called ``name``, with what it needs
    (``EstimatorNeeds``)."""
    if min_group_size < 1:
        raise ValueError(f"advantage estimator {name!r}: min_group_size must be >= 1, got {min_group_size}")
    register = registrar(ADV_ESTIMATORS, name, "advantage estimator", overwrite=overwrite)
    needs = EstimatorNeeds(
        needs_critic=needs_critic,
        greedy_baseline=greedy_baseline,
        min_group_size=min_group_size,
        group_baseline=group_baseline or min_group_size > 1,
        sum_pi_squared=sum_pi_squared,
    )

    def decorator(fn: AdvEstimator) -> AdvEstimator:
        register(fn)
        ADV_ESTIMATOR_NEEDS[name] = needs
        # A replacement (overwrite=True) declares its own needs: the old estimator's critic goes with it.
        (NEEDS_CRITIC.add if needs.needs_critic else NEEDS_CRITIC.discard)(name)
        return fn

    return decorator


def estimator_needs(name: str) -> EstimatorNeeds:
    """What estimator ``name`` declared it needs (defaults for one put into ``ADV_ESTIMATORS`` directly)."""
    get_adv_estimator(name)  # an unknown name is the same error everywhere
    return ADV_ESTIMATOR_NEEDS.get(name, EstimatorNeeds(needs_critic=name in NEEDS_CRITIC))


def get_adv_estimator(name: str) -> AdvEstimator:
    """Return the estimator registered as ``name``; ValueError listing valid names otherwise."""
    return lookup(ADV_ESTIMATORS, name, "algorithm.adv_estimator")


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
    reward_baselines: torch.Tensor | None = None,
    old_log_probs: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    reward_components: torch.Tensor | None = None,
    reward_weights: Sequence[float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch to estimator ``name``; returns ``(advantages (B, T), returns (B, T))``.

    ``reward_baselines`` (B,) is the greedy-decoding reward ``remax`` subtracts;
    ``old_log_probs``, ``sum_pi_squared`` and ``rollout_is_weights`` (B, T) feed the
    optimal token baselines; ``reward_components`` (B, K) and ``reward_weights`` (K,) ``gdpo``.
    """
    fn = get_adv_estimator(name)
    # Passed only when given, so estimators registered before they existed (with
    # an exact keyword list) keep working.
    optional = {
        "reward_baselines": reward_baselines,
        "old_log_probs": old_log_probs,
        "sum_pi_squared": sum_pi_squared,
        "rollout_is_weights": rollout_is_weights,
        "reward_components": reward_components,
        "reward_weights": reward_weights,
    }
    extra = {k: v for k, v in optional.items() if v is not None}
    return fn(
        token_level_rewards,
        response_mask,
        values=values,
        group_index=group_index,
        gamma=gamma,
        lam=lam,
        norm_adv_by_std=norm_adv_by_std,
        epsilon=epsilon,
        **extra,
    )


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
    check_same_shape("token_level_rewards", token_level_rewards, response_mask)
    check_same_shape("values", values, response_mask)
    m = as_bool_mask(response_mask)
    dtype = compute_dtype(token_level_rewards)
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


@register_adv_estimator("grpo", group_baseline=True)
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
    m, g, dtype = outcome_groups(token_level_rewards, response_mask, group_index)
    adv = centred(g)
    if norm_adv_by_std:
        # A lone sample has no peers to compare with: std 1 keeps its raw score.
        adv = adv / (torch.where(g.lone, torch.ones_like(g.std), g.std) + epsilon)
    return per_token(adv, g, m, dtype)


@register_adv_estimator("rloo", group_baseline=True)
def compute_rloo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    group_index: torch.Tensor | Sequence[Hashable] | None = None,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (B, T): score minus the mean score of the other samples in its group; 0 for a lone sample."""
    m, g, dtype = outcome_groups(token_level_rewards, response_mask, group_index)
    others_mean = (g.total - g.scores) / (g.count - 1).clamp_min(1)
    adv = torch.where(g.lone, torch.zeros_like(others_mean), g.scores - others_mean)
    return per_token(adv, g, m, dtype)


@register_adv_estimator("reinforce_plus_plus")
def compute_reinforce_plus_plus_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (B, T): discounted return-to-go over valid tokens; advantages = its masked whitening."""
    check_same_shape("token_level_rewards", token_level_rewards, response_mask)
    m = as_bool_mask(response_mask)
    dtype = compute_dtype(token_level_rewards)
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


@register_adv_estimator("reinforce_plus_plus_baseline", group_baseline=True)
def compute_reinforce_plus_plus_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    group_index: torch.Tensor | Sequence[Hashable] | None = None,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline (B, T): score minus its group mean on each token, whitened over the batch's tokens.

    The whitening subtracts the batch's token mean, so a flat group (exactly 0
    before it) ends at ``-mean / std`` like every other token shifted by it.
    """
    m, g, dtype = outcome_groups(token_level_rewards, response_mask, group_index)
    tokens, _ = per_token(centred(g), g, m, dtype)
    adv = masked_whiten(tokens, m)
    return adv, adv.clone()


@register_adv_estimator("remax", greedy_baseline=True)
def compute_remax_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    reward_baselines: torch.Tensor | None = None,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (B, T): undiscounted reward-to-go minus the greedy response's reward ``reward_baselines`` (B,)."""
    if reward_baselines is None:
        raise ValueError("reward_baselines (B,) is required by the 'remax' estimator (a greedy rollout's reward)")
    check_same_shape("token_level_rewards", token_level_rewards, response_mask)
    if reward_baselines.shape != token_level_rewards.shape[:1]:
        raise ValueError(
            f"reward_baselines must have shape ({token_level_rewards.shape[0]},), got {tuple(reward_baselines.shape)}"
        )
    m = as_bool_mask(response_mask)
    dtype = compute_dtype(token_level_rewards)
    zero = torch.zeros((), dtype=dtype, device=token_level_rewards.device)
    rewards = torch.where(m, token_level_rewards.to(dtype), zero)
    returns = torch.where(m, rewards.flip(-1).cumsum(-1).flip(-1), zero)
    adv = torch.where(m, returns - reward_baselines.to(dtype).unsqueeze(-1), zero)
    return adv, returns


@register_adv_estimator("opo", group_baseline=True)
def compute_opo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    group_index: torch.Tensor | Sequence[Hashable] | None = None,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO (B, T): score minus the length-weighted mean score of its group; a lone sample keeps its raw score."""
    m, g, dtype = outcome_groups(token_level_rewards, response_mask, group_index)
    lengths = m.sum(-1).to(torch.float64)
    # Weighting by length makes this the baseline that minimises the gradient's
    # variance when every token carries the sequence's advantage (the paper's result).
    baseline = per_group(lengths * g.scores, g.ids, "sum") / per_group(lengths, g.ids, "sum").clamp_min(1)
    return per_token(g.scores - torch.where(g.lone, torch.zeros_like(baseline), baseline), g, m, dtype)


@register_adv_estimator("gpg", group_baseline=True)
def compute_gpg_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    group_index: torch.Tensor | Sequence[Hashable] | None = None,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG (B, T): alpha * (score - group mean), alpha = B / (samples with a non-zero score)."""
    m, g, dtype = outcome_groups(token_level_rewards, response_mask, group_index)
    # alpha rescales the batch gradient up by the share of samples that carry
    # reward, so batches where few samples score are not drowned (GPG's correction).
    alpha = g.scores.shape[0] / torch.count_nonzero(g.scores).clamp_min(1).to(torch.float64)
    return per_token(alpha * centred(g), g, m, dtype)


@register_adv_estimator("grpo_passk", min_group_size=2)
def compute_grpo_passk_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    group_index: torch.Tensor | Sequence[Hashable] | None = None,
    norm_adv_by_std: bool = True,
    epsilon: float = 1e-6,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k GRPO (B, T): only each group's best sample gets (best - second best) [/ (group std + eps)]."""
    m, g, dtype = outcome_groups(token_level_rewards, response_mask, group_index)
    if bool(g.lone.any()):
        raise ValueError("the 'grpo_passk' estimator needs at least 2 samples per group (rollout.n >= 2)")
    ids = g.ids
    best = per_group(g.scores, ids, "amax")
    positions = torch.arange(ids.shape[0], device=ids.device)
    # One winner per group even on ties (the first best); a tie gives best - second = 0 anyway.
    first_best = per_group(torch.where(g.scores == best, positions, ids.shape[0]), ids, "amin")
    winner = positions == first_best
    second = per_group(torch.where(winner, torch.full_like(g.scores, -torch.inf), g.scores), ids, "amax")
    adv = best - second
    if norm_adv_by_std:
        adv = adv / (g.std + epsilon)
    return per_token(torch.where(winner, adv, torch.zeros_like(adv)), g, m, dtype)


@register_adv_estimator("gdpo", group_baseline=True)
def compute_gdpo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    group_index: torch.Tensor | Sequence[Hashable] | None = None,
    norm_adv_by_std: bool = True,
    epsilon: float = 1e-6,
    reward_components: torch.Tensor | None = None,
    reward_weights: Sequence[float] | None = None,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO (B, T): GRPO on each reward component (B, K) separately, their weighted sum, whitened over the batch.

    Normalising each component within its group before adding them keeps a
    dominant reward from drowning the others. Without ``reward_components``
    the one component is the sequence's score (``token_level_rewards`` summed),
    as in verl; ``reward_weights`` (K,) default to 1 each. A component counts in
    its group's statistics even for a response without tokens. Returns = advantages.
    """
    check_same_shape("token_level_rewards", token_level_rewards, response_mask)
    m = as_bool_mask(response_mask)
    if reward_components is None:
        components = outcome_scores(token_level_rewards, m).unsqueeze(-1)
    else:
        components = reward_components.reshape(reward_components.shape[0], -1)
        if components.shape[0] != m.shape[0]:
            raise ValueError(f"reward_components has {components.shape[0]} rows but response_mask has {m.shape[0]}")
    k = components.shape[1]
    if reward_weights is None:
        weights = [1.0] * k
    else:
        weights = [float(w) for w in reward_weights]
        if len(weights) != k:
            raise ValueError(f"reward_weights has {len(weights)} entries for {k} reward components")
    dtype = compute_dtype(token_level_rewards)
    total = torch.zeros(m.shape, dtype=dtype, device=m.device)
    ones = torch.ones((m.shape[0], 1), dtype=torch.bool, device=m.device)
    for j in range(k):
        # Each component as a one-token outcome reward: GRPO reads only the sequence's score.
        adv, _ = compute_grpo_advantage(
            components[:, j : j + 1].to(dtype),
            ones,
            group_index=group_index,
            norm_adv_by_std=norm_adv_by_std,
            epsilon=epsilon,
        )
        total = total + weights[j] * torch.where(m, adv, torch.zeros_like(adv))
    adv = masked_whiten(total, m)
    return adv, adv.clone()


def _path_weights(
    response_mask: torch.Tensor,
    old_log_probs: torch.Tensor | None,
    sum_pi_squared: torch.Tensor | None,
    rollout_is_weights: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``W_t = Σ_{j≤t} (1 − 2π_j + Σπ²_j) ρ_j²`` over valid tokens (B, T): the cumulative path-variance proxy.

    ``1 − 2π_j + Σπ²`` is ``‖e_y − π‖²``, the squared norm of the score function's
    logit-space gradient at token j; ``ρ`` are the truncated importance weights (1 without them).
    """
    for name, t in (("old_log_probs", old_log_probs), ("sum_pi_squared", sum_pi_squared)):
        if t is None:
            raise ValueError(
                f"{name} (B, T) is required by the optimal token baselines (the old-log-prob forward writes it "
                "when the estimator is chosen)"
            )
        check_same_shape(name, t, response_mask)
    zero = torch.zeros((), dtype=dtype, device=response_mask.device)
    w = 1 - 2 * torch.exp(old_log_probs.to(dtype)) + sum_pi_squared.to(dtype)
    if rollout_is_weights is not None:
        check_same_shape("rollout_is_weights", rollout_is_weights, response_mask)
        w = w * rollout_is_weights.to(dtype) ** 2
    return torch.where(response_mask, w, zero).cumsum(-1)


def _reward_to_go(token_level_rewards: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Undiscounted sum of the valid rewards from each valid token on (B, T); 0 off the mask."""
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    rewards = torch.where(mask, token_level_rewards.to(dtype), zero)
    return torch.where(mask, rewards.flip(-1).cumsum(-1).flip(-1), zero)


def _token_baseline(
    returns: torch.Tensor,
    w_cum: torch.Tensor,
    mask: torch.Tensor,
    ids: torch.Tensor,
    members: torch.Tensor,
    handle_zero_tail: bool,
    epsilon: float,
) -> torch.Tensor:
    """Per position t and group, ``B_t = Σ G_t W_t / (Σ W_t + eps)`` over the group's members valid at t (B, T).

    Positions are columns of the inputs (the caller aligns them). A group with one
    member gets baseline 0; with ``handle_zero_tail``, a group's unique longest
    member gets baseline 0 from the second-longest member's length on, where no
    other member exists to compare with.
    """
    count = per_group(members.to(torch.float64), ids, "sum")
    num_groups = int(ids.max().item()) + 1
    width = returns.shape[1]
    zero = torch.zeros((), dtype=torch.float64, device=returns.device)
    weight = torch.where(mask & members.unsqueeze(-1), w_cum.to(torch.float64), zero)
    zeros = torch.zeros(num_groups, width, dtype=torch.float64, device=returns.device)
    num = zeros.clone().index_add_(0, ids, returns.to(torch.float64) * weight)
    den = zeros.index_add_(0, ids, weight)
    baseline = (num / (den + epsilon))[ids]
    keep = members & (count > 1)
    baseline = torch.where(keep.unsqueeze(-1), baseline, torch.zeros_like(baseline))
    if handle_zero_tail:
        lengths = torch.where(members, mask.sum(-1).to(torch.float64), torch.full_like(count, -torch.inf))
        top = per_group(lengths, ids, "amax")
        at_top = per_group((lengths == top).to(torch.float64), ids, "sum")
        second = per_group(torch.where(lengths == top, torch.full_like(lengths, -torch.inf), lengths), ids, "amax")
        alone_on_top = keep & (lengths == top) & (at_top == 1)
        cols = torch.arange(width, device=returns.device, dtype=torch.float64)
        tail = alone_on_top.unsqueeze(-1) & (cols.unsqueeze(0) >= second.unsqueeze(-1))
        baseline = torch.where(tail, torch.zeros_like(baseline), baseline)
    return baseline


@register_adv_estimator("optimal_token_baseline", group_baseline=True, sum_pi_squared=True)
def compute_optimal_token_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    group_index: torch.Tensor | Sequence[Hashable] | None = None,
    old_log_probs: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Optimal token baseline (B, T): ``A_t = G_t − Σ_G G_t W_t / (Σ_G W_t + 1e-8)`` per position t of each group.

    ``G_t`` is the reward-to-go, ``W_t`` the cumulative path-variance proxy
    (``_path_weights``, from ``old_log_probs`` and ``sum_pi_squared`` (B, T),
    scaled by ``rollout_is_weights``² when given): the baseline that minimises
    the variance of the per-token gradient, one per time step rather than one
    per sequence. A lone sample keeps ``G_t``; ``handle_zero_tail`` as in
    ``_token_baseline``. Returns = the reward-to-go.
    """
    check_same_shape("token_level_rewards", token_level_rewards, response_mask)
    m = as_bool_mask(response_mask)
    dtype = compute_dtype(token_level_rewards)
    returns = _reward_to_go(token_level_rewards, m, dtype)
    w_cum = _path_weights(m, old_log_probs, sum_pi_squared, rollout_is_weights, dtype)
    ids = group_ids(group_index, m.shape[0], m.device)
    if m.shape[0] == 0:
        return returns.clone(), returns
    members = torch.ones(m.shape[0], dtype=torch.bool, device=m.device)
    baseline = _token_baseline(returns, w_cum, m, ids, members, handle_zero_tail, 1e-8)
    adv = torch.where(m, returns - baseline.to(dtype), torch.zeros((), dtype=dtype, device=m.device))
    return adv, returns


@register_adv_estimator("tir_optimal_token_baseline", group_baseline=True, sum_pi_squared=True)
def compute_tir_optimal_token_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    group_index: torch.Tensor | Sequence[Hashable] | None = None,
    old_log_probs: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Optimal token baseline for tool-integrated (multi-turn) responses (B, T): positions are counted in model tokens.

    As ``optimal_token_baseline``, but the baseline of a sample's k-th *valid*
    token is taken over the k-th valid tokens of its group, so tool output
    masked out between turns does not shift one sample's tokens against
    another's; a response with no tokens is left out of its group. On
    right-padded responses without holes it equals ``optimal_token_baseline``
    (except for groups holding an empty response).
    """
    check_same_shape("token_level_rewards", token_level_rewards, response_mask)
    m = as_bool_mask(response_mask)
    dtype = compute_dtype(token_level_rewards)
    returns = _reward_to_go(token_level_rewards, m, dtype)
    w_cum = _path_weights(m, old_log_probs, sum_pi_squared, rollout_is_weights, dtype)
    ids = group_ids(group_index, m.shape[0], m.device)
    lengths = m.sum(-1)
    width = int(lengths.max().item()) if lengths.numel() else 0
    if width == 0:
        return torch.zeros_like(returns), returns
    # Compact each row's valid tokens to the front: column k is the sample's k-th model token.
    rows, cols = torch.nonzero(m, as_tuple=True)
    rank = (m.cumsum(-1) - 1)[rows, cols]
    compact_mask = torch.arange(width, device=m.device).unsqueeze(0) < lengths.unsqueeze(-1)
    compact_returns = torch.zeros(m.shape[0], width, dtype=dtype, device=m.device)
    compact_w = torch.zeros_like(compact_returns)
    compact_returns[rows, rank] = returns[rows, cols]
    compact_w[rows, rank] = w_cum[rows, cols]
    baseline = _token_baseline(compact_returns, compact_w, compact_mask, ids, lengths > 0, handle_zero_tail, 1e-8)
    adv = torch.zeros_like(returns)
    adv[rows, cols] = (compact_returns - baseline.to(dtype))[rows, rank]
    return adv, returns
