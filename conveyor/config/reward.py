"""The `reward` and `reward_model` sections: how responses are scored, a reward model, and DAPO's overlong shaping.

It deliberately loads no reward function or model: `conveyor.tasks` and the
reward workers do, from `reward.custom_reward_function`, the registry by
data_source, or `reward_model.model.path`.
"""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.config.actor import STRATEGY_CHOICES, FSDPConfig
from conveyor.config.fields import F, S, check
from conveyor.config.judge import JudgeConfig
from conveyor.config.model import DTYPES
from conveyor.config.sandbox import SandboxConfig

__all__ = [
    "CustomRewardFunctionConfig",
    "RewardConfig",
    "OverlongBufferConfig",
    "RewardModelModelConfig",
    "RewardModelConfig",
    "REWARD_MODEL_HEADS",
    "REWARD_MODEL_PLACEMENTS",
]

#: How a reward model's checkpoint scores a sequence: its config's architecture decides (auto), a
#: sequence-classification head, or a causal LM with a `value_head.safetensors` beside it.
REWARD_MODEL_HEADS = ("auto", "sequence_classification", "value_head")
#: Where its ranks run: in the actor's processes, or in worker processes of their own (Ray).
REWARD_MODEL_PLACEMENTS = ("colocated", "separate")


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
class RewardModelModelConfig:
    """The reward model's checkpoint (verl's reward_model.model keys)."""

    path: str | None = F(
        None, "a local Hugging Face checkpoint directory (sequence classification, or a causal LM with a value head)"
    )
    tokenizer_path: str | None = F(
        None,
        "directory of the reward model's tokenizer; null = reward_model.model.path's own. When it differs from "
        "the policy's (vocabulary or chat template) each response is decoded and re-tokenized",
    )
    external_lib: str | None = F(
        None, "a Python module imported before loading (one that registers a custom model class), as verl's key"
    )
    trust_remote_code: bool = F(False, "run code shipped in the checkpoint's directory")
    dtype: str = F("float32", "dtype the reward model is loaded and run in", choices=DTYPES)
    head: str = F(
        "auto",
        "auto (from config.json's architectures), sequence_classification, or value_head (a causal LM plus "
        "value_head.safetensors)",
        choices=REWARD_MODEL_HEADS,
    )


@dataclass
class RewardModelConfig:
    """A reward model scoring every response (verl's reward_model keys), and reward shaping."""

    enable: bool = F(False, "score every response with the reward model at reward_model.model.path")
    model: RewardModelModelConfig = S(RewardModelModelConfig, "the reward model's checkpoint and tokenizer")
    micro_batch_size_per_gpu: int = F(16, "sequences per reward-model forward", gt=0, resume_neutral=True)
    use_dynamic_bsz: bool = F(
        False,
        "fill each forward up to forward_max_token_len_per_gpu tokens instead of micro_batch_size_per_gpu sequences",
        resume_neutral=True,
    )
    forward_max_token_len_per_gpu: int = F(
        32768, "use_dynamic_bsz: most tokens per reward-model forward", gt=0, resume_neutral=True
    )
    max_length: int | None = F(
        None,
        "most tokens of one scored sequence (the reward model's own tokens); a longer one keeps its last "
        "max_length tokens (counted in reward/model_truncated_frac); null = no limit",
        gt=0,
        hint="null = no limit",
    )
    strategy: str | None = F(
        None,
        "fsdp2, dp or none (as actor_rollout_ref.actor.strategy); null = fsdp2 with more than one rank",
        choices=STRATEGY_CHOICES,
        resume_neutral=True,
    )
    fsdp_config: FSDPConfig = S(FSDPConfig, "FSDP2 settings (param_offload keeps the shards on the host between calls)")
    placement: str = F(
        "colocated",
        "colocated: rank i in the actor's rank-i process; separate: ranks of their own (Ray), "
        "reward_model.num_workers of them",
        choices=REWARD_MODEL_PLACEMENTS,
        resume_neutral=True,
    )
    num_workers: int = F(
        1, "placement=separate on Ray: the reward model's ranks (a GPU each on a GPU run)", gt=0, resume_neutral=True
    )
    model_weight: float = F(
        1.0,
        "the reward: model_weight x the model's score + rule_weight x the rule reward (reward_model.enable)",
        ge=0,
    )
    rule_weight: float = F(
        0.0,
        "weight of the rule reward (reward function, overlong shaping, tool rewards) in the sum; 0 = the model's "
        "score alone, as in verl",
        ge=0,
    )
    judge: JudgeConfig = S(JudgeConfig, "a generative judge (LLM-as-a-judge) scoring every response")
    overlong_buffer: OverlongBufferConfig = S(OverlongBufferConfig, "overlong reward shaping (DAPO)")

    def validate(self, prefix: str) -> None:
        """An enabled reward model names its checkpoint."""
        check(
            not self.enable or self.model.path is not None,
            f"{prefix}.model.path",
            "reward_model.enable=true needs the reward model's checkpoint directory; set reward_model.model.path "
            "(or reward_model.enable=false)",
        )
