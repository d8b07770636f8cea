"""Rollout correction: the sampler's log-probs differ from the trainer's.

The rollout engine samples with its own numerics (other kernels, precision,
possibly stale weights), so ``rollout_log_probs`` is not exactly the
trainer's ``old_log_prob``. Two remedies live here:

- bypass mode: use the rollout's log-probs as the old log-probs and skip the
  extra actor forward pass (``bypass_old_log_prob``);
- truncated importance sampling: reweight each token's (or sequence's) loss by
  ``min(pi_old / pi_rollout, threshold)`` (``compute_rollout_is_weights``),
  plus metrics that show how far apart the two distributions are.

``compute_rejection_mask`` drops tokens or whole sequences whose divergence
between the two is beyond a bound (verl's ``rollout_rs``), and
``compute_mismatch_metrics`` measures the gap itself (verl's ``rollout_corr/``
names), whenever an old-log-prob forward ran next to the rollout.

This module deliberately does not decide *when* to apply either (that is the
trainer's config) and does no rejection sampling or distributed reduction.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch

logger = logging.getLogger(__name__)

__all__ = [
    "IS_LEVELS",
    "RS_OPTIONS",
    "bypass_old_log_prob",
    "parse_is_threshold",
    "compute_rollout_is_weights",
    "compute_is_metrics",
    "parse_rejection",
    "compute_rejection_mask",
    "compute_mismatch_metrics",
]

IS_LEVELS: tuple[str, ...] = ("token", "sequence")

# Bounds the log-ratio before exp() so diagnostics stay finite on wild mismatches.
_LOG_RATIO_BOUND = 20.0


def bypass_old_log_prob(rollout_log_probs: torch.Tensor) -> torch.Tensor:
    """Old log-probs (B, T) for bypass mode: a detached float32 copy of ``rollout_log_probs``."""
    return rollout_log_probs.detach().to(dtype=torch.float32, copy=True)


def _bounds(spec: float | int | str) -> tuple[float | None, float]:
    """``(lower, upper)`` of verl's threshold text: "upper" or "lower_upper" (ValueError if not numbers)."""
    if isinstance(spec, bool):
        raise ValueError(f"{spec!r} is not a number")
    lower_text, sep, upper_text = str(spec).strip().partition("_")
    return (float(lower_text) if sep else None), float(upper_text if sep else lower_text)


def parse_is_threshold(spec: float | int | str) -> tuple[float, float | None]:
    """``(upper, lower)`` from verl's ``rollout_is_threshold``: a number (truncate at it) or "lower_upper" (IcePop)."""
    try:
        lower, upper = _bounds(spec)
    except ValueError:
        raise ValueError(
            f"must be a number (truncate the weights there) or 'lower_upper' such as '0.5_5.0' "
            f"(IcePop: zero the weights outside), got {spec!r}"
        ) from None
    if not (math.isfinite(upper) and upper > 0) or (
        lower is not None and not (math.isfinite(lower) and 0 < lower <= upper)
    ):
        raise ValueError(f"needs 0 < lower <= upper, both finite, got {spec!r}")
    return upper, lower


