"""The `actor_rollout_ref.actor` and `actor_rollout_ref.ref` sections: the policy update and the reference.

Also the sections they share with the critic (`optim`, `fsdp_config`) and the
actor's own (`policy_loss`, `router_replay`, `router`). Choice lists (policy losses,
loss aggregations, KL estimators, strategies, LR schedules, replay modes) are
read from the modules that implement them, when checked.

It deliberately holds no logic of the update itself: `conveyor.workers` and
`conveyor.algos` take these values as plain arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.config.fields import F, S, check, registry
from conveyor.config.model import DTYPES
from conveyor.config.parallel import ulysses_size_field

__all__ = [
    "OptimConfig",
    "FSDPConfig",
    "RouterReplayConfig",
    "RouterConfig",
    "PolicyLossConfig",
    "ActorConfig",
    "RefConfig",
    "STRATEGY_CHOICES",
]

STRATEGY_CHOICES = registry("conveyor.workers.training.strategy", "STRATEGIES")
LOSS_AGG_CHOICES = registry("conveyor.algos.losses", "LOSS_AGG_MODES")
KL_KIND_CHOICES = registry("conveyor.algos.kl", "KL_KINDS")


@dataclass
class OptimConfig:
    """AdamW and its schedule."""

    lr: float = F(6e-4, "learning rate (the default suits the tiny model; real models want 1e-6 to 1e-5)", gt=0)
    weight_decay: float = F(0.0, "AdamW weight decay", ge=0)
    betas: list = F([0.9, 0.99], "AdamW betas")
    lr_warmup_steps: int = F(0, "linear warm-up steps", ge=0)
    lr_scheduler: str = F(
        "cosine", "the schedule after warm-up", choices=registry("conveyor.workers.training.optim", "LR_SCHEDULERS")
    )
    min_lr_ratio: float = F(0.2, "cosine floor as a fraction of lr", ge=0, le=1)

    def validate(self, prefix: str) -> None:
        """The betas are two numbers in [0, 1)."""
        check(
            len(self.betas) == 2
            and all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in self.betas),
            f"{prefix}.betas",
            f"must be two numbers in [0, 1), got {self.betas}",
        )


@dataclass
class FSDPConfig:
    """FSDP2 settings of a role (verl's fsdp_config keys); used when the role's strategy is fsdp2."""

    param_dtype: str | None = F(
        None,
        "dtype parameters are gathered and computed in (mixed precision); null = the model's dtype",
        choices=DTYPES,
    )
    reduce_dtype: str | None = F(
        None, "dtype gradients are reduce-scattered in; null = the parameters' dtype", choices=DTYPES
    )
    param_offload: bool = F(
        False,
        "keep parameter shards (and gradients) in host memory between uses, on a GPU run (no effect on a CPU run)",
        resume_neutral=True,
    )
    optimizer_offload: bool = F(
        False,
        "keep optimizer state in host memory except during its step, on a GPU run (no effect on a CPU run)",
        resume_neutral=True,
    )
    defer_grad_sync: bool = F(
        False,
        "communicate gradients only in an update's last micro-batch instead of every "
        "one: fewer collectives, but each rank holds a full unsharded gradient of the "
        "model until then (dp and fsdp2; the trained roles only)",
        resume_neutral=True,
    )
    fsdp_size: int | None = F(
        None,
        "fsdp2 shards within groups of this many ranks and replicates across the "
        "groups (HSDP: the sharding traffic stays in a group, one node's GPUs); null = all "
        "ranks, one group (verl's key, whose -1 is null here)",
        gt=0,
    )
    expert_parallel_size: int = F(
        1,
        "ranks each MoE layer's experts are split over, whole experts per rank, "
        "tokens sent to them by all-to-all (fsdp2 only; must divide the role's ranks "
        "and the experts per layer; 1 = off)",
        ge=1,
    )


@dataclass
class RouterReplayConfig:
    """Routing replay for MoE models."""

    mode: str = F(
        "disabled",
        "disabled; R3: training forwards use the experts recorded at rollout; R2: the "
        "updates use the experts of the old-log-prob forward (any rollout engine); auto: the run "
        "plan picks one from how off-policy the updates are (docs/moe.md)",
        choices=registry("conveyor.models.router_control", "REPLAY_CHOICES"),
    )


@dataclass
class RouterConfig:
    """Controls on the policy's MoE routers (docs/moe.md, "Controls")."""

    freeze: bool = F(
        False,
        "keep every MoE router's weights as loaded (no gradient, no optimizer state) while the rest trains",
    )
    aux_loss_coef: float = F(
        0.0,
        "weight of the Switch-Transformer load-balancing loss added to the policy loss (transformers' "
        "router_aux_loss_coef, OpenRLHF's aux_loss_coef; 0.001 is the usual value); 0 = off",
        ge=0,
    )
    bias_update_rate: float = F(
        0.0,
        "auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias on the router logits, used to "
        "choose the experts only, moves by this much after every optimizer step against its expert's "
        "excess load (DeepSeek-V3 used 0.001; torchtitan's load_balance_coeff); 0 = off",
        ge=0,
    )
    bias_update: str = F(
        "sign",
        "how the bias moves from the load d = (mean - load) / mean of each expert: sign = rate x sign(d) "
        "(DeepSeek-V3, Megatron-LM, torchtitan: the full rate every step, balanced or not); proportional = "
        "rate x clip(d, -1, 1) (the same step far from balance, shrinking to 0 at balance)",
        choices=registry("conveyor.models.router_control", "BIAS_UPDATES"),
    )
    bias_dead_band: float = F(
        0.0,
        "an expert whose |d| (its load's relative deviation from the layer's mean) is at most this keeps "
        "its bias; 0 = every expert moves",
        ge=0,
    )

    def validate(self, prefix: str) -> None:
        """The update rule's keys act on loss-free balancing only: set without it they are a mistake."""
        for key, unset in (("bias_update", self.bias_update == "sign"), ("bias_dead_band", self.bias_dead_band == 0)):
            check(
                unset or self.bias_update_rate > 0,
                f"{prefix}.{key}",
                "shapes loss-free balancing, which is off: set bias_update_rate > 0 (e.g. 0.05) or leave this key out",
            )


@dataclass
class PolicyLossConfig:
    """Which policy loss."""

    loss_mode: str = F(
        "vanilla",
        "policy loss from the registry (vanilla = PPO clip with dual clip; add one with "
        "conveyor.algos.register_policy_loss)",
        choices=registry("conveyor.algos.losses", "POLICY_LOSSES"),
    )
    clip_cov_ratio: float = F(0.0002, "clip_cov: share of tokens whose gradient is switched off", gt=0, le=1)
    clip_cov_lb: float = F(1.0, "clip_cov: lower bound of the covariance of a token that may be switched off")
    clip_cov_ub: float = F(5.0, "clip_cov: upper bound of that covariance")
    kl_cov_ratio: float = F(0.0002, "kl_cov: share of tokens (highest covariance) given the KL penalty", gt=0, le=1)
    ppo_kl_coef: float = F(0.1, "kl_cov: coefficient of that |log ratio| penalty", ge=0)
    dro_beta: float | None = F(
        None, "dro: coefficient of the quadratic log-ratio penalty (required with loss_mode=dro)", gt=0
    )

    def validate(self, prefix: str) -> None:
        """clip_cov's bounds are ordered; dro has its beta."""
        check(
            self.clip_cov_lb < self.clip_cov_ub,
            f"{prefix}.clip_cov_lb",
            f"must be below clip_cov_ub, got {self.clip_cov_lb} >= {self.clip_cov_ub}",
        )
        check(
            self.loss_mode != "dro" or self.dro_beta is not None,
            f"{prefix}.dro_beta",
            "loss_mode=dro penalises (log ratio)^2 with this coefficient and has no default: set it (> 0, e.g. 0.1)",
        )

    def loss_kwargs(self) -> dict[str, float | None]:
        """The hyperparameters handed to the policy loss (each loss takes the ones it declares)."""
        keys = ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef", "dro_beta")
        return {k: getattr(self, k) for k in keys}


@dataclass
class ActorConfig:
    """The policy update."""

    optim: OptimConfig = S(OptimConfig, "optimizer")
    ppo_mini_batch_size: int = F(32, "prompts per optimizer step (times rollout.n sequences)", gt=0)
    ppo_micro_batch_size_per_gpu: int = F(
        256,
        "sequences per forward/backward (gradient accumulation; lower it for big models)",
        gt=0,
        resume_neutral=True,
    )
    use_dynamic_bsz: bool = F(
        False,
        "fill each micro-batch up to ppo_max_token_len_per_gpu real tokens (prompt + "
        "response) instead of ppo_micro_batch_size_per_gpu sequences; also the default of "
        "rollout.log_prob_use_dynamic_bsz, ref.log_prob_use_dynamic_bsz and critic.use_dynamic_bsz",
        resume_neutral=True,
    )
    ppo_max_token_len_per_gpu: int = F(
        16384,
        "use_dynamic_bsz: most real tokens per forward/backward of the update "
        "(at least the longest sequence; verl suggests 2 x (max_prompt_length + "
        "max_response_length))",
        gt=0,
        resume_neutral=True,
    )
    ppo_epochs: int = F(1, "passes over the batch per step", gt=0)
    shuffle: bool = F(True, "shuffle sequences into mini-batches")
    clip_ratio: float = F(0.2, "PPO clip range (both sides unless clip_ratio_low/high are set)", gt=0)
    clip_ratio_low: float | None = F(None, "lower clip range; null = clip_ratio", gt=0)
    clip_ratio_high: float | None = F(None, "upper clip range; null = clip_ratio", gt=0)
    clip_ratio_c: float = F(3.0, "dual-clip bound for negative advantages (> 1)", gt=1)
    loss_agg_mode: str = F("token-mean", "how token losses become one number", choices=LOSS_AGG_CHOICES)
    loss_scale_factor: float | None = F(
        None,
        "seq-mean-token-sum-norm: the constant every sequence's token sum "
        "is divided by; null = data.max_response_length",
        gt=0,
    )
    tau_pos: float = F(1.0, "sapo: temperature of the soft gate for positive advantages", gt=0)
    tau_neg: float = F(1.05, "sapo: temperature of the soft gate for negative advantages", gt=0)
    calculate_sum_pi_squared: bool | None = F(
        None,
        "the old-log-prob forward also writes sum_pi_squared (Σ π² of each response token's distribution); "
        "null = when algorithm.adv_estimator reads it (optimal_token_baseline, tir_optimal_token_baseline)",
    )
    entropy_coeff: float = F(0.0, "entropy bonus coefficient")
    use_kl_loss: bool = F(False, "add a KL(policy || reference) loss term")
    kl_loss_coef: float = F(0.001, "KL loss coefficient", ge=0)
    kl_loss_type: str = F("low_var_kl", "KL estimator of the loss term", choices=KL_KIND_CHOICES)
    grad_clip: float = F(1.0, "gradient norm clip", gt=0)
    policy_loss: PolicyLossConfig = S(PolicyLossConfig, "policy loss")
    router_replay: RouterReplayConfig = S(RouterReplayConfig, "MoE routing replay")
    router: RouterConfig = S(
        RouterConfig, "MoE router controls: freezing, the load-balancing loss, loss-free balancing"
    )
    strategy: str | None = F(
        None,
        "how ranks hold the model: fsdp2 (sharded), dp (replicas, DDP) or none (one "
        "rank); null = fsdp2 with more than one rank",
        choices=STRATEGY_CHOICES,
        resume_neutral=True,
    )
    fsdp_config: FSDPConfig = S(FSDPConfig, "FSDP2 settings")
    ulysses_sequence_parallel_size: int = ulysses_size_field()


@dataclass
class RefConfig:
    """The frozen reference policy (used when a KL term is on)."""

    log_prob_micro_batch_size_per_gpu: int = F(256, "sequences per reference forward", gt=0, resume_neutral=True)
    log_prob_use_dynamic_bsz: bool | None = F(
        None,
        "fill each reference forward up to log_prob_max_token_len_per_gpu real tokens; null = actor.use_dynamic_bsz",
        resume_neutral=True,
    )
    log_prob_max_token_len_per_gpu: int | None = F(
        None,
        "most real tokens per reference forward under a token budget; null = actor.ppo_max_token_len_per_gpu",
        gt=0,
        resume_neutral=True,
    )
    strategy: str | None = F(
        None,
        "fsdp2 (sharded parameters, no optimizer), dp or none; null = fsdp2 with more than one rank",
        choices=STRATEGY_CHOICES,
        resume_neutral=True,
    )
    fsdp_config: FSDPConfig = S(FSDPConfig, "FSDP2 settings")
    ulysses_sequence_parallel_size: int | None = ulysses_size_field(follows_actor=True)
