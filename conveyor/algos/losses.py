"""Policy, value and entropy losses and how per-token losses are aggregated.

All functions take response-aligned ``(B, T)`` tensors and return scalars.
Aggregation divides by normalisers the *caller* passes (``num_tokens``,
``num_seqs``, and the constant ``loss_scale_factor`` of
``seq-mean-token-sum-norm``; ``token-sum`` takes none): a data-parallel rank
computing on its shard with the global counts produces a loss whose sum over
ranks equals the whole-batch loss, so summing gradients across ranks is exact.
Without them the local counts are used, which is right for a single rank.

Policy losses are chosen by name from a registry, under verl's names
(``"vanilla"`` is PPO's clipped surrogate with dual clip; also ``gspo``,
``sapo``, ``cispo``, ``gpg``, ``clip_cov``, ``kl_cov``, ``geo_mean``,
``dppo_tv``, ``dppo_kl``, ``dro``); a new
variant is added by registering a function with ``compute_policy_loss``'s
signature (hyperparameters of its own as extra keywords with defaults).

This module deliberately does no distributed communication, reads no config
objects and computes no advantages (see ``advantages.py``).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch

from conveyor.algos.group_stats import masked_mean
from conveyor.registry import lookup, registrar

logger = logging.getLogger(__name__)

__all__ = [
    "LOSS_AGG_MODES",
    "agg_loss",
    "POLICY_LOSSES",
    "register_policy_loss",
    "get_policy_loss",
    "loss_params",
    "compute_policy_loss",
    "compute_value_loss",
    "compute_entropy_loss",
]

LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)

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
    loss_scale_factor: Normaliser = None,
) -> torch.Tensor:
    """Aggregate ``loss_mat`` (B, T) over ``loss_mask`` (B, T) into a scalar by ``loss_agg_mode``.

    ``token-mean``: sum of masked losses / ``num_tokens`` (default: tokens in the mask).
    ``token-sum``: sum of masked losses, no normaliser (shards' sums add up to the batch's).
    ``seq-mean-token-sum``: sum of per-sequence token sums / ``num_seqs`` (default: B).
    ``seq-mean-token-mean``: sum of per-sequence masked token means / ``num_seqs`` (default: B).
    ``seq-mean-token-sum-norm``: ``seq-mean-token-sum`` / ``loss_scale_factor``
    (default: T, the padded response width, as in verl; pass the maximum
    response length so the scale does not change with a micro-batch's padding).
    """
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; valid modes: {', '.join(LOSS_AGG_MODES)}")
    if loss_mat.shape != loss_mask.shape:
        raise ValueError(f"loss_mat has shape {tuple(loss_mat.shape)} but loss_mask has shape {tuple(loss_mask.shape)}")
    mask = loss_mask if loss_mask.dtype == torch.bool else loss_mask != 0
    # where() rather than multiplication: NaN/inf under the mask must not leak into the sum.
    masked = torch.where(mask, loss_mat, torch.zeros((), dtype=loss_mat.dtype, device=loss_mat.device))
    if loss_agg_mode == "token-mean":
        return masked.sum() / _denominator(num_tokens, mask.sum(), masked)
    if loss_agg_mode == "token-sum":
        # conveyor sums gradients over data-parallel ranks, so the local sum is
        # already this rank's share (verl multiplies by dp_size because DDP averages).
        return masked.sum()
    per_seq = masked.sum(-1)
    if loss_agg_mode == "seq-mean-token-mean":
        per_seq = per_seq / mask.sum(-1).clamp_min(1).to(per_seq.dtype)
    loss = per_seq.sum() / _denominator(num_seqs, loss_mat.shape[0], masked)
    if loss_agg_mode == "seq-mean-token-sum-norm":
        # Dr. GRPO: one constant for every sequence instead of its own length, so
        # long and short answers weigh the same per token.
        loss = loss / _denominator(loss_scale_factor, loss_mat.shape[-1], masked)
    return loss


# --------------------------------------------------------------------------- policy losses

PolicyLoss = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]

POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register_policy_loss(name: str, *, overwrite: bool = False) -> Callable[[PolicyLoss], PolicyLoss]:
    """Decorator registering ``fn`` as the policy loss called ``name`` (``overwrite=True`` replaces one)."""

    return registrar(POLICY_LOSSES, name, "policy loss", overwrite=overwrite)


def get_policy_loss(name: str) -> PolicyLoss:
    """Return the policy loss registered as ``name``; ValueError listing valid names otherwise."""
    return lookup(POLICY_LOSSES, name, "actor_rollout_ref.actor.policy_loss.loss_mode")


def _clamped_log_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor) -> torch.Tensor:
    """log r = log_prob - old_log_prob (B, T), clamped to +-20 so exp(log r) stays finite.

    The losses that clamp it this way in verl (vanilla, sapo, cispo, dppo_tv, dppo_kl) also report
    ``ppo_kl`` from the clamped value, so theirs do too: the metric saturates at
    20 per token where verl's does.
    """
    # Clipping makes the gradient 0 out there anyway; an inf would turn 0 * inf into NaN.
    return torch.clamp(log_prob - old_log_prob, -20.0, 20.0)


def _ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    """exp(log_ratio) (B, T) with the exponent clamped to +-20, for losses whose ``ppo_kl`` is unclamped, as in verl."""
    return torch.exp(torch.clamp(log_ratio, -20.0, 20.0))


def _zero(like: torch.Tensor) -> torch.Tensor:
    """A 0-dim zero on ``like``'s device, for metrics a loss does not have (kept for a uniform metric set)."""
    return torch.zeros((), device=like.device)


# Per-token losses (B, T) and metrics (0-dim tensors): what a token loss returns.
TokenLossResult = tuple[torch.Tensor, dict[str, torch.Tensor]]
TokenLoss = Callable[..., TokenLossResult]

# The keywords every policy loss is called with; anything else is a loss's own hyperparameter.
_COMMON_KEYWORDS = frozenset(
    {
        "clip_ratio_low",
        "clip_ratio_high",
        "clip_ratio_c",
        "loss_agg_mode",
        "num_tokens",
        "num_seqs",
        "loss_scale_factor",
        "is_weights",
    }
)


def _policy_loss(fixed_agg_mode: str | None = None) -> Callable[[TokenLoss], PolicyLoss]:
    """Decorator making a policy loss from ``token_loss(mask, old_log_prob, log_prob, advantages, **kw)``.

    ``token_loss`` gets the bool mask and (B, T) inputs already zeroed off the
    mask, and returns per-token losses (B, T) and its metrics; it declares
    which of ``clip_ratio_low``, ``clip_ratio_high``, ``clip_ratio_c`` and
    ``is_weights`` it uses (declaring ``is_weights`` means it applies them
    itself) plus hyperparameters of its own. Shape checks, padding, importance
    weights and aggregation (by ``loss_agg_mode``, or ``fixed_agg_mode`` when
    the loss is defined for one) are done here, once for every loss.
    """

    def decorator(token_loss: TokenLoss) -> PolicyLoss:
        accepted = set(inspect.signature(token_loss).parameters)

        def policy_loss(
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
            loss_scale_factor: Normaliser = None,
            is_weights: torch.Tensor | None = None,
            **params: Any,
        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            for name, t in (
                ("old_log_prob", old_log_prob),
                ("log_prob", log_prob),
                ("advantages", advantages),
                ("is_weights", is_weights),
            ):
                if t is not None and t.shape != response_mask.shape:
                    raise ValueError(
                        f"{name} has shape {tuple(t.shape)} but response_mask has shape {tuple(response_mask.shape)}"
                    )
            if clip_ratio_low < 0 or clip_ratio_high < 0:
                raise ValueError(
                    f"clip_ratio_low and clip_ratio_high must be >= 0, got {clip_ratio_low}, {clip_ratio_high}"
                )
            mask = response_mask if response_mask.dtype == torch.bool else response_mask != 0
            # Neutralise padded positions up front so garbage there (NaN, inf) cannot
            # reach the loss or its gradient through any branch of any loss.
            zero = torch.zeros((), dtype=log_prob.dtype, device=log_prob.device)
            weights = None if is_weights is None else is_weights.detach()
            shared = {
                "clip_ratio_low": clip_ratio_low,
                "clip_ratio_high": clip_ratio_high,
                "clip_ratio_c": clip_ratio_c,
                "is_weights": weights,
            }
            pg_losses, metrics = token_loss(
                mask,
                torch.where(mask, old_log_prob, zero),
                torch.where(mask, log_prob, zero),
                torch.where(mask, advantages, zero),
                **{k: v for k, v in shared.items() if k in accepted},
                **params,
            )
            if weights is not None and "is_weights" not in accepted:
                pg_losses = pg_losses * weights
            pg_loss = agg_loss(
                pg_losses,
                mask,
                fixed_agg_mode or loss_agg_mode,
                num_tokens=num_tokens,
                num_seqs=num_seqs,
                loss_scale_factor=loss_scale_factor,
            )
            return pg_loss, {name: value.detach() for name, value in metrics.items()}

        # The registered loss reads as the function it was made from (its docs), with the full signature.
        for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
            setattr(policy_loss, attr, getattr(token_loss, attr))
        policy_loss.token_loss = token_loss  # type: ignore[attr-defined]  # what loss_params reads
        return policy_loss

    return decorator


def loss_params(loss: PolicyLoss, params: Mapping[str, Any]) -> dict[str, Any]:
    """The hyperparameters among ``params`` that policy loss ``loss`` declares by name.

    A loss taking only ``**kwargs`` gets none: it typically forwards them to
    another loss (``compute_policy_loss``), which would refuse the ones it
    does not know. Name a hyperparameter in the signature to receive it.
    """
    declared = inspect.signature(getattr(loss, "token_loss", loss)).parameters
    # The common keywords are passed by the caller already; a second copy would be a TypeError.
    return {
        k: v
        for k, v in params.items()
        if k not in _COMMON_KEYWORDS
        and k in declared
        and declared[k].kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    }


@register_policy_loss("vanilla")
@_policy_loss()
def compute_policy_loss(
    mask: torch.Tensor,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float,
) -> TokenLossResult:
    """PPO clipped surrogate with dual clip over (B, T) inputs; returns (pg_loss scalar, metrics).

    Called as every registered policy loss is: ``(old_log_prob, log_prob,
    advantages, response_mask, *, clip_ratio_low=0.2, clip_ratio_high=0.2,
    clip_ratio_c=3.0, loss_agg_mode="token-mean", num_tokens=None,
    num_seqs=None, loss_scale_factor=None, is_weights=None, **own
    hyperparameters)``.

    Per token, ``r = exp(log_prob - old_log_prob)`` and the loss is
    ``max(-A r, -A clip(r, 1 - low, 1 + high))``; for ``A < 0`` it is further
    capped at ``-A * clip_ratio_c`` (dual clip) so one very unlikely old action
    cannot dominate. ``is_weights`` (B, T), if given, multiplies the per-token
    loss (rollout correction). Metrics (detached 0-dim tensors): ``pg_clipfrac``,
    ``pg_clipfrac_lower``, ``ppo_kl``.
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1.0 for dual clip, got {clip_ratio_c}")
    log_ratio = _clamped_log_ratio(log_prob, old_log_prob)
    ratio = torch.exp(log_ratio)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_ppo = torch.maximum(loss_unclipped, loss_clipped)

    loss_cap = -advantages * clip_ratio_c
    negative = advantages < 0
    pg_losses = torch.where(negative, torch.minimum(loss_ppo, loss_cap), loss_ppo)
    return pg_losses, {
        "pg_clipfrac": masked_mean((loss_clipped > loss_unclipped).float(), mask),
        "pg_clipfrac_lower": masked_mean(((loss_ppo > loss_cap) & negative).float(), mask),
        "ppo_kl": masked_mean(-log_ratio, mask),
    }


@register_policy_loss("gspo")
@_policy_loss()
def compute_policy_loss_gspo(
    mask: torch.Tensor,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
) -> TokenLossResult:
    """GSPO (B, T): the PPO clip applied to the sequence-level ratio (geometric mean of token ratios).

    ``s_i = exp(mean_t log r_it)``; each token uses ``sg(s_i) * p_it / sg(p_it)``
    (value ``s_i``, gradient of its own log-prob scaled by ``s_i``) in
    ``max(-A s, -A clip(s, 1 - low, 1 + high))``. No dual clip. The paper
    aggregates ``seq-mean-token-mean``; like verl, ``loss_agg_mode`` is honoured.
    """
    log_ratio = log_prob - old_log_prob
    seq_log_ratio = log_ratio.sum(-1) / mask.sum(-1).clamp_min(1).to(log_ratio.dtype)
    # The straight-through form keeps a per-token gradient while the value is the sequence ratio.
    log_seq_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    seq_ratio = torch.exp(torch.clamp(log_seq_ratio, max=10.0))
    loss_unclipped = -advantages * seq_ratio
    loss_clipped = -advantages * torch.clamp(seq_ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    return torch.maximum(loss_unclipped, loss_clipped), {
        "pg_clipfrac": masked_mean((loss_clipped > loss_unclipped).float(), mask),
        "pg_clipfrac_lower": _zero(mask),
        "ppo_kl": masked_mean(-log_ratio, mask),
    }


@register_policy_loss("sapo")
@_policy_loss(fixed_agg_mode="seq-mean-token-mean")
def compute_policy_loss_sapo(
    mask: torch.Tensor,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
) -> TokenLossResult:
    """SAPO (B, T): a smooth sigmoid gate on the ratio instead of a hard clip.

    Per token ``-A * (4 / tau) * sigmoid(tau (r - 1))`` with ``tau = tau_pos``
    where ``A > 0`` and ``tau_neg`` elsewhere (its gradient is ``-A r`` at
    ``r = 1`` and fades smoothly away from it). The objective is defined per
    sequence, so, as in verl, it always aggregates ``seq-mean-token-mean``
    over ``num_seqs`` and ignores ``loss_agg_mode``; the clip ranges are unused.
    """
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"SAPO temperatures tau_pos and tau_neg must be > 0, got {tau_pos}, {tau_neg}")
    log_ratio = _clamped_log_ratio(log_prob, old_log_prob)
    taus = torch.where(
        advantages > 0,
        torch.as_tensor(tau_pos, dtype=advantages.dtype, device=advantages.device),
        torch.as_tensor(tau_neg, dtype=advantages.dtype, device=advantages.device),
    )
    gates = torch.sigmoid(taus * (torch.exp(log_ratio) - 1.0)) * (4.0 / taus)
    return -gates * advantages, {
        "pg_clipfrac": _zero(mask),
        "pg_clipfrac_lower": _zero(mask),
        "ppo_kl": masked_mean(-log_ratio, mask),
    }


@register_policy_loss("cispo")
@_policy_loss()
def compute_policy_loss_cispo(
    mask: torch.Tensor,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
) -> TokenLossResult:
    """CISPO (B, T): REINFORCE weighted by the clipped, detached ratio: ``-sg(clip(r, 1-low, 1+high)) A log_prob``.

    Clipping the weight rather than the objective keeps every token's gradient
    (PPO drops clipped tokens entirely).
    """
    log_ratio = _clamped_log_ratio(log_prob, old_log_prob)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    return -clipped.detach() * advantages * log_prob, {
        "pg_clipfrac": masked_mean((ratio != clipped).float(), mask),
        "pg_clipfrac_lower": _zero(mask),
        "ppo_kl": masked_mean(-log_ratio, mask),
    }


@register_policy_loss("gpg")
@_policy_loss()
def compute_policy_loss_gpg(
    mask: torch.Tensor, old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor
) -> TokenLossResult:
    """GPG (B, T): plain policy gradient ``-A log_prob``, no ratio and no clip (the clip ranges are unused).

    Metrics: ``ppo_kl`` only (verl reports none; it is kept to watch drift).
    """
    return -log_prob * advantages, {"ppo_kl": masked_mean(old_log_prob - log_prob, mask)}


@register_policy_loss("clip_cov")
@_policy_loss()
def compute_policy_loss_clip_cov(
    mask: torch.Tensor,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_cov_ratio: float = 0.0002,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    generator: torch.Generator | None = None,
) -> TokenLossResult:
    """Clip-Cov (B, T): PPO's clip, plus the gradient of a few high-covariance tokens switched off.

    Per token ``cov = (A - mean A) (log_prob - mean log_prob)`` over this
    micro-batch; of the tokens PPO did not clip with ``clip_cov_lb < cov <
    clip_cov_ub``, ``max(1, int(clip_cov_ratio * tokens))`` chosen at random
    (``torch.randperm`` with ``generator``, the global one by default, as verl)
    get loss 0. Those tokens drive entropy collapse (the paper). No dual clip.
    Metrics: ``pg_clipfrac`` (the share switched off), ``ppo_kl``.
    """
    if clip_cov_ratio <= 0:
        raise ValueError(f"clip_cov_ratio must be > 0, got {clip_cov_ratio}")
    log_ratio = log_prob - old_log_prob
    ratio = _ratio(log_ratio)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)

    logp = log_prob.detach()
    cov = (advantages - masked_mean(advantages, mask)) * (logp - masked_mean(logp, mask))
    candidates = mask & ~(loss_clipped > loss_unclipped) & (cov > clip_cov_lb) & (cov < clip_cov_ub)
    # Row-major positions, shuffled and cut like verl's so the same seed picks the same tokens.
    positions = torch.nonzero(candidates)
    clip_num = max(int(clip_cov_ratio * mask.sum().item()), 1)
    chosen = positions[torch.randperm(len(positions), generator=generator)[:clip_num].to(positions.device)]
    keep = torch.ones_like(loss_unclipped)
    keep[chosen[:, 0], chosen[:, 1]] = 0.0
    return torch.maximum(loss_unclipped, loss_clipped) * keep, {
        "pg_clipfrac": masked_mean((keep == 0).float(), mask),
        "ppo_kl": masked_mean(-log_ratio, mask),
    }


@register_policy_loss("kl_cov")
@_policy_loss()
def compute_policy_loss_kl_cov(
    mask: torch.Tensor,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    *,
    kl_cov_ratio: float = 0.0002,
    ppo_kl_coef: float = 0.1,
) -> TokenLossResult:
    """KL-Cov (B, T): unclipped ``-A r``, plus ``ppo_kl_coef * |log r|`` on the highest-covariance tokens.

    Per valid token ``cov = (A - mean A) (log_prob - mean log_prob)`` over this
    micro-batch; the top ``max(1, int(tokens * kl_cov_ratio))`` get the KL
    penalty, which restrains exactly the tokens that collapse entropy (the
    paper). No clipping at all (the clip ranges are unused). Metrics:
    ``ppo_kl`` is the mean of ``|log r|`` here, as in verl.
    """
    if kl_cov_ratio <= 0:
        raise ValueError(f"kl_cov_ratio must be > 0, got {kl_cov_ratio}")
    log_ratio = log_prob - old_log_prob
    pg_losses = -advantages * _ratio(log_ratio)

    valid = torch.nonzero(mask.reshape(-1), as_tuple=True)[0]
    if valid.numel() > 0:
        adv_v = advantages.detach().reshape(-1)[valid]
        logp_v = log_prob.detach().reshape(-1)[valid]
        cov = (adv_v - adv_v.mean()) * (logp_v - logp_v.mean())
        top = valid[torch.topk(cov, max(1, int(len(cov) * kl_cov_ratio)), largest=True).indices]
        penalised = torch.zeros(mask.numel(), dtype=torch.bool, device=mask.device)
        penalised[top] = True
        pg_losses = torch.where(penalised.view_as(mask), pg_losses + ppo_kl_coef * log_ratio.abs(), pg_losses)
    return pg_losses, {"ppo_kl": masked_mean(log_ratio.abs(), mask)}


@register_policy_loss("geo_mean")
@_policy_loss(fixed_agg_mode="seq-mean-token-sum")
def compute_policy_loss_geo_mean(
    mask: torch.Tensor,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    is_weights: torch.Tensor | None,
) -> TokenLossResult:
    """GMPO (B, T): PPO on the geometric mean of token ratios, clipped per token in log space.

    Per token the log-ratio is clipped to ``[-low, high]`` on the side the
    advantage's sign makes pessimistic; per sequence ``-mean_t(A) *
    exp(mean_t(clipped log r))``, summed over sequences / ``num_seqs``. The
    loss is per sequence, so ``loss_agg_mode`` is unused (the mean over
    sequences verl takes, with the global count); ``is_weights`` enter as their
    per-sequence geometric mean. Metrics: ``pg_clipfrac`` (clipped tokens with
    ``A > 0``), ``pg_clipfrac_lower`` (``A < 0``), ``ppo_kl``.
    """
    log_ratio = log_prob - old_log_prob
    sign = torch.sign(advantages)
    log_ratio_clamped = torch.clamp(log_ratio, -clip_ratio_low, clip_ratio_high)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * log_ratio_clamped)

    lengths = mask.sum(-1).clamp_min(1).to(log_ratio.dtype)
    seq_losses = -(advantages.sum(-1) / lengths) * torch.exp(pessimistic.sum(-1) / lengths)
    if is_weights is not None:
        log_w = torch.where(mask, torch.log(is_weights + 1e-10), torch.zeros_like(log_ratio))
        seq_losses = seq_losses * torch.exp(log_w.sum(-1) / lengths)
    clipped = log_ratio != log_ratio_clamped
    # Spread evenly over its tokens, a sequence's loss sums back to itself under seq-mean-token-sum.
    return (seq_losses / lengths).unsqueeze(-1).expand_as(log_ratio), {
        "pg_clipfrac": masked_mean((clipped & (advantages > 0)).float(), mask),
        "pg_clipfrac_lower": masked_mean((clipped & (advantages < 0)).float(), mask),
        "ppo_kl": masked_mean(-log_ratio, mask),
    }


def _dppo_loss(
    mask: torch.Tensor,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    valid: torch.Tensor,
    clip_ratio_c: float,
) -> TokenLossResult:
    """DPPO's shared tail (B, T): ``-A sg(min(r, c)) log_prob`` on the tokens ``valid`` keeps, 0 elsewhere."""
    if clip_ratio_c <= 0:
        raise ValueError(f"clip_ratio_c (DPPO's truncation of the ratio) must be > 0, got {clip_ratio_c}")
    log_ratio = _clamped_log_ratio(log_prob, old_log_prob)
    ratio = torch.exp(log_ratio)
    keep = valid.detach().to(log_prob.dtype)
    # Truncated importance sampling in place of PPO's dual clip (DPPO section 5.4), detached like the mask.
    pg_losses = -advantages * torch.clamp(ratio, max=clip_ratio_c).detach() * log_prob * keep
    return pg_losses, {
        "pg_clipfrac": masked_mean(1.0 - keep, mask),
        "pg_clipfrac_lower": masked_mean((ratio > clip_ratio_c).to(keep.dtype) * keep, mask),
        "ppo_kl": masked_mean(-log_ratio, mask),
    }


@register_policy_loss("dppo_tv")
@_policy_loss()
def compute_policy_loss_dppo_tv(
    mask: torch.Tensor,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float,
) -> TokenLossResult:
    """DPPO-Binary-TV (B, T): REINFORCE with the truncated ratio, dropping tokens whose probability moved too far.

    Per token ``-A sg(min(r, c)) log π_θ``, kept only where the change of the
    sampled token's probability ``π_θ − π_old`` is at most ``clip_ratio_high``
    (for ``A > 0``) or at least ``−clip_ratio_low`` (otherwise): the clip
    ranges are total-variation thresholds here, not ratio ranges; ``c`` is
    ``clip_ratio_c``. Metrics: ``pg_clipfrac`` (tokens dropped),
    ``pg_clipfrac_lower`` (kept tokens whose ratio was truncated), ``ppo_kl``.
    """
    change = torch.exp(log_prob) - torch.exp(old_log_prob)
    valid = torch.where(advantages > 0, change <= clip_ratio_high, change >= -clip_ratio_low)
    return _dppo_loss(mask, old_log_prob, log_prob, advantages, valid, clip_ratio_c)


@register_policy_loss("dppo_kl")
@_policy_loss()
def compute_policy_loss_dppo_kl(
    mask: torch.Tensor,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float,
) -> TokenLossResult:
    """DPPO-Binary-KL (B, T): as ``dppo_tv``, with the binary KL of the sampled token's probability as the divergence.

    ``KL = p_old log(p_old / p) + (1 − p_old) log((1 − p_old + 1e-8) / (1 − p + 1e-8))``
    over the sampled token's probability ``p`` (and ``p_old``); a token is
    dropped when it exceeds ``clip_ratio_high`` while ``p`` rose (``A > 0``) or
    ``clip_ratio_low`` while ``p`` fell (otherwise). Metrics as ``dppo_tv``.
    """
    prob, old_prob = torch.exp(log_prob), torch.exp(old_log_prob)
    binary_kl = old_prob * (old_log_prob - log_prob) + (1 - old_prob) * torch.log(
        (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8)
    )
    valid = torch.where(
        advantages > 0,
        (binary_kl <= clip_ratio_high) | (prob <= old_prob),
        (binary_kl <= clip_ratio_low) | (prob >= old_prob),
    )
    return _dppo_loss(mask, old_log_prob, log_prob, advantages, valid, clip_ratio_c)


@register_policy_loss("dro")
@_policy_loss()
def compute_policy_loss_dro(
    mask: torch.Tensor,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    *,
    dro_beta: float | None = None,
) -> TokenLossResult:
    """DRO (B, T): ``−(A log π_θ − β/2 (log r)²)``, REINFORCE with a quadratic penalty on the log-ratio.

    ``β`` is ``dro_beta`` (required, > 0; verl has no default either). No
    ratio and no clip (the clip ranges are unused). Metrics: ``ppo_kl``.
    """
    if dro_beta is None or not dro_beta > 0:
        raise ValueError(
            f"dro_beta must be > 0 for the 'dro' loss (actor_rollout_ref.actor.policy_loss.dro_beta), got {dro_beta}"
        )
    log_ratio = log_prob - old_log_prob
    return -(log_prob * advantages - 0.5 * dro_beta * log_ratio.square()), {"ppo_kl": masked_mean(-log_ratio, mask)}


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
    loss_scale_factor: Normaliser = None,
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
    vf_loss = 0.5 * agg_loss(
        vf_losses, mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs, loss_scale_factor=loss_scale_factor
    )
    vf_clipfrac = masked_mean((loss_clipped > loss_unclipped).float(), mask).detach()
    return vf_loss, vf_clipfrac


def compute_entropy_loss(
    entropy: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    num_tokens: Normaliser = None,
    num_seqs: Normaliser = None,
    loss_scale_factor: Normaliser = None,
) -> torch.Tensor:
    """Aggregated entropy (B, T) -> scalar; the caller subtracts ``coef *`` it for an entropy bonus."""
    return agg_loss(
        entropy,
        response_mask,
        loss_agg_mode,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        loss_scale_factor=loss_scale_factor,
    )
