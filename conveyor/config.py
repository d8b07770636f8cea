"""Every setting of a run, as dataclasses: the one source of truth for names, defaults and checks.

Paths follow verl's where the concept is shared (`data.train_batch_size`,
`actor_rollout_ref.rollout.n`, `algorithm.adv_estimator`, ...), so its users
feel at home. A config is the defaults, then an optional YAML file, then dotted
command-line overrides, merged and type-checked by OmegaConf (structured configs
over these dataclasses, `${...}` interpolation included); each section then
checks its values in `__post_init__`. Every user mistake is a `ConfigError` (a
`ValueError`) of one line that names the key and says what to change.

A setting that names an algorithm, a tracker or a backend is checked against
the registry of the code that implements it (the field's `choices`), so a
function registered with `register_adv_estimator` or `register_policy_loss`,
e.g. in a `trainer.plugins` file, is selectable by name at once.

There is deliberately no YAML copy of the defaults: `conveyor config` prints
them from here.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Union

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, InterpolationResolutionError, OmegaConfBaseException, ValidationError

from conveyor.algos.advantages import ADV_ESTIMATORS, NEEDS_CRITIC
from conveyor.algos.correction import parse_is_threshold, parse_rejection
from conveyor.algos.kl import KL_KINDS
from conveyor.algos.losses import LOSS_AGG_MODES, POLICY_LOSSES
from conveyor.data_plane import BACKENDS
from conveyor.metrics.trackers import TRACKERS
from conveyor.plugins import load_plugins
from conveyor.tasks.dataset import TRUNCATION_MODES
from conveyor.workers.strategy import STRATEGIES

__all__ = [
    "Config",
    "ConfigError",
    "load_config",
    "parse_overrides",
    "config_to_dict",
    "config_to_yaml",
    "REMOVED_KEYS",
]


class ConfigError(ValueError):
    """A user mistake in the configuration; the message names the key and the fix."""


def F(default: Any, help: str, choices: Callable[[], Iterable[str]] | None = None) -> Any:  # noqa: A002
    """A dataclass field with its one-line documentation and, for a name, where its valid choices live.

    `choices` returns the registry (or tuple) of the code that implements the
    choices, read when a config is checked or described, so a function
    registered at run time (e.g. from `trainer.plugins`) is valid at once.
    """
    meta = {"help": help, "choices": choices}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


def S(cls: type, help: str) -> Any:
    """A nested section field."""
    return field(default_factory=cls, metadata={"help": help})


def _check(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{key}: {msg}")


def _check_choices(section: Any, prefix: str) -> None:
    """Every field of `section` declared with `choices` names one of them (each entry, for a list)."""
    for f in dataclasses.fields(section):
        choices = f.metadata.get("choices")
        if choices is None:
            continue
        value = getattr(section, f.name)
        valid = list(choices())
        for v in value if isinstance(value, list) else [value]:
            if v is not None and v not in valid:  # null, where a key allows it, means "the default choice"
                near = difflib.get_close_matches(str(v), [str(c) for c in valid], n=1)
                hint = f" (did you mean {near[0]!r}?)" if near else ""
                raise ConfigError(f"{prefix}.{f.name}: unknown {v!r}{hint}; valid: {valid}")


# Keys that existed once and were renamed: using one is an error that names the new key.
REMOVED_KEYS: dict[str, str] = {
    "moe_load_balance_monitor_interval": (
        "the engine-level key 'moe_load_balance_monitor_interval' was removed; "
        "use actor_rollout_ref.rollout.moe_load_balance_metrics_interval"
    ),
}


# --------------------------------------------------------------------------- data
@dataclass
class SyntheticTaskConfig:
    """The built-in arithmetic task used when no data files are given."""

    num_train: int = F(8000, "number of training problems generated (at most the train split holds)")
    num_val: int = F(128, "number of held-out problems (never in the training set)")
    max_operand: int = F(99, "largest operand")
    ops: list = F(["+"], "operators to draw from: any of +, -, *")
    task: str = F("arithmetic", "arithmetic, or arithmetic_tool (n-digit operands, a calculator to call; see "
                  "docs/agent.md)", choices=lambda: _synthetic_tasks())

    def __post_init__(self) -> None:
        _check_choices(self, "data.synthetic")
        _check(self.num_train > 0, "data.synthetic.num_train", "must be > 0")
        _check(self.num_val > 0, "data.synthetic.num_val", "must be > 0")
        _check(self.max_operand >= 1, "data.synthetic.max_operand", "must be >= 1")
        bad = [o for o in self.ops if o not in ("+", "-", "*")]
        _check(not bad and bool(self.ops), "data.synthetic.ops", f"must be a non-empty list of +, -, *; got {self.ops}")


def _synthetic_tasks() -> Iterable[str]:
    from conveyor.tasks import SYNTHETIC_TASKS

    return SYNTHETIC_TASKS


@dataclass
class DataConfig:
    """Where prompts come from and how they are shaped."""

    train_files: Optional[list] = F(None, "verl-style parquet files of training prompts; null = the synthetic task")
    val_files: Optional[list] = F(None, "parquet files of held-out prompts; null = the synthetic task's test split")
    train_batch_size: int = F(32, "prompts per step (each sampled actor_rollout_ref.rollout.n times)")
    val_batch_size: Optional[int] = F(None, "held-out prompts used per validation; null = all")
    max_prompt_length: int = F(64, "longest prompt in tokens")
    max_response_length: int = F(6, "most tokens generated per response")
    truncation: str = F("error", "what to do with a prompt longer than max_prompt_length (error, or cut at the "
                        "left or right)", choices=lambda: TRUNCATION_MODES)
    shuffle: bool = F(True, "shuffle training prompts each epoch")
    seed: int = F(1, "seed of the prompt order and of the synthetic task")
    synthetic: SyntheticTaskConfig = S(SyntheticTaskConfig, "the built-in task")

    def __post_init__(self) -> None:
        _check(self.train_batch_size > 0, "data.train_batch_size", "must be > 0")
        _check(self.max_prompt_length > 0, "data.max_prompt_length", "must be > 0")
        _check(self.max_response_length > 0, "data.max_response_length", "must be > 0")
        _check_choices(self, "data")
        _check(self.val_batch_size is None or self.val_batch_size > 0, "data.val_batch_size", "must be > 0 or null")
        for key in ("train_files", "val_files"):
            files = getattr(self, key)
            if files is None:
                continue
            _check(bool(files), f"data.{key}", "is an empty list; give parquet files, or null for the synthetic task")
            bad = [f for f in files if not isinstance(f, str) or not f.strip()]
            _check(not bad, f"data.{key}", f"{bad[0] if bad else ''!r} is not a file path; give a list of parquet "
                   "file paths")


# --------------------------------------------------------------------------- model
@dataclass
class TinyModelConfig:
    """The tiny model built from config when actor_rollout_ref.model.path is null."""

    arch: str = F("qwen3_moe", "qwen3_moe, qwen3 (dense), mixtral or olmoe")
    hidden_size: int = F(64, "hidden size")
    num_layers: int = F(2, "decoder layers")
    num_heads: int = F(4, "attention heads")
    num_kv_heads: int = F(2, "key/value heads")
    intermediate_size: int = F(128, "MLP width (dense layers; expert width for MoE)")
    num_experts: int = F(8, "experts per MoE layer")
    top_k: int = F(2, "experts chosen per token")
    warmstart_steps: int = F(3000, "most supervised steps on the task format before RL (0 = start from random init)")
    warmstart_lr: float = F(3e-3, "learning rate of the warm start")
    warmstart_until_accuracy: float = F(
        0.3, "stop the warm start early once greedy exact match on its last 20 training batches reaches this "
        "(0 = run all warmstart_steps): the same starting point for RL on every machine")
    seed: int = F(0, "initialisation seed")

    def __post_init__(self) -> None:
        archs = ("qwen3_moe", "qwen3", "mixtral", "olmoe")
        _check(self.arch in archs, "actor_rollout_ref.model.tiny.arch", f"must be one of {list(archs)}")
        for k in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "num_experts", "top_k"):
            _check(getattr(self, k) > 0, f"actor_rollout_ref.model.tiny.{k}", "must be > 0")
        _check(self.top_k <= self.num_experts, "actor_rollout_ref.model.tiny.top_k", "must be <= num_experts")
        _check(self.warmstart_steps >= 0, "actor_rollout_ref.model.tiny.warmstart_steps", "must be >= 0")
        _check(self.warmstart_lr > 0, "actor_rollout_ref.model.tiny.warmstart_lr", f"must be > 0, got {self.warmstart_lr}")
        _check(0 <= self.warmstart_until_accuracy <= 1, "actor_rollout_ref.model.tiny.warmstart_until_accuracy",
               f"must be in [0, 1] (0 = run all warmstart_steps), got {self.warmstart_until_accuracy}")
        # The attention splits hidden_size into num_heads heads of an even width (rotary
        # embeddings rotate pairs), and each key/value head serves a whole group of heads.
        head_dim = self.hidden_size // self.num_heads
        _check(head_dim >= 2 and head_dim % 2 == 0, "actor_rollout_ref.model.tiny.hidden_size",
               f"hidden_size // num_heads must be an even number >= 2, got {self.hidden_size} // {self.num_heads}")
        _check(self.num_heads % self.num_kv_heads == 0, "actor_rollout_ref.model.tiny.num_kv_heads",
               f"num_heads={self.num_heads} must be a multiple of it (got {self.num_kv_heads})")


@dataclass
class ModelConfig:
    """The policy model."""

    path: Optional[str] = F(None, "local Hugging Face checkpoint directory; null = build the tiny model")
    tokenizer_path: Optional[str] = F(None, "tokenizer directory if not the model's")
    trust_remote_code: bool = F(False, "run the Python code a checkpoint ships (the auto_map of its config.json or "
                                "tokenizer_config.json) to build its model and tokenizer: only for checkpoints you trust")
    dtype: str = F("float32", "parameter dtype: float32 or bfloat16")
    forward_impl: str = F(
        "auto",
        "auto, lean or hf: lean computes each group's shared prompt once (Qwen3 and Qwen3-MoE); "
        "auto uses it where the model allows and the Hugging Face forward elsewhere",
    )
    enable_gradient_checkpointing: bool = F(
        False, "recompute activations in the backward instead of keeping them (actor and critic): less memory, "
        "about a third more compute")
    tiny: TinyModelConfig = S(TinyModelConfig, "the built-in tiny model")

    def __post_init__(self) -> None:
        _check(self.dtype in ("float32", "bfloat16", "float16"), "actor_rollout_ref.model.dtype",
               "must be float32, bfloat16 or float16")
        _check(self.forward_impl in ("auto", "lean", "hf"), "actor_rollout_ref.model.forward_impl",
               "must be auto, lean or hf")


@dataclass
class OptimConfig:
    """AdamW and its schedule."""

    lr: float = F(6e-4, "learning rate (the default suits the tiny model; real models want 1e-6 to 1e-5)")
    weight_decay: float = F(0.0, "AdamW weight decay")
    betas: list = F([0.9, 0.99], "AdamW betas")
    lr_warmup_steps: int = F(0, "linear warm-up steps")
    lr_scheduler: str = F("cosine", "constant or cosine (after warm-up)")
    min_lr_ratio: float = F(0.2, "cosine floor as a fraction of lr")

    def _validate(self, prefix: str) -> None:
        _check(self.lr > 0, f"{prefix}.lr", f"must be > 0, got {self.lr}")
        _check(self.weight_decay >= 0, f"{prefix}.weight_decay", "must be >= 0")
        _check(len(self.betas) == 2 and all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1
                                            for b in self.betas), f"{prefix}.betas",
               f"must be two numbers in [0, 1), got {self.betas}")
        _check(self.lr_warmup_steps >= 0, f"{prefix}.lr_warmup_steps", "must be >= 0")
        _check(self.lr_scheduler in ("constant", "cosine"), f"{prefix}.lr_scheduler", "must be constant or cosine")
        _check(0 <= self.min_lr_ratio <= 1, f"{prefix}.min_lr_ratio", "must be in [0, 1]")


@dataclass
class FSDPConfig:
    """FSDP2 settings of a role (verl's fsdp_config keys); used when the role's strategy is fsdp2."""

    param_dtype: Optional[str] = F(None, "dtype parameters are gathered and computed in (mixed precision); null = "
                                   "the model's dtype", choices=lambda: ("float32", "bfloat16", "float16"))
    reduce_dtype: Optional[str] = F(None, "dtype gradients are reduce-scattered in; null = the parameters' dtype",
                                    choices=lambda: ("float32", "bfloat16", "float16"))
    param_offload: bool = F(False, "keep parameter shards (and gradients) in host memory between uses, on a GPU "
                                   "run (no effect on a CPU run)")
    optimizer_offload: bool = F(False, "keep optimizer state in host memory except during its step, on a GPU run "
                                       "(no effect on a CPU run)")

    def _validate(self, prefix: str) -> None:
        _check_choices(self, prefix)


@dataclass
class RouterReplayConfig:
    """Routing replay for MoE models."""

    mode: str = F("disabled", "disabled; R3: training forwards use the experts recorded at rollout; R2: the "
                  "updates use the experts of the old-log-prob forward (any rollout engine)")

    def __post_init__(self) -> None:
        _check(self.mode in ("disabled", "R2", "R3"), "actor_rollout_ref.actor.router_replay.mode",
               f"must be disabled, R2 or R3, got {self.mode!r}")


@dataclass
class PolicyLossConfig:
    """Which policy loss."""

    loss_mode: str = F("vanilla", "policy loss from the registry (vanilla = PPO clip with dual clip; add one with "
                       "conveyor.algos.register_policy_loss)", choices=lambda: POLICY_LOSSES)
    clip_cov_ratio: float = F(0.0002, "clip_cov: share of tokens whose gradient is switched off")
    clip_cov_lb: float = F(1.0, "clip_cov: lower bound of the covariance of a token that may be switched off")
    clip_cov_ub: float = F(5.0, "clip_cov: upper bound of that covariance")
    kl_cov_ratio: float = F(0.0002, "kl_cov: share of tokens (highest covariance) given the KL penalty")
    ppo_kl_coef: float = F(0.1, "kl_cov: coefficient of that |log ratio| penalty")

    def __post_init__(self) -> None:
        p = "actor_rollout_ref.actor.policy_loss"
        _check_choices(self, p)
        for k in ("clip_cov_ratio", "kl_cov_ratio"):
            v = getattr(self, k)
            _check(0 < v <= 1, f"{p}.{k}", f"must be in (0, 1], got {v}")
        _check(self.clip_cov_lb < self.clip_cov_ub, f"{p}.clip_cov_lb",
               f"must be below clip_cov_ub, got {self.clip_cov_lb} >= {self.clip_cov_ub}")
        _check(self.ppo_kl_coef >= 0, f"{p}.ppo_kl_coef", f"must be >= 0, got {self.ppo_kl_coef}")

    def loss_kwargs(self) -> dict[str, float]:
        """The hyperparameters handed to the policy loss (each loss takes the ones it declares)."""
        return {k: getattr(self, k) for k in ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio",
                                              "ppo_kl_coef")}


@dataclass
class ActorConfig:
    """The policy update."""

    optim: OptimConfig = S(OptimConfig, "optimizer")
    ppo_mini_batch_size: int = F(32, "prompts per optimizer step (times rollout.n sequences)")
    ppo_micro_batch_size_per_gpu: int = F(256, "sequences per forward/backward (gradient accumulation; lower it for big models)")
    ppo_epochs: int = F(1, "passes over the batch per step")
    shuffle: bool = F(True, "shuffle sequences into mini-batches")
    clip_ratio: float = F(0.2, "PPO clip range (both sides unless clip_ratio_low/high are set)")
    clip_ratio_low: Optional[float] = F(None, "lower clip range; null = clip_ratio")
    clip_ratio_high: Optional[float] = F(None, "upper clip range; null = clip_ratio")
    clip_ratio_c: float = F(3.0, "dual-clip bound for negative advantages (> 1)")
    loss_agg_mode: str = F("token-mean", "how token losses become one number", choices=lambda: LOSS_AGG_MODES)
    loss_scale_factor: Optional[float] = F(None, "seq-mean-token-sum-norm: the constant every sequence's token sum "
                                           "is divided by; null = data.max_response_length")
    tau_pos: float = F(1.0, "sapo: temperature of the soft gate for positive advantages")
    tau_neg: float = F(1.05, "sapo: temperature of the soft gate for negative advantages")
    entropy_coeff: float = F(0.0, "entropy bonus coefficient")
    use_kl_loss: bool = F(False, "add a KL(policy || reference) loss term")
    kl_loss_coef: float = F(0.001, "KL loss coefficient")
    kl_loss_type: str = F("low_var_kl", "KL estimator of the loss term", choices=lambda: KL_KINDS)
    grad_clip: float = F(1.0, "gradient norm clip")
    policy_loss: PolicyLossConfig = S(PolicyLossConfig, "policy loss")
    router_replay: RouterReplayConfig = S(RouterReplayConfig, "MoE routing replay")
    strategy: Optional[str] = F(None, "how ranks hold the model: fsdp2 (sharded), dp (replicas, DDP) or none (one "
                                "rank); null = fsdp2 with more than one rank", choices=lambda: STRATEGIES)
    fsdp_config: FSDPConfig = S(FSDPConfig, "FSDP2 settings")

    def __post_init__(self) -> None:
        p = "actor_rollout_ref.actor"
        self.optim._validate(f"{p}.optim")
        self.fsdp_config._validate(f"{p}.fsdp_config")
        _check(self.ppo_mini_batch_size > 0, f"{p}.ppo_mini_batch_size", "must be > 0")
        _check(self.ppo_micro_batch_size_per_gpu > 0, f"{p}.ppo_micro_batch_size_per_gpu", "must be > 0")
        _check(self.ppo_epochs > 0, f"{p}.ppo_epochs", "must be > 0")
        _check(self.clip_ratio > 0, f"{p}.clip_ratio", f"must be > 0, got {self.clip_ratio}")
        for k in ("clip_ratio_low", "clip_ratio_high"):
            v = getattr(self, k)
            _check(v is None or v > 0, f"{p}.{k}", f"must be > 0, got {v}")
        _check(self.clip_ratio_c > 1, f"{p}.clip_ratio_c", f"must be > 1, got {self.clip_ratio_c}")
        _check_choices(self, p)
        _check(self.grad_clip > 0, f"{p}.grad_clip", "must be > 0")
        _check(self.kl_loss_coef >= 0, f"{p}.kl_loss_coef", "must be >= 0")
        _check(self.loss_scale_factor is None or self.loss_scale_factor > 0, f"{p}.loss_scale_factor",
               f"must be > 0 or null, got {self.loss_scale_factor}")
        for k in ("tau_pos", "tau_neg"):
            _check(getattr(self, k) > 0, f"{p}.{k}", f"must be > 0, got {getattr(self, k)}")


@dataclass
class RefConfig:
    """The frozen reference policy (used when a KL term is on)."""

    log_prob_micro_batch_size_per_gpu: int = F(256, "sequences per reference forward")
    strategy: Optional[str] = F(None, "fsdp2 (sharded parameters, no optimizer), dp or none; null = fsdp2 with "
                                "more than one rank", choices=lambda: STRATEGIES)
    fsdp_config: FSDPConfig = S(FSDPConfig, "FSDP2 settings")

    def __post_init__(self) -> None:
        _check(self.log_prob_micro_batch_size_per_gpu > 0, "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
               "must be > 0")
        _check_choices(self, "actor_rollout_ref.ref")
        self.fsdp_config._validate("actor_rollout_ref.ref.fsdp_config")


@dataclass
class ValKwargs:
    """Sampling for validation."""

    temperature: float = F(0.0, "0 = greedy")
    top_p: float = F(1.0, "nucleus sampling")
    top_k: int = F(0, "top-k sampling (0 = off)")
    n: int = F(1, "samples per held-out prompt")
    do_sample: bool = F(False, "sample instead of greedy decoding")

    def __post_init__(self) -> None:
        p = "actor_rollout_ref.rollout.val_kwargs"
        _check(self.temperature >= 0, f"{p}.temperature", "must be >= 0 (0 = greedy)")
        _check(0 < self.top_p <= 1, f"{p}.top_p", "must be in (0, 1]")
        _check(self.top_k >= 0, f"{p}.top_k", "must be >= 0")
        _check(self.n > 0, f"{p}.n", "must be > 0")


TRUNCATE_SIDES = ("left", "middle", "right")


@dataclass
class MultiTurnConfig:
    """Multi-turn rollouts with tools (verl's actor_rollout_ref.rollout.multi_turn keys)."""

    enable: bool = F(False, "generate, call tools, append their responses and generate again, per sample")
    max_assistant_turns: Optional[int] = F(None, "most model turns per sample (null = until EOS or the response "
                                           "budget, data.max_response_length, is spent)")
    max_user_turns: Optional[int] = F(None, "most tool-response turns per sample (null = no limit)")
    max_tool_response_length: int = F(256, "characters of a tool's text kept (cut on tool_response_truncate_side)")
    tool_response_truncate_side: str = F("middle", "which part of a long tool response is cut: left, middle or "
                                         "right", choices=lambda: TRUNCATE_SIDES)
    format: str = F("hermes", "tool-call syntax: hermes (<tool_call>{json}</tool_call>) or hash (#name text; "
                    "writable with the tiny character tokenizer)", choices=lambda: _tool_formats())
    tool_config_path: Optional[str] = F(None, "YAML naming the tools by Python path (see docs/agent.md)")
    tool_timeout_s: float = F(30.0, "seconds one tool call may take; a slower call answers an error message")
    tool_workers: int = F(16, "tool calls run at once per rank (one thread each)")

    def __post_init__(self) -> None:
        p = "actor_rollout_ref.rollout.multi_turn"
        _check_choices(self, p)
        for k in ("max_assistant_turns", "max_user_turns"):
            v = getattr(self, k)
            _check(v is None or v > 0, f"{p}.{k}", f"must be > 0 or null (no limit), got {v}")
        _check(self.max_tool_response_length > 0, f"{p}.max_tool_response_length",
               f"must be > 0, got {self.max_tool_response_length}")
        _check(self.tool_timeout_s > 0, f"{p}.tool_timeout_s", f"must be > 0, got {self.tool_timeout_s}")
        _check(self.tool_workers > 0, f"{p}.tool_workers", f"must be > 0, got {self.tool_workers}")
        _check(not self.enable or bool(self.tool_config_path), f"{p}.tool_config_path",
               f"{p}.enable=true needs a tool YAML; give its path (see docs/agent.md) or set {p}.enable=false")


def _tool_formats() -> Iterable[str]:
    from conveyor.tools.formats import TOOL_CALL_FORMATS

    return TOOL_CALL_FORMATS


@dataclass
class RolloutConfig:
    """Generation."""

    name: str = F("hf", "rollout engine: hf (conveyor's decode loop over the Hugging Face model) or vllm (a vLLM "
                  "engine in the actor's process, fed the new weights after every update; docs/rollout.md)")
    n: int = F(8, "samples per prompt (the group size of GRPO/RLOO)")
    temperature: float = F(1.0, "sampling temperature")
    top_p: float = F(1.0, "nucleus sampling (1 = off)")
    top_k: int = F(0, "top-k sampling (0 = off)")
    do_sample: bool = F(True, "sample (false = greedy)")
    log_prob_micro_batch_size_per_gpu: int = F(256, "sequences per old-log-prob forward")
    moe_load_balance_metrics_interval: int = F(0, "log rollout/moe/* router load-balance metrics and save the "
                                               "per-expert load every N steps (0 = off; the default run, "
                                               "examples/tiny_cpu.yaml, uses 10)")
    gpu_memory_utilization: float = F(0.5, "vllm: the share of GPU memory the engine may take (weights and KV "
                                      "cache); on a CPU the KV cache is sized to max_num_seqs x max_model_len")
    tensor_model_parallel_size: int = F(1, "vllm: GPUs one engine shards the model over")
    max_num_seqs: int = F(256, "vllm: most sequences the engine decodes at once")
    max_model_len: Optional[int] = F(None, "vllm: longest sequence the engine holds; null = data.max_prompt_length "
                                     "+ data.max_response_length")
    enforce_eager: bool = F(True, "vllm: no CUDA graphs (they take memory and start-up time, and weights change "
                            "every step)")
    free_cache_engine: bool = F(True, "vllm: release the engine's KV cache between rollouts so the update can use "
                                "the memory (vLLM's sleep mode; GPU only, ignored on a CPU)")
    val_kwargs: ValKwargs = S(ValKwargs, "validation sampling")
    multi_turn: MultiTurnConfig = S(MultiTurnConfig, "multi-turn rollouts with tools")

    def __post_init__(self) -> None:
        p = "actor_rollout_ref.rollout"
        _check(self.name in ("hf", "vllm"), f"{p}.name", f"must be hf or vllm, got {self.name!r}")
        _check(0 < self.gpu_memory_utilization <= 1, f"{p}.gpu_memory_utilization", "must be in (0, 1]")
        _check(self.tensor_model_parallel_size > 0, f"{p}.tensor_model_parallel_size", "must be > 0")
        _check(self.max_num_seqs > 0, f"{p}.max_num_seqs", "must be > 0")
        _check(self.max_model_len is None or self.max_model_len > 0, f"{p}.max_model_len", "must be > 0 or null")
        _check(not (self.name == "vllm" and self.multi_turn.enable), f"{p}.multi_turn.enable",
               "multi-turn rollouts with tools run on the hf rollout: set actor_rollout_ref.rollout.name=hf")
        _check(self.n > 0, f"{p}.n", "must be > 0")
        _check(self.temperature > 0, f"{p}.temperature", "must be > 0 (use do_sample=false for greedy)")
        _check(0 < self.top_p <= 1, f"{p}.top_p", "must be in (0, 1]")
        _check(self.top_k >= 0, f"{p}.top_k", "must be >= 0")
        _check(self.log_prob_micro_batch_size_per_gpu > 0, f"{p}.log_prob_micro_batch_size_per_gpu", "must be > 0")
        _check(self.moe_load_balance_metrics_interval >= 0, f"{p}.moe_load_balance_metrics_interval", "must be >= 0")


@dataclass
class ActorRolloutRefConfig:
    """Policy, rollout and reference: one model, three roles."""

    model: ModelConfig = S(ModelConfig, "model")
    actor: ActorConfig = S(ActorConfig, "actor")
    ref: RefConfig = S(RefConfig, "reference")
    rollout: RolloutConfig = S(RolloutConfig, "rollout")


@dataclass
class CriticConfig:
    """The value model (used by GAE)."""

    enable: Optional[bool] = F(None, "null = on exactly when the advantage estimator needs values")
    optim: OptimConfig = S(OptimConfig, "optimizer")
    ppo_mini_batch_size: int = F(32, "prompts per critic optimizer step")
    ppo_micro_batch_size_per_gpu: int = F(256, "sequences per forward/backward (lower it for big models)")
    ppo_epochs: int = F(1, "passes over the batch per step")
    cliprange_value: float = F(0.5, "value clip range")
    loss_agg_mode: str = F("token-mean", "how token losses become one number", choices=lambda: LOSS_AGG_MODES)
    loss_scale_factor: Optional[float] = F(None, "seq-mean-token-sum-norm: the divisor of each sequence's token "
                                           "sum; null = actor_rollout_ref.actor.loss_scale_factor")
    grad_clip: float = F(1.0, "gradient norm clip")
    strategy: Optional[str] = F(None, "fsdp2, dp or none (as actor_rollout_ref.actor.strategy); null = fsdp2 with "
                                "more than one rank", choices=lambda: STRATEGIES)
    fsdp_config: FSDPConfig = S(FSDPConfig, "FSDP2 settings")

    def __post_init__(self) -> None:
        self.optim._validate("critic.optim")
        self.fsdp_config._validate("critic.fsdp_config")
        _check(self.ppo_mini_batch_size > 0, "critic.ppo_mini_batch_size", "must be > 0")
        _check(self.ppo_micro_batch_size_per_gpu > 0, "critic.ppo_micro_batch_size_per_gpu", "must be > 0")
        _check(self.ppo_epochs > 0, "critic.ppo_epochs", "must be > 0")
        _check(self.cliprange_value > 0, "critic.cliprange_value", "must be > 0")
        _check(self.grad_clip > 0, "critic.grad_clip", "must be > 0")
        _check(self.loss_scale_factor is None or self.loss_scale_factor > 0, "critic.loss_scale_factor",
               f"must be > 0 or null, got {self.loss_scale_factor}")
        _check_choices(self, "critic")


@dataclass
class KLControlConfig:
    """The in-reward KL coefficient."""

    type: str = F("fixed", "fixed or adaptive")
    kl_coef: float = F(0.001, "initial coefficient")
    target_kl: float = F(0.1, "adaptive: target KL")
    horizon: int = F(10000, "adaptive: horizon")

    def __post_init__(self) -> None:
        _check(self.type in ("fixed", "adaptive"), "algorithm.kl_ctrl.type", "must be fixed or adaptive")
        _check(self.kl_coef >= 0, "algorithm.kl_ctrl.kl_coef", "must be >= 0")
        _check(self.horizon > 0, "algorithm.kl_ctrl.horizon", "must be > 0")
        _check(self.target_kl > 0, "algorithm.kl_ctrl.target_kl", f"must be > 0, got {self.target_kl}")


@dataclass
class RolloutCorrectionConfig:
    """Correcting for the gap between sampler and trainer log-probs."""

    bypass_mode: Optional[bool] = F(
        None,
        "use the rollout's log-probs as old log-probs (no old-log-prob forward); null = on when the in-process hf "
        "rollout samples from the trainer's own weights and nothing needs the forward (rollout_is, rollout_rs, "
        "router_replay.mode=R2 turn it off)",
    )
    rollout_is: Optional[str] = F(None, "truncated importance weights: null, token or sequence")
    rollout_is_threshold: Any = F(2.0, "a number: truncate the importance weights there; 'lower_upper' (e.g. "
                                  "0.5_5.0): IcePop, weights outside [lower, upper] become 0")
    rollout_rs: Optional[str] = F(None, "rejection sampling: null, or comma-separated options (token_k1, token_k2, "
                                  "token_k3, seq_sum_k1..k3, seq_mean_k1..k3, seq_max_k2, seq_max_k3) that a token "
                                  "(token_*) or all of a sequence's tokens (seq_*) must pass to count in the loss")
    rollout_rs_threshold: Any = F(None, "bounds of rollout_rs: one for all options or one per option, "
                                  "comma-separated; k1 options take ratio bounds 'lower_upper', the others an "
                                  "upper bound")

    def __post_init__(self) -> None:
        p = "algorithm.rollout_correction"
        _check(self.rollout_is in (None, "token", "sequence"), f"{p}.rollout_is", "must be null, token or sequence")
        try:
            parse_is_threshold(self.rollout_is_threshold)
        except ValueError as err:
            raise ConfigError(f"{p}.rollout_is_threshold: {err}") from None
        if self.rollout_rs is not None:
            try:
                self.rejection()
            except ValueError as err:
                raise ConfigError(f"{p}.rollout_rs: {err}") from None

    def rejection(self) -> list[tuple[str, float | None, float]]:
        """The rejection-sampling options as (option, lower, upper), [] when rollout_rs is null."""
        return [] if self.rollout_rs is None else parse_rejection(self.rollout_rs, self.rollout_rs_threshold)

    def is_thresholds(self) -> tuple[float, float | None]:
        """(upper, lower) of the importance weights; lower is None unless IcePop's 'lower_upper' is set."""
        return parse_is_threshold(self.rollout_is_threshold)


# What filter_groups.metric may name: "reward" (verl's default; "score" and
# "seq_reward" are its older names) is the summed rm_scores before any KL
# penalty, "acc" the reward function's accuracy field.
FILTER_GROUPS_METRICS = ("reward", "acc", "score", "seq_reward")


@dataclass
class FilterGroupsConfig:
    """DAPO's dynamic sampling: train only on groups whose rewards differ."""

    enable: bool = F(False, "drop groups whose samples all score the same and generate more until the batch is full")
    metric: str = F("reward", "what must differ within a group: reward (summed rm_scores) or acc",
                    choices=lambda: FILTER_GROUPS_METRICS)
    max_num_gen_batches: int = F(0, "stop with an error after this many generation batches in one step (0 = no "
                                 "limit)")

    def __post_init__(self) -> None:
        _check_choices(self, "algorithm.filter_groups")
        _check(self.max_num_gen_batches >= 0, "algorithm.filter_groups.max_num_gen_batches",
               f"must be >= 0 (0 = no limit), got {self.max_num_gen_batches}")


@dataclass
class AlgorithmConfig:
    """Advantage estimation and in-reward KL."""

    adv_estimator: str = F("grpo", "advantage estimator from the registry (add one with "
                           "conveyor.algos.register_adv_estimator)", choices=lambda: ADV_ESTIMATORS)
    gamma: float = F(1.0, "discount")
    lam: float = F(1.0, "GAE lambda")
    norm_adv_by_std_in_grpo: bool = F(True, "GRPO: divide by the group's reward std")
    use_kl_in_reward: bool = F(False, "subtract kl_ctrl.kl_coef * KL from the token rewards")
    kl_penalty: str = F("kl", "KL estimator of the in-reward penalty", choices=lambda: KL_KINDS)
    kl_ctrl: KLControlConfig = S(KLControlConfig, "in-reward KL controller")
    rollout_correction: RolloutCorrectionConfig = S(RolloutCorrectionConfig, "rollout correction")
    filter_groups: FilterGroupsConfig = S(FilterGroupsConfig, "dynamic sampling (DAPO)")

    def __post_init__(self) -> None:
        _check_choices(self, "algorithm")
        _check(0 <= self.gamma <= 1, "algorithm.gamma", "must be in [0, 1]")
        _check(0 <= self.lam <= 1, "algorithm.lam", "must be in [0, 1]")


@dataclass
class CustomRewardFunctionConfig:
    """A reward function of the user's, loaded from a Python file (verl's custom_reward_function)."""

    path: Optional[str] = F(None, "Python file defining the function; null = the reward registry by data_source")
    name: str = F("compute_score", "the function in that file: fn(data_source, solution_str, ground_truth, "
                  "extra_info=None) -> float, used for every sample")

    def __post_init__(self) -> None:
        _check(bool(self.name) and self.name.isidentifier(), "reward.custom_reward_function.name",
               f"must be a Python function name, got {self.name!r}")


@dataclass
class RewardConfig:
    """How responses are scored."""

    custom_reward_function: CustomRewardFunctionConfig = S(CustomRewardFunctionConfig, "a reward function from a file")
    timeout_s: float = F(30.0, "seconds one call of a reward function may take; a call that takes longer stops the "
                         "run with an error naming the function (0 = no limit)")

    def __post_init__(self) -> None:
        _check(self.timeout_s >= 0, "reward.timeout_s", f"must be >= 0 (0 = no limit), got {self.timeout_s}")


@dataclass
class OverlongBufferConfig:
    """DAPO's soft overlong punishment (verl's reward_model.overlong_buffer keys)."""

    enable: bool = F(False, "penalise responses longer than data.max_response_length - len")
    len: Optional[int] = F(None, "tokens before data.max_response_length where the penalty starts; null = a "
                           "quarter of data.max_response_length (at least 1)")
    penalty_factor: float = F(1.0, "penalty at data.max_response_length; it grows linearly from 0 over the buffer")
    log: bool = F(True, "log reward/overlong_reward_mean and reward/overlong_frac")

    def __post_init__(self) -> None:
        p = "reward_model.overlong_buffer"
        _check(self.len is None or self.len > 0, f"{p}.len",
               f"must be > 0 or null (turn it off with {p}.enable=false), got {self.len}")
        _check(self.penalty_factor >= 0, f"{p}.penalty_factor", f"must be >= 0, got {self.penalty_factor}")


@dataclass
class RewardModelConfig:
    """Reward shaping under verl's reward_model keys (the scoring itself is configured under reward)."""

    overlong_buffer: OverlongBufferConfig = S(OverlongBufferConfig, "overlong reward shaping (DAPO)")


@dataclass
class MetricsEndpointConfig:
    """A Prometheus endpoint (used for trainer.prometheus and transfer_queue.metrics)."""

    enabled: bool = F(False, "serve these metrics over HTTP for Prometheus")
    port: int = F(0, "port (0 = pick a free one; the chosen port is logged)")
    host: str = F("127.0.0.1", "bind address (127.0.0.1 = this machine only)")

    def _validate(self, prefix: str) -> None:
        _check(0 <= self.port < 65536, f"{prefix}.port", "must be in [0, 65535]")
        _check(bool(self.host.strip()), f"{prefix}.host", "must be an address to bind to, e.g. 127.0.0.1")


# Values of trainer.v1.trainer_mode (verl's V1 trainer keys): today's synchronous loop, or rollout in its own
# process concurrently with training (`conveyor.trainer.async_loop`). verl's colocate_async is not implemented.
TRAINER_MODES: tuple[str, ...] = ("sync", "separate_async")
OFF_POLICY_STRATEGIES: tuple[str, ...] = ("drop", "wait")


@dataclass
class SamplerConfig:
    """How old a sample may be in asynchronous training (trainer.v1.sampler)."""

    max_off_policy_threshold: int = F(1, "k: a sample trained at policy version v was generated by a version >= "
                                         "v - k (0 = on-policy: the synchronous trainer's samples)")
    max_off_policy_strategy: str = F("wait", "wait: generation waits for newer weights; drop: samples too old "
                                             "when trained are discarded", choices=lambda: OFF_POLICY_STRATEGIES)

    def _validate(self, prefix: str) -> None:
        _check(self.max_off_policy_threshold >= 0, f"{prefix}.max_off_policy_threshold",
               f"must be >= 0, got {self.max_off_policy_threshold}")
        _check_choices(self, prefix)


@dataclass
class SeparateAsyncConfig:
    """The rollout process of trainer.v1.trainer_mode=separate_async."""

    parameter_sync_step: int = F(1, "the trainer sends its weights to the rollout every N updates (at most "
                                    "max_off_policy_threshold + 1, else the bound could never hold)")
    partial_rollout: bool = F(False, "weights that reach the rollout mid-generation apply at once: unfinished "
                                     "samples continue with them (cache recomputed) and each token records "
                                     "the version that sampled it; false: a batch finishes with the weights "
                                     "it started with")

    def _validate(self, prefix: str) -> None:
        _check(self.parameter_sync_step >= 1, f"{prefix}.parameter_sync_step",
               f"must be >= 1, got {self.parameter_sync_step}")


@dataclass
class TrainerV1Config:
    """verl's V1 trainer keys: synchronous or asynchronous training with bounded staleness."""

    trainer_mode: str = F("sync", "sync (rollout, then update, every step) or separate_async (rollout in its own "
                                  "process while the trainer updates; docs/async.md)", choices=lambda: TRAINER_MODES)
    sampler: SamplerConfig = S(SamplerConfig, "the staleness bound")
    separate_async: SeparateAsyncConfig = S(SeparateAsyncConfig, "weight shipping to the rollout process")

    def _validate(self, prefix: str) -> None:
        _check_choices(self, prefix)
        self.sampler._validate(f"{prefix}.sampler")
        self.separate_async._validate(f"{prefix}.separate_async")
        k, p = self.sampler.max_off_policy_threshold, self.separate_async.parameter_sync_step
        _check(p <= k + 1, f"{prefix}.separate_async.parameter_sync_step",
               f"weights that reach the rollout every {p} updates make samples up to {p - 1} versions old, beyond "
               f"trainer.v1.sampler.max_off_policy_threshold={k}: set it to at most {k + 1}")

    @property
    def is_async(self) -> bool:
        """Whether rollout runs concurrently with training."""
        return self.trainer_mode != "sync"


@dataclass
class TrainerConfig:
    """The loop: steps, logging, checkpoints, devices."""

    total_training_steps: int = F(600, "training steps to run")
    project_name: str = F("conveyor", "tracker project")
    experiment_name: str = F("tiny-moe-grpo", "tracker run name and run directory name")
    logger: list = F(["console", "jsonl"], "trackers the metrics go to", choices=lambda: TRACKERS)
    default_local_dir: Optional[str] = F(None, "run directory; null = runs/<experiment_name> under the working directory")
    test_freq: int = F(100, "validate every N steps (and before the first; 0 = only before and after)")
    val_before_train: bool = F(True, "validate at step 0")
    save_freq: int = F(100, "checkpoint every N steps, and at the end (0 = only at the end): bounds what a crash "
                            "loses")
    max_ckpt_to_keep: Optional[int] = F(2, "newest checkpoints kept (null = all)")
    resume_mode: str = F("auto", "auto (continue from the newest checkpoint), disable, or resume_path")
    resume_from_path: Optional[str] = F(None, "checkpoint directory for resume_mode=resume_path")
    save_on_interrupt: bool = F(True, "on Ctrl-C or SIGTERM, finish the running step and save a checkpoint "
                                      "before stopping (false: stop at once)")
    resume_accept_config_changes: bool = F(
        False, "resume even when settings that change the run differ from the checkpoint's (they are listed "
        "in the log); false: such a resume is refused")
    dump_freq: int = F(100, "write sample generations every N steps (0 = off)")
    dump_num: int = F(8, "generations per dump")
    seed: int = F(0, "seed of sampling and of mini-batch shuffling")
    device: str = F("auto", "auto, cpu or cuda")
    nnodes: int = F(1, "nodes (Ray)")
    n_gpus_per_node: int = F(0, "GPUs per node (0 = CPU workers)")
    num_cpu_workers: int = F(1, "data-parallel actor ranks when running on CPUs")
    progress_bar: bool = F(True, "show a progress bar with ETA on a terminal")
    console_every: int = F(0, "steps per row of the console table, each row their mean (validations always get a "
                           "row; 0 = about 30 rows per run); every metric of every step is in metrics.jsonl")
    prometheus: MetricsEndpointConfig = S(MetricsEndpointConfig, "live training metrics (and the data plane's)")
    plugins: list = F([], "Python files or importable modules loaded before the config is checked and in every "
                          "worker: register advantage estimators, policy losses or reward functions there")
    v1: TrainerV1Config = S(TrainerV1Config, "synchronous or asynchronous training (verl's V1 trainer keys)")

    def __post_init__(self) -> None:
        _check(self.total_training_steps > 0, "trainer.total_training_steps", "must be > 0")
        _check_choices(self, "trainer")
        name = self.experiment_name
        # It names the run directory (runs/<name>): a path in it would write outside runs/.
        _check(bool(name.strip()) and "/" not in name and "\\" not in name and name not in (".", "..")
               and name.isprintable(), "trainer.experiment_name",
               f"must be a plain name (no '/', no '..'), since the run directory is runs/<name>; got {name!r}. "
               "To write the run elsewhere, set trainer.default_local_dir")
        for k in ("test_freq", "save_freq", "dump_freq", "dump_num", "console_every"):
            _check(getattr(self, k) >= 0, f"trainer.{k}", "must be >= 0")
        _check(self.max_ckpt_to_keep is None or self.max_ckpt_to_keep > 0, "trainer.max_ckpt_to_keep", "must be > 0 or null")
        _check(self.resume_mode in ("auto", "disable", "resume_path"), "trainer.resume_mode",
               "must be auto, disable or resume_path")
        _check(self.resume_mode != "resume_path" or bool(self.resume_from_path), "trainer.resume_from_path",
               "must be set when trainer.resume_mode=resume_path")
        _check(self.device in ("auto", "cpu", "cuda"), "trainer.device", "must be auto, cpu or cuda")
        _check(self.nnodes > 0, "trainer.nnodes", "must be > 0")
        _check(self.n_gpus_per_node >= 0, "trainer.n_gpus_per_node", "must be >= 0")
        _check(self.num_cpu_workers > 0, "trainer.num_cpu_workers", "must be > 0")
        self.prometheus._validate("trainer.prometheus")
        self.v1._validate("trainer.v1")


@dataclass
class TransferQueueConfig:
    """The data plane."""

    backend: str = F("memory", "data-plane backend (memory is embedded in the trainer's process)",
                     choices=lambda: BACKENDS)
    num_storage_actors: int = F(1, "ray backend: storage actors")
    storage_actor_cpus: float = F(0.05, "ray backend: logical CPUs each storage actor reserves")
    transferqueue: dict = F({}, "transferqueue backend: passed through to the transferqueue package")
    host: str = F("127.0.0.1", "transferqueue backend: the address its controller and storage units listen on "
                  "(127.0.0.1 = this machine only; its protocol is unauthenticated pickle, so give a node's address, "
                  "or auto for Ray's node address, only on a trusted network)")
    metrics: MetricsEndpointConfig = S(MetricsEndpointConfig, "Prometheus metrics of the data plane")

    def __post_init__(self) -> None:
        _check_choices(self, "transfer_queue")
        _check(bool(self.host.strip()) and not any(c.isspace() for c in self.host), "transfer_queue.host",
               f"must be an IP address or host name (or auto), got {self.host!r}")
        _check(self.num_storage_actors > 0, "transfer_queue.num_storage_actors", "must be > 0")
        _check(self.storage_actor_cpus >= 0, "transfer_queue.storage_actor_cpus", "must be >= 0")
        self.metrics._validate("transfer_queue.metrics")


@dataclass
class RayConfig:
    """How to reach or start Ray (only when workers or the data plane use it)."""

    address: Optional[str] = F(None, "existing cluster address (auto = the local head); null = start a local one")
    num_cpus: Optional[int] = F(None, "logical CPUs of a locally started Ray (null = the machine's)")
    worker_cpus: float = F(0.5, "logical CPUs each worker actor reserves (fractional so small machines fit)")
    timeout_s: float = F(60.0, "seconds to wait for resources before failing")

    def __post_init__(self) -> None:
        _check(self.worker_cpus >= 0, "ray.worker_cpus", "must be >= 0")
        _check(self.timeout_s > 0, "ray.timeout_s", "must be > 0")
        _check(self.num_cpus is None or self.num_cpus > 0, "ray.num_cpus", "must be > 0 or null")


@dataclass
class Config:
    """The root of a run's configuration."""

    data: DataConfig = S(DataConfig, "prompts")
    actor_rollout_ref: ActorRolloutRefConfig = S(ActorRolloutRefConfig, "policy, rollout and reference")
    critic: CriticConfig = S(CriticConfig, "value model")
    algorithm: AlgorithmConfig = S(AlgorithmConfig, "advantages and KL")
    reward: RewardConfig = S(RewardConfig, "reward functions")
    reward_model: RewardModelConfig = S(RewardModelConfig, "reward shaping")
    trainer: TrainerConfig = S(TrainerConfig, "the loop")
    transfer_queue: TransferQueueConfig = S(TransferQueueConfig, "the data plane")
    ray: RayConfig = S(RayConfig, "Ray")

    def __post_init__(self) -> None:
        bs = self.data.train_batch_size
        mb = self.actor_rollout_ref.actor.ppo_mini_batch_size
        t = self.trainer
        world = t.nnodes * max(t.n_gpus_per_node, t.num_cpu_workers)
        n = self.actor_rollout_ref.rollout.n
        # Every rank needs at least one sequence of each mini-batch: a sharded update is a collective.
        _check(mb * n >= world, "actor_rollout_ref.actor.ppo_mini_batch_size",
               f"a mini-batch of {mb} prompts x {n} samples is fewer sequences than the {world} ranks; raise it "
               "or use fewer ranks")
        _check(bs % mb == 0, "actor_rollout_ref.actor.ppo_mini_batch_size",
               f"data.train_batch_size={bs} must be divisible by it (got {mb})")
        ro = self.actor_rollout_ref.rollout
        if ro.name == "vllm":
            # Each rank's engine would have to share the trainer's process group (vLLM's external_launcher
            # backend); until that is built and tested, the vllm rollout serves a single actor rank.
            _check(world == 1, "actor_rollout_ref.rollout.name",
                   f"the vllm rollout runs with one actor rank so far, got {world} (trainer.nnodes x "
                   "n_gpus_per_node or num_cpu_workers): use one rank, or rollout.name=hf")
            need = self.data.max_prompt_length + self.data.max_response_length
            _check(ro.max_model_len is None or ro.max_model_len >= need, "actor_rollout_ref.rollout.max_model_len",
                   f"must hold data.max_prompt_length + data.max_response_length = {need} tokens, got "
                   f"{ro.max_model_len}")
            tiny = self.actor_rollout_ref.model.tiny
            if self.actor_rollout_ref.model.path is None:
                # vLLM's CPU attention kernels reject smaller heads ("Unsupported CPU attention configuration").
                _check(tiny.hidden_size // tiny.num_heads >= 32, "actor_rollout_ref.model.tiny.num_heads",
                       f"the vllm rollout needs a head_dim (hidden_size // num_heads) of at least 32, got "
                       f"{tiny.hidden_size} // {tiny.num_heads}: e.g. num_heads=2 num_kv_heads=2 (examples/vllm_cpu.yaml)")
        algo = self.algorithm
        _check(not (self.actor_rollout_ref.actor.router_replay.mode == "R2"
                    and algo.rollout_correction.bypass_mode is True),
               "algorithm.rollout_correction.bypass_mode",
               "router_replay.mode=R2 records the routing in the old-log-prob forward, which bypass mode skips: "
               "set bypass_mode to null or false, or use router_replay.mode=R3")
        if algo.adv_estimator == "grpo_passk" or algo.filter_groups.enable:
            what = ("algorithm.filter_groups.enable" if algo.filter_groups.enable
                    else "algorithm.adv_estimator=grpo_passk")
            _check(n >= 2, "actor_rollout_ref.rollout.n", f"{what} compares the samples of a prompt: set it to 2 or "
                   f"more, got {n}")
        ob = self.reward_model.overlong_buffer
        if ob.enable and ob.len is not None:
            _check(ob.len <= self.data.max_response_length, "reward_model.overlong_buffer.len",
                   f"must be at most data.max_response_length={self.data.max_response_length}, got {ob.len}")
        if t.v1.is_async:
            self._check_async()
        if self.use_critic:
            cmb = self.critic.ppo_mini_batch_size
            _check(bs % cmb == 0, "critic.ppo_mini_batch_size",
                   f"data.train_batch_size={bs} must be divisible by it (got {cmb})")
            _check(cmb * n >= world, "critic.ppo_mini_batch_size",
                   f"a mini-batch of {cmb} prompts x {n} samples is fewer sequences than the {world} ranks")

    def _check_async(self) -> None:
        """What the asynchronous trainer does not (yet) combine with: each an error naming the key."""
        mode = f"trainer.v1.trainer_mode={self.trainer.v1.trainer_mode}"
        arr, algo = self.actor_rollout_ref, self.algorithm
        _check(arr.rollout.name == "hf", "actor_rollout_ref.rollout.name", f"{mode} supports the hf rollout only")
        _check(not arr.rollout.multi_turn.enable, "actor_rollout_ref.rollout.multi_turn.enable",
               f"multi-turn rollouts are not supported with {mode}")
        _check(not algo.filter_groups.enable, "algorithm.filter_groups.enable",
               f"dynamic sampling is not supported with {mode}")
        _check(algo.adv_estimator != "remax", "algorithm.adv_estimator",
               f"remax's greedy baseline rollout is not supported with {mode}")
        k = self.trainer.v1.sampler.max_off_policy_threshold
        _check(not (k > 0 and algo.rollout_correction.bypass_mode is True), "algorithm.rollout_correction.bypass_mode",
               f"with trainer.v1.sampler.max_off_policy_threshold={k} the rollout's log-probs come from an older "
               "policy and cannot stand in for the proximal policy's: set bypass_mode to null or false")

    @property
    def off_policy(self) -> bool:
        """Whether samples may come from an older policy than the one they train (asynchronous, k > 0)."""
        return self.trainer.v1.is_async and self.trainer.v1.sampler.max_off_policy_threshold > 0

    @property
    def proximal_from_update(self) -> bool:
        """Off-policy with one optimizer step per batch: the update's own forward is the proximal policy.

        Before the step's only optimizer step the weights are the proximal policy's, so the update's
        forward gives `old_log_probs` (detached) and the old-log-prob forward is skipped. Not when a
        stage needs them before the update (KL in the reward, rejection sampling, R2's recorded routing).
        """
        a = self.actor_rollout_ref.actor
        return (self.off_policy and a.ppo_epochs == 1 and a.ppo_mini_batch_size == self.data.train_batch_size
                and not self.algorithm.use_kl_in_reward and self.algorithm.rollout_correction.rollout_rs is None
                and a.router_replay.mode != "R2")

    @property
    def rollout_is_level(self) -> str | None:
        """algorithm.rollout_correction.rollout_is, resolved: off-policy training defaults to token-level weights.

        They make the decoupled (proximal) objective of docs/async.md: the clipped ratio is taken against
        the old-log-prob forward (the current policy), and each token is weighted by the truncated
        pi_old / pi_behaviour of the policy that generated it.
        """
        level = self.algorithm.rollout_correction.rollout_is
        return level if level is not None or not self.off_policy else "token"

    @property
    def use_critic(self) -> bool:
        """Whether a value model runs (explicit, or because the estimator needs values)."""
        if self.critic.enable is not None:
            return self.critic.enable
        return self.algorithm.adv_estimator in NEEDS_CRITIC

    @property
    def bypass_old_log_prob(self) -> bool:
        """Whether old_log_probs are the rollout's (algorithm.rollout_correction.bypass_mode, resolved)."""
        bypass = self.algorithm.rollout_correction.bypass_mode
        if bypass is not None:
            return bypass
        correction = self.algorithm.rollout_correction
        if self.off_policy:
            # The rollout's log-probs are an older policy's: the proximal policy needs the forward.
            return False
        if self.actor_rollout_ref.actor.router_replay.mode == "R2" or correction.rollout_is or correction.rollout_rs:
            # R2 records the routing in that forward; importance weights and rejection compare it with the rollout.
            return False
        # The hf engine samples from the very weights the actor trains, in the same
        # numerics (under R3, with the very routing the update replays), so its
        # log-probs are the old log-probs; a forward would only repeat them.
        return self.actor_rollout_ref.rollout.name == "hf"

    @property
    def rollout_max_model_len(self) -> int:
        """The longest sequence the vllm engine must hold (actor_rollout_ref.rollout.max_model_len, resolved)."""
        ro = self.actor_rollout_ref.rollout
        return ro.max_model_len or self.data.max_prompt_length + self.data.max_response_length

    def loss_scale_factor(self, role: str) -> float:
        """The seq-mean-token-sum-norm divisor of `role` ("actor" or "critic"), resolved to a number."""
        actor = self.actor_rollout_ref.actor.loss_scale_factor
        chosen = self.critic.loss_scale_factor if role == "critic" else None
        # A constant, not the micro-batch's padded width as in verl: the loss of a
        # sequence must not depend on which sequences it was padded next to.
        return float(chosen or actor or self.data.max_response_length)

    @property
    def use_reference(self) -> bool:
        """Whether a reference policy is needed (a KL term is on)."""
        return self.actor_rollout_ref.actor.use_kl_loss or self.algorithm.use_kl_in_reward

    @property
    def run_dir(self) -> Path:
        """The run directory."""
        if self.trainer.default_local_dir:
            return Path(self.trainer.default_local_dir)
        return Path("runs") / self.trainer.experiment_name


# --------------------------------------------------------------------------- building
# OmegaConf does the loading: YAML, dotted overrides, merging, type checks and
# `${...}` interpolation (`${data.max_prompt_length}`, `${oc.env:VAR}`), as verl
# users write them. What is ours: the one-line errors with "did you mean", the
# removed keys, and `trainer.plugins` loaded before the choices are checked.
def _all_paths(cls: type, prefix: str = "") -> list[str]:
    out = []
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        out.append(path)
        sub = _section_type(cls, f.name)
        if sub is not None:
            out.extend(_all_paths(sub, path + "."))
    return out


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _section_type(cls: type, name: str) -> type | None:
    t = _hints(cls)[name]
    return t if dataclasses.is_dataclass(t) else None


def _field_type(path: str) -> Any:
    """The declared type of a dotted key (None when there is no such key)."""
    t: Any = Config
    for part in path.split("."):
        if not dataclasses.is_dataclass(t) or part not in _hints(t):
            return None
        t = _hints(t)[part]
    return t


def _nearest(path: str) -> str:
    """The valid key a mistyped one most likely meant ('' when nothing is close)."""
    paths = _all_paths(Config)
    section, _, leaf = path.rpartition(".")
    siblings = [p.rpartition(".")[2] for p in paths if p.rpartition(".")[0] == section]
    near = difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.5)
    if near:
        return f"{section}.{near[0]}" if section else near[0]
    # The right leaf in the wrong section (e.g. `temperature=` at the top level).
    same_leaf = [p for p in paths if p.rpartition(".")[2] == leaf]
    if same_leaf:
        return same_leaf[0]
    # Keys of other sections only: the siblings were compared leaf to leaf above (a short sibling such as
    # trainer.v1 would otherwise match any trainer.* path on the shared prefix alone).
    others = [p for p in paths if p.rpartition(".")[0] != section]
    near = difflib.get_close_matches(path, others, n=1, cutoff=0.6)
    if near and not path.startswith(near[0] + "."):
        return near[0]
    return ""


def _unknown_key_message(path: str) -> str:
    near = _nearest(path)
    if near:
        return f"unknown config key {path}; did you mean {near}?"
    section = path.rpartition(".")[0]
    siblings = [p.rpartition(".")[2] for p in _all_paths(Config) if p.rpartition(".")[0] == section]
    return f"unknown config key {path}; valid keys under {section or 'the top level'}: {', '.join(siblings)}"


def _type_name(t: Any) -> str:
    origin = typing.get_origin(t)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(t) if a is not type(None)]
        return " or ".join(_type_name(a) for a in args) + " or null"
    return getattr(t, "__name__", str(t))


