"""The roles of a run: which worker each one runs, built the same way in this process and on Ray, and typed handles.

`worker_specs` is the one place that turns the config and the run plan into
each role's worker class and constructor arguments (the role's settings,
`conveyor.workers.ranks.settings`). `LocalWorkerGroup` and `RayWorkerGroup` both
build their ranks from these specs, so a setting cannot reach workers in this
process and miss those on Ray (or the reverse). The model roles
(`MODEL_ROLES`: actor, reference, critic, teacher, reward model) are colocated: rank i of each is
built by one `ColocatedWorker` in one process, here or in rank i's Ray actor;
the reward worker runs on its own.

The trainer calls a role through its handle (`ActorGroup.update_actor(meta)`),
whose methods name the worker's endpoints as functions, not strings: a reader
and an IDE follow the call from the trainer into the worker.

What it deliberately does not do: decide where ranks run (`group.py`,
`ray_group.py`) or what an endpoint computes (`actor.py`, `critic.py`,
`reward.py`, `reference.py`), or decide what a run does (`conveyor.trainer.plan`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from conveyor.config import Config
from conveyor.data_plane.base import DataPlane
from conveyor.protocol import KVBatchMeta
from conveyor.weights import Endpoints, WeightShipper
from conveyor.workers.placement.group import (
    MODEL_ROLES,
    ColocatedWorker,
    LocalWorkerGroup,
    WorkerGroup,
    WorkerSpec,
    use_ray,
)
from conveyor.workers.placement.recovery import fault_tolerant
from conveyor.workers.placement.reward_model import (
    build_judge,
    build_separate_reward_model,
    build_separate_teacher,
    separate_reward_model,
    separate_teacher,
)
from conveyor.workers.ranks.actor import PolicyWorker
from conveyor.workers.ranks.critic import CriticWorker
from conveyor.workers.ranks.distill import teacher_settings
from conveyor.workers.ranks.judge import JudgeWorker, judge_settings
from conveyor.workers.ranks.reference import ReferenceWorker
from conveyor.workers.ranks.replica import ReplicaWorker
from conveyor.workers.ranks.reward import RewardWorker
from conveyor.workers.ranks.reward_model import RewardModelWorker, reward_model_settings
from conveyor.workers.ranks.settings import actor_settings, critic_settings, reference_settings, rollout_settings
from conveyor.workers.ranks.teacher import TeacherWorker

if TYPE_CHECKING:
    from conveyor.config.plan import RunPlan

logger = logging.getLogger(__name__)

__all__ = [
    "worker_specs",
    "build_worker_groups",
    "WorkerGroups",
    "ActorGroup",
    "RefGroup",
    "CriticGroup",
    "RewardGroup",
    "RewardModelGroup",
    "JudgeGroup",
    "ReplicaGroup",
    "TeacherGroup",
]


def worker_specs(
    cfg: Config, plan: RunPlan, model_path: str, data_plane: DataPlane, tokenizer: Any, device: str
) -> dict[str, WorkerSpec]:
    """Each role this run uses -> its worker class and constructor arguments (rank and world size come later)."""
    plugins = tuple(cfg.trainer.plugins)
    where = {"model_path": model_path, "data_plane": data_plane, "device": device}
    specs = {"actor": WorkerSpec("actor", PolicyWorker, {"settings": actor_settings(cfg, plan), **where}, plugins)}
    if plan.use_reference and not plan.reference_from_actor:
        specs["ref"] = WorkerSpec("ref", ReferenceWorker, {"settings": reference_settings(cfg, plan), **where}, plugins)
    if plan.use_critic:
        specs["critic"] = WorkerSpec("critic", CriticWorker, {"settings": critic_settings(cfg, plan), **where}, plugins)
    if plan.use_teacher:  # its own checkpoints (teacher_settings), never the actor's model_path
        kwargs = {"settings": teacher_settings(cfg, plan), "data_plane": data_plane, "device": device}
        specs["teacher"] = WorkerSpec("teacher", TeacherWorker, kwargs, plugins)
    if plan.rollout_placement == "separate":
        specs["rollout"] = WorkerSpec(
            "rollout", ReplicaWorker, {"settings": rollout_settings(cfg, plan), **where}, plugins
        )
    if plan.use_reward_model:
        rm_kwargs = {"settings": reward_model_settings(cfg, plan), "policy_tokenizer": tokenizer, **where}
        rm_kwargs.pop("model_path")
        specs["rm"] = WorkerSpec("rm", RewardModelWorker, rm_kwargs, plugins)
    if plan.use_judge:
        judge_kwargs = {"settings": judge_settings(cfg, plan), "policy_tokenizer": tokenizer, **where}
        judge_kwargs.pop("model_path")
        specs["judge"] = WorkerSpec("judge", JudgeWorker, judge_kwargs, plugins)
    custom = cfg.reward.custom_reward_function
    specs["reward"] = WorkerSpec(
        "reward",
        RewardWorker,
        {
            "tokenizer": tokenizer,
            "data_plane": data_plane,
            "custom_reward_path": custom.path,
            "custom_reward_name": custom.name,
            "timeout_s": cfg.reward.timeout_s,
            "overlong_buffer": _overlong(cfg),
            "sandbox": dataclasses.asdict(cfg.reward.sandbox),
        },
        plugins,
    )
    return specs


def _overlong(cfg: Config) -> tuple[int, int, float, bool] | None:
    """The reward worker's overlong-shaping arguments, or None when it is off."""
    ob = cfg.reward_model.overlong_buffer
    if not ob.enable:
        return None
    max_len = cfg.data.max_response_length
    return max_len, ob.len or max(1, max_len // 4), ob.penalty_factor, ob.log


# --------------------------------------------------------------------------- typed handles
class _Role:
    """The ranks of one role behind typed methods."""

    def __init__(self, ranks: WorkerGroup):
        self.ranks = ranks

    @property
    def world_size(self) -> int:
        """How many ranks the role has."""
        return self.ranks.world_size

    def shutdown(self) -> None:
        """Release the role's ranks."""
        self.ranks.shutdown()


class ActorGroup(_Role):
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


class ReplicaGroup(_Role):
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
        )
        # Replicas in processes of their own that die or hang are replaced (`fault_tolerance.enable`).
        self.recovery = fault_tolerant(ranks, self.weights, fault_tolerance)

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
    between_tokens=ReplicaWorker.take_weights_between_tokens,
    load_staged=ReplicaWorker.load_staged_weights,
)


