"""Every setting of a run, as dataclasses: the one source of truth for names, defaults and checks.

Paths follow verl's where the concept is shared (`data.train_batch_size`,
`actor_rollout_ref.rollout.n`, `algorithm.adv_estimator`, ...), so its users
feel at home. A config is the defaults, then an optional YAML file, then dotted
command-line overrides, merged and type-checked by OmegaConf; building the
`Config` then checks every section once (`fields.check_tree`). Every user
mistake is a `ConfigError` (a `ValueError`) of one line that names the key and
says what to change.

Where things live:

- `fields`: `F` and `S` (how a setting is declared: help, range, choices,
  whether a resume may change it), `ConfigError`, and the one place checks run;
- one schema module per section: `data`, `model`, `actor` (with optim, FSDP,
  router replay, policy loss, ref), `rollout`, `critic`, `algorithm`, `reward`
  (with reward_model), `trainer`, `data_plane` (transfer_queue), `ray`;
- `root`: `Config`, its cross-section checks and derived settings;
- `loader`: YAML, overrides, OmegaConf, error messages, and the YAML dump.

A setting that names an algorithm, a tracker or a backend is checked against
the registry of the code that implements it, read when checked, so a function
registered with `register_adv_estimator` or `register_policy_loss`, e.g. in a
`trainer.plugins` file, is selectable by name at once, and importing the
config imports none of that code. There is deliberately no YAML copy of the
defaults: `conveyor config` prints them from here.
"""

from conveyor.config.actor import ActorConfig, FSDPConfig, OptimConfig, PolicyLossConfig, RefConfig, RouterReplayConfig
from conveyor.config.algorithm import (
    FILTER_GROUPS_METRICS,
    AlgorithmConfig,
    FilterGroupsConfig,
    KLControlConfig,
    RolloutCorrectionConfig,
)
from conveyor.config.critic import CriticConfig
from conveyor.config.data import DataConfig, SyntheticTaskConfig
from conveyor.config.data_plane import TransferQueueConfig
from conveyor.config.fields import ConfigError, F, S, field_paths, registry, resume_neutral_keys
from conveyor.config.loader import REMOVED_KEYS, config_to_dict, config_to_yaml, load_config, parse_overrides
from conveyor.config.model import ModelConfig, TinyModelConfig
from conveyor.config.ray import RayConfig
from conveyor.config.reward import CustomRewardFunctionConfig, OverlongBufferConfig, RewardConfig, RewardModelConfig
from conveyor.config.rollout import TRUNCATE_SIDES, MultiTurnConfig, RolloutConfig, ValKwargs
from conveyor.config.root import ActorRolloutRefConfig, Config
from conveyor.config.trainer import (
    OFF_POLICY_STRATEGIES,
    TRAINER_MODES,
    MetricsEndpointConfig,
    SamplerConfig,
    SeparateAsyncConfig,
    TrainerConfig,
    TrainerV1Config,
)

__all__ = [
    "Config",
    "ConfigError",
    "load_config",
    "parse_overrides",
    "config_to_dict",
    "config_to_yaml",
    "REMOVED_KEYS",
    "F",
    "S",
    "registry",
    "field_paths",
    "resume_neutral_keys",
    "ActorRolloutRefConfig",
    "DataConfig",
    "SyntheticTaskConfig",
    "ModelConfig",
    "TinyModelConfig",
    "ActorConfig",
    "OptimConfig",
    "FSDPConfig",
    "RouterReplayConfig",
    "PolicyLossConfig",
    "RefConfig",
    "RolloutConfig",
    "ValKwargs",
    "MultiTurnConfig",
    "CriticConfig",
    "AlgorithmConfig",
    "KLControlConfig",
    "RolloutCorrectionConfig",
    "FilterGroupsConfig",
    "RewardConfig",
    "CustomRewardFunctionConfig",
    "RewardModelConfig",
    "OverlongBufferConfig",
    "TrainerConfig",
    "TrainerV1Config",
    "SamplerConfig",
    "SeparateAsyncConfig",
    "MetricsEndpointConfig",
    "TransferQueueConfig",
    "RayConfig",
    "TRAINER_MODES",
    "OFF_POLICY_STRATEGIES",
    "FILTER_GROUPS_METRICS",
    "TRUNCATE_SIDES",
]