def _lookup(data: Any, path: str) -> Any:
    """The raw value at a dotted path of nested dicts (KeyError when absent)."""
    node = data
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            raise KeyError(path)
        node = node[part]
    return node


def _prepare(data: Any, cls: Any, prefix: str) -> Any:
    """Refuse removed keys and values given for sections; a section given null is its defaults.

    A list key given one bare string (`trainer.logger=console`) takes it as a
    comma-separated list, as verl's trackers do.
    """
    if not isinstance(data, dict):
        return data
    out = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key in REMOVED_KEYS:
            raise ConfigError(f"{path}: {REMOVED_KEYS[key]}")
        t = _hints(cls).get(key) if dataclasses.is_dataclass(cls) else None
        if dataclasses.is_dataclass(t):
            if value is None:
                value = {}
            elif not isinstance(value, dict):
                raise ConfigError(f"{path}: expected a mapping of keys, got {type(value).__name__} {value!r}")
        elif (t is list or typing.get_origin(t) is list) and isinstance(value, str) and "${" not in value:
            value = [v.strip() for v in value.split(",") if v.strip()]
        out[key] = _prepare(value, t, path + ".")
    return out


# Numbers the trainer can compute with: every float ends up in float32 tensors or
# schedules, every int in int64 tensors, seeds or counts.
_F32_MAX = 3.4028234663852886e38
_INT64_LIMIT = 2**63


