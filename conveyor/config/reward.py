"""The `reward` and `reward_model` sections: how responses are scored, and DAPO's overlong shaping.

It deliberately loads no reward function: `conveyor.tasks` and the reward
worker do, from `reward.custom_reward_function` or the registry by data_source.
"""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.config.fields import F, S, check
from conveyor.config.sandbox import SandboxConfig

__all__ = ["CustomRewardFunctionConfig", "RewardConfig", "OverlongBufferConfig", "RewardModelConfig"]


@dataclass
class CustomRewardFunctionConfig:
    """A reward function of the user's, loaded from a Python file (verl's custom_reward_function)."""

    path: str | None = F(None, "Python file defining the function; null = the reward registry by data_source")
    name: str = F(
        "compute_score",
        "the function in that file: fn(data_source, solution_str, ground_truth, "
        "extra_info=None) -> float, used for every sample",
    )

    def validate(self, prefix: str) -> None:
        """The function's name is a Python identifier."""
        check(
            bool(self.name) and self.name.isidentifier(),
            f"{prefix}.name",
            f"must be a Python function name, got {self.name!r}",
        )


@dataclass
class RewardConfig:
    """How responses are scored."""

    custom_reward_function: CustomRewardFunctionConfig = S(CustomRewardFunctionConfig, "a reward function from a file")
    timeout_s: float = F(
        30.0,
        "seconds one call of a reward function may take; a call that takes longer stops the "
        "run with an error naming the function (0 = no limit)",
        ge=0,
        hint="0 = no limit",
    )
    sandbox: SandboxConfig = S(SandboxConfig, "the sandbox that runs programs for code-execution rewards")


@dataclass
class OverlongBufferConfig:
    """DAPO's soft overlong punishment (verl's reward_model.overlong_buffer keys)."""

    enable: bool = F(False, "penalise responses longer than data.max_response_length - len")
    len: int | None = F(
        None,
        "tokens before data.max_response_length where the penalty starts; null = a "
        "quarter of data.max_response_length (at least 1)",
        gt=0,
        hint="turn it off with reward_model.overlong_buffer.enable=false",
    )
    penalty_factor: float = F(
        1.0, "penalty at data.max_response_length; it grows linearly from 0 over the buffer", ge=0
    )
    log: bool = F(True, "log reward/overlong_reward_mean and reward/overlong_frac")


@dataclass
class RewardModelConfig:
    """Reward shaping under verl's reward_model keys (the scoring itself is configured under reward)."""

    overlong_buffer: OverlongBufferConfig = S(OverlongBufferConfig, "overlong reward shaping (DAPO)")
