"""The roles of a run: which worker each one runs, built the same way in this process and on Ray, and typed handles.

`worker_specs` is the one place that turns the config and the run plan into
each role's worker class and constructor arguments (the role's settings,
`conveyor.workers.settings`). `LocalWorkerGroup` and `RayWorkerGroup` both
build their ranks from these specs, so a setting cannot reach workers in this
process and miss those on Ray (or the reverse). The model roles
(`MODEL_ROLES`: actor, reference, critic) are colocated: rank i of each is
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

import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Iterable

import torch

from conveyor.config import Config
from conveyor.data_plane.base import DataPlane
from conveyor.protocol import KVBatchMeta
from conveyor.workers.actor import PolicyWorker
from conveyor.workers.critic import CriticWorker
from conveyor.workers.group import MODEL_ROLES, ColocatedWorker, LocalWorkerGroup, WorkerGroup, WorkerSpec, use_ray
from conveyor.workers.reference import ReferenceWorker
from conveyor.workers.reward import RewardWorker
from conveyor.workers.rollout import LOAD_SHARED, LOAD_STAGED, RolloutWorker, WeightInbox
from conveyor.weights import THREAD_PREFIX as WEIGHT_THREADS
from conveyor.weights import SharedSlots, Table, cast_weights, layout, pack
from conveyor.workers.settings import actor_settings, critic_settings, reference_settings, rollout_settings

if TYPE_CHECKING:
    from conveyor.trainer.plan import RunPlan

logger = logging.getLogger(__name__)

__all__ = [
    "worker_specs",
    "build_worker_groups",
    "WorkerGroups",
    "ActorGroup",
    "RefGroup",
    "CriticGroup",
    "RewardGroup",
    "RolloutGroup",
    "WeightInbox",
]


def worker_specs(cfg: Config, plan: RunPlan, model_path: str, data_plane: DataPlane, tokenizer: Any,
                 device: str) -> dict[str, WorkerSpec]:
    """Each role this run uses -> its worker class and constructor arguments (rank and world size come later)."""
    plugins = tuple(cfg.trainer.plugins)
    where = {"model_path": model_path, "data_plane": data_plane, "device": device}
    specs = {"actor": WorkerSpec("actor", PolicyWorker, {"settings": actor_settings(cfg, plan), **where}, plugins)}
    if plan.use_reference and not plan.reference_from_actor:
        specs["ref"] = WorkerSpec("ref", ReferenceWorker, {"settings": reference_settings(cfg, plan), **where},
                                  plugins)
    if plan.use_critic:
        specs["critic"] = WorkerSpec("critic", CriticWorker, {"settings": critic_settings(cfg, plan), **where},
                                     plugins)
    if plan.rollout_placement == "separate":
        specs["rollout"] = WorkerSpec("rollout", RolloutWorker, {"settings": rollout_settings(cfg, plan), **where},
                                      plugins)
    custom = cfg.reward.custom_reward_function
    specs["reward"] = WorkerSpec("reward", RewardWorker, {
        "tokenizer": tokenizer, "data_plane": data_plane,
        "custom_reward_path": custom.path, "custom_reward_name": custom.name, "timeout_s": cfg.reward.timeout_s,
        "overlong_buffer": _overlong(cfg),
    }, plugins)
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


class RolloutGroup(_Role):
    """The rollout worker group's engines: they generate, and take the actor's weights first.

    Synchronous runs: before a rollout the group asks the actor for its weights' version; when its
    replicas serve an older one, the actor streams its weights to them: in this process straight into
    the engine, on Ray over the weight channel from the actor's rank 0 (`conveyor.weights.channel`),
    which is built on the first sync.

    Asynchronous runs generate on another thread while the actor trains (`conveyor.trainer.sources`), and
    label each sync with the policy version the scheduler counts: `stage_weights` takes the weights as they
    are now and returns what loads them on the rollout's thread. In this process that is a copy, left in an
    inbox that a partial rollout may also take between two tokens. Replicas on Ray (a Ray actor's, or this
    process's actor under rollout_process=own, which sends a copy from a thread of its own) receive the sync
    at once, beside the generation in progress (a replica runs two calls at a time), into a staged copy; the
    rollout's thread waits for the exchange and the replicas load that copy at the start of their next call, in order
    with the batches. When the reward worker lives in the replicas' processes (`colocated_reward`), the asynchronous
    source has a replica generate and score a batch in that one call.
    """

    def __init__(self, ranks: WorkerGroup, actor: ActorGroup, *, bucket_bytes: int, dtype: torch.dtype | None = None):
        super().__init__(ranks)
        self.actor = actor
        self.bucket_bytes = bucket_bytes
        # The dtype the replicas' engines hold, where known (a replica in this process says its own): weights are cast
        # to it before they leave, so bf16 engines fed by fp32 masters get half the bytes (None: sent as held).
        local = getattr(getattr(ranks, "worker", None), "engine", None) if isinstance(ranks, LocalWorkerGroup) else None
        self.dtype = getattr(local, "dtype", None) if local is not None else dtype
        self.served: int | None = None  # the version every replica serves (None: not synced yet)
        self._channel = False
        self._inbox = WeightInbox()
        self._sender: concurrent.futures.ThreadPoolExecutor | None = None
        self._load_next: int | None = None  # staged weights the next generation loads first (replicas on Ray)
        # Replicas on Ray on this machine, the actor here on CPUs: syncs packed into shared memory (`SharedSlots`);
        # the slot of `_load_next` when it is there, freed once the call that loads it returns.
        self._slots: SharedSlots | None = None
        self._load_slot: int | None = None
        self._between_tokens = False  # partial rollouts: weights must reach a replica mid-generation
        self._on_this_machine: bool | None = None

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
        return isinstance(self.ranks, LocalWorkerGroup) and isinstance(self.actor.ranks, LocalWorkerGroup)

    def generate_sequences(self, meta: KVBatchMeta, *, sync: bool = True, score: bool = False) -> KVBatchMeta:
        """Stage 2 on the replicas, after a sync if the actor has moved on (unless `sync` is False): the rollout's fields.

        `score` (needs `colocated_reward`): stage 3 too, by the reward worker in each replica's process, in the same
        call: one round trip per batch instead of two, and the reward's metrics in the same `extra_info`.
        """
        metrics = self.sync() if sync else {}
        slot = self._load_slot
        if self._load_next is not None:  # the weights staged last, loaded by the replicas before they generate
            info: dict[str, Any] = {LOAD_STAGED: self._load_next}
            if slot is not None:  # ...from shared memory: where they are rides on this call
                assert self._slots is not None
                info[LOAD_SHARED] = self._slots.handle(slot)
            meta = meta.with_extra_info(**info)
            self._load_next = self._load_slot = None
        try:
            if score:
                assert self.colocated_reward, "scoring in the generation call needs the reward worker on the replicas"
                out = self.ranks.call_chain([("rollout", RolloutWorker.generate_sequences),
                                             ("reward", RewardWorker.compute_reward)], meta)
            else:
                out = self.ranks.call(RolloutWorker.generate_sequences, meta)
        finally:
            self._check_released()
            if slot is not None:
                assert self._slots is not None
                self._slots.release(slot)  # loaded by every replica (or never to be: the call failed)
        if slot is not None:
            self._slots.unlink()  # every replica has mapped the file: nothing to leave behind in /dev/shm
        if metrics:  # one entry per rank, as every per-rank metric arrives
            out.extra_info.update({k: [v] * self.ranks.world_size for k, v in metrics.items()})
        return out

    def _check_released(self) -> None:
        """Forget what the replicas serve when a generation ended with their weights released (a level-2 sleep), so
        that the next one syncs even if the actor has not moved on.

        vLLM's adapter never sleeps a separate replica (`conveyor.rollout.vllm.sleeps_between_rollouts`); an engine
        that does anyway says so by its `weights_version` (None), which a replica in this process shows here.
        """
        worker = self.ranks.worker if isinstance(self.ranks, LocalWorkerGroup) else None
        engine = getattr(worker, "engine", None)
        if engine is not None and engine.weights_version is None:
            self.served = None

    def sync(self) -> dict[str, float]:
        """Give every replica the actor's current weights if they serve older ones; the sync's metrics."""
        version = self.actor.ranks.call_all(PolicyWorker.weights_version)[0]
        if self.served == version:
            return {}
        if self.in_process:
            # One process: the actor's stream goes straight into the engine, tensor by tensor.
            stream = cast_weights(self.actor.ranks.worker.weight_stream(), self.dtype)
            seconds = self.ranks.worker.load_weights(stream, version)
            metrics = {"rollout/weight_sync_s": seconds}
        else:
            metrics = self._sync_over_channel(version)
        self.served = version
        return metrics

    def stage_weights(self, label: int) -> Callable[[], dict[str, float]]:
        """The actor's weights as they are now, labelled `label`; returns what gives them to the replicas (run it on
        the thread that generates, before the batches that are to use them)."""
        self.served = None  # labelled by the caller: a later `sync` compares optimizer steps again
        local = isinstance(self.actor.ranks, LocalWorkerGroup)
        if local and not self.in_process and self.actor.ranks.worker.device.type == "cpu":
            named = list(cast_weights(self.actor.ranks.worker.weight_stream(), self.dtype))
            if not self._between_tokens and self._same_machine():
                # Replicas on this machine: one copy into a shared-memory slot, loaded by the next generation call
                # (no object store, no call of its own); when both slots still wait for their loads, as below.
                load = self._into_slot(label, named)
                if load is not None:
                    return load
            # One packed copy into Ray's object store, which replicas on this node read in place from shared memory
            # (no channel, no sending thread streaming buckets); the replicas stage it beside the generation.
            return self._put_weights(label, *pack(named))
        # A copy when the actor is here: it goes on training while the rollout finishes the batch it is generating.
        staged = [(name, _copy(t, self.dtype)) for name, t in self.actor.ranks.worker.weight_stream()] if local else None
        if not self.in_process:
            # Replicas on Ray take the weights beside the generation in progress, into a staged copy; the exchange
            # starts now, and the rollout's thread waits for it and has them load it, in order with the batches.
            return self._exchange(label, staged)
        self._inbox.offer(label, staged)
        worker = self.ranks.worker

        def load() -> dict[str, float]:
            staged = self._inbox.take()
            if staged is None:  # a partial rollout took these (or newer) between two tokens
                return {}
            version, tensors = staged
            return {"rollout/weight_sync_s": worker.load_weights(iter(tensors), version)}

        return load

    def _same_machine(self) -> bool:
        """Whether every replica runs on this process's machine (Ray node); asked once."""
        if self._on_this_machine is None:
            import ray

            here = ray.get_runtime_context().get_node_id()
            self._on_this_machine = all(w["node_id"] == here for w in self.ranks.rank_info())
        return self._on_this_machine

    def _into_slot(self, label: int, named: list[tuple[str, torch.Tensor]]) -> Callable[[], dict[str, float]] | None:
        """Pack `named` into a free shared-memory slot; returns what has the next generation load it, or None when
        no slot is free (both hold syncs whose loading calls have not returned)."""
        t0 = time.perf_counter()
        table, nbytes = layout(named)
        if self._slots is None:
            self._slots = SharedSlots(table, nbytes)
        slot = self._slots.write(named, table)
        if slot is None:
            return None
        sent = {"rollout/weight_sync_s": time.perf_counter() - t0, "rollout/weight_send_gb": nbytes / 1e9,
                "rollout/weight_send_buckets": 1.0}

        def load() -> dict[str, float]:
            self._load_first(label, slot)
            return sent

        return load

    def _load_first(self, version: int, slot: int | None) -> None:
        """On the rollout's thread, in order with the batches: the next generation call loads `version` first (from
        shared-memory slot `slot`, or the replicas' staged copy). A sync queued before it and not yet loaded never
        will be now (the replicas load the newest): its slot is free again."""
        if self._load_slot is not None:
            assert self._slots is not None
            self._slots.release(self._load_slot)
        self._load_next, self._load_slot = version, slot

    def take_weights_between_tokens(self) -> None:
        """Partial rollouts: weights reach the replicas between two tokens of a generation: in this process from the
        inbox, on Ray from the staged copy a sync leaves beside the generation in progress."""
        self._between_tokens = True
        if self.in_process:
            self.ranks.worker.take_weights_between_tokens(self._inbox)
        else:
            self.ranks.call_all(RolloutWorker.take_weights_between_tokens)

    def _join_channel(self) -> None:
        """Build the weight channel from the actor's rank 0 to every replica (once)."""
        from conveyor.workers.ray_group import gather_together, gather_with_local

        if self._channel:
            return
        size = 1 + self.ranks.world_size
        address = self.actor.ranks.call_all(PolicyWorker.channel_address)[0]
        joins = self.ranks.submit_all(RolloutWorker.join_weight_channel, address, size)
        if isinstance(self.actor.ranks, LocalWorkerGroup):
            gather_with_local(joins, lambda: self.actor.ranks.worker.join_weight_channel(address, size),
                              "actor", "join_weight_channel")
        else:
            gather_together([self.actor.ranks.submit_all(PolicyWorker.join_weight_channel, address, size), joins])
        self._channel = True

    def _sync_over_channel(self, version: int) -> dict[str, float]:
        """A synchronous run on Ray: the actor's rank 0 streams its current weights into every replica's engine.

        (An actor in this process with replicas on Ray is only asynchronous, rollout_process=own: `_exchange`.)
        """
        from conveyor.workers.ray_group import RayWorkerGroup, gather_together

        assert isinstance(self.ranks, RayWorkerGroup) and isinstance(self.actor.ranks, RayWorkerGroup), (
            "a synchronous sync over the channel needs both roles on Ray")
        self._join_channel()
        sent, received = gather_together([self.actor.ranks.submit_all(PolicyWorker.send_weights, self.bucket_bytes, dtype=self.dtype),
                                          self.ranks.submit_all(RolloutWorker.receive_weights, version)])
        return _sync_metrics(sent[0], received)

    def _exchange(self, version: int, staged: list[tuple[str, torch.Tensor]] | None) -> Callable[[], dict[str, float]]:
        """Start sending the weights (`staged`, a copy taken here, or the Ray actor's current ones) into every
        replica's staging copy; returns what waits for it and gives its metrics."""
        from conveyor.workers.ray_group import gather_together, gather_with_local

        self._join_channel()
        sends = None
        if staged is None:  # submitted from the trainer's thread: the actor sends before the update submitted next
            sends = self.actor.ranks.submit_all(PolicyWorker.send_weights, self.bucket_bytes, dtype=self.dtype)
        worker = self.actor.ranks.worker if staged is not None else None

        def run() -> dict[str, float]:
            # One exchange at a time, in order (this thread runs them): a replica runs two calls at once, and two
            # receives side by side would share the channel.
            receives = self.ranks.submit_all(RolloutWorker.receive_weights, version, stage=True)
            if sends is not None:
                sent, received = gather_together([sends, receives])
                return _sync_metrics(sent[0], received)
            mine, received = gather_with_local(receives, lambda: worker.send_weights(self.bucket_bytes, staged, dtype=self.dtype),
                                               "actor", "send_weights")
            return _sync_metrics(mine, received)

        return self._in_order(version, run)

    def _put_weights(self, version: int, buffer: torch.Tensor, table: Table) -> Callable[[], dict[str, float]]:
        """Start handing the packed weights to every replica through Ray's object store, into its staging copy;
        returns what waits for it and gives its metrics."""
        import ray

        from conveyor.workers.ray_group import gather_together

        def run() -> dict[str, float]:
            t0 = time.perf_counter()
            refs = [ray.put(buffer.numpy())]  # freed when the last reference, this one, goes
            sent = {"rollout/weight_send_s": time.perf_counter() - t0, "rollout/weight_send_gb": buffer.numel() / 1e9,
                    "rollout/weight_send_buckets": 1.0}
            received = gather_together([self.ranks.submit_all(RolloutWorker.take_weights, version, refs, table)])[0]
            return _sync_metrics(sent, received)

        return self._in_order(version, run)

    def _in_order(self, version: int, run: Callable[[], dict[str, float]]) -> Callable[[], dict[str, float]]:
        """Run one exchange (`run`) on the sending thread, after the ones started before; returns what waits for it
        on the rollout's thread and has the replicas load `version` before they next generate."""
        if self._sender is None:
            self._sender = concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                                 thread_name_prefix=f"{WEIGHT_THREADS}-send")
        done = self._sender.submit(run)

        def load() -> dict[str, float]:
            # On the rollout's thread, in order with the batches: these weights, not a later sync's that may already
            # have arrived beside the generation. The replicas load them at the start of the next generation call
            # (no round trip of its own).
            metrics = done.result()
            self._load_first(version, None)
            return metrics

        return load

    def shutdown(self) -> None:
        """Release the role's ranks (and the thread that sends staged weights)."""
        if self._sender is not None:
            self._sender.shutdown(wait=False, cancel_futures=True)
            self._sender = None
        if self._slots is not None:
            self._slots.unlink()
            self._slots = None
        super().shutdown()