def _check_number(path: str, value: Any) -> None:
    """Refuse NaN, infinities, floats beyond float32 and ints beyond int64 (bools are not numbers here)."""
    if isinstance(value, bool):
        return
    if isinstance(value, int) and not -_INT64_LIMIT <= value < _INT64_LIMIT:
        # str() of an int beyond 4300 digits fails: count those by their logarithm.
        digits = len(str(abs(value))) if value.bit_length() < 14_000 else int(math.log10(abs(value))) + 1
        raise ConfigError(f"{path}: an integer of {digits} digits is too large; "
                          f"give a number within +-{_INT64_LIMIT - 1}")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ConfigError(f"{path}: must be a finite number, got {value}")
        if abs(value) > _F32_MAX:
            raise ConfigError(f"{path}: {value:g} overflows float32 (where the trainer computes); "
                              "give a number within +-3.4e38")


def _check_numbers(data: Any, cls: Any, prefix: str) -> None:
    """`_check_number` on every value of the sections of `data` (nested dicts over the dataclasses), lists included.

    Done once for every key here, so no section has to remember it: a NaN
    coefficient would otherwise pass every `x > 0`-style check it lacks.
    Free-form mappings (`transfer_queue.transferqueue`) belong to their package.
    """
    if not isinstance(data, dict) or not dataclasses.is_dataclass(cls):
        return
    hints = _hints(cls)
    for key, value in data.items():
        if key not in hints:
            continue  # an unknown key: the merge reports it, with the key it was probably meant to be
        if dataclasses.is_dataclass(hints[key]):
            _check_numbers(value, hints[key], f"{prefix}{key}.")
            continue
        for v in value if isinstance(value, list) else [value]:
            _check_number(f"{prefix}{key}", v)


