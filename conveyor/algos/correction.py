"""Rollout correction: the sampler's log-probs differ from the trainer's.

The rollout engine samples with its own numerics (other kernels, precision,
possibly stale weights), so ``rollout_log_probs`` is not exactly the
trainer's ``old_log_prob``. Two remedies live here:

- bypass mode: use the rollout's log-probs as the old log-probs and skip the
  extra actor forward pass (``bypass_old_log_prob``);
- truncated importance sampling: reweight each token's (or sequence's) loss by
  ``min(pi_old / pi_rollout, threshold)`` (``compute_rollout_is_weights``),
  plus metrics that show how far apart the two distributions are.

This module deliberately does not decide *when* to apply either (that is the
trainer's config) and does no rejection sampling or distributed reduction.
"""

from __future__ import annotations

import logging
import math

import torch

logger = logging.getLogger(__name__)

__all__ = ["IS_LEVELS", "bypass_old_log_prob", "compute_rollout_is_weights"]

IS_LEVELS: tuple[str, ...] = ("token", "sequence")

# Bounds the log-ratio before exp() so diagnostics stay finite on wild mismatches.
_LOG_RATIO_BOUND = 20.0


def bypass_old_log_prob(rollout_log_probs: torch.Tensor) -> torch.Tensor:
    """Old log-probs (B, T) for bypass mode: a detached float32 copy of ``rollout_log_probs``."""
    return rollout_log_probs.detach().to(dtype=torch.float32, copy=True)


def compute_rollout_is_weights(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    level: str = "token",
    threshold: float = 2.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated IS weights (B, T) = min(exp(old - rollout), threshold), detached and 0 off the mask.

    ``level="token"`` uses each token's ratio; ``level="sequence"`` uses the
    product over the sequence's response tokens (exp of the masked sum of
    log-ratios), broadcast to its tokens. Metrics (python floats):
    ``rollout_corr/is_mean`` and ``rollout_corr/is_max`` of the weights
    *before* truncation (per token or per sequence, by level),
    ``rollout_corr/is_truncated_mean`` of the weights applied,
    ``rollout_corr/clipped_frac`` (share of tokens or sequences truncated),
    ``rollout_corr/log_ppl_diff`` (mean over sequences of
    log-perplexity(rollout) - log-perplexity(old); positive when the trainer
    finds the samples more likely than the sampler did), and
    ``rollout_corr/probs_diff_max`` / ``rollout_corr/probs_diff_mean`` of
    ``|p_old - p_rollout|`` per token.
    """
    if level not in IS_LEVELS:
        raise ValueError(f"unknown level {level!r}; valid levels: {', '.join(IS_LEVELS)}")
    if not threshold > 0:
        raise ValueError(f"threshold must be > 0, got {threshold}")
    if old_log_prob.shape != response_mask.shape or rollout_log_prob.shape != response_mask.shape:
        raise ValueError(
            f"old_log_prob {tuple(old_log_prob.shape)}, rollout_log_prob "
            f"{tuple(rollout_log_prob.shape)} and response_mask {tuple(response_mask.shape)} "
            "must have the same shape"
        )
    mask = response_mask if response_mask.dtype == torch.bool else response_mask != 0
    old = old_log_prob.detach().float()
    rollout = rollout_log_prob.detach().float()
    zero = torch.zeros((), dtype=torch.float32, device=old.device)
    log_ratio = torch.where(mask, old - rollout, zero)
    log_threshold = math.log(threshold)

    tokens_per_seq = mask.sum(-1)
    has_tokens = tokens_per_seq > 0
    if level == "token":
        unit_log_ratio = log_ratio
        unit_mask = mask
    else:
        unit_log_ratio = log_ratio.sum(-1)
        unit_mask = has_tokens

    raw = torch.exp(unit_log_ratio.clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND))
    # Truncating in log space avoids overflow before the clamp on long sequences.
    truncated = torch.exp(unit_log_ratio.clamp(max=log_threshold))
    clipped = unit_log_ratio > log_threshold
    if level == "sequence":
        truncated = truncated.unsqueeze(-1).expand_as(log_ratio)
    weights = torch.where(mask, truncated, zero)

    metrics: dict[str, float] = {}
    if bool(unit_mask.any()):
        metrics["rollout_corr/is_mean"] = raw[unit_mask].mean().item()
        metrics["rollout_corr/is_max"] = raw[unit_mask].max().item()
        metrics["rollout_corr/clipped_frac"] = clipped[unit_mask].float().mean().item()
        metrics["rollout_corr/is_truncated_mean"] = weights[mask].mean().item()
        # log-ppl = -mean token log-prob, so rollout - old = mean(old - rollout).
        per_seq = log_ratio.sum(-1)[has_tokens] / tokens_per_seq[has_tokens].float()
        metrics["rollout_corr/log_ppl_diff"] = per_seq.mean().item()
        probs_diff = (torch.exp(old) - torch.exp(rollout)).abs()[mask]
        metrics["rollout_corr/probs_diff_max"] = probs_diff.max().item()
        metrics["rollout_corr/probs_diff_mean"] = probs_diff.mean().item()
    else:
        for key in (
            "is_mean",
            "is_max",
            "clipped_frac",
            "is_truncated_mean",
            "log_ppl_diff",
            "probs_diff_max",
            "probs_diff_mean",
        ):
            metrics[f"rollout_corr/{key}"] = 0.0
    return weights, metrics