def _copy(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A copy of `tensor` that the actor's next update cannot change, at the engine's `dtype` where it is floating."""
    tensor = tensor.detach()
    if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
        return tensor.to(dtype)  # a new tensor already: no second copy
    return tensor.clone()


def _sync_metrics(sent: dict[str, float], received: list[dict[str, float]]) -> dict[str, float]:
    """One sync's metrics: the sender's, and the slowest replica's."""
    metrics = dict(sent)
    metrics.update({k: max(r[k] for r in received) for k in received[0]})
    return metrics


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


class RewardGroup(_Role):
    """The reward functions."""

    def compute_reward(self, meta: KVBatchMeta) -> KVBatchMeta:
        """Stage 3: rm_scores and acc."""
        return self.ranks.call(RewardWorker.compute_reward, meta)


@dataclasses.dataclass
class WorkerGroups:
    """The roles of a run; ref and critic are None when unused."""

    actor: ActorGroup
    ref: RefGroup | None
    critic: CriticGroup | None
    reward: RewardGroup
    rollout: RolloutGroup | None = None  # placement=separate; None: the actor's ranks generate
    data_plane_server: Any = None  # serves the data plane to workers in processes of their own (rollout_process=own)

    def generate_sequences(self, meta: KVBatchMeta) -> KVBatchMeta:
        """Stage 2 where the engines are: the separate rollout group, or the actor's ranks (colocated)."""
        return (self.rollout or self.actor).generate_sequences(meta)

    def shutdown(self) -> None:
        """Release every role's ranks."""
        try:
            for role in (self.rollout, self.actor, self.ref, self.critic, self.reward):
                if role is not None:
                    role.shutdown()
        finally:
            if self.data_plane_server is not None:
                self.data_plane_server.close()


def build_worker_groups(cfg: Config, plan: RunPlan, model_path: str, data_plane: DataPlane, tokenizer: Any,
                        device: str = "cpu") -> WorkerGroups:
    """Every role of the run from `worker_specs`: in this process, or as Ray actors for a multi-rank run."""
    server = None
    if use_ray(cfg):
        from conveyor.workers.ray_group import build_ray_worker_groups, ray_worker_device

        device = ray_worker_device(cfg, device)
        specs = worker_specs(cfg, plan, model_path, data_plane, tokenizer, device)
        if getattr(data_plane, "backend", None) == "memory":  # a Ray on this machine (`serves_memory_plane`)
            server, specs = _served(specs, data_plane)
        try:
            groups = build_ray_worker_groups(cfg, specs, server.client() if server is not None else data_plane)
        except BaseException:
            if server is not None:
                server.close()
            raise
    else:
        specs = worker_specs(cfg, plan, model_path, data_plane, tokenizer, device)
        # The model roles share one process as they share a Ray rank's (`ColocatedWorker`, built in order).
        host = ColocatedWorker(0, 1, [spec for role, spec in specs.items() if role in MODEL_ROLES])
        groups = {role: LocalWorkerGroup.hosted(host, role) for role in host.roles}
        try:
            if plan.rollout_process == "own":
                server, remote = _own_process_groups(cfg, specs, data_plane)
                groups.update(remote)
            else:
                groups["reward"] = LocalWorkerGroup(specs["reward"])
            if "rollout" in specs and "rollout" not in groups:  # its own engine and copy of the model, here
                replicas = cfg.actor_rollout_ref.rollout.replicas
                if replicas > 1:
                    raise ValueError(f"actor_rollout_ref.rollout.replicas={replicas}: a run in one process holds one "
                                     "replica; run on Ray (trainer.num_cpu_workers or n_gpus_per_node > 1, or "
                                     "ray.address) or set replicas=1")
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
        rollout=(RolloutGroup(rollout, actor, bucket_bytes=cfg.actor_rollout_ref.rollout.update_weights_bucket_megabytes
                              << 20, dtype=_configured_engine_dtype(cfg, plan.device)) if rollout is not None else None),
        data_plane_server=server,
    )