class RefGroup(_Role):
    """The frozen reference policy: its own worker, or (LoRA) the actor's ranks with their adapters disabled."""

    def __init__(self, ranks: WorkerGroup, *, from_actor: bool = False):
        super().__init__(ranks)
        self.from_actor = from_actor

    def compute_log_prob(self, meta: KVBatchMeta) -> KVBatchMeta:
        """Stage 5 on every rank: ref_log_prob."""
        if self.from_actor:
            return self.ranks.call(PolicyWorker.compute_ref_log_prob, meta)
        return self.ranks.call(ReferenceWorker.compute_log_prob, meta)

    def shutdown(self) -> None:
        """Release the role's ranks (the actor's own handle releases them when they are the actor's)."""
        if not self.from_actor:
            self.ranks.shutdown()


class CriticGroup(_Role):
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


class TeacherGroup(_Role):
    """The frozen teachers of on-policy distillation."""

    def compute_teacher_log_prob(self, meta: KVBatchMeta) -> KVBatchMeta:
        """On every rank: each sample's teacher writes its log-probs (and top-k or full-vocabulary ones)."""
        return self.ranks.call(TeacherWorker.compute_teacher_log_prob, meta)


class RewardGroup(_Role):
    """The reward functions."""

    def compute_reward(self, meta: KVBatchMeta) -> KVBatchMeta:
        """Stage 3: rm_scores and acc."""
        return self.ranks.call(RewardWorker.compute_reward, meta)


