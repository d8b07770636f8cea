"""The run plan's type: what a run does, decided once from the config, the device and the engines.

`conveyor.trainer.plan.build_run_plan` makes it (its module docstring gives the rules); the trainer, the
worker groups and the workers read it. It lives beside the config, below every package that reads it, so
that the workers name the plan's type without importing the trainer that builds it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["RunPlan", "OLD_LOG_PROB_SOURCES", "COLOCATED", "SEPARATE", "IN_ACTOR", "BESIDE_REPLICAS", "PLACEMENTS"]

# Where old_log_probs come from: the rollout's (bypass), the old-log-prob forward, or the update's forward.
OLD_LOG_PROB_SOURCES = ("rollout", "forward", "update")

# Where a role's ranks run (`RunPlan.roles`): a worker of its own in each of the actor's rank processes; ranks of its
# own; no worker, the actor's own worker serves it (the LoRA reference: the actor with its adapters disabled); or in
# the rollout replicas' processes (the replicas and the reward worker: here, or Ray actors beside the trainer).
COLOCATED, SEPARATE, IN_ACTOR, BESIDE_REPLICAS = "colocated", "separate", "actor", "replicas"
PLACEMENTS = (COLOCATED, SEPARATE, IN_ACTOR, BESIDE_REPLICAS)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunPlan:
    """What a run does, decided once (see the module docstring for the rules); fields grouped by what they decide."""

    # ---- the device and the rollout: which engine, where it runs
    device: str  # the device the workers run on
    engine: str  # actor_rollout_ref.rollout.name
    engine_returns_routing: bool  # the engine's declared capability on `device`
    engine_max_model_len: int | None  # the longest sequence an engine with its own KV cache holds (None: hf)
    rollout_placement: str  # where the engines run: colocated (actor ranks), separate (rollout group), none (replay)
    rollout_process: str  # where the rollout group and the reward worker run: "trainer" (this process) or "own" (Ray)
    off_policy: bool  # samples may come from an older policy (asynchronous, k > 0)

    # ---- old log-probs and the correction of the rollout-vs-trainer gap
    old_log_probs: str  # one of OLD_LOG_PROB_SOURCES
    forward_sum_pi_squared: bool = False  # the old-log-prob forward writes sum_pi_squared (the estimator reads it)
    rollout_is_level: str | None  # importance weights: None, token or sequence
    rollout_rs: bool  # rejection sampling is on

    # ---- MoE routing: where it comes from, who replays it
    is_moe: bool  # the policy has routed experts (from the tiny config or the checkpoint's config.json)
    replay_mode: str  # the router replay that runs: disabled, R2 or R3
    replay_requested: str  # actor_rollout_ref.actor.router_replay.mode as configured
    replay_reason: str  # why replay_mode differs from the request ("" when it does not)
    routing_source: str  # where routed_experts come from: rollout, forward or none
    rollout_captures_routing: bool  # the generate call asks the engine for routed_experts
    forward_records_routing: bool  # the old-log-prob forward writes routed_experts (R2, or metrics without routing)
    forward_replays_routing: bool  # the old-log-prob forward replays the rollout's routing (R3)
    update_replays_routing: bool  # the update's forward replays routed_experts (R2 or R3)
    load_balance_from_forward: bool  # the rollout/moe/* metrics describe the trainer's forward, not the rollout's

    # ---- the roles of the run, and where they run
    # Every role that runs -> its placement (one of PLACEMENTS), in the role table's order
    # (`conveyor.workers.placement.role_table.ROLES`); a role not in it does not run.
    roles: dict[str, str]

    # ---- the losses' scales
    actor_loss_scale: float  # seq-mean-token-sum-norm divisor of the actor's loss
    critic_loss_scale: float  # and of the critic's

    # ---- in words
    decisions: tuple[str, ...]  # what was decided and why, in words
    warnings: tuple[str, ...] = ()  # decisions the run warns about at its start (also among `decisions`)

    @property
    def bypass(self) -> bool:
        """Whether old_log_probs are the rollout's (no old-log-prob forward)."""
        return self.old_log_probs == "rollout"

    @property
    def proximal_from_update(self) -> bool:
        """Whether the update's own forward writes old_log_probs (off-policy, one optimizer step per batch)."""
        return self.old_log_probs == "update"

    def runs(self, role: str) -> bool:
        """Whether `role` runs in this plan."""
        return role in self.roles

    def placement(self, role: str) -> str:
        """Where `role` runs (`colocated` for a role that does not: its default)."""
        return self.roles.get(role, COLOCATED)

    # The built-in roles' flags, read where a stage or a budget asks about one role by name.
    @property
    def use_critic(self) -> bool:
        """Whether the critic runs."""
        return self.runs("critic")

    @property
    def use_reference(self) -> bool:
        """Whether the reference policy runs (its own worker, or the actor with its LoRA adapters disabled)."""
        return self.runs("ref")

    @property
    def reference_from_actor(self) -> bool:
        """Whether the reference is the actor with its LoRA adapters disabled (no second model)."""
        return self.roles.get("ref") == IN_ACTOR

    @property
    def use_teacher(self) -> bool:
        """Whether on-policy distillation's teachers score every batch (distillation.enabled)."""
        return self.runs("teacher")

    @property
    def teacher_placement(self) -> str:
        """The teachers' ranks: in the actor's processes (colocated), or ranks of their own (separate)."""
        return self.placement("teacher")

    @property
    def use_reward_model(self) -> bool:
        """Whether a reward model scores every response after the rule reward (reward_model.enable)."""
        return self.runs("reward_model")

    @property
    def reward_model_placement(self) -> str:
        """The reward model's ranks: in the actor's processes (colocated), or ranks of their own (separate)."""
        return self.placement("reward_model")

    @property
    def use_judge(self) -> bool:
        """Whether a generative judge scores every response, last (reward_model.judge.enable)."""
        return self.runs("judge")

    def to_dict(self) -> dict[str, Any]:
        """The plan as plain JSON-ready values (what plan.json holds): the fields, and the roles' flags by name."""
        out = dataclasses.asdict(self)
        out["decisions"] = list(self.decisions)
        out["warnings"] = list(self.warnings)
        # Readers of plan.json from before the roles map find their keys.
        out.update(
            use_critic=self.use_critic,
            use_reference=self.use_reference,
            reference_from_actor=self.reference_from_actor,
            use_teacher=self.use_teacher,
            teacher_placement=self.teacher_placement,
            use_reward_model=self.use_reward_model,
            reward_model_placement=self.reward_model_placement,
            use_judge=self.use_judge,
        )
        return out

    def describe(self) -> str:
        """One block of text for the log: the decisions, one per line."""
        return "run plan:\n" + "\n".join(f"  - {d}" for d in self.decisions)
