"""What each model role's worker is built from: the config sections it needs and its part of the run plan.

One frozen dataclass per role (`ActorSettings`, `ReferenceSettings`,
`CriticSettings`) and one function per role that builds it from the config
and the run plan (`actor_settings(cfg, plan)`, ...). `worker_specs`, the
asynchronous trainer's rollout process and the tests all build workers from
these, so a worker never reads the root config and never re-derives a
decision: whether its forward records or replays routing, whether the update
writes the proximal log-probs, the importance-weight level and the loss scale
come decided. The sections are copies, so a later change to the config
cannot reach a built worker. They are plain dataclasses: Ray pickles them to
its ranks as they are.

What it deliberately does not do: decide anything (`conveyor.trainer.plan`
does) or hold per-call parameters (`conveyor.workers.ranks.calls`).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import TYPE_CHECKING, Any

from conveyor.config.parallel import ref_sequence_parallel_size
from conveyor.workers.ranks.distill import distill_settings
from conveyor.workers.training.batching import TokenBudget, token_budget
from conveyor.workers.training.optim import total_optim_steps

if TYPE_CHECKING:
    from conveyor.config import Config
    from conveyor.config.plan import RunPlan
    from conveyor.workers.training.strategy import TrainingStrategy

__all__ = [
    "ActorSettings",
    "ReferenceSettings",
    "CriticSettings",
    "ReplicaSettings",
    "actor_settings",
    "reference_settings",
    "critic_settings",
    "rollout_settings",
    "role_strategy",
]


@dataclasses.dataclass(frozen=True)
class ActorSettings:
    """The actor's worker (`PolicyWorker`): rollout, old log-probs and the PPO update."""

    model: Any  # actor_rollout_ref.model
    actor: Any  # actor_rollout_ref.actor (optim, strategy, fsdp_config, the loss's settings)
    rollout: Any  # actor_rollout_ref.rollout
    seed: int  # trainer.seed (the vllm engine's, plus the rank)
    total_optim_steps: int  # optimizer steps of the whole run (the lr schedule's length)
    replay_mode: str  # the router replay that runs (the plan's)
    forward_records_routing: bool  # the old-log-prob forward writes routed_experts
    forward_replays_routing: bool  # the old-log-prob forward replays the rollout's routed_experts (R3)
    update_replays_routing: bool  # the update's forward replays routed_experts (R2, R3)
    update_writes_old_log_probs: bool  # the update's forward is the proximal policy: it writes old_log_probs
    rollout_is: str | None  # importance-weight level (None: off)
    is_threshold: float  # upper truncation of the importance weights
    is_threshold_lower: float | None  # IcePop's lower bound (None: none)
    rejection: tuple[tuple[str, float | None, float], ...]  # rollout_rs options as (option, lower, upper)
    loss_scale_factor: float  # seq-mean-token-sum-norm divisor
    max_model_len: int | None  # the vllm engine's (None: another engine)
    # Token budgets of the micro-batches (None: fixed-size micro-batches of sequences).
    update_budget: TokenBudget | None = None  # actor.use_dynamic_bsz / ppo_max_token_len_per_gpu
    log_prob_budget: TokenBudget | None = None  # rollout.log_prob_use_dynamic_bsz / log_prob_max_token_len_per_gpu
    serves_reference: bool = False  # LoRA: the actor also writes ref_log_prob, with its adapters disabled
    ref: Any = None  # actor_rollout_ref.ref when it serves the reference (its micro-batch size)
    ref_budget: TokenBudget | None = None  # and that reference forward's token budget
    distill: Any = None  # on-policy distillation's term (`conveyor.workers.ranks.distill.DistillSettings`), or None