def compute_rollout_is_weights(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    level: str = "token",
    threshold: float = 2.0,
    lower: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated IS weights (B, T) = min(exp(old - rollout), threshold), detached and 0 off the mask.

    ``level="token"`` uses each token's ratio; ``level="sequence"`` uses the
    product over the sequence's response tokens (exp of the masked sum of
    log-ratios), broadcast to its tokens. With ``lower`` (IcePop, verl's
    "lower_upper" threshold) weights are not truncated but kept as they are
    inside ``[lower, threshold]`` and set to 0 outside, so a token (or
    sequence) the two policies disagree on too much contributes nothing.
    Metrics (python floats):
    ``rollout_corr/is_mean`` and ``rollout_corr/is_max`` of the weights
    *before* truncation (per token or per sequence, by level),
    ``rollout_corr/is_truncated_mean`` of the weights applied,
    ``rollout_corr/clipped_frac`` (share of tokens or sequences truncated, or
    with ``lower`` zeroed), and
    ``rollout_corr/probs_diff_max`` / ``rollout_corr/probs_diff_mean`` of
    ``|p_old - p_rollout|`` per token.
    """
    weights, raw, clipped, unit_mask, mask, old, rollout = _is_weights(
        old_log_prob, rollout_log_prob, response_mask, level, threshold, lower
    )
    metrics: dict[str, float] = {}
    if bool(unit_mask.any()):
        metrics["rollout_corr/is_mean"] = raw[unit_mask].mean().item()
        metrics["rollout_corr/is_max"] = raw[unit_mask].max().item()
        metrics["rollout_corr/clipped_frac"] = clipped[unit_mask].float().mean().item()
        metrics["rollout_corr/is_truncated_mean"] = weights[mask].mean().item()
        probs_diff = (torch.exp(old) - torch.exp(rollout)).abs()[mask]
        metrics["rollout_corr/probs_diff_max"] = probs_diff.max().item()
        metrics["rollout_corr/probs_diff_mean"] = probs_diff.mean().item()
    else:
        for key in (
            "is_mean",
            "is_max",
            "clipped_frac",
            "is_truncated_mean",
            "probs_diff_max",
            "probs_diff_mean",
        ):
            metrics[f"rollout_corr/{key}"] = 0.0
    return weights, metrics


def _is_weights(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    level: str,
    threshold: float,
    lower: float | None,
) -> tuple[torch.Tensor, ...]:
    """`compute_rollout_is_weights`' weights (its arguments checked), with the raw ratios, which units were clipped,
    the units' mask, the token mask and the float32 log-probs its metrics read."""
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
    if lower is None:
        # Truncating in log space avoids overflow before the clamp on long sequences.
        truncated = torch.exp(unit_log_ratio.clamp(max=log_threshold))
        clipped = unit_log_ratio > log_threshold
    else:
        clipped = (raw < lower) | (raw > threshold)
        truncated = torch.where(clipped, torch.zeros_like(raw), raw)
    if level == "sequence":
        truncated = truncated.unsqueeze(-1).expand_as(log_ratio)
    weights = torch.where(mask, truncated, zero)
    return weights, raw, clipped, unit_mask, mask, old, rollout


def compute_is_metrics(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    level: str = "token",
    threshold: float = 2.0,
    lower: float | None = None,
) -> dict[str, float]:
    """Batch statistics of the importance weights ``compute_rollout_is_weights`` applies, by verl's names.

    ``rollout_corr/rollout_is_{mean,max,min,std,eff_sample_size}`` of the
    weights applied (truncated, or IcePop-zeroed), except that at sequence
    level ``max``/``min`` are of the raw sequence ratios; the shares of raw
    ratios above ``threshold`` and below ``lower`` (default
    ``1 / threshold``), ``rollout_is_ratio_fraction_{high,low}``; per
    sequence (mean weight over its tokens) ``rollout_is_seq_{mean,std,max,
    min,max_deviation}`` (deviation from 1) and ``rollout_is_seq_fraction_
    {high,low}`` (of the raw means); with ``lower``, ``rollout_is_oob_ratio``
    (tokens zeroed). The effective sample size is ``1 / mean(w / mean w)²``
    over tokens: 1 when every weight is equal, small when a few dominate.
    Sequences without response tokens are left out.
    """
    mask = response_mask if response_mask.dtype == torch.bool else response_mask != 0
    has_tokens = mask.sum(-1) > 0
    if not bool(has_tokens.any()):
        return {}
    mask = mask[has_tokens]
    old, rollout = old_log_prob[has_tokens].detach(), rollout_log_prob[has_tokens].detach()
    weights = _is_weights(old, rollout, mask, level, threshold, lower)[0]  # its own metrics are not needed here
    # The statistics in float64 numpy: a few dozen reductions over one batch, each several times cheaper than
    # torch's per-op dispatch (this runs every step of an asynchronous run, on the trainer's thread).
    m = mask.cpu().numpy()
    log_ratio = np.where(m, _f64(old) - _f64(rollout), 0.0)
    w_all = _f64(weights)
    w = w_all[m]
    low = 1.0 / threshold if lower is None else lower
    out: dict[str, float] = {"rollout_is_mean": w.mean()}
    if level == "sequence":
        seq_log = log_ratio.sum(-1)
        out["rollout_is_max"] = math.exp(min(seq_log.max(), _LOG_RATIO_BOUND))
        out["rollout_is_min"] = math.exp(seq_log.min())
        out["rollout_is_ratio_fraction_high"] = (seq_log > math.log(threshold)).mean()
        out["rollout_is_ratio_fraction_low"] = (seq_log < math.log(low)).mean()
        raw = np.broadcast_to(np.exp(np.clip(seq_log, -_LOG_RATIO_BOUND, _LOG_RATIO_BOUND))[:, None], log_ratio.shape)
    else:
        raw = np.exp(np.clip(log_ratio, -_LOG_RATIO_BOUND, _LOG_RATIO_BOUND))
        out["rollout_is_max"] = w.max()
        out["rollout_is_min"] = w.min()
        out["rollout_is_ratio_fraction_high"] = (raw[m] > threshold).mean()
        out["rollout_is_ratio_fraction_low"] = (raw[m] < low).mean()
    capped = np.clip(w, 0.0, threshold)
    out["rollout_is_std"] = math.sqrt(max(np.square(capped).mean() - capped.mean() ** 2, 0.0)) if w.size > 1 else 0.0
    with np.errstate(divide="ignore"):  # every weight 0 (IcePop): infinite, as torch gives it, without a warning
        out["rollout_is_eff_sample_size"] = 1.0 / np.square(capped / (capped.mean() + 1e-8)).mean()
    n_tok = m.sum(-1)
    seq_mean = np.where(m, w_all, 0.0).sum(-1) / n_tok
    raw_seq_mean = np.where(m, raw, 0.0).sum(-1) / n_tok
    out["rollout_is_seq_mean"] = seq_mean.mean()
    out["rollout_is_seq_std"] = seq_mean.std(ddof=1) if seq_mean.size > 1 else 0.0
    out["rollout_is_seq_max"] = seq_mean.max()
    out["rollout_is_seq_min"] = seq_mean.min()
    out["rollout_is_seq_max_deviation"] = np.abs(seq_mean - 1).max()
    out["rollout_is_seq_fraction_high"] = (raw_seq_mean > threshold).mean()
    out["rollout_is_seq_fraction_low"] = (raw_seq_mean < low).mean()
    if lower is not None:
        out["rollout_is_oob_ratio"] = ((raw[m] < lower) | (raw[m] > threshold)).mean()
    return {f"rollout_corr/{k}": float(v) for k, v in out.items()}


