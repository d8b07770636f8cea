"""The rollout worker: one engine replica of the separate placement (actor_rollout_ref.rollout.placement=separate).

A `ReplicaWorker` is a forward-only role: it holds an engine (built from the
registry, `conveyor.rollout.base`, like the actor's colocated one) and no
optimizer, no learning-rate schedule, no strategy. Its `generate_sequences`
is the actor's (`conveyor.workers.ranks.generation.Generation`): it reads the
prompts from the data plane and writes the rollout's fields back, so a step's
stages do not know where the rollout ran.

Weights. The engine starts from the checkpoint on disk and gets the actor's
weights before every rollout that follows an update: in this process
straight from the actor worker's stream (`load_weights`, a local run), or
over the weight channel from the actor's rank 0 (`join_weight_channel`,
`receive_weights`, on Ray; `conveyor.weights`). A receive
beside a generation in progress keeps a staged copy, which the next
`generate_sequences` loads first when its handle names it (`LOAD_STAGED`).
The rollout group keeps the actor's optimizer-step count of what the replicas serve.

Versions. Every sample it writes is tagged with the version of the weights
that generated it (`policy_version`, the label the last sync carried) and
every response token with its own (`token_policy_version`): they differ only
when weights arrived between two tokens (`take_weights_between_tokens`, the
partial rollouts of asynchronous training), and a sample's version is its
oldest token's.

Replicas do not share a process group: each is its own engine, the group
splits a handle across them, and they pad responses to `max_new_tokens` so
their fields fit one partition.

What it deliberately does not do: decide when to sync (the rollout group
does) or train.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable
from typing import Any

import torch

from conveyor.data_plane.base import DataPlane
from conveyor.models.loading import load_tokenizer
from conveyor.models.moe_routing import moe_info
from conveyor.models.vision import vision_processor
from conveyor.protocol import KVBatchMeta
from conveyor.rollout.base import engine_spec, served_dtype
from conveyor.tasks.prompts import PromptEncoder
from conveyor.weights import LOAD_SHARED, LOAD_STAGED, StagedWeights, Table, WeightChannel, get_packed, unpack
from conveyor.workers.ranks.generation import Generation, build_engine
from conveyor.workers.ranks.perf import set_allocator_defaults
from conveyor.workers.ranks.settings import ReplicaSettings
from conveyor.workers.training.strategy import TrainingStrategy

logger = logging.getLogger(__name__)

__all__ = ["ReplicaWorker"]


def _forward_model(
    model_path: str, *, own_weights: bool, device: torch.device, dtype: str, trust_remote_code: bool
) -> torch.nn.Module:
    """The model an engine is built over: real weights for one that samples from it, a meta skeleton otherwise."""
    if own_weights:
        from conveyor.workers.training.loading import load_role_model

        model = load_role_model(
            model_path,
            strategy_name="none",
            world_size=1,
            rank=0,
            device=device,
            dtype=dtype,
            trust_remote_code=trust_remote_code,
        )
    else:
        # An engine with its own copy (vLLM) needs only the architecture: its config, its sparse layers.
        from conveyor.models.loading import build_causal_lm_on_meta

        model = build_causal_lm_on_meta(model_path, dtype=dtype, trust_remote_code=trust_remote_code)
    model.requires_grad_(False)
    return model.eval()


class ReplicaWorker:
    """One engine replica: generate_sequences, and new weights by stream or channel."""

    def __init__(
        self,
        settings: ReplicaSettings,
        *,
        model_path: str,
        data_plane: DataPlane,
        rank: int = 0,
        world_size: int = 1,
        device: str = "cpu",
    ):
        set_allocator_defaults()
        self.settings, self.rank, self.world_size = settings, rank, world_size
        self.device = torch.device(device)
        m, ro = settings.model, settings.rollout
        spec = engine_spec(ro.name)
        shares = spec.capabilities(self.device.type).shares_trainer_modules
        self.model = _forward_model(
            model_path, own_weights=shares, device=self.device, dtype=m.dtype, trust_remote_code=m.trust_remote_code
        )
        self.tokenizer = load_tokenizer(m.tokenizer_path or model_path, trust_remote_code=m.trust_remote_code)
        self.moe = moe_info(self.model)
        if settings.selection_bias:  # the buffers the actor's stream fills (loss-free balancing)
            from conveyor.models.router_control import install_selection_bias

            install_selection_bias(self.model)
        lean = None
        if shares:
            from conveyor.models.lean import resolve_forward_impl

            lean = resolve_forward_impl(m.forward_impl, self.model)
        self.engine, agent_loop = build_engine(
            settings,
            model_path,
            self.model,
            self.tokenizer,
            rank=rank,
            world_size=world_size,
            device=self.device,
            lean=lean,
            moe=self.moe,
        )
        # One replica, one engine: no collectives, so a single-rank strategy (its collectives are no-ops).
        strategy = TrainingStrategy("none", world_size=1, device=self.device)
        self.generation = Generation(
            self.engine,
            agent_loop=agent_loop,
            tokenizer=self.tokenizer,
            moe=self.moe,
            rollout=ro,
            engine_name=spec.name,
            strategy=strategy,
            passes=lambda slices: [(s, True) for s in slices],
            data_plane=data_plane,
            rank=rank,
            world_size=world_size,
            device=self.device,
            prompts=PromptEncoder(
                self.tokenizer,
                settings.max_prompt_length,
                settings.truncation,
                # A replica that renders its prompts processes their images too (a vision-language policy).
                vision=vision_processor(model_path, self.tokenizer, getattr(self.model, "config", None)),
                agent_images=ro.agent.enabled,
            ),
        )
        self.channel: Any = None
        self.data_plane = data_plane
        # The label of the weights the engine serves; -1: none synced yet (a vllm engine starts from dummy
        # weights and refuses to generate before its first sync).
        self.version = -1
        # (tokens sampled before: one int, or one per row, new version) in this generation
        self.switches: list[tuple[int | list[int], int]] = []
        # Weights received while a generation ran (`receive_weights(stage=True)`), by version, until loaded, at the
        # dtype its engine holds.
        self.staged = StagedWeights(getattr(torch, served_dtype(ro, m.dtype, self.device.type)))

    def generate_sequences(self, meta: KVBatchMeta) -> KVBatchMeta:
        """Sample responses for the handle's prompts (the actor's endpoint, on this replica's engine),
        version-tagged."""
        cpu0 = time.thread_time()
        loaded = {}
        if LOAD_STAGED in meta.extra_info:  # the replica's own parameters, not the generation's
            version, shared = meta.extra_info[LOAD_STAGED], meta.extra_info.get(LOAD_SHARED)
            meta = dataclasses.replace(
                meta, extra_info={k: v for k, v in meta.extra_info.items() if k not in (LOAD_STAGED, LOAD_SHARED)}
            )
            if shared is not None:
                loaded = self.load_shared_weights(int(version), *shared)  # a sync packed into shared memory
            else:
                loaded = self.load_staged_weights(int(version))  # a sync staged beside the last generation
        start, self.switches = self.version, []

        def versions(fields: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            # Written with the rollout's own fields, in the same put.
            shape = fields["response_mask"].shape
            tokens = torch.full(shape, start, dtype=torch.long)
            for sampled, version in self.switches:
                if isinstance(sampled, int):  # every row had sampled as many tokens (hf)
                    tokens[:, sampled:] = version
                else:  # one count per row (vllm schedules rows as its batch allows)
                    for row, n in enumerate(sampled):
                        tokens[row, n:] = version
            return {"policy_version": torch.full((shape[0],), start, dtype=torch.long), "token_policy_version": tokens}

        out = self.generation(meta, {}, extra_fields=versions)
        if self.generation.interrupt is not None:  # partial rollouts: how often weights changed mid-generation
            out.extra_info["rollout/weight_switches"] = float(len(self.switches))
        out.extra_info.update(loaded)
        out.extra_info["rollout/perf/cpu_s"] = time.thread_time() - cpu0  # where a step's CPU goes
        return out

    def take_weights_between_tokens(self, inbox: Any = None) -> None:
        """Partial rollouts: between two sampled tokens, load the newest weights that have arrived, if any.

        `inbox` (this worker in the trainer's process): what `inbox.take()` holds. Without one (a replica of its
        own): the newest sync staged beside the generation (`take_weights`, `receive_weights(stage=True)`), which
        the next call's `load_staged_weights` then finds loaded already.
        """
        if self.generation.replica_group is not None:
            raise ValueError(
                "trainer.v1.separate_async.partial_rollout: a replica spanning several ranks would "
                "switch weights on each rank at a different token; set partial_rollout=false"
            )
        take = inbox.take if inbox is not None else (lambda: self.staged.newest_after(self.version))

        def hook(sampled: int | list[int]) -> bool:
            staged = take()
            if staged is None:
                return False
            version, tensors = staged
            self.engine.update_weights(iter(tensors), version=version)
            self.version = version
            self.switches.append((sampled, version))
            return True

        self.generation.interrupt = hook

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> float:
        """In this process: load the actor's streamed tensors into the engine; returns the seconds taken."""
        seconds = self.engine.update_weights(named_tensors, version=version)
        self.version = version
        return seconds

    def join_weight_channel(self, address: tuple[str, int], size: int) -> None:
        """Join the channel from the actor's rank 0 as channel rank 1 + this replica's rank."""
        self.channel = WeightChannel(address, 1 + self.rank, size, device=self.device)

    def receive_weights(self, version: int, stage: bool = False) -> dict[str, float]:
        """Take one sync's buckets from the channel into the engine, bucket by bucket; its metrics.

        `stage`: keep a copy under `version` for `load_staged_weights` instead (asynchronous runs: the replica runs
        this beside the generation in progress, whose weights must not change under it).
        """
        t0 = time.perf_counter()
        if stage:
            self.staged.stage(version, self.channel.received())
        else:
            targets = getattr(self.engine, "weight_targets", None)  # an engine whose tensors take the sender's
            into = targets() if callable(targets) else None
            self.engine.update_weights(self.channel.received(into), version=version)
            self.version = version
        got = self.channel.last
        return {
            "rollout/weight_sync_s": time.perf_counter() - t0,
            "rollout/weight_sync_gb": got.bytes / 1e9,
            "rollout/weight_sync_buckets": float(got.buckets),
        }

    def take_weights(self, version: int, refs: list[Any], table: Table) -> dict[str, float]:
        """Stage a sync that came through Ray's object store as `version` (`refs[0]`: the packed weights, a byte
        array `conveyor.weights.put_packed` stored; a list, so that Ray hands over the reference, not its value);
        metrics.

        On one node the array is read from shared memory in place; the staged copy is this process's own.
        """
        t0 = time.perf_counter()
        return self._stage_packed(version, get_packed(refs), table, t0)

    def take_shared_weights(
        self, version: int, path: str, size: int, offset: int, nbytes: int, table: Table
    ) -> dict[str, float]:
        """Stage a (delta) sync the trainer packed into a shared-memory slot (`SharedSlots`) as `version`, decoded
        into this replica's copies now, in order with every other sync (the trainer frees the slot once this call has
        returned); metrics."""
        t0 = time.perf_counter()
        return self._stage_packed(version, self.staged.shared(path, size, offset, nbytes), table, t0)

    def _stage_packed(self, version: int, buffer: torch.Tensor, table: Table, t0: float) -> dict[str, float]:
        """Stage the packed sync in `buffer` (read in place) as `version`; the exchange's metrics since `t0`."""
        self.staged.stage(version, unpack(buffer, table))
        return {
            "rollout/weight_sync_s": time.perf_counter() - t0,
            "rollout/weight_sync_gb": buffer.numel() / 1e9,
            "rollout/weight_sync_buckets": 1.0,
            # A delta that did not check out goes back to the sender, whose next sync is then whole.
            **self.staged.delta_metrics(),
        }

    def load_shared_weights(
        self, version: int, path: str, size: int, offset: int, nbytes: int, table: Table
    ) -> dict[str, float]:
        """Load the weights the trainer packed into a shared-memory slot (`SharedSlots`) as `version`, straight into
        the engine (the trainer writes that slot again only once this call has returned); metrics."""
        t0 = time.perf_counter()
        buffer = self.staged.shared(path, size, offset, nbytes)
        self.staged.pop(version)  # staged copies of older syncs are never loaded now
        self.load_weights(unpack(buffer, table), version)
        return {"rollout/weight_load_s": time.perf_counter() - t0}

    def load_staged_weights(self, version: int) -> dict[str, float]:
        """Load the weights a staged `receive_weights` took as `version` (older staged ones are dropped); metrics.

        Called in order with the generations (by the rollout's thread), so a batch gets the version it was scheduled
        with even when a later sync has already arrived beside it.
        """
        tensors = self.staged.pop(version)
        if tensors is None:
            # A partial rollout loaded these (or newer ones) between two tokens of the generation before.
            assert self.generation.interrupt is not None and self.version >= version, (version, self.version)
            return {}
        return {"rollout/weight_load_s": self.load_weights(iter(tensors), version)}

    def close(self) -> None:
        """Shut the engine and the channel down."""
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        loop = getattr(self.generation, "agent_loop", None) if getattr(self, "generation", None) else None
        if loop is not None and hasattr(loop, "close"):
            loop.close()
        self.engine.close()