@dataclasses.dataclass(frozen=True)
class ReplicaSettings:
    """A rollout worker's (`ReplicaWorker`, placement=separate): a forward-only engine with no optimizer."""

    model: Any  # actor_rollout_ref.model
    rollout: Any  # actor_rollout_ref.rollout
    seed: int  # trainer.seed (the engine's, plus the replica)
    max_model_len: int | None  # the plan's, for an engine with its own KV cache
    # data.max_prompt_length and data.truncation: a replica that renders its batches' prompts applies them too.
    max_prompt_length: int
    truncation: str
    selection_bias: bool = False  # the actor's routers carry a loss-free balancing bias, streamed with the weights


@dataclasses.dataclass(frozen=True)
class ReferenceSettings:
    """The frozen reference policy's worker (`ReferenceWorker`)."""

    model: Any  # actor_rollout_ref.model
    ref: Any  # actor_rollout_ref.ref (micro-batch size, strategy, fsdp_config)
    log_prob_budget: TokenBudget | None = None  # ref.log_prob_use_dynamic_bsz / log_prob_max_token_len_per_gpu
    sequence_parallel_size: int = 1  # ref.ulysses_sequence_parallel_size, null resolved to the actor's


@dataclasses.dataclass(frozen=True)
class CriticSettings:
    """The value model's worker (`CriticWorker`)."""

    model: Any  # actor_rollout_ref.model (the critic starts from the policy's backbone)
    critic: Any  # critic (optim, strategy, fsdp_config, the value loss's settings)
    total_optim_steps: int  # the critic's own: its mini-batch size and epochs may differ from the actor's
    loss_scale_factor: float
    update_budget: TokenBudget | None = None  # critic.use_dynamic_bsz / ppo_max_token_len_per_gpu
    forward_budget: TokenBudget | None = None  # critic.use_dynamic_bsz / forward_max_token_len_per_gpu


def actor_settings(cfg: Config, plan: RunPlan) -> ActorSettings:
    """The actor's settings of a run of `cfg` under `plan`."""
    arr = cfg.actor_rollout_ref
    correction = cfg.algorithm.rollout_correction
    upper, lower = correction.is_thresholds()
    return ActorSettings(
        model=copy.deepcopy(arr.model),
        actor=copy.deepcopy(arr.actor),
        rollout=_placed(arr.rollout, plan),
        seed=cfg.trainer.seed,
        total_optim_steps=total_optim_steps(
            cfg.trainer.total_training_steps,
            cfg.data.train_batch_size,
            arr.actor.ppo_mini_batch_size,
            arr.actor.ppo_epochs,
        ),
        replay_mode=plan.replay_mode,
        forward_records_routing=plan.forward_records_routing,
        forward_replays_routing=plan.forward_replays_routing,
        update_replays_routing=plan.update_replays_routing,
        update_writes_old_log_probs=plan.proximal_from_update,
        rollout_is=plan.rollout_is_level,
        is_threshold=upper,
        is_threshold_lower=lower,
        rejection=tuple(tuple(r) for r in correction.rejection()),
        loss_scale_factor=plan.actor_loss_scale,
        max_model_len=plan.engine_max_model_len,
        update_budget=token_budget(
            arr.actor.use_dynamic_bsz, arr.actor.ppo_max_token_len_per_gpu, _ACTOR_MAX, **_actor_defaults(arr)
        ),
        log_prob_budget=token_budget(
            arr.rollout.log_prob_use_dynamic_bsz,
            arr.rollout.log_prob_max_token_len_per_gpu,
            "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
            **_actor_defaults(arr),
        ),
        serves_reference=plan.reference_from_actor,
        ref=copy.deepcopy(arr.ref) if plan.reference_from_actor else None,
        ref_budget=_reference_budget(arr) if plan.reference_from_actor else None,
        distill=distill_settings(cfg) if plan.use_teacher else None,
    )


def _placed(rollout: Any, plan: RunPlan) -> Any:
    """A copy of the rollout config with the placement the plan decided (asynchronous runs generate apart)."""
    out = copy.deepcopy(rollout)
    out.placement = plan.rollout_placement
    return out