def _f64(t: torch.Tensor) -> np.ndarray:
    """A detached tensor's values as a float64 numpy array (on the CPU)."""
    return t.detach().cpu().numpy().astype(np.float64)


# verl's rejection-sampling statistics: a KL estimator per token (k1 = -log r, k2 = (log r)^2 / 2,
# k3 = r - 1 - log r, with r = pi_old / pi_rollout), or its sum, mean or max over a sequence.
RS_OPTIONS: tuple[str, ...] = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)


def parse_rejection(options: str, thresholds: float | int | str | None) -> list[tuple[str, float | None, float]]:
    """verl's ``rollout_rs`` / ``rollout_rs_threshold`` -> ``[(option, lower, upper)]`` (lower only for k1 options).

    ``options`` is comma-separated (all must pass); ``thresholds`` one value
    shared by all or one per option, comma-separated. A k1 option takes ratio
    bounds ``lower_upper`` (a single number ``u`` means ``1/u_u``); the others
    an upper bound on their statistic.
    """
    names = list(dict.fromkeys(o.strip() for o in str(options).split(",") if o.strip()))
    if not names:
        raise ValueError("rollout_rs names no option; use null to turn rejection sampling off")
    unknown = [n for n in names if n not in RS_OPTIONS]
    if unknown:
        raise ValueError(f"unknown rollout_rs option(s) {unknown}; valid: {', '.join(RS_OPTIONS)}")
    if thresholds is None or isinstance(thresholds, bool):
        raise ValueError("rollout_rs needs rollout_rs_threshold (one value, or one per option, comma-separated)")
    specs = [t.strip() for t in str(thresholds).split(",") if t.strip()]
    if len(specs) == 1:
        specs = specs * len(names)
    if len(specs) != len(names):
        raise ValueError(
            f"rollout_rs_threshold has {len(specs)} values for {len(names)} options; give one for all or one per option"
        )
    out = []
    for name, spec in zip(names, specs):
        try:
            lower, upper = _bounds(spec)
        except ValueError:
            raise ValueError(f"rollout_rs_threshold {spec!r} for {name} is not a number") from None
        if name.endswith("k1"):
            lower = 1.0 / upper if lower is None and upper > 0 else lower
            if not (lower is not None and 0 < lower <= upper and math.isfinite(upper)):
                raise ValueError(f"rollout_rs_threshold {spec!r} for {name} needs ratio bounds 0 < lower <= upper")
        elif lower is not None or not (upper > 0 and math.isfinite(upper)):
            raise ValueError(
                f"rollout_rs_threshold {spec!r} for {name} must be one positive number (an upper "
                "bound on the statistic)"
            )
        out.append((name, lower, upper))
    return out


