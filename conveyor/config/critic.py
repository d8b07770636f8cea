"""The `critic` section: the value model used by GAE (and by any estimator that needs values).

It deliberately does not decide whether a critic runs: the root config's
`use_critic` reads `critic.enable` and the estimator's registry.
"""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.config.actor import LOSS_AGG_CHOICES, STRATEGY_CHOICES, FSDPConfig, OptimConfig
from conveyor.config.fields import F, S
from conveyor.config.parallel import ulysses_size_field

__all__ = ["CriticConfig"]


@dataclass
class CriticConfig:
    """The value model (used by GAE)."""

    enable: bool | None = F(None, "null = on exactly when the advantage estimator needs values")
    optim: OptimConfig = S(OptimConfig, "optimizer")
    ppo_mini_batch_size: int = F(32, "prompts per critic optimizer step", gt=0)
    ppo_micro_batch_size_per_gpu: int = F(
        256, "sequences per forward/backward (lower it for big models)", gt=0, resume_neutral=True
    )
    use_dynamic_bsz: bool | None = F(
        None,
        "fill each micro-batch up to a number of real tokens (prompt + "
        "response) instead of ppo_micro_batch_size_per_gpu sequences; null = "
        "actor_rollout_ref.actor.use_dynamic_bsz",
        resume_neutral=True,
    )
    ppo_max_token_len_per_gpu: int = F(
        32768, "use_dynamic_bsz: most real tokens per forward/backward of the update", gt=0, resume_neutral=True
    )
    forward_max_token_len_per_gpu: int | None = F(
        None,
        "use_dynamic_bsz: most real tokens per values forward; null = ppo_max_token_len_per_gpu",
        gt=0,
        resume_neutral=True,
    )
    ppo_epochs: int = F(1, "passes over the batch per step", gt=0)
    cliprange_value: float = F(0.5, "value clip range", gt=0)
    loss_agg_mode: str = F("token-mean", "how token losses become one number", choices=LOSS_AGG_CHOICES)
    loss_scale_factor: float | None = F(
        None,
        "seq-mean-token-sum-norm: the divisor of each sequence's token "
        "sum; null = actor_rollout_ref.actor.loss_scale_factor",
        gt=0,
    )
    grad_clip: float = F(1.0, "gradient norm clip", gt=0)
    strategy: str | None = F(
        None,
        "fsdp2, dp or none (as actor_rollout_ref.actor.strategy); null = fsdp2 with more than one rank",
        choices=STRATEGY_CHOICES,
        resume_neutral=True,
    )
    fsdp_config: FSDPConfig = S(FSDPConfig, "FSDP2 settings")
    ulysses_sequence_parallel_size: int = ulysses_size_field()