def _reference_budget(arr: Any) -> TokenBudget | None:
    """The reference forward's token budget (ref.log_prob_use_dynamic_bsz / log_prob_max_token_len_per_gpu)."""
    return token_budget(
        arr.ref.log_prob_use_dynamic_bsz,
        arr.ref.log_prob_max_token_len_per_gpu,
        "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
        **_actor_defaults(arr),
    )


def rollout_settings(cfg: Config, plan: RunPlan) -> ReplicaSettings:
    """The rollout worker's settings of a run of `cfg` (placement=separate)."""
    arr = cfg.actor_rollout_ref
    return ReplicaSettings(
        model=copy.deepcopy(arr.model),
        rollout=_placed(arr.rollout, plan),
        seed=cfg.trainer.seed,
        max_model_len=plan.engine_max_model_len,
        max_prompt_length=cfg.data.max_prompt_length,
        truncation=cfg.data.truncation,
        selection_bias=plan.is_moe and arr.actor.router.bias_update_rate > 0,
    )


def reference_settings(cfg: Config, plan: RunPlan) -> ReferenceSettings:
    """The reference's settings of a run of `cfg` (the plan says whether there is one)."""
    arr = cfg.actor_rollout_ref
    return ReferenceSettings(
        model=copy.deepcopy(arr.model),
        ref=copy.deepcopy(arr.ref),
        log_prob_budget=_reference_budget(arr),
        sequence_parallel_size=ref_sequence_parallel_size(arr),
    )


def critic_settings(cfg: Config, plan: RunPlan) -> CriticSettings:
    """The critic's settings of a run of `cfg` under `plan`."""
    c = cfg.critic
    arr_on = cfg.actor_rollout_ref.actor.use_dynamic_bsz  # critic.use_dynamic_bsz's default, as in verl
    return CriticSettings(
        model=copy.deepcopy(cfg.actor_rollout_ref.model),
        critic=copy.deepcopy(c),
        total_optim_steps=total_optim_steps(
            cfg.trainer.total_training_steps, cfg.data.train_batch_size, c.ppo_mini_batch_size, c.ppo_epochs
        ),
        loss_scale_factor=plan.critic_loss_scale,
        update_budget=token_budget(
            c.use_dynamic_bsz,
            c.ppo_max_token_len_per_gpu,
            "critic.ppo_max_token_len_per_gpu",
            enabled_default=arr_on,
            max_tokens_default=c.ppo_max_token_len_per_gpu,
            default_key="critic.ppo_max_token_len_per_gpu",
        ),
        forward_budget=token_budget(
            c.use_dynamic_bsz,
            c.forward_max_token_len_per_gpu,
            "critic.forward_max_token_len_per_gpu",
            enabled_default=arr_on,
            max_tokens_default=c.ppo_max_token_len_per_gpu,
            default_key="critic.ppo_max_token_len_per_gpu",
        ),
    )


_ACTOR_MAX = "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"


def _actor_defaults(arr: Any) -> dict[str, Any]:
    """What a null log-prob budget key of the rollout or the reference stands for: the actor's (verl's defaults)."""
    return {
        "enabled_default": arr.actor.use_dynamic_bsz,
        "max_tokens_default": arr.actor.ppo_max_token_len_per_gpu,
        "default_key": _ACTOR_MAX,
    }


def role_strategy(name: str | None, fsdp: Any, world_size: int, device: Any, sp: int = 1) -> TrainingStrategy:
    """The `TrainingStrategy` of one role's rank from its `strategy` name, `fsdp_config` section and SP size."""
    from conveyor.workers.training.strategy import TrainingStrategy

    return TrainingStrategy(
        name,
        world_size=world_size,
        device=device,
        param_dtype=fsdp.param_dtype,
        reduce_dtype=fsdp.reduce_dtype,
        param_offload=fsdp.param_offload,
        optimizer_offload=fsdp.optimizer_offload,
        defer_grad_sync=fsdp.defer_grad_sync,
        expert_parallel_size=fsdp.expert_parallel_size,
        fsdp_size=fsdp.fsdp_size,
        ulysses_sequence_parallel_size=sp,
    )