class RewardModelGroup(_Role):
    """The reward model (reward_model.enable)."""

    def compute_rm_score(self, meta: KVBatchMeta) -> KVBatchMeta:
        """Stage 3, after the rule reward: the model's score, summed into rm_scores with the rule reward."""
        return self.ranks.call(RewardModelWorker.compute_rm_score, meta)


class JudgeGroup(_Role):
    """The generative judge (reward_model.judge.enable)."""

    def compute_judge_score(self, meta: KVBatchMeta) -> KVBatchMeta:
        """Stage 3, last: the judge's score, summed into rm_scores with the earlier rewards."""
        return self.ranks.call(JudgeWorker.compute_judge_score, meta)


@dataclasses.dataclass
class WorkerGroups:
    """The roles of a run; ref and critic are None when unused."""

    actor: ActorGroup
    ref: RefGroup | None
    critic: CriticGroup | None
    reward: RewardGroup
    rollout: ReplicaGroup | None = None  # placement=separate; None: the actor's ranks generate
    data_plane_server: Any = None  # serves the data plane to workers in processes of their own (rollout_process=own)
    teacher: TeacherGroup | None = None  # on-policy distillation's teachers; None when distillation is off
    reward_model: RewardModelGroup | None = None  # reward_model.enable
    judge: JudgeGroup | None = None  # reward_model.judge.enable

    def generate_sequences(self, meta: KVBatchMeta) -> KVBatchMeta:
        """Stage 2 where the engines are: the separate rollout group, or the actor's ranks (colocated)."""
        return (self.rollout or self.actor).generate_sequences(meta)

    def shutdown(self) -> None:
        """Release every role's ranks."""
        try:
            for role in (
                self.rollout,
                self.actor,
                self.ref,
                self.critic,
                self.teacher,
                self.reward,
                self.reward_model,
                self.judge,
            ):
                if role is not None:
                    role.shutdown()
        finally:
            if self.data_plane_server is not None:
                self.data_plane_server.close()


def build_worker_groups(
    cfg: Config, plan: RunPlan, model_path: str, data_plane: DataPlane, tokenizer: Any, device: str = "cpu"
) -> WorkerGroups:
    """Every role of the run from `worker_specs`: in this process, or as Ray actors for a multi-rank run."""
    server = None
    if use_ray(cfg):
        from conveyor.workers.placement.ray_group import build_ray_worker_groups, ray_worker_device

        device = ray_worker_device(cfg, device)
        specs = worker_specs(cfg, plan, model_path, data_plane, tokenizer, device)
        if getattr(data_plane, "backend", None) == "memory":  # a Ray on this machine (`serves_memory_plane`)
            server, specs = _served(specs, data_plane)
        specs, rm_apart = separate_reward_model(plan, specs)
        specs, teacher_apart = separate_teacher(plan, specs)
        judge = specs.pop("judge", None)
        try:
            groups = build_ray_worker_groups(cfg, specs, server.client() if server is not None else data_plane)
            try:
                groups.update(build_separate_reward_model(cfg, rm_apart, ray=True))
                groups.update(build_separate_teacher(cfg, teacher_apart, ray=True))
                groups.update(build_judge(cfg, judge, ray=True))
            except BaseException:
                for group in groups.values():
                    group.shutdown()
                raise
        except BaseException:
            if server is not None:
                server.close()
            raise
    else:
        specs, rm_apart = separate_reward_model(
            plan, worker_specs(cfg, plan, model_path, data_plane, tokenizer, device)
        )
        specs, teacher_apart = separate_teacher(plan, specs)
        judge = specs.pop("judge", None)  # its own worker, beside the model roles' process
        # The model roles share one process as they share a Ray rank's (`ColocatedWorker`, built in order).
        host = ColocatedWorker(0, 1, [spec for role, spec in specs.items() if role in MODEL_ROLES])
        groups = {role: LocalWorkerGroup.hosted(host, role) for role in host.roles}
        try:
            groups.update(build_separate_reward_model(cfg, rm_apart, ray=False))
            groups.update(build_separate_teacher(cfg, teacher_apart, ray=False))
            groups.update(build_judge(cfg, judge, ray=False))
            if plan.rollout_process == "own":
                server, remote = _own_process_groups(cfg, specs, data_plane)
                groups.update(remote)
            else:
                groups["reward"] = LocalWorkerGroup(specs["reward"])
            if "rollout" in specs and "rollout" not in groups:  # its own engine and copy of the model, here
                replicas = cfg.actor_rollout_ref.rollout.replicas
                if replicas > 1:
                    raise ValueError(
                        f"actor_rollout_ref.rollout.replicas={replicas}: a run in one process holds one "
                        "replica; run on Ray (trainer.num_cpu_workers or n_gpus_per_node > 1, or "
                        "ray.address) or set replicas=1"
                    )
                groups["rollout"] = LocalWorkerGroup(specs["rollout"])
        except BaseException:
            host.close()
            raise
    ref, critic = groups.get("ref"), groups.get("critic")
    if plan.reference_from_actor:
        ref_group: RefGroup | None = RefGroup(groups["actor"], from_actor=True)
    else:
        ref_group = RefGroup(ref) if ref is not None else None
    actor = ActorGroup(groups["actor"])
    rollout = groups.get("rollout")
    return WorkerGroups(
        actor=actor,
        ref=ref_group,
        critic=CriticGroup(critic) if critic is not None else None,
        reward=RewardGroup(groups["reward"]),
        rollout=(
            ReplicaGroup(
                rollout,
                actor,
                bucket_bytes=cfg.actor_rollout_ref.rollout.update_weights_bucket_megabytes << 20,
                dtype=_configured_engine_dtype(cfg, plan.device),
                fault_tolerance=cfg.actor_rollout_ref.rollout.fault_tolerance,
            )
            if rollout is not None
            else None
        ),
        data_plane_server=server,
        teacher=TeacherGroup(groups["teacher"]) if "teacher" in groups else None,
        reward_model=RewardModelGroup(groups["rm"]) if "rm" in groups else None,
        judge=JudgeGroup(groups["judge"]) if "judge" in groups else None,
    )