def _translate(err: OmegaConfBaseException, sources: list[dict]) -> ConfigError:
    """One line naming the key for an OmegaConf error (unknown key, wrong type, failed interpolation)."""
    key = getattr(err, "full_key", None) or ""
    first = str(err).splitlines()[0] if str(err) else type(err).__name__
    if isinstance(err, InterpolationResolutionError):
        # "KeyError raised while resolving interpolation: \"...\"" -> the quoted reason alone.
        reason = first.split("while resolving interpolation: ", 1)[-1].strip().strip('"')
        return ConfigError(f"{key}: cannot resolve its interpolation: {reason}")
    if isinstance(err, ConfigKeyError):
        return ConfigError(_unknown_key_message(key))
    if isinstance(err, ValidationError) and key:
        t = _field_type(key)
        for data in reversed(sources):  # the last source given wins, as in the merge
            try:
                value = _lookup(data, key)
            except KeyError:
                continue
            got = "null" if value is None else f"{type(value).__name__} {value!r}"
            return ConfigError(f"{key}: expected {_type_name(t)}, got {got}")
    return ConfigError(f"{key or 'config'}: {first}")


def _parse_dotlist(overrides: list[str]) -> dict:
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. trainer.total_training_steps=10)")
        key = item.split("=", 1)[0].strip().lstrip("+")
        if not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override {item!r} has an empty key")
    # Hydra's "+key=value" (add a key) means the same as "key=value" here.
    items = [item.strip().lstrip("+") for item in overrides]
    try:
        data = OmegaConf.to_container(OmegaConf.from_dotlist(items), resolve=False)
    except OmegaConfBaseException as err:
        raise ConfigError(f"overrides {overrides}: {str(err).splitlines()[0]}") from err
    for item in items:
        key, value = (part.strip() for part in item.split("=", 1))
        # YAML reads "5_0.5" as the number 50.5 (underscores are digit separators there); for a
        # key that takes text, such as rollout_is_threshold's "lower_upper", keep what was typed.
        if "_" in value and _field_type(key) in (Any, str, Optional[str]):
            node = data
            *parents, last = key.split(".")
            for part in parents:
                node = node[part]
            node[last] = value
    return data


