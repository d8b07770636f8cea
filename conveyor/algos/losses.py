"""Policy, value and entropy losses and how per-token losses are aggregated.

All functions take response-aligned ``(B, T)`` tensors and return scalars.
Aggregation divides by normalisers the *caller* passes (``num_tokens``,
``num_seqs``): a data-parallel rank computing on its shard with the global
counts produces a loss whose sum over ranks equals the whole-batch loss, so
summing gradients across ranks is exact. Without them the local counts are
used, which is right for a single rank.

Policy losses are chosen by name from a registry (``"vanilla"`` is PPO's
clipped surrogate with dual clip); a new variant is added by registering a
function with the same signature.

This module deliberately does no distributed communication, reads no config
objects and computes no advantages (see ``advantages.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from conveyor.algos.advantages import masked_mean
from conveyor.registry import registrar

logger = logging.getLogger(__name__)

__all__ = [
    "LOSS_AGG_MODES",
    "agg_loss",
    "POLICY_LOSSES",
    "register_policy_loss",
    "get_policy_loss",
    "compute_policy_loss",
    "compute_value_loss",
    "compute_entropy_loss",
]

LOSS_AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")

Normaliser = int | float | torch.Tensor | None


def _denominator(value: Normaliser, default: torch.Tensor | int, like: torch.Tensor) -> torch.Tensor:
    """``value`` (or ``default``) as a tensor on ``like``'s device; 0 becomes 1 so empty batches give 0."""
    chosen = default if value is None else value
    denom = torch.as_tensor(chosen, dtype=like.dtype, device=like.device)
    return torch.where(denom == 0, torch.ones_like(denom), denom)


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    *,
    num_tokens: Normaliser = None,
    num_seqs: Normaliser = None,
) -> torch.Tensor:
    """Aggregate ``loss_mat`` (B, T) over ``loss_mask`` (B, T) into a scalar by ``loss_agg_mode``.

    ``token-mean``: sum of masked losses / ``num_tokens`` (default: tokens in the mask).
    ``seq-mean-token-sum``: sum of per-sequence token sums / ``num_seqs`` (default: B).
    ``seq-mean-token-mean``: sum of per-sequence masked token means / ``num_seqs`` (default: B).
    """
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(
            f"unknown loss_agg_mode {loss_agg_mode!r}; valid modes: {', '.join(LOSS_AGG_MODES)}"
        )
    if loss_mat.shape != loss_mask.shape:
        raise ValueError(
            f"loss_mat has shape {tuple(loss_mat.shape)} but loss_mask has shape {tuple(loss_mask.shape)}"
        )
    mask = loss_mask if loss_mask.dtype == torch.bool else loss_mask != 0
    # where() rather than multiplication: NaN/inf under the mask must not leak into the sum.
    masked = torch.where(mask, loss_mat, torch.zeros((), dtype=loss_mat.dtype, device=loss_mat.device))
    if loss_agg_mode == "token-mean":
        return masked.sum() / _denominator(num_tokens, mask.sum(), masked)
    per_seq = masked.sum(-1)
    if loss_agg_mode == "seq-mean-token-mean":
        per_seq = per_seq / mask.sum(-1).clamp_min(1).to(per_seq.dtype)
    return per_seq.sum() / _denominator(num_seqs, loss_mat.shape[0], masked)


# --------------------------------------------------------------------------- policy losses

PolicyLoss = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]

POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    """Decorator registering ``fn`` as the policy loss called ``name``."""

    return registrar(POLICY_LOSSES, name, "policy loss")


def get_policy_loss(name: str) -> PolicyLoss:
    """Return the policy loss registered as ``name``; ValueError listing valid names otherwise."""
    try:
        return POLICY_LOSSES[name]
    except KeyError:
        valid = ", ".join(sorted(POLICY_LOSSES))
        raise ValueError(f"unknown policy_loss {name!r}; valid names: {valid}") from None