def _configured_engine_dtype(cfg: Config, device_type: str) -> torch.dtype | None:
    """The dtype the replicas' engines hold on the run's device; None where it is the model's (nothing to cast)."""
    from conveyor.rollout.base import served_dtype

    model_dtype = cfg.actor_rollout_ref.model.dtype
    dtype = served_dtype(cfg.actor_rollout_ref.rollout, model_dtype, device_type)
    return None if dtype == model_dtype else getattr(torch, dtype)


def _served(
    specs: dict[str, WorkerSpec],
    data_plane: DataPlane,
    roles: Iterable[str] | None = None,
) -> tuple[Any, dict[str, WorkerSpec]]:
    """`data_plane` served to the workers of `roles` (all by default) in processes of their own: (the server, which
    the run closes after the workers, their specs with a client in place of the plane)."""
    from conveyor.data_plane.served import DataPlaneServer

    server = DataPlaneServer(data_plane)
    client = server.client()
    return server, {
        role: dataclasses.replace(spec, kwargs={**spec.kwargs, "data_plane": client})
        for role, spec in specs.items()
        if roles is None or role in roles
    }


def _own_process_groups(
    cfg: Config,
    specs: dict[str, WorkerSpec],
    data_plane: DataPlane,
) -> tuple[Any, dict[str, Any]]:
    """The reward worker and the rollout group as Ray actors beside this process, on `data_plane` served to them:
    (the server, which the run closes after the workers, their groups)."""
    from conveyor.workers.placement.ray_group import build_ray_rollout_groups

    server, remote = _served(specs, data_plane, ("reward", "rollout"))
    try:
        groups = build_ray_rollout_groups(cfg, remote, gpu=False)
    except BaseException:
        server.close()
        raise
    try:
        # Every batch is one call to each replica: over a socket each, not a Ray task per batch (workers/link.py).
        groups["reward"].ranks.open_links()
    except BaseException:
        groups["reward"].ranks.kill()
        server.close()
        raise
    return server, groups
