"""KL estimators between the policy and a reference, and KL-coefficient controllers.

Used two ways: as a per-token penalty folded into the reward before
advantages are computed (``apply_kl_penalty``), or as a loss term in the actor
update (the caller aggregates ``kl_penalty`` with ``losses.agg_loss``).
Estimators follow Schulman's "Approximating KL divergence" notes: k1 is
unbiased but noisy, k2 and k3 are lower-variance; the "+" kinds keep k1's,
k3's or abs's value but take k2's gradient (as verl's do).

This module deliberately does not read configs (``make_kl_controller`` takes
plain values) and does no distributed reduction of the measured KL.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from conveyor.registry import lookup, registrar

logger = logging.getLogger(__name__)

__all__ = [
    "KL_KINDS",
    "KL_CONTROLLERS",
    "kl_penalty",
    "FixedKLController",
    "AdaptiveKLController",
    "make_kl_controller",
    "register_kl_controller",
    "apply_kl_penalty",
]

# Aliases map onto the canonical estimator names. A "+" kind is straight-through:
# its value is the named estimator's, its gradient k2's (see kl_penalty).
KL_KINDS: dict[str, str] = {
    "k1": "k1",
    "kl": "k1",
    "abs": "abs",
    "k2": "k2",
    "mse": "k2",
    "k3": "k3",
    "low_var_kl": "k3",
    "k1+": "k1+",
    "kl+": "k1+",
    "abs+": "abs+",
    "k3+": "k3+",
    "low_var_kl+": "k3+",
    # k2's own gradient is already k2's: accepted because verl accepts it.
    "k2+": "k2",
    "mse+": "k2",
}


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate (B, T) of the policy from the reference, by estimator ``kind``.

    ``k1``/``kl``: logp - ref. ``abs``: |logp - ref|. ``k2``/``mse``: 0.5 (logp - ref)^2.
    ``k3``/``low_var_kl``: exp(ref - logp) - (ref - logp) - 1, clamped to [-10, 10].
    ``k1+``, ``abs+``, ``k3+``/``low_var_kl+``: the value of the estimator
    without the ``+`` with the gradient of ``k2`` (straight-through), whose
    expected gradient is the true KL's, which k1's and k3's are not.
    """
    canonical = lookup(KL_KINDS, kind, "algorithm.kl_penalty / actor_rollout_ref.actor.kl_loss_type")
    diff = log_prob - ref_log_prob
    if canonical.endswith("+"):
        value = _estimate(log_prob, ref_log_prob, diff, canonical[:-1])
        k2 = 0.5 * diff.square()
        return k2 - k2.detach() + value.detach()
    return _estimate(log_prob, ref_log_prob, diff, canonical)


def _estimate(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, diff: torch.Tensor, canonical: str) -> torch.Tensor:
    """The plain estimator ``canonical`` (k1, abs, k2 or k3) per token (B, T); ``diff`` = logp - ref."""
    if canonical == "k1":
        return diff
    if canonical == "abs":
        return diff.abs()
    if canonical == "k2":
        return 0.5 * diff.square()
    # k3. Clamping the exponent at +-20 cannot change the clamped result (the
    # estimate already exceeds 10 there) but keeps exp() and its gradient finite.
    log_ratio = torch.clamp(ref_log_prob - log_prob, -20.0, 20.0)
    return torch.clamp(torch.exp(log_ratio) - log_ratio - 1.0, -10.0, 10.0)


class FixedKLController:
    """A constant KL coefficient; ``update`` is a no-op kept for a uniform interface."""

    def __init__(self, kl_coef: float) -> None:
        if kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Leave the coefficient unchanged."""


class AdaptiveKLController:
    """Proportional KL controller (Ziegler et al. 2019) steering the measured KL towards ``target_kl``."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float) -> None:
        if init_kl_coef < 0:
            raise ValueError(f"init_kl_coef must be >= 0, got {init_kl_coef}")
        if target_kl <= 0:
            raise ValueError(f"target_kl must be > 0, got {target_kl}")
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """value *= 1 + clip(current_kl / target - 1, -0.2, 0.2) * n_steps / horizon."""
        # The +-0.2 clip bounds how fast one noisy KL reading can move the coefficient.
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


# `factory(kl_coef, target_kl, horizon) -> controller`: anything with a `value` and `update(current_kl, n_steps)`.
KLControllerFactory = Callable[[float, float | None, float | None], Any]

# The in-reward KL controllers by name (algorithm.kl_ctrl.type).
KL_CONTROLLERS: dict[str, KLControllerFactory] = {}


def register_kl_controller(
    name: str, *, overwrite: bool = False
) -> Callable[[KLControllerFactory], KLControllerFactory]:
    """Decorator registering `factory(kl_coef, target_kl, horizon) -> controller` as KL controller `name`."""
    return registrar(KL_CONTROLLERS, name, "KL controller", overwrite=overwrite)


@register_kl_controller("fixed")
def _fixed(kl_coef: float, target_kl: float | None, horizon: float | None) -> FixedKLController:
    return FixedKLController(kl_coef)


@register_kl_controller("adaptive")
def _adaptive(kl_coef: float, target_kl: float | None, horizon: float | None) -> AdaptiveKLController:
    if target_kl is None or horizon is None:
        raise ValueError("an adaptive kl controller needs target_kl and horizon")
    return AdaptiveKLController(kl_coef, target_kl, horizon)


def make_kl_controller(
    kind: str,
    kl_coef: float,
    target_kl: float | None = None,
    horizon: float | None = None,
) -> Any:
    """Build the KL controller registered as `kind` (``"fixed"``, ``"adaptive"``, ...) starting at ``kl_coef``."""
    return lookup(KL_CONTROLLERS, kind, "algorithm.kl_ctrl.type")(kl_coef, target_kl, horizon)


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    kl_coef: float,
    kind: str = "k1",
) -> tuple[torch.Tensor, float]:
    """Rewards (B, T) = scores - kl_coef * KL on response tokens; also the measured KL as a float.

    The measured KL is the mean over sequences (those with at least one
    response token) of each sequence's masked mean per-token KL, which is what
    the adaptive controller is fed.
    """
    for name, t in (("old_log_prob", old_log_prob), ("ref_log_prob", ref_log_prob)):
        if t.shape != token_level_scores.shape:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} but token_level_scores has shape {tuple(token_level_scores.shape)}"
            )
    mask = response_mask if response_mask.dtype == torch.bool else response_mask != 0
    kld = kl_penalty(old_log_prob.detach(), ref_log_prob.detach(), kind)
    kld = torch.where(mask, kld, torch.zeros((), dtype=kld.dtype, device=kld.device))
    rewards = token_level_scores - kl_coef * kld.to(token_level_scores.dtype)

    tokens_per_seq = mask.sum(-1)
    has_tokens = tokens_per_seq > 0
    if not bool(has_tokens.any()):
        return rewards, 0.0
    per_seq = kld.sum(-1) / tokens_per_seq.clamp_min(1).to(kld.dtype)
    current_kl = per_seq[has_tokens].float().mean().item()
    return rewards, current_kl