def _rs_statistics(log_ratio: torch.Tensor, mask: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Option `name`'s statistic per token (B, T) (for a sequence option, its row value broadcast) and per row."""
    lr = log_ratio.clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
    kind = name[-2:]
    per_token = {"k1": -lr, "k2": 0.5 * lr.square(), "k3": torch.exp(lr) - 1 - lr}[kind]
    if name.startswith("token"):
        return per_token, None
    zero = torch.zeros((), dtype=per_token.dtype, device=per_token.device)
    masked = torch.where(mask, per_token, zero)
    if name.startswith("seq_sum"):
        rows = masked.sum(-1)
    elif name.startswith("seq_mean"):
        rows = masked.sum(-1) / mask.sum(-1).clamp_min(1)
    else:
        rows = torch.where(mask, per_token, torch.full_like(per_token, -torch.inf)).amax(-1)
        rows = torch.where(torch.isinf(rows), zero, rows)
    return rows.unsqueeze(-1).expand_as(per_token), rows


def compute_rejection_mask(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    options: list[tuple[str, float | None, float]],
) -> tuple[torch.Tensor, dict[str, float]]:
    """Tokens kept (B, T) bool by every rejection option of `parse_rejection`, and verl's ``rollout_rs_*`` metrics.

    A token option drops single tokens; a sequence option drops all of a
    sequence's tokens. k1 bounds compare ``-log r`` with ``[log lower, log
    upper]`` (the ratio ``pi_rollout / pi_old`` within the bounds), the
    others their statistic with ``upper``. Per option ``o`` the metrics
    (python floats, no prefix) are ``rollout_rs_{o}_{mean,max,min,std}`` and
    ``_fraction_{high,low}`` of its statistic, ``_seq_{mean,std,max,min,
    max_deviation,fraction_high[,fraction_low]}`` over sequences,
    ``_masked_fraction`` (tokens) and ``_seq_masked_fraction`` (sequences it
    touched); overall ``rollout_rs_masked_fraction`` and
    ``rollout_rs_seq_masked_fraction``. Sequences without response tokens
    are left out of every statistic.
    """
    mask = response_mask if response_mask.dtype == torch.bool else response_mask != 0
    zero = torch.zeros((), dtype=torch.float64, device=mask.device)
    log_ratio = torch.where(mask, old_log_prob.detach().double() - rollout_log_prob.detach().double(), zero)
    keep = torch.ones_like(mask)
    metrics: dict[str, float] = {}
    valid = mask.sum(-1) > 0
    if not bool(valid.any()):
        return keep, metrics
    for name, lower, upper in options:
        stat, rows = _rs_statistics(log_ratio, mask, name)
        k1 = name.endswith("k1")
        hi = math.log(upper) if k1 else upper
        lo = math.log(lower) if k1 else 0.0
        option_keep = (stat >= lo) & (stat <= hi) if k1 else stat <= hi
        keep = keep & option_keep
        tokens = stat[mask]
        seq = (rows if rows is not None else torch.where(mask, stat, zero).sum(-1) / mask.sum(-1).clamp_min(1))[valid]
        p = f"rollout_rs_{name}"
        m: dict[str, torch.Tensor | float] = {f"{p}_mean": tokens.mean()}
        level_values = seq if rows is not None else tokens
        m[f"{p}_max"], m[f"{p}_min"] = level_values.max(), level_values.min()
        m[f"{p}_fraction_high"] = (level_values > hi).double().mean()
        m[f"{p}_fraction_low"] = (level_values < lo).double().mean() if k1 else 0.0
        capped = tokens.clamp(lo, hi)
        m[f"{p}_std"] = (
            (capped.square().mean() - capped.mean().square()).clamp_min(0).sqrt() if tokens.numel() > 1 else 0.0
        )
        m[f"{p}_seq_mean"] = seq.mean()
        m[f"{p}_seq_std"] = seq.std() if seq.numel() > 1 else 0.0
        m[f"{p}_seq_max"], m[f"{p}_seq_min"] = seq.max(), seq.min()
        m[f"{p}_seq_max_deviation"] = seq.abs().max()
        m[f"{p}_seq_fraction_high"] = (seq > hi).double().mean()
        if k1:
            m[f"{p}_seq_fraction_low"] = (seq < lo).double().mean()
        m[f"{p}_masked_fraction"] = (~option_keep[mask]).double().mean()
        m[f"{p}_seq_masked_fraction"] = ((~option_keep & mask).any(-1)[valid]).double().mean()
        metrics.update({k: float(v) for k, v in m.items()})
    metrics["rollout_rs_masked_fraction"] = float((~keep[mask]).double().mean())
    metrics["rollout_rs_seq_masked_fraction"] = float(((~keep & mask).any(-1)[valid]).double().mean())
    return keep & mask, metrics


def compute_mismatch_metrics(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """The train-inference mismatch of a batch (B, T), under verl's ``rollout_corr/`` names (python floats).

    With ``ℓ = old - rollout`` per token and per-sequence means over its
    response tokens (sequences without tokens are left out):
    ``training_ppl`` / ``rollout_ppl`` (mean over sequences of
    ``exp(-mean log p)``), ``training_log_ppl`` / ``rollout_log_ppl``,
    ``log_ppl_diff`` (mean of ``mean(rollout) - mean(old)`` = log(training
    ppl / rollout ppl); its ``_max``, ``_min`` and ``log_ppl_abs_diff``),
    ``ppl_ratio`` (mean of its exp), ``kl`` (k1 of KL(rollout || trainer):
    token mean of ``-ℓ``), ``k3_kl`` (token mean of ``exp(ℓ) - ℓ - 1``),
    ``chi2_token`` (token mean of ``exp(2ℓ)`` minus 1), ``chi2_seq`` (mean of
    ``exp(2 Σℓ)`` minus 1), with ``ℓ`` and ``Σℓ`` clamped to ±20 before exp,
    and ``extreme_frac``, the share of tokens with ``|ℓ| > ln 2`` (one side
    twice as likely as the other). Healthy: ``ppl_ratio`` ≈ 1, ``kl`` and
    ``k3_kl`` ≈ 0 (bf16 engines show ~1e-3), ``extreme_frac`` ≈ 0.
    """
    if old_log_prob.shape != response_mask.shape or rollout_log_prob.shape != response_mask.shape:
        raise ValueError(
            f"old_log_prob {tuple(old_log_prob.shape)}, rollout_log_prob {tuple(rollout_log_prob.shape)} and "
            f"response_mask {tuple(response_mask.shape)} must have the same shape"
        )
    mask = response_mask if response_mask.dtype == torch.bool else response_mask != 0
    has_tokens = mask.sum(-1) > 0
    if not bool(has_tokens.any()):
        return {}
    # float64 numpy, as `compute_is_metrics`: every step, on the trainer's thread.
    m = mask[has_tokens].cpu().numpy()
    old = np.where(m, _f64(old_log_prob[has_tokens]), 0.0)
    rollout = np.where(m, _f64(rollout_log_prob[has_tokens]), 0.0)
    n_tok = m.sum(-1)
    mean_old, mean_rollout = old.sum(-1) / n_tok, rollout.sum(-1) / n_tok
    log_ratio = old - rollout
    tokens = log_ratio[m]
    ppl_diff = mean_rollout - mean_old
    seq_sum = np.clip(log_ratio.sum(-1), -_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
    out = {
        "training_ppl": np.exp(-mean_old).mean(),
        "training_log_ppl": (-mean_old).mean(),
        "rollout_ppl": np.exp(-mean_rollout).mean(),
        "rollout_log_ppl": (-mean_rollout).mean(),
        "kl": (-tokens).mean(),
        "k3_kl": (np.exp(tokens) - tokens - 1).mean(),
        "log_ppl_diff": ppl_diff.mean(),
        "log_ppl_abs_diff": np.abs(ppl_diff).mean(),
        "log_ppl_diff_max": ppl_diff.max(),
        "log_ppl_diff_min": ppl_diff.min(),
        "ppl_ratio": np.exp(ppl_diff).mean(),
        "chi2_token": np.exp(2 * np.clip(tokens, -_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)).mean() - 1,
        "chi2_seq": np.exp(2 * seq_sum).mean() - 1,
        "extreme_frac": (np.abs(tokens) > math.log(2)).mean(),
    }
    return {f"rollout_corr/{k}": float(v) for k, v in out.items()}