@register_policy_loss("vanilla")
def compute_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    num_tokens: Normaliser = None,
    num_seqs: Normaliser = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate with dual clip over (B, T) inputs; returns (pg_loss scalar, metrics).

    Per token, ``r = exp(log_prob - old_log_prob)`` and the loss is
    ``max(-A r, -A clip(r, 1 - low, 1 + high))``; for ``A < 0`` it is further
    capped at ``-A * clip_ratio_c`` (dual clip) so one very unlikely old action
    cannot dominate. ``is_weights`` (B, T), if given, multiplies the per-token
    loss (rollout correction). Metrics (detached 0-dim tensors): ``pg_clipfrac``,
    ``pg_clipfrac_lower``, ``ppo_kl``.
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1.0 for dual clip, got {clip_ratio_c}")
    if clip_ratio_low < 0 or clip_ratio_high < 0:
        raise ValueError(
            f"clip_ratio_low and clip_ratio_high must be >= 0, got {clip_ratio_low}, {clip_ratio_high}"
        )
    for name, t in (("old_log_prob", old_log_prob), ("log_prob", log_prob), ("advantages", advantages)):
        if t.shape != response_mask.shape:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} but response_mask has shape {tuple(response_mask.shape)}"
            )
    mask = response_mask if response_mask.dtype == torch.bool else response_mask != 0
    # Neutralise padded positions up front so garbage there (NaN, inf) cannot
    # reach the loss or its gradient through any branch below.
    zero = torch.zeros((), dtype=log_prob.dtype, device=log_prob.device)
    log_prob = torch.where(mask, log_prob, zero)
    old_log_prob = torch.where(mask, old_log_prob, zero)
    advantages = torch.where(mask, advantages, zero)

    log_ratio = log_prob - old_log_prob
    # Clamping the exponent keeps the ratio finite; clipping makes the gradient 0 there anyway.
    ratio = torch.exp(torch.clamp(log_ratio, -20.0, 20.0))
    ppo_kl = masked_mean(-log_ratio.detach(), mask)

    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_ppo = torch.maximum(loss_unclipped, loss_clipped)
    clipfrac = masked_mean((loss_clipped > loss_unclipped).float(), mask)

    loss_cap = -advantages * clip_ratio_c
    negative = advantages < 0
    loss_dual = torch.minimum(loss_ppo, loss_cap)
    clipfrac_lower = masked_mean(((loss_ppo > loss_cap) & negative).float(), mask)
    pg_losses = torch.where(negative, loss_dual, loss_ppo)

    if is_weights is not None:
        if is_weights.shape != pg_losses.shape:
            raise ValueError(
                f"is_weights has shape {tuple(is_weights.shape)}, expected {tuple(pg_losses.shape)}"
            )
        pg_losses = pg_losses * is_weights.detach()

    pg_loss = agg_loss(pg_losses, mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs)
    metrics = {
        "pg_clipfrac": clipfrac.detach(),
        "pg_clipfrac_lower": clipfrac_lower.detach(),
        "ppo_kl": ppo_kl.detach(),
    }
    return pg_loss, metrics


# --------------------------------------------------------------------------- value and entropy


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    cliprange_value: float = 0.5,
    loss_agg_mode: str = "token-mean",
    num_tokens: Normaliser = None,
    num_seqs: Normaliser = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss (B, T) -> (loss, clipfrac): 0.5 * max((v - R)^2, (clip(v, old +- c) - R)^2)."""
    if cliprange_value < 0:
        raise ValueError(f"cliprange_value must be >= 0, got {cliprange_value}")
    mask = response_mask if response_mask.dtype == torch.bool else response_mask != 0
    zero = torch.zeros((), dtype=vpreds.dtype, device=vpreds.device)
    vpreds = torch.where(mask, vpreds, zero)
    returns = torch.where(mask, returns, zero)
    values = torch.where(mask, values, zero)
    vpred_clipped = values + torch.clamp(vpreds - values, -cliprange_value, cliprange_value)
    loss_unclipped = (vpreds - returns) ** 2
    loss_clipped = (vpred_clipped - returns) ** 2
    vf_losses = torch.maximum(loss_unclipped, loss_clipped)
    vf_loss = 0.5 * agg_loss(vf_losses, mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs)
    vf_clipfrac = masked_mean((loss_clipped > loss_unclipped).float(), mask).detach()
    return vf_loss, vf_clipfrac


def compute_entropy_loss(
    entropy: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    num_tokens: Normaliser = None,
    num_seqs: Normaliser = None,
) -> torch.Tensor:
    """Aggregated entropy (B, T) -> scalar; the caller subtracts ``coef *`` it for an entropy bonus."""
    return agg_loss(entropy, response_mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs)