def parse_overrides(overrides: list[str]) -> dict:
    """Turn `a.b.c=value` strings into a nested dict (values parsed by OmegaConf: numbers, bools, lists)."""
    return _parse_dotlist(list(overrides))


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"--config {path}: no such file")
    try:
        loaded = OmegaConf.load(path)
    except yaml.YAMLError as err:
        # One line, as every config error is: where, then what.
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        what = getattr(err, "problem", None) or " ".join(str(err).split())
        raise ConfigError(f"--config {path}: not valid YAML{where}: {what}") from err
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"--config {path}: the top level must be a mapping of sections")
    return OmegaConf.to_container(loaded, resolve=False)


def _build(sources: list[dict]) -> Config:
    """Merge `sources` over the defaults, load the plugins they name, then resolve and check everything."""
    sources = [_prepare(data, Config, "") for data in sources]
    for data in sources:  # before the merge: OmegaConf cannot turn an int beyond a double into a float
        _check_numbers(data, Config, "")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Config), *sources)
        # Plugins register the estimators, losses and reward functions the config may name.
        load_plugins(list(OmegaConf.select(merged, "trainer.plugins")))
        # Again once resolved (interpolations, "nan" given as text), before any section's own checks run.
        _check_numbers(OmegaConf.to_container(merged, resolve=True), Config, "")
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise _translate(err, sources) from err


