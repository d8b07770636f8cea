"""The built-in roles: their typed handles and their records in the role table.

The trainer calls a role through its handle (`ActorGroup.update_actor(meta)`), whose methods name the worker's
endpoints as functions, not strings: a reader and an IDE follow the call from the trainer into the worker. Below
the handles, each role's decision (whether and where it runs, with the plan's line saying why) and its worker's
arguments; the roles' records (`Role`) are registered together at the end of this module, in the order the roles
are built: the actor, the reference, the critic, the teachers, the rollout replicas, the reward model, the judge and
the reward worker. A plugin's role is registered after them the same way (`register_role`).

What it deliberately does not do: build groups (`conveyor.workers.placement.roles`) or define what an endpoint
computes (`conveyor.workers.ranks`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from conveyor.config.root import critic_in_use
from conveyor.protocol import KVBatchMeta
from conveyor.weights import DeltaSettings, Endpoints, WeightShipper
from conveyor.workers.placement.group import LocalWorkerGroup, WorkerGroup, use_ray
from conveyor.workers.placement.recovery import fault_tolerant
from conveyor.workers.placement.role_table import (
    BESIDE_REPLICAS,
    COLOCATED,
    IN_ACTOR,
    SEPARATE,
    Role,
    RoleDecision,
    RoleHandle,
    Where,
    register_role,
)
from conveyor.workers.ranks.actor import PolicyWorker
from conveyor.workers.ranks.critic import CriticWorker
from conveyor.workers.ranks.distill import distillation_decision, teacher_settings
from conveyor.workers.ranks.judge import JudgeWorker, judge_settings
from conveyor.workers.ranks.reference import ReferenceWorker
from conveyor.workers.ranks.replica import ReplicaWorker
from conveyor.workers.ranks.reward import RewardWorker
from conveyor.workers.ranks.reward_model import RewardModelWorker, reward_model_settings
from conveyor.workers.ranks.settings import actor_settings, critic_settings, reference_settings, rollout_settings
from conveyor.workers.ranks.teacher import TeacherWorker

if TYPE_CHECKING:
    from conveyor.config import Config
    from conveyor.config.plan import RunPlan

__all__ = [
    "ActorGroup",
    "ReferenceGroup",
    "CriticGroup",
    "RewardGroup",
    "RewardModelGroup",
    "JudgeGroup",
    "ReplicaGroup",
    "TeacherGroup",
    "WEIGHT_ENDPOINTS",
]


class ActorGroup(RoleHandle):
    """The policy: rollout, old log-probs, the PPO update and its state."""

    def generate_sequences(self, meta: KVBatchMeta) -> KVBatchMeta:
        """Stage 2 on every rank: responses, masks, sampled log-probs (and routed experts)."""
        return self.ranks.call(PolicyWorker.generate_sequences, meta)

    def compute_log_prob(self, meta: KVBatchMeta) -> KVBatchMeta:
        """Stage 4 on every rank: old_log_probs (and entropy)."""
        return self.ranks.call(PolicyWorker.compute_log_prob, meta)

    def compute_routing_agreement(self, meta: KVBatchMeta) -> KVBatchMeta:
        """How often the trainer's own routing matches the rollout's (metrics only)."""
        return self.ranks.call(PolicyWorker.compute_routing_agreement, meta)

    def update_actor(self, meta: KVBatchMeta) -> KVBatchMeta:
        """One optimizer step over a mini-batch, split across ranks."""
        return self.ranks.call(PolicyWorker.update_actor, meta)

    def save_checkpoint(self, path: str) -> dict[str, Any]:
        """Every rank writes its shards under `path`; the schedule state to keep with the checkpoint (rank 0's)."""
        return self.ranks.call_all(PolicyWorker.save_checkpoint, path)[0]

    def load_checkpoint(self, path: str, extra: dict[str, Any]) -> None:
        """Every rank reads its shards from `path` (written by any number of ranks) and the schedule state."""
        self.ranks.call_all(PolicyWorker.load_checkpoint, path, extra)

    def model_state_dict(self) -> dict[str, Any]:
        """The whole model's weights, gathered from the ranks."""
        return self.ranks.call_all(PolicyWorker.model_state_dict)[0]


class ReplicaGroup(RoleHandle):
    """The rollout worker group's engines: they generate, and take the actor's weights first.

    Synchronous runs: before a rollout the group asks the actor for its weights' version; when its replicas serve an
    older one, the actor streams its weights to them. Asynchronous runs generate on another thread while the actor
    trains (`conveyor.trainer.sources`): `stage_weights` takes the weights as they are now and returns what loads
    them on the rollout's thread, in order with the batches. How the weights travel (in process, the weight channel,
    shared memory, Ray's object store) is the group's `WeightShipper`'s (`conveyor.weights`). When the reward worker
    lives in the replicas' processes (`colocated_reward`), a replica can generate and score a batch in one call.
    """

    def __init__(
        self,
        ranks: WorkerGroup,
        actor: ActorGroup,
        *,
        bucket_bytes: int,
        dtype: torch.dtype | None = None,
        fault_tolerance: Any = None,
        delta: Any = None,
    ):
        super().__init__(ranks)
        self.actor = actor
        here = isinstance(ranks, LocalWorkerGroup)
        # A replica in this process says its engine's dtype itself; one on Ray has it resolved from the config.
        engine = getattr(ranks.worker, "engine", None) if here else None
        self.weights = WeightShipper(
            actor.ranks,
            ranks,
            WEIGHT_ENDPOINTS,
            bucket_bytes=bucket_bytes,
            dtype=getattr(engine, "dtype", None) if engine is not None else dtype,
            actor_here=isinstance(actor.ranks, LocalWorkerGroup),
            replicas_here=here,
            # actor_rollout_ref.rollout.delta_sync: after a whole sync, only the elements that changed travel.
            delta=DeltaSettings(**dataclasses.asdict(delta)) if delta is not None else None,
        )
        # Replicas in processes of their own that die or hang are replaced (`fault_tolerance.enable`).
        self.recovery = fault_tolerant(ranks, self.weights, fault_tolerance)

    @classmethod
    def attach(
        cls, ranks: WorkerGroup | None, *, handles: dict[str, RoleHandle], cfg: Config, plan: RunPlan
    ) -> ReplicaGroup:
        """The replicas' handle: they take the weights of the actor (built before them) over the configured buckets."""
        assert ranks is not None
        ro = cfg.actor_rollout_ref.rollout
        return cls(
            ranks,
            handles["actor"],
            bucket_bytes=ro.update_weights_bucket_megabytes << 20,
            dtype=_configured_engine_dtype(cfg, plan.device),
            fault_tolerance=ro.fault_tolerance,
            delta=ro.delta_sync,
        )

    @property
    def served(self) -> int | None:
        """The actor's optimizer-step count the replicas serve (None: not synced, or staged by label since)."""
        return self.weights.served

    @property
    def dtype(self) -> torch.dtype | None:
        """The dtype the replicas' engines hold, which weights are cast to before they leave (None: as held)."""
        return self.weights.dtype

    @property
    def colocated_reward(self) -> bool:
        """Whether the reward worker lives in the replicas' processes (Ray): a batch can then be scored in the call
        that generates it."""
        return "reward" in getattr(getattr(self.ranks, "ranks", None), "roles", ())

    @property
    def renders_prompts(self) -> bool:
        """Whether a batch's prompts are best rendered by the replicas that generate it (`RENDER_PROMPTS`): they run
        in processes of their own, which then write the prompts with the rollout's fields, in one put."""
        return not isinstance(self.ranks, LocalWorkerGroup)

    @property
    def in_process(self) -> bool:
        """Whether the replicas and the actor run in this process (one local replica)."""
        return self.weights.in_process

    def generate_sequences(self, meta: KVBatchMeta, *, sync: bool = True, score: bool = False) -> KVBatchMeta:
        """Stage 2 on the replicas, after a sync if the actor has moved on (unless `sync` is False): the rollout's
        fields.

        `score` (needs `colocated_reward`): stage 3 too, by the reward worker in each replica's process, in the same
        call: one round trip per batch instead of two, and the reward's metrics in the same `extra_info`.
        """
        metrics = self.sync() if sync else {}
        with self.weights.loading(meta) as meta:  # weights staged last, loaded by the replicas before they generate
            if score:
                assert self.colocated_reward, "scoring in the generation call needs the reward worker on the replicas"
                steps = [("rollout", ReplicaWorker.generate_sequences), ("reward", RewardWorker.compute_reward)]
                issue = functools.partial(self.ranks.call_chain, steps)
            else:
                issue = functools.partial(self.ranks.call, ReplicaWorker.generate_sequences)
            out = self.recovery.call(issue, meta) if self.recovery is not None else issue(meta)
        if metrics:  # one entry per rank, as every per-rank metric arrives
            out.extra_info.update({k: [v] * self.ranks.world_size for k, v in metrics.items()})
        return out

    def sync(self) -> dict[str, float]:
        """Give every replica the actor's current weights if they serve older ones; the sync's metrics."""
        return self.weights.sync()

    def stage_weights(self, label: int) -> Callable[[], dict[str, float]]:
        """The actor's weights as they are now, labelled `label`; returns what gives them to the replicas (run it on
        the thread that generates, before the batches that are to use them)."""
        return self.weights.stage(label)

    def take_weights_between_tokens(self) -> None:
        """Partial rollouts: weights reach the replicas between two tokens of a generation."""
        self.weights.take_between_tokens()

    def shutdown(self) -> None:
        """Release the role's ranks (and the thread that sends staged weights)."""
        self.weights.close()
        super().shutdown()


# The workers' weight endpoints, named for the shipper (which imports no worker).
WEIGHT_ENDPOINTS = Endpoints(
    version=PolicyWorker.weights_version,
    address=PolicyWorker.channel_address,
    join_sender=PolicyWorker.join_weight_channel,
    send=PolicyWorker.send_weights,
    join_receiver=ReplicaWorker.join_weight_channel,
    receive=ReplicaWorker.receive_weights,
    take=ReplicaWorker.take_weights,
    take_shared=ReplicaWorker.take_shared_weights,
    between_tokens=ReplicaWorker.take_weights_between_tokens,
    load_staged=ReplicaWorker.load_staged_weights,
)


class ReferenceGroup(RoleHandle):
    """The frozen reference policy: its own worker, or (LoRA) the actor's ranks with their adapters disabled."""

    def __init__(self, ranks: WorkerGroup, *, from_actor: bool = False):
        super().__init__(ranks)
        self.from_actor = from_actor

    @classmethod
    def attach(
        cls, ranks: WorkerGroup | None, *, handles: dict[str, RoleHandle], cfg: Config, plan: RunPlan
    ) -> ReferenceGroup:
        """The reference's handle: over its own worker's ranks, or (no worker: LoRA) over the actor's."""
        return cls(handles["actor"].ranks, from_actor=True) if ranks is None else cls(ranks)

    def compute_log_prob(self, meta: KVBatchMeta) -> KVBatchMeta:
        """Stage 5 on every rank: ref_log_prob."""
        if self.from_actor:
            return self.ranks.call(PolicyWorker.compute_ref_log_prob, meta)
        return self.ranks.call(ReferenceWorker.compute_log_prob, meta)

    def shutdown(self) -> None:
        """Release the role's ranks (the actor's own handle releases them when they are the actor's)."""
        if not self.from_actor:
            self.ranks.shutdown()


class CriticGroup(RoleHandle):
    """The value model."""

    def compute_values(self, meta: KVBatchMeta) -> KVBatchMeta:
        """Stage 6 on every rank: values."""
        return self.ranks.call(CriticWorker.compute_values, meta)

    def update_critic(self, meta: KVBatchMeta) -> KVBatchMeta:
        """One critic optimizer step over a mini-batch, split across ranks."""
        return self.ranks.call(CriticWorker.update_critic, meta)

    def save_checkpoint(self, path: str) -> dict[str, Any]:
        """Every rank writes its shards under `path`; the schedule state to keep with the checkpoint (rank 0's)."""
        return self.ranks.call_all(CriticWorker.save_checkpoint, path)[0]

    def load_checkpoint(self, path: str, extra: dict[str, Any]) -> None:
        """Every rank reads its shards from `path` and the schedule state."""
        self.ranks.call_all(CriticWorker.load_checkpoint, path, extra)


class TeacherGroup(RoleHandle):
    """The frozen teachers of on-policy distillation."""

    def compute_teacher_log_prob(self, meta: KVBatchMeta) -> KVBatchMeta:
        """On every rank: each sample's teacher writes its log-probs (and top-k or full-vocabulary ones)."""
        return self.ranks.call(TeacherWorker.compute_teacher_log_prob, meta)


class RewardGroup(RoleHandle):
    """The reward functions."""

    def compute_reward(self, meta: KVBatchMeta) -> KVBatchMeta:
        """Stage 3: rm_scores and acc."""
        return self.ranks.call(RewardWorker.compute_reward, meta)


class RewardModelGroup(RoleHandle):
    """The reward model (reward_model.enable)."""

    def compute_rm_score(self, meta: KVBatchMeta) -> KVBatchMeta:
        """Stage 3, after the rule reward: the model's score, summed into rm_scores with the rule reward."""
        return self.ranks.call(RewardModelWorker.compute_rm_score, meta)

    def score(self, meta: KVBatchMeta) -> KVBatchMeta:
        """Stage 3: the reward model's score (`compute_rm_score`)."""
        return self.compute_rm_score(meta)


class JudgeGroup(RoleHandle):
    """The generative judge (reward_model.judge.enable)."""

    def compute_judge_score(self, meta: KVBatchMeta) -> KVBatchMeta:
        """Stage 3, last: the judge's score, summed into rm_scores with the earlier rewards."""
        return self.ranks.call(JudgeWorker.compute_judge_score, meta)

    def score(self, meta: KVBatchMeta) -> KVBatchMeta:
        """Stage 3: the judge's score (`compute_judge_score`)."""
        return self.compute_judge_score(meta)


def _configured_engine_dtype(cfg: Config, device_type: str) -> torch.dtype | None:
    """The dtype the replicas' engines hold on the run's device; None where it is the model's (nothing to cast)."""
    from conveyor.rollout.base import served_dtype

    model_dtype = cfg.actor_rollout_ref.model.dtype
    dtype = served_dtype(cfg.actor_rollout_ref.rollout, model_dtype, device_type)
    return None if dtype == model_dtype else getattr(torch, dtype)


# --------------------------------------------------------------------------- each role's decision
def _always_colocated(cfg: Config, d: RoleDecision) -> str:
    """The actor runs in every run, on the training ranks."""
    return COLOCATED


def _reference(cfg: Config, d: RoleDecision) -> str | None:
    """The reference runs when a KL term (loss or reward) is on; with LoRA it is the actor, adapters disabled."""
    arr, algo = cfg.actor_rollout_ref, cfg.algorithm
    kinds = [k for k, on in (("use_kl_loss", arr.actor.use_kl_loss), ("use_kl_in_reward", algo.use_kl_in_reward)) if on]
    if not kinds:
        return None
    d.why.append(f"reference policy: on ({', '.join(kinds)})")
    if arr.model.lora_rank > 0:  # LoRA trains adapters over frozen weights: those weights are the reference
        d.why.append(
            f"reference policy: the actor with its LoRA adapters disabled (actor_rollout_ref.model.lora_rank="
            f"{arr.model.lora_rank}: the base weights are frozen), no reference model built"
        )
        return IN_ACTOR
    return COLOCATED


def _critic(cfg: Config, d: RoleDecision) -> str | None:
    """The critic runs when `critic.enable` says so, or when null, when the estimator needs values."""
    on = critic_in_use(cfg)
    d.why.append(
        f"critic: {'on' if on else 'off'}"
        + (" (critic.enable)" if cfg.critic.enable is not None else f" (adv_estimator={cfg.algorithm.adv_estimator})")
    )
    return COLOCATED if on else None


def _teacher(cfg: Config, d: RoleDecision) -> str | None:
    """On-policy distillation's teachers run when it is on, where `distillation.placement` puts them."""
    if not cfg.distillation.enabled:
        return None
    d.why.append(distillation_decision(cfg))
    return cfg.distillation.placement


def _rollout(cfg: Config, d: RoleDecision) -> str | None:
    """The rollout replicas run when the engines are placed apart from the actor (the plan's rollout decision)."""
    return BESIDE_REPLICAS if d.rollout_placement == SEPARATE else None


def _reward_model(cfg: Config, d: RoleDecision) -> str | None:
    """The reward model runs when `reward_model.enable`, where `reward_model.placement` puts it, except that an
    asynchronous run on Ray places it apart."""
    rm = cfg.reward_model
    if not rm.enable:
        return None
    placement = rm.placement
    reason = f"reward_model.placement={placement}"
    # The rollout thread scores a batch while the actor's ranks train: a reward model in the actor's processes would
    # queue its forwards behind (and between) the actor's collectives, in an order the ranks need not share.
    if placement == COLOCATED and cfg.trainer.v1.is_async and use_ray(cfg):
        placement = SEPARATE
        reason = (
            f"trainer.v1.trainer_mode={cfg.trainer.v1.trainer_mode} on Ray: it scores while the actor trains, so "
            "on ranks of its own"
        )
    d.why.append(
        f"reward model: {rm.model.path} ({placement}; {reason}); reward = {rm.model_weight:g} x its score + "
        f"{rm.rule_weight:g} x the rule reward"
    )
    return placement


def _judge(cfg: Config, d: RoleDecision) -> str | None:
    """The generative judge runs when `reward_model.judge.enable`, always apart, on an engine of its own."""
    judge = cfg.reward_model.judge
    if not judge.enable:
        return None
    d.why.append(
        f"judge: {judge.model.path} on the {judge.engine} engine ({judge.parser} parser); reward adds "
        f"{judge.weight:g} x its score"
    )
    return SEPARATE


def _always_beside_replicas(cfg: Config, d: RoleDecision) -> str:
    """The reward worker runs in every run, where the rollout replicas run (in their processes on Ray)."""
    return BESIDE_REPLICAS


# --------------------------------------------------------------------------- each role's worker arguments
def _model_role(build: Callable[[Config, RunPlan], Any]) -> Callable[[Config, RunPlan, Where], dict[str, Any]]:
    """The arguments of a worker that loads the policy's checkpoint: its settings and where it runs."""
    return lambda cfg, plan, where: {"settings": build(cfg, plan), **where.model_kwargs()}


def _own_checkpoint(build: Callable[[Config, RunPlan], Any], *, tokenizer: bool) -> Callable[..., dict[str, Any]]:
    """The arguments of a worker that loads its own checkpoints (never the actor's model_path); a scorer that reads
    the policy's tokens also gets the policy's tokenizer."""

    def kwargs(cfg: Config, plan: RunPlan, where: Where) -> dict[str, Any]:
        extra = {"policy_tokenizer": where.tokenizer} if tokenizer else {}
        return {"settings": build(cfg, plan), **extra, "data_plane": where.data_plane, "device": where.device}

    return kwargs


def _reward_kwargs(cfg: Config, plan: RunPlan, where: Where) -> dict[str, Any]:
    """The reward worker's arguments: the tokenizer, the custom reward function, its limits and the sandbox."""
    custom = cfg.reward.custom_reward_function
    return {
        "tokenizer": where.tokenizer,
        "data_plane": where.data_plane,
        "custom_reward_path": custom.path,
        "custom_reward_name": custom.name,
        "timeout_s": cfg.reward.timeout_s,
        "overlong_buffer": _overlong(cfg),
        "sandbox": dataclasses.asdict(cfg.reward.sandbox),
    }


def _overlong(cfg: Config) -> tuple[int, int, float, bool] | None:
    """The reward worker's overlong-shaping arguments, or None when it is off."""
    ob = cfg.reward_model.overlong_buffer
    if not ob.enable:
        return None
    max_len = cfg.data.max_response_length
    return max_len, ob.len or max(1, max_len // 4), ob.penalty_factor, ob.log


# --------------------------------------------------------------------------- the table, in build order
for _role in (
    Role("actor", PolicyWorker, _model_role(actor_settings), ActorGroup, _always_colocated),
    Role("ref", ReferenceWorker, _model_role(reference_settings), ReferenceGroup, _reference),
    Role("critic", CriticWorker, _model_role(critic_settings), CriticGroup, _critic),
    Role(
        "teacher",
        TeacherWorker,
        _own_checkpoint(teacher_settings, tokenizer=False),
        TeacherGroup,
        _teacher,
        ranks_apart=lambda cfg: cfg.distillation.num_workers,
    ),
    Role("rollout", ReplicaWorker, _model_role(rollout_settings), ReplicaGroup, _rollout, colocate=False),
    Role(
        "reward_model",
        RewardModelWorker,
        _own_checkpoint(reward_model_settings, tokenizer=True),
        RewardModelGroup,
        _reward_model,
        ranks_apart=lambda cfg: cfg.reward_model.num_workers,
        scores=True,
    ),
    Role(
        "judge",
        JudgeWorker,
        _own_checkpoint(judge_settings, tokenizer=True),
        JudgeGroup,
        _judge,
        colocate=False,
        scores=True,
    ),
    Role("reward", RewardWorker, _reward_kwargs, RewardGroup, _always_beside_replicas, colocate=False),
):
    register_role(_role)
