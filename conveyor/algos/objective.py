"""The actor's whole objective for one micro-batch: policy loss, entropy bonus, KL loss, rollout correction.

``compute_policy_objective`` is the single place these terms are put
together, so the worker's update is only get -> forward -> objective ->
backward -> step, and the assembly is testable on hand-made tensors.

Its metrics are additive over micro-batches and data-parallel ranks, in the
convention of ``conveyor.metrics.reduce``: a mean is a ``name@sum`` /
``name@count`` pair (the count is the tokens, or for sequence-level
quantities the sequences, it averages over), a loss already divided by the
global normaliser is a lone ``name@sum``, and a name holding "max" is a plain
value combined by taking the maximum. Keys carry no role prefix (the caller
adds ``actor/``).

This module deliberately reads no config objects and does no distributed
reduction: the caller passes the global ``num_tokens``/``num_seqs``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from conveyor.algos.correction import compute_rollout_is_weights
from conveyor.algos.kl import kl_penalty
from conveyor.algos.losses import Normaliser, agg_loss, get_policy_loss, loss_params

__all__ = ["compute_policy_objective", "merge_objective_metrics"]

_SUM, _COUNT = "@sum", "@count"

# Which count each rollout-correction mean averages over, by IS level; the
# "max" ones stay plain.
_IS_MEAN_UNITS: dict[str, str] = {
    "is_mean": "unit",
    "clipped_frac": "unit",
    "is_truncated_mean": "token",
    "probs_diff_mean": "token",
}


def _mean_pair(name: str, mean: float, count: float) -> dict[str, float]:
    """A mean over ``count`` items as its additive ``@sum``/``@count`` pair."""
    return {name + _SUM: float(mean) * count, name + _COUNT: float(count)}


def compute_policy_objective(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    entropy: torch.Tensor | None = None,
    ref_log_prob: torch.Tensor | None = None,
    rollout_log_probs: torch.Tensor | None = None,
    loss_mode: str = "vanilla",
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    entropy_coeff: float = 0.0,
    kl_loss_type: str = "low_var_kl",
    kl_loss_coef: float = 0.0,
    rollout_is: str | None = None,
    rollout_is_threshold: float = 2.0,
    rollout_is_threshold_lower: float | None = None,
    num_tokens: Normaliser = None,
    num_seqs: Normaliser = None,
    loss_scale_factor: Normaliser = None,
    policy_loss_kwargs: Mapping[str, Any] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Actor loss of one micro-batch of (B, T) tensors and its additive metrics.

    ``loss = pg_loss - entropy_coeff * entropy_loss + kl_loss_coef * kl_loss``:

    - ``pg_loss``: the registry's ``loss_mode`` policy loss, given those of
      ``policy_loss_kwargs`` it declares (hyperparameters such as
      ``clip_cov_ratio`` or ``tau_pos``: the caller may pass every configured
      one whatever the loss) on top of the common keywords; with
      ``rollout_is`` ("token" or "sequence") each token's loss is weighted by
      the truncated importance weights of ``old_log_prob`` against
      ``rollout_log_probs`` (B, T) (``correction.compute_rollout_is_weights``;
      with ``rollout_is_threshold_lower``, IcePop's two-sided masking).
    - ``entropy_loss``: ``entropy`` (B, T) aggregated, only when
      ``entropy_coeff != 0``.
    - ``kl_loss``: ``kl_penalty(log_prob, ref_log_prob, kl_loss_type)``
      aggregated, whenever ``ref_log_prob`` (B, T) is given.

    Every term is aggregated by ``loss_agg_mode`` over the global
    ``num_tokens``/``num_seqs`` (and ``loss_scale_factor`` for
    ``seq-mean-token-sum-norm``), so summing the losses of all micro-batches and
    ranks gives the mini-batch loss. Metrics (python floats; see the module
    docstring for the convention): ``pg_loss@sum``; the policy loss's own
    metrics (``pg_clipfrac``, ``pg_clipfrac_lower``, ``ppo_kl`` for vanilla) as
    token-weighted pairs; ``entropy`` as a token-weighted pair whenever
    ``entropy`` is given; ``entropy_loss@sum`` and ``kl_loss@sum`` with their
    terms; and with ``rollout_is`` the ``rollout_corr/*`` metrics: pairs for
    ``is_mean``, ``clipped_frac`` (over tokens or sequences, by level),
    ``is_truncated_mean``, ``probs_diff_mean`` (over tokens), and plain ``is_max``,
    ``probs_diff_max``.
    """
    if entropy_coeff != 0 and entropy is None:
        raise ValueError(f"entropy_coeff={entropy_coeff} needs the entropy tensor")
    if rollout_is is not None and rollout_log_probs is None:
        raise ValueError(f"rollout_is={rollout_is!r} needs rollout_log_probs")
    mask = response_mask if response_mask.dtype == torch.bool else response_mask != 0
    ntok = float(mask.sum())
    norms = {"num_tokens": num_tokens, "num_seqs": num_seqs}
    if loss_scale_factor is not None:
        # Only when set, so losses registered before the keyword existed keep working.
        norms["loss_scale_factor"] = loss_scale_factor
    metrics: dict[str, float] = {}

    is_weights = None
    if rollout_is is not None:
        is_weights, is_metrics = compute_rollout_is_weights(
            old_log_prob,
            rollout_log_probs,
            mask,
            level=rollout_is,
            threshold=rollout_is_threshold,
            lower=rollout_is_threshold_lower,
        )
        nseq = float((mask.sum(-1) > 0).sum())
        counts = {"token": ntok, "seq": nseq, "unit": ntok if rollout_is == "token" else nseq}
        for key, value in is_metrics.items():
            short = key.removeprefix("rollout_corr/")
            if short in _IS_MEAN_UNITS:
                metrics.update(_mean_pair(key, value, counts[_IS_MEAN_UNITS[short]]))
            else:
                metrics[key] = float(value)

    loss_fn = get_policy_loss(loss_mode)
    pg_loss, pg_metrics = loss_fn(
        old_log_prob,
        log_prob,
        advantages,
        mask,
        clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high,
        clip_ratio_c=clip_ratio_c,
        loss_agg_mode=loss_agg_mode,
        is_weights=is_weights,
        **norms,
        **loss_params(loss_fn, policy_loss_kwargs or {}),
    )
    loss = pg_loss
    metrics["pg_loss" + _SUM] = pg_loss.item()
    for name, value in pg_metrics.items():
        # A registered loss reports micro-batch token means; weight them back into sums.
        metrics.update(_mean_pair(name, float(value), ntok))

    if entropy is not None:
        zero = torch.zeros((), dtype=entropy.dtype, device=entropy.device)
        ent_sum = float(torch.where(mask, entropy.detach(), zero).sum())
        metrics.update({"entropy" + _SUM: ent_sum, "entropy" + _COUNT: ntok})
    if entropy_coeff != 0:
        entropy_loss = agg_loss(entropy, mask, loss_agg_mode, **norms)
        loss = loss - entropy_coeff * entropy_loss
        metrics["entropy_loss" + _SUM] = entropy_loss.item()
    if ref_log_prob is not None:
        kl = kl_penalty(log_prob, ref_log_prob, kl_loss_type)
        kl_loss = agg_loss(kl, mask, loss_agg_mode, **norms)
        loss = loss + kl_loss_coef * kl_loss
        metrics["kl_loss" + _SUM] = kl_loss.item()
    return loss, metrics


def merge_objective_metrics(total: dict[str, float], new: dict[str, float]) -> dict[str, float]:
    """Fold one micro-batch's objective metrics into ``total`` (in place): add, or max for "max" names."""
    for key, value in new.items():
        if "max" in key and not key.endswith((_SUM, _COUNT)):
            total[key] = max(total.get(key, value), value)
        else:
            total[key] = total.get(key, 0.0) + value
    return total