def load_config(config_file: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults, then a YAML file, then dotted overrides; interpolations resolved; validated."""
    data = _read_yaml(Path(config_file)) if config_file is not None else {}
    return _build([data, _parse_dotlist(list(overrides or []))])


def config_from_dict(data: dict) -> Config:
    """Build a validated Config from nested dicts (e.g. a saved config.yaml)."""
    return _build([data])


def config_to_dict(cfg: Any) -> dict:
    """The config as plain nested dicts."""
    return dataclasses.asdict(cfg)


def config_to_yaml(cfg: Config, with_help: bool = False) -> str:
    """The resolved config as YAML; with_help adds each field's documentation (and valid choices) as a comment."""
    if not with_help:
        return yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=None)
    lines: list[str] = []
    _yaml_with_help(cfg, 0, lines)
    return "\n".join(lines) + "\n"


def _yaml_with_help(obj: Any, indent: int, lines: list[str]) -> None:
    pad = "  " * indent
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        help_ = f.metadata.get("help", "")
        choices = f.metadata.get("choices")
        if choices is not None:
            help_ += f" (one of: {', '.join(map(str, choices()))})"
        if dataclasses.is_dataclass(value):
            lines.append(f"{pad}{f.name}:  # {help_}")
            _yaml_with_help(value, indent + 1, lines)
        else:
            dumped = yaml.safe_dump(value, default_flow_style=True).strip()
            if dumped.endswith("..."):
                dumped = dumped[:-3].strip()
            lines.append(f"{pad}{f.name}: {dumped}  # {help_}")
