"""The root `Config`: the sections of a run, the checks across them, and the settings derived from several.

Building a `Config` (directly, or by the loader through OmegaConf) runs
`check_tree` once over every section, then the cross-section checks here
(`validate`). What a run does with the settings (where old log-probs come
from, which replay runs, whether a critic runs, the loss scales) is not
derived here: the run plan (`conveyor.trainer.plan`) decides it once. The
checks that need an estimator's declared needs import the registry when they
run, never at import time.

It deliberately does not load YAML or overrides (that is `conveyor.config.loader`)
and does not build anything the settings name.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from conveyor.config.actor import ActorConfig, RefConfig
from conveyor.config.algorithm import AlgorithmConfig
from conveyor.config.critic import CriticConfig
from conveyor.config.data import DataConfig
from conveyor.config.data_plane import TransferQueueConfig
from conveyor.config.distillation import DistillationConfig
from conveyor.config.fields import S, check, check_tree
from conveyor.config.model import ModelConfig
from conveyor.config.parallel import check_sequence_parallel_sizes
from conveyor.config.ray import RayConfig
from conveyor.config.reward import RewardConfig, RewardModelConfig
from conveyor.config.rollout import RolloutConfig
from conveyor.config.trainer import TrainerConfig

__all__ = ["ActorRolloutRefConfig", "Config", "critic_in_use"]


def _estimator_needs(name: str):
    """What the advantage estimator `name` declared at registration (critic, greedy baseline, group size)."""
    from conveyor.algos.advantages import estimator_needs

    return estimator_needs(name)


def critic_in_use(cfg: Config) -> bool:
    """Whether a value model runs: critic.enable when set, else whether the estimator declared it needs values."""
    if cfg.critic.enable is not None:
        return cfg.critic.enable
    return _estimator_needs(cfg.algorithm.adv_estimator).needs_critic


@dataclass
class ActorRolloutRefConfig:
    """Policy, rollout and reference: one model, three roles."""

    model: ModelConfig = S(ModelConfig, "model")
    actor: ActorConfig = S(ActorConfig, "actor")
    ref: RefConfig = S(RefConfig, "reference")
    rollout: RolloutConfig = S(RolloutConfig, "rollout")


@dataclass
class Config:
    """The root of a run's configuration."""

    data: DataConfig = S(DataConfig, "prompts")
    actor_rollout_ref: ActorRolloutRefConfig = S(ActorRolloutRefConfig, "policy, rollout and reference")
    critic: CriticConfig = S(CriticConfig, "value model")
    algorithm: AlgorithmConfig = S(AlgorithmConfig, "advantages and KL")
    reward: RewardConfig = S(RewardConfig, "reward functions")
    reward_model: RewardModelConfig = S(RewardModelConfig, "reward shaping")
    distillation: DistillationConfig = S(DistillationConfig, "on-policy distillation from teachers")
    trainer: TrainerConfig = S(TrainerConfig, "the loop")
    transfer_queue: TransferQueueConfig = S(TransferQueueConfig, "the data plane", resume_neutral=True)
    ray: RayConfig = S(RayConfig, "Ray", resume_neutral=True)

    def __post_init__(self) -> None:
        check_tree(self)

    def validate(self, prefix: str) -> None:
        """The checks across sections (run by `check_tree` after every section's own)."""
        bs = self.data.train_batch_size
        mb = self.actor_rollout_ref.actor.ppo_mini_batch_size
        t = self.trainer
        world = t.nnodes * max(t.n_gpus_per_node, t.num_cpu_workers)
        n = self.actor_rollout_ref.rollout.n
        self._check_expert_parallel(world)
        check_sequence_parallel_sizes(self, world)
        # Every rank needs at least one sequence of each mini-batch: a sharded update is a collective.
        check(
            mb * n >= world,
            "actor_rollout_ref.actor.ppo_mini_batch_size",
            f"a mini-batch of {mb} prompts x {n} samples is fewer sequences than the {world} ranks; raise it "
            "or use fewer ranks",
        )
        check(
            bs % mb == 0,
            "actor_rollout_ref.actor.ppo_mini_batch_size",
            f"data.train_batch_size={bs} must be divisible by it (got {mb})",
        )
        model = self.actor_rollout_ref.model
        # The actor always trains: its weights and AdamW's moments are in model.dtype.
        check(
            model.dtype == "float32" or model.allow_low_precision_master_weights,
            "actor_rollout_ref.model.dtype",
            f"{model.dtype} master weights make the actor (and critic) train in {model.dtype}, AdamW state "
            "included, where updates below its precision are lost; for bf16 compute over float32 masters set "
            "actor_rollout_ref.model.dtype=float32 and actor_rollout_ref.actor.fsdp_config.param_dtype=bfloat16 "
            "(strategy fsdp2), or set actor_rollout_ref.model.allow_low_precision_master_weights=true to train "
            f"in {model.dtype} anyway",
        )
        algo = self.algorithm
        check(
            not (
                self.actor_rollout_ref.actor.router_replay.mode == "R2" and algo.rollout_correction.bypass_mode is True
            ),
            "algorithm.rollout_correction.bypass_mode",
            "router_replay.mode=R2 records the routing in the old-log-prob forward, which bypass mode skips: "
            "set bypass_mode to null or false, or use router_replay.mode=R3",
        )
        need = _estimator_needs(algo.adv_estimator)
        if algo.filter_groups.enable:
            check(
                n >= 2,
                "actor_rollout_ref.rollout.n",
                f"algorithm.filter_groups.enable compares the samples of a prompt: set it to 2 or more, got {n}",
            )
        self._check_sum_pi_squared(need.sum_pi_squared)
        check(
            n >= need.min_group_size,
            "actor_rollout_ref.rollout.n",
            f"algorithm.adv_estimator={algo.adv_estimator} compares the samples of a prompt: set it to "
            f"{need.min_group_size} or more, got {n}",
        )
        ob = self.reward_model.overlong_buffer
        if ob.enable and ob.len is not None:
            check(
                ob.len <= self.data.max_response_length,
                "reward_model.overlong_buffer.len",
                f"must be at most data.max_response_length={self.data.max_response_length}, got {ob.len}",
            )
        check(
            not (self.actor_rollout_ref.rollout.agent.enabled and self.actor_rollout_ref.rollout.multi_turn.enable),
            "actor_rollout_ref.rollout.multi_turn.enable",
            "an agent through the gateway runs its own turns: set multi_turn.enable=false with "
            "actor_rollout_ref.rollout.agent (the call format is still multi_turn.format)",
        )
        if t.v1.is_async:
            self._check_async()
        if critic_in_use(self):
            cmb = self.critic.ppo_mini_batch_size
            check(
                bs % cmb == 0,
                "critic.ppo_mini_batch_size",
                f"data.train_batch_size={bs} must be divisible by it (got {cmb})",
            )
            check(
                cmb * n >= world,
                "critic.ppo_mini_batch_size",
                f"a mini-batch of {cmb} prompts x {n} samples is fewer sequences than the {world} ranks",
            )

    def _check_sum_pi_squared(self, estimator_reads_it: bool) -> None:
        """sum_pi_squared comes from the old-log-prob forward: on when the estimator reads it, never under bypass."""
        key = self.actor_rollout_ref.actor.calculate_sum_pi_squared
        algo = self.algorithm
        check(
            not (estimator_reads_it and key is False),
            "actor_rollout_ref.actor.calculate_sum_pi_squared",
            f"algorithm.adv_estimator={algo.adv_estimator} reads sum_pi_squared: set it to true or null",
        )
        check(
            not ((estimator_reads_it or key) and algo.rollout_correction.bypass_mode is True),
            "algorithm.rollout_correction.bypass_mode",
            "sum_pi_squared (actor_rollout_ref.actor.calculate_sum_pi_squared"
            + (f", read by adv_estimator={algo.adv_estimator}" if estimator_reads_it else "")
            + ") is written by the old-log-prob forward, which bypass mode skips: set bypass_mode to null or false",
        )

    def _check_expert_parallel(self, world: int) -> None:
        """Each role's fsdp_config.fsdp_size and expert_parallel_size fit its strategy, its ranks and its experts."""
        arr = self.actor_rollout_ref
        tiny = arr.model.tiny if arr.model.path is None else None
        for prefix, role in (
            ("actor_rollout_ref.actor", arr.actor),
            ("actor_rollout_ref.ref", arr.ref),
            ("critic", self.critic),
        ):
            ep, fsdp_size = role.fsdp_config.expert_parallel_size, role.fsdp_config.fsdp_size
            if fsdp_size is not None:
                size_key = f"{prefix}.fsdp_config.fsdp_size"
                check(
                    world % fsdp_size == 0,
                    size_key,
                    f"must divide the {world} ranks, or be null (all of them), got {fsdp_size}",
                )
                check(
                    fsdp_size == world or role.strategy in (None, "fsdp2"),
                    size_key,
                    f"shards within groups under strategy fsdp2 only, not {role.strategy}: set "
                    f"{prefix}.strategy=fsdp2 or {size_key}=null",
                )
                check(
                    ep == 1 or fsdp_size == world,
                    size_key,
                    f"HSDP (groups of {fsdp_size}) with "
                    f"{prefix}.fsdp_config.expert_parallel_size={ep} is not supported yet: set one of them back "
                    "(fsdp_size=null or expert_parallel_size=1)",
                )
            if ep == 1:
                continue
            key = f"{prefix}.fsdp_config.expert_parallel_size"
            check(
                role.strategy in (None, "fsdp2"),
                key,
                f"expert parallelism runs under strategy fsdp2, not "
                f"{role.strategy}: set {prefix}.strategy=fsdp2 or {key}=1",
            )
            check(
                world % ep == 0,
                key,
                f"must divide the {world} ranks (trainer.nnodes x trainer.n_gpus_per_node "
                f"or trainer.num_cpu_workers), got {ep}",
            )
            if tiny is not None:
                check(
                    tiny.arch != "qwen3",
                    key,
                    f"needs a Mixture-of-Experts model; the tiny {tiny.arch} is dense: "
                    f"set {key}=1 or actor_rollout_ref.model.tiny.arch=qwen3_moe",
                )
                check(
                    tiny.num_experts % ep == 0,
                    key,
                    f"must divide actor_rollout_ref.model.tiny.num_experts={tiny.num_experts}, got {ep}",
                )

    def _check_async(self) -> None:
        """What the asynchronous trainer cannot combine with: each an error naming the key."""
        k = self.trainer.v1.sampler.max_off_policy_threshold
        check(
            not (k > 0 and self.algorithm.rollout_correction.bypass_mode is True),
            "algorithm.rollout_correction.bypass_mode",
            f"with trainer.v1.sampler.max_off_policy_threshold={k} the rollout's log-probs come from an older "
            "policy and cannot stand in for the proximal policy's: set bypass_mode to null or false",
        )
        check(
            not (self.trainer.v1.separate_async.partial_rollout and self.actor_rollout_ref.rollout.multi_turn.enable),
            "trainer.v1.separate_async.partial_rollout",
            "weights that arrive between two tokens are counted within one engine call, and a multi-turn rollout "
            "makes one per turn: set partial_rollout=false with multi_turn.enable",
        )
        agent = self.actor_rollout_ref.rollout.agent
        check(
            not (self.trainer.v1.separate_async.partial_rollout and agent.enabled),
            "trainer.v1.separate_async.partial_rollout",
            "an agent's session spans many engine calls, which weights arriving between two tokens cannot be "
            "counted over: set partial_rollout=false with actor_rollout_ref.rollout.agent",
        )

    @property
    def run_dir(self) -> Path:
        """The run directory."""
        if self.trainer.default_local_dir:
            return Path(self.trainer.default_local_dir)
        return Path("runs") / self.trainer.experiment_name
