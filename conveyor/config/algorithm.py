"""The `algorithm` section: advantage estimation, in-reward KL, rollout correction and dynamic sampling.

Estimator, KL-estimator and KL-controller names are read from `conveyor.algos`
when checked; the rollout-correction strings are parsed by
`conveyor.algos.correction`, imported when a config is checked. It deliberately
computes nothing: the trainer hands these values to the pure functions of
`conveyor.algos`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from conveyor.config.actor import KL_KIND_CHOICES
from conveyor.config.fields import ConfigError, F, S, check, registry

__all__ = [
    "FILTER_GROUPS_METRICS",
    "ROLLOUT_IS_LEVELS",
    "KLControlConfig",
    "RolloutCorrectionConfig",
    "FilterGroupsConfig",
    "AlgorithmConfig",
]

ROLLOUT_IS_LEVELS: tuple[str, ...] = ("token", "sequence")

# What filter_groups.metric may name: "reward" (verl's default; "score" and
# "seq_reward" are its older names) is the summed rm_scores before any KL
# penalty, "acc" the reward function's accuracy field.
FILTER_GROUPS_METRICS = ("reward", "acc", "score", "seq_reward")


@dataclass
class KLControlConfig:
    """The in-reward KL coefficient."""

    type: str = F(
        "fixed",
        "how the coefficient moves (adaptive: towards target_kl)",
        choices=registry("conveyor.algos.kl", "KL_CONTROLLERS"),
    )
    kl_coef: float = F(0.001, "initial coefficient", ge=0)
    target_kl: float = F(0.1, "adaptive: target KL", gt=0)
    horizon: int = F(10000, "adaptive: horizon", gt=0)


@dataclass
class RolloutCorrectionConfig:
    """Correcting for the gap between sampler and trainer log-probs."""

    bypass_mode: bool | None = F(
        None,
        "use the rollout's log-probs as old log-probs (no old-log-prob forward); null = on when the in-process hf "
        "rollout samples from the trainer's own weights and nothing needs the forward (rollout_is, rollout_rs, "
        "router_replay.mode=R2 turn it off)",
    )
    rollout_is: str | None = F(
        None,
        "truncated importance weights per token or per sequence; null = off (token when training off-policy)",
        choices=ROLLOUT_IS_LEVELS,
    )
    rollout_is_threshold: Any = F(
        2.0,
        "a number: truncate the importance weights there; 'lower_upper' (e.g. "
        "0.5_5.0): IcePop, weights outside [lower, upper] become 0",
    )
    rollout_rs: str | None = F(
        None,
        "rejection sampling: null, or comma-separated options (token_k1, token_k2, "
        "token_k3, seq_sum_k1..k3, seq_mean_k1..k3, seq_max_k2, seq_max_k3) that a token "
        "(token_*) or all of a sequence's tokens (seq_*) must pass to count in the loss",
    )
    rollout_rs_threshold: Any = F(
        None,
        "bounds of rollout_rs: one for all options or one per option, "
        "comma-separated; k1 options take ratio bounds 'lower_upper', the others an "
        "upper bound",
    )

    def validate(self, prefix: str) -> None:
        """The threshold and rejection strings parse."""
        try:
            self.is_thresholds()
        except ValueError as err:
            raise ConfigError(f"{prefix}.rollout_is_threshold: {err}") from None
        if self.rollout_rs is not None:
            try:
                self.rejection()
            except ValueError as err:
                raise ConfigError(f"{prefix}.rollout_rs: {err}") from None

    def rejection(self) -> list[tuple[str, float | None, float]]:
        """The rejection-sampling options as (option, lower, upper), [] when rollout_rs is null."""
        from conveyor.algos.correction import parse_rejection

        return [] if self.rollout_rs is None else parse_rejection(self.rollout_rs, self.rollout_rs_threshold)

    def is_thresholds(self) -> tuple[float, float | None]:
        """(upper, lower) of the importance weights; lower is None unless IcePop's 'lower_upper' is set."""
        from conveyor.algos.correction import parse_is_threshold

        return parse_is_threshold(self.rollout_is_threshold)


@dataclass
class FilterGroupsConfig:
    """DAPO's dynamic sampling: train only on groups whose rewards differ."""

    enable: bool = F(False, "drop groups whose samples all score the same and generate more until the batch is full")
    metric: str = F(
        "reward", "what must differ within a group: reward (summed rm_scores) or acc", choices=FILTER_GROUPS_METRICS
    )
    max_num_gen_batches: int = F(
        0, "stop with an error after this many generation batches in one step (0 = no limit)", ge=0, hint="0 = no limit"
    )


@dataclass
class AlgorithmConfig:
    """Advantage estimation and in-reward KL."""

    adv_estimator: str = F(
        "grpo",
        "advantage estimator from the registry (add one with conveyor.algos.register_adv_estimator)",
        choices=registry("conveyor.algos.advantages", "ADV_ESTIMATORS"),
    )
    gamma: float = F(1.0, "discount", ge=0, le=1)
    lam: float = F(1.0, "GAE lambda", ge=0, le=1)
    norm_adv_by_std_in_grpo: bool = F(True, "GRPO: divide by the group's reward std")
    use_kl_in_reward: bool = F(False, "subtract kl_ctrl.kl_coef * KL from the token rewards")
    kl_penalty: str = F("kl", "KL estimator of the in-reward penalty", choices=KL_KIND_CHOICES)
    kl_ctrl: KLControlConfig = S(KLControlConfig, "in-reward KL controller")
    rollout_correction: RolloutCorrectionConfig = S(RolloutCorrectionConfig, "rollout correction")
    filter_groups: FilterGroupsConfig = S(FilterGroupsConfig, "dynamic sampling (DAPO)")
    gdpo_reward_keys: list | None = F(
        None,
        "gdpo: the per-sample reward components to normalise one by one (fields the reward stage writes: "
        "acc, or a key of the dict a reward function returns); null = the summed rm_scores as the one component",
    )
    gdpo_reward_weights: list | None = F(
        None, "gdpo: one weight per gdpo_reward_keys entry in the weighted sum; null = 1 each"
    )

    def validate(self, prefix: str) -> None:
        """GDPO's keys are distinct names, its weights numbers, one per key."""
        keys, weights = self.gdpo_reward_keys, self.gdpo_reward_weights
        if keys is not None:
            check(
                len(keys) > 0 and all(isinstance(k, str) and k for k in keys) and len(set(keys)) == len(keys),
                f"{prefix}.gdpo_reward_keys",
                f"must be a non-empty list of distinct field names (e.g. [acc, format_reward]), got {keys}",
            )
        if weights is not None:
            check(
                keys is not None,
                f"{prefix}.gdpo_reward_weights",
                "weighs the components named by gdpo_reward_keys: set those too, or leave the weights null",
            )
            check(
                all(isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) for w in weights)
                and len(weights) == len(keys),
                f"{prefix}.gdpo_reward_weights",
                f"must be {len(keys)} finite number(s), one per gdpo_reward_keys entry, got {weights}",
            )