def _configured_engine_dtype(cfg: Config, device_type: str) -> torch.dtype | None:
    """The dtype vllm replicas hold on the run's device (`rollout.dtype`, else bf16 on CUDA); None for hf replicas."""
    ro = cfg.actor_rollout_ref.rollout
    if ro.name != "vllm":
        return None  # an hf replica holds the model's own dtype: nothing to cast
    return getattr(torch, ro.engine_dtype(cfg.actor_rollout_ref.model.dtype, device_type))


def _served(specs: dict[str, WorkerSpec], data_plane: DataPlane, roles: Iterable[str] | None = None,
            ) -> tuple[Any, dict[str, WorkerSpec]]:
    """`data_plane` served to the workers of `roles` (all by default) in processes of their own: (the server, which
    the run closes after the workers, their specs with a client in place of the plane)."""
    from conveyor.data_plane.served import DataPlaneServer

    server = DataPlaneServer(data_plane)
    client = server.client()
    return server, {role: dataclasses.replace(spec, kwargs={**spec.kwargs, "data_plane": client})
                    for role, spec in specs.items() if roles is None or role in roles}


def _own_process_groups(cfg: Config, specs: dict[str, WorkerSpec], data_plane: DataPlane,
                        ) -> tuple[Any, dict[str, Any]]:
    """The reward worker and the rollout group as Ray actors beside this process, on `data_plane` served to them:
    (the server, which the run closes after the workers, their groups)."""
    from conveyor.workers.ray_group import build_ray_rollout_groups

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
