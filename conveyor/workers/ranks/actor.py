"""The actor worker: rollout, old log-probs and the PPO update of one rank.

Every endpoint takes a handle, reads the fields it needs from the data plane,
computes, writes its outputs back and returns a handle whose `extra_info` holds
this rank's metrics (token-weighted ones as `@sum`/`@count` pairs, see
`conveyor.metrics.reduce`) and memory figures. The call's parameters come
typed (`conveyor.workers.ranks.calls`); what holds for the whole run comes in its
`ActorSettings` (`conveyor.workers.ranks.settings`), decided once by the run plan.
How the ranks of the role hold the model (one rank, DDP replicas or FSDP2
shards) is its `TrainedModel`'s business (`conveyor.workers.training.trained_model`); where
the ranks run is the worker group's. The frozen reference has its own worker
(`conveyor.workers.ranks.reference`), sharing the log-prob forward
(`conveyor.workers.ranks.forward`).

Under a multi-rank strategy the update's forward is the Hugging Face forward
through the strategy's wrapper (FSDP2 and DDP act in the module's own forward
hooks, which the lean forward does not call). Under `fsdp2` the no-grad
forwards (old log-probs, routing agreement) are the sharded module's own
forward too, gathering one layer at a time. So is the hf rollout's decoding,
every rank stepping until the last one is done, unless the whole model takes
at most `rollout.hf_whole_gather_max_gb`: then it is gathered once for the
rollout (`TrainingStrategy.full_params`), which keeps the lean forward and
spares a collective per layer and token. The multi-turn loop always gathers
it (its ranks run different numbers of turns).
Every endpoint measures its phase's peak memory (`perf/<phase>/max_memory_gb`).
Under `ulysses_sequence_parallel_size` > 1 the ranks of a sequence-parallel group
read the group's samples, compute them together (each on its slice of every packed
row) and write their own shares; only the group's first rank reports summed metrics
(`conveyor.workers.training.sequence_parallel`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from typing import Any

import torch
from tensordict import TensorDict

from conveyor.algos.correction import compute_rejection_mask
from conveyor.algos.objective import merge_objective_metrics
from conveyor.data_plane.base import DataPlane
from conveyor.metrics.moe_router import (
    expert_grad_norm_metrics,
    expert_grad_norms,
    expert_load,
    flip_counts,
    gate_load_tv,
)
from conveyor.metrics.reduce import weighted
from conveyor.models.fused_head import float32_lm_head
from conveyor.models.lean import resolve_forward_impl
from conveyor.models.loading import load_tokenizer
from conveyor.models.moe_routing import compute_routing_agreement, moe_info
from conveyor.models.packing import setup_packing
from conveyor.models.router_control import freeze_routers
from conveyor.models.vision import with_vision_fields
from conveyor.protocol import KVBatchMeta
from conveyor.rollout.base import GenerationEngine, engine_spec
from conveyor.weights import (
    DeltaSettings,
    WeightChannel,
    cast_weights,
    free_address,
    iter_weights,
    merged_weights,
    send_over,
)
from conveyor.workers.ranks.calls import LogProbCall, UpdateCall
from conveyor.workers.ranks.distill import student_forward
from conveyor.workers.ranks.forward import PolicyForward, replayed_truncation, sequence_inputs
from conveyor.workers.ranks.generation import Generation, build_engine
from conveyor.workers.ranks.loss_terms import MicroBatch, build_loss_terms, micro_batch_loss
from conveyor.workers.ranks.perf import begin_phase, phase_memory_metrics, result_handle, set_allocator_defaults
from conveyor.workers.ranks.router import RouterControls
from conveyor.workers.ranks.settings import ActorSettings, role_strategy
from conveyor.workers.training.batching import plan_micro_batches, take
from conveyor.workers.training.loading import load_role_model
from conveyor.workers.training.sequence_parallel import (
    check_sequence_parallel,
    count_once,
    group_budget,
    group_share,
)
from conveyor.workers.training.trained_model import CheckpointEndpoints, TrainedModel

logger = logging.getLogger(__name__)

__all__ = ["PolicyWorker", "sequence_inputs"]


def _full_model_bytes(model: torch.nn.Module) -> int:
    """Bytes of the whole model's parameters (a DTensor shard counts as its full tensor)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


class PolicyWorker(CheckpointEndpoints):
    """One rank of the actor: rollout, old log-probs and the PPO update."""

    def __init__(
        self,
        settings: ActorSettings,
        *,
        model_path: str,
        data_plane: DataPlane,
        rank: int = 0,
        world_size: int = 1,
        device: str = "cpu",
    ):
        set_allocator_defaults()  # before the first CUDA allocation of this process
        self.settings = settings
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)
        self.data_plane = data_plane
        m, acfg = settings.model, settings.actor
        trust = m.trust_remote_code
        strategy = role_strategy(
            acfg.strategy, acfg.fsdp_config, world_size, self.device, sp=acfg.ulysses_sequence_parallel_size
        )
        # Under fsdp2 over several ranks only rank 0 reads the checkpoint (conveyor.workers.training.loading).
        self.model = load_role_model(
            model_path,
            strategy_name=strategy.name,
            world_size=world_size,
            rank=rank,
            device=self.device,
            dtype=m.dtype,
            trust_remote_code=trust,
        )
        self.tokenizer = load_tokenizer(m.tokenizer_path or model_path, trust_remote_code=trust)
        self.moe = moe_info(self.model)
        routing = (
            settings.forward_records_routing or settings.forward_replays_routing or settings.update_replays_routing
        )
        if routing and self.moe is None:
            raise ValueError(
                f"actor_rollout_ref.model: the run plan records or replays MoE routing, but "
                f"{type(self.model).__name__} has no MoE layers conveyor can route; set "
                "actor_rollout_ref.actor.router_replay.mode=disabled"
            )
        # LoRA: adapters injected in place, before the strategy wraps the model (fsdp2 shards them with their
        # layer; on rank 0 of a rank-0 load they are initialised and sent with the base weights).
        self.peft = None
        if m.lora_rank > 0:
            from conveyor.models.lora import apply_lora

            self.peft = apply_lora(
                self.model,
                rank=m.lora_rank,
                alpha=m.lora_alpha,
                target_modules=m.target_modules,
                seed=settings.seed,
                base_model_path=model_path,
            )
        # Before the strategy wraps the model and the optimizer is built: a frozen router gets neither.
        if acfg.router.freeze:
            freeze_routers(self.model)
        if settings.serves_reference and self.peft is None:
            raise ValueError(
                "the run plan makes the actor serve the reference, which needs actor_rollout_ref.model.lora_rank > 0"
            )
        if m.lm_head_fp32:  # before the lean forward and the engine take the head, and before wrapping
            float32_lm_head(self.model)
        # Before wrapping: the lean forward keeps references to the model's own modules.
        # None: the Hugging Face forward (models the lean one does not cover, LoRA, or forward_impl=hf).
        self.lean = resolve_forward_impl(m.forward_impl, self.model)
        # The worker's own step count (from its settings): the schedule must not depend on what a caller passes.
        self.trained = TrainedModel(
            self.model,
            strategy,
            trainable=True,
            optim_cfg=acfg.optim,
            total_steps=settings.total_optim_steps,
            gradient_checkpointing=m.enable_gradient_checkpointing,
        )
        self.forward = PolicyForward(
            self.model,
            self.trained,
            self.lean,
            self.moe,
            packed=setup_packing(self.model, m.use_remove_padding),
            fused=m.use_fused_kernels,
        )
        # The rollout's top-k / top-p / min-p, replayed in the old log-probs and the update (never the reference's).
        self.truncation = replayed_truncation(settings.rollout)
        sp_key = "actor_rollout_ref.actor.ulysses_sequence_parallel_size"
        check_sequence_parallel(self.model, acfg.ulysses_sequence_parallel_size, sp_key, packed=self.forward.packed)
        # The group's ranks read each other's samples; results are written, and metrics counted, once.
        self.sp = self.forward.sp
        if self.sp is not None and (acfg.router.aux_loss_coef > 0 or acfg.router.bias_update_rate > 0):
            raise ValueError(
                f"{sp_key}={self.sp.size}: the router's load-balancing controls count each rank's own tokens "
                "of the whole group's rows, which sequence parallelism does not support yet; set "
                f"actor_rollout_ref.actor.router.aux_loss_coef=0 and bias_update_rate=0, or {sp_key}=1"
            )
        # After wrapping (the bias is a plain buffer on the router's device) and before the engine is built over
        # the same modules: the rollout then chooses experts with the bias too.
        rc = acfg.router
        self.router_controls = (
            RouterControls(self.model, rc)
            if self.moe is not None and (rc.aux_loss_coef > 0 or rc.bias_update_rate > 0)
            else None
        )
        # The update's loss, from the registered terms this run uses (workers/ranks/loss_terms.py).
        self.loss_terms = build_loss_terms(settings, self)
        self.channel: Any = None  # the weight channel to separate engines (placement=separate, rank 0)
        self.engine: GenerationEngine | None = None
        self.agent_loop = None
        self.generation: Generation | None = None
        self.rollout_over_shards = False
        if settings.rollout.placement == "colocated":  # separate: the rollout workers hold the engines
            self._build_generation(model_path, strategy, data_plane)

    def _build_generation(self, model_path: str, strategy: Any, data_plane: DataPlane) -> None:
        """This rank's engine, from the registry, in this process (placement=colocated), and the rollout over it."""
        settings, rank, world_size = self.settings, self.rank, self.world_size
        spec = engine_spec(settings.rollout.name)
        # The engine, and what drives it: the agent gateway (rollout.agent), the tool loop (rollout.multi_turn) or None.
        self.engine, self.agent_loop = build_engine(
            settings,
            model_path,
            self.model,
            self.tokenizer,
            rank=rank,
            world_size=world_size,
            device=self.device,
            lean=self.lean,
            moe=self.moe,
        )
        caps = self.engine.capabilities
        if not caps.shares_trainer_modules and rank == 0:
            logger.info("%s rollout engine started in %.1f s", spec.name, getattr(self.engine, "start_time_s", 0.0))
        # An engine over the trainer's modules under fsdp2 gathers the whole model once when it is small, else
        # decodes over the shards; an engine with its own copy of the weights needs neither.
        shares = caps.shares_trainer_modules
        full_gb = _full_model_bytes(self.model) / 1e9
        # Under expert parallelism a gathered model still exchanges tokens in every forward, so the ranks must
        # decode in step: over the shards, whatever the size.
        self.rollout_over_shards = (
            strategy.sharded
            and shares
            and self.agent_loop is None
            and (full_gb > settings.rollout.hf_whole_gather_max_gb or strategy.forward_communicates)
        )
        if strategy.forward_communicates and shares and self.agent_loop is not None:
            raise ValueError(
                "actor_rollout_ref.rollout.multi_turn.enable: the multi-turn loop decodes each rank on "
                "its own, which expert parallelism (every forward an all-to-all) cannot do; set "
                "actor_rollout_ref.actor.fsdp_config.expert_parallel_size=1 or use an engine with its "
                "own weights"
            )
        if self.lean is not None and strategy.sharded and rank == 0:
            logger.info(
                "strategy fsdp2: the update and the no-grad forwards (old log-probs, routing agreement) run the "
                "Hugging Face forward over the shards, one layer gathered at a time (the lean forward needs "
                "the whole model)"
            )
        elif self.lean is not None and (strategy.distributed or self.trained.checkpointing) and rank == 0:
            logger.info(
                "the update runs the Hugging Face forward (the lean forward bypasses %s); the rollout and "
                "no-grad log-probs keep the lean forward",
                f"strategy {strategy.name}'s module hooks" if strategy.distributed else "activation checkpointing",
            )
        if strategy.sharded and shares and rank == 0:
            if self.rollout_over_shards:
                logger.info(
                    "strategy fsdp2 with the %s rollout: the model's %.2f GB exceed rollout."
                    "hf_whole_gather_max_gb=%g, so generation decodes over the shards (one all-gather per "
                    "layer and token; an engine with its own weights, e.g. rollout.name=vllm, decodes "
                    "without them)",
                    spec.name,
                    full_gb,
                    settings.rollout.hf_whole_gather_max_gb,
                )
            else:
                logger.info(
                    "strategy fsdp2 with the %s rollout: generation gathers the whole model (%.2f GB) on every rank%s",
                    spec.name,
                    full_gb,
                    " (the multi-turn loop needs it whole)"
                    if self.agent_loop is not None
                    else f" (at most rollout.hf_whole_gather_max_gb={settings.rollout.hf_whole_gather_max_gb:g})",
                )
        self.generation = Generation(
            self.engine,
            agent_loop=self.agent_loop,
            tokenizer=self.tokenizer,
            moe=self.moe,
            rollout=settings.rollout,
            engine_name=spec.name,
            strategy=strategy,
            passes=self.trained.passes,
            data_plane=data_plane,
            rank=rank,
            world_size=world_size,
            device=self.device,
            over_shards=self.rollout_over_shards,
        )

    def close(self) -> None:
        """Release what the worker holds outside Python's reach: the engine and the weight channel, if any."""
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        if self.agent_loop is not None and hasattr(self.agent_loop, "close"):
            self.agent_loop.close()  # the agent gateway's server
            self.agent_loop = None
        if self.engine is not None:
            self.engine.close()

    def _sync_engine(self) -> dict[str, float]:
        """Give a colocated engine with its own weights the actor's current ones if it serves older ones; metrics."""
        version = self.trained.optim_steps
        if self.engine.capabilities.shares_trainer_modules or self.engine.weights_version == version:
            return {}
        return {"rollout/weight_sync_s": self.engine.update_weights(self.weight_stream(), version=version)}

    def weight_stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The actor's weights one tensor at a time, under Hugging Face names, as an engine loads them.

        Under fsdp2 each tensor is gathered in turn (a collective: every rank iterates the same stream).
        LoRA: the adapters merged in tensor by tensor, under the base model's names (the engine serves the base
        architecture).
        """
        if self.peft is not None:
            yield from merged_weights(self.model)
            return
        yield from iter_weights(self.model)

    def weights_version(self) -> int:
        """The optimizer-step count of the actor's weights (what a synced engine serves)."""
        return self.trained.optim_steps

    def channel_address(self) -> tuple[str, int] | None:
        """Rank 0: (host, free port) for the weight channel's rendezvous; None elsewhere."""
        return free_address() if self.rank == 0 else None

    def join_weight_channel(self, address: tuple[str, int], size: int) -> None:
        """Rank 0 joins the weight channel to separate engines as its sender (the other ranks have no part in it)."""
        if self.rank == 0:
            self.channel = WeightChannel(address, 0, size, device=self.device)
            delta = self.settings.rollout.delta_sync  # after a whole sync, only the elements that changed travel
            self.channel.configure_delta(DeltaSettings(enable=delta.enable, full_every=delta.full_every))

    def send_weights(
        self, bucket_bytes: int, staged: list[tuple[str, torch.Tensor]] | None = None, dtype: torch.dtype | None = None
    ) -> dict[str, float]:
        """Stream the weights over the channel (rank 0 sends; every rank takes part in the gathers); metrics.

        `staged`: a copy of the weights taken earlier, sent instead of the current ones (one rank, in the caller's
        process: the asynchronous source copies them while the actor trains on). `dtype`: the engine's, each
        tensor cast to it before it is bucketed (a bf16 engine takes half the bytes of fp32 masters on the wire).
        """
        stream = cast_weights(iter(staged) if staged is not None else self.weight_stream(), dtype)
        return send_over(self.channel if self.rank == 0 else None, stream, bucket_bytes)

    @property
    def optim_steps(self) -> int:
        """Update calls so far (the lr schedule's position)."""
        return self.trained.optim_steps

    # ------------------------------------------------------------------ helpers
    def _result(self, meta: KVBatchMeta, fields: list[str], metrics: dict[str, float], phase: str) -> KVBatchMeta:
        metrics = {**metrics, **phase_memory_metrics(phase, self.device)}
        return result_handle(meta, fields, metrics, self.device)

    def _get(self, meta: KVBatchMeta, fields: list[str]) -> TensorDict:
        # A forward over the prompts of a vision-language policy reads their pixels and positions too.
        fields = with_vision_fields(fields, meta.fields)
        return self.data_plane.kv_batch_get(keys=meta.keys, partition_id=meta.partition_id, select_fields=fields).to(
            self.device
        )

    def _put(self, meta: KVBatchMeta, fields: dict[str, Any]) -> None:
        cpu = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in fields.items()}
        self.data_plane.kv_batch_put(keys=meta.keys, partition_id=meta.partition_id, fields=cpu)

    def _forward(
        self,
        td: TensorDict,
        temperature: float,
        with_entropy: bool,
        routed_experts: torch.Tensor | None = None,
        record_routing: bool = False,
        train: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Response log-probs (B, R), entropy (B, R) or None, and this forward's own routing when recorded."""
        return self.forward.log_probs(
            td, temperature, with_entropy, routed_experts, record_routing, train, truncation=self.truncation
        )

    # ------------------------------------------------------------------ endpoints
    def generate_sequences(self, meta: KVBatchMeta) -> KVBatchMeta:
        """Sample responses for the handle's prompts: writes responses, response_mask, rollout_log_probs (+
        routed_experts)."""
        if self.generation is None:
            raise RuntimeError(
                "actor_rollout_ref.rollout.placement=separate: the rollout workers generate, not the actor"
            )
        return self.generation(meta, self._sync_engine())

    @property
    def interrupt(self) -> Callable[[int], bool] | None:
        """A partial rollout's hook, called between the engine's tokens (`conveyor.workers.ranks.generation`)."""
        return self.generation.interrupt if self.generation is not None else None

    @interrupt.setter
    def interrupt(self, hook: Callable[[int], bool] | None) -> None:
        assert self.generation is not None, "the actor generates under placement=colocated only"
        self.generation.interrupt = hook

    @torch.no_grad()
    def compute_log_prob(self, meta: KVBatchMeta) -> KVBatchMeta:
        """Forward without grad: writes old_log_probs (+ entropy, + sum_pi_squared when asked, + routed_experts when
        the plan records them)."""
        begin_phase(self.device)
        call = LogProbCall.from_extra_info(meta.extra_info)
        st = self.settings
        # R2: this forward's routing is what every update of the step replays; without routing from the
        # rollout engine, the load-balance metrics describe this forward's (the run plan decides both).
        record, replay = st.forward_records_routing, st.forward_replays_routing
        fields = ["prompts", "prompt_mask", "responses", "response_mask"]
        if replay:
            fields.append("routed_experts")
        group, own = group_share(self.sp, meta)
        td = self._get(group, fields)
        log_probs, entropy, sum_pi_squared, routing = self.forward.no_grad_token_stats(
            td,
            st.rollout.log_prob_micro_batch_size_per_gpu,
            float(call.temperature),
            with_entropy=bool(call.calculate_entropy),
            with_sum_pi_squared=bool(call.calculate_sum_pi_squared),
            replay=replay,
            record=record,
            budget=st.log_prob_budget,
            truncation=self.truncation,
        )
        metrics: dict[str, float] = {}
        out = {"old_log_probs": log_probs}
        if st.rollout.exact:
            # rollout.exact: the rollout's log-probs are this forward's, by construction (validate_config of the
            # hf engine refuses what it cannot hold to).
            out["rollout_log_probs"] = log_probs
        if sum_pi_squared is not None:
            out["sum_pi_squared"] = sum_pi_squared
        if entropy is not None:
            out["entropy"] = entropy
            mask = td["response_mask"][own].bool()
            metrics.update(weighted("actor/entropy", float(entropy[own].sum()), float(mask.sum())))
        if routing is not None:
            out["routed_experts"] = routing
        self._put(meta, {k: v[own] for k, v in out.items()})
        return self._result(meta, list(out), metrics, "old_log_prob")

    @torch.no_grad()
    def compute_ref_log_prob(self, meta: KVBatchMeta) -> KVBatchMeta:
        """LoRA's reference: the forward with the adapters disabled (the frozen base model); writes ref_log_prob (B,
        R)."""
        assert self.peft is not None and self.settings.ref is not None, "the actor serves the reference under LoRA only"
        begin_phase(self.device)
        call = LogProbCall.from_extra_info(meta.extra_info)
        group, own = group_share(self.sp, meta)
        td = self._get(group, ["prompts", "prompt_mask", "responses", "response_mask"])
        # No replay: the reference's routing is its own, as the separate reference worker's is.
        with self.peft.disable_adapter():
            log_probs, _, _ = self.forward.no_grad_log_probs(
                td,
                self.settings.ref.log_prob_micro_batch_size_per_gpu,
                float(call.temperature),
                budget=self.settings.ref_budget,
            )
        out = {"ref_log_prob": log_probs[own]}
        self._put(meta, out)
        return self._result(meta, list(out), {}, "ref")

    def save_checkpoint(self, path: str) -> dict[str, Any]:
        """Write this rank's shards (LoRA: the adapters and their optimizer state only) under `path`."""
        extra = super().save_checkpoint(path)
        if self.peft is not None and self.rank == 0:
            # PEFT's adapter_config.json (rank, alpha, targets, the base checkpoint's path): what export needs.
            from conveyor.models.lora import ADAPTER

            self.peft.peft_config[ADAPTER].save_pretrained(path)
        return extra

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's weights on rank 0 (LoRA: the adapters only, the rest never changes); empty elsewhere."""
        if self.peft is None:
            return super().model_state_dict()
        from conveyor.models.lora import is_adapter_key

        return {k: v for k, v in super().model_state_dict().items() if is_adapter_key(k)}

    @torch.no_grad()
    def compute_routing_agreement(self, meta: KVBatchMeta) -> KVBatchMeta:
        """This rank's own routing (no replay) against the rollout's, and its router health; writes nothing.

        Reports `actor/moe/routing_agreement` and, per MoE layer, the flip rate, the near-tie share (router margin
        below `rollout.moe_near_tie_eps`), the router entropy and the gate mass's distance from the assigned load
        (`conveyor.metrics.moe_router`), token-weighted over the ranks.
        """
        assert self.moe is not None, "routing agreement needs an MoE model"
        begin_phase(self.device)
        # Under SP the group's ranks each compute the whole group's rows (no split here): counted once below.
        group, _ = group_share(self.sp, meta)
        td = self._get(group, ["prompts", "prompt_mask", "responses", "response_mask", "routed_experts"])
        self.model.eval()
        st = self.settings
        eps = float(st.rollout.moe_near_tie_eps)
        batches = plan_micro_batches(
            td["prompt_mask"],
            td["response_mask"],
            st.rollout.log_prob_micro_batch_size_per_gpu,
            group_budget(st.log_prob_budget, self.sp),
            agree=self.trained.strategy.agree_count,
            packed=self.forward.packed,
        )
        with self.trained.strategy.sharded_no_grad():
            passes = []
            for sl, real in self.trained.passes(batches):
                mb, _ = take(td, sl)
                stats = self.forward.router_stats(mb)
                if real:
                    passes.append((mb, stats))
        layers, experts = self.moe.num_layers, self.moe.num_experts
        total, count = 0.0, 0
        sums = torch.zeros(4, layers, dtype=torch.float64)  # flips, flip pairs, near ties, entropy
        known = torch.zeros(layers, dtype=torch.float64)  # pairs with a margin (and an entropy)
        mass_load = torch.zeros(2, layers, experts, dtype=torch.float64, device=self.device)
        for mb, stats in passes:
            valid = torch.cat([mb["prompt_mask"], mb["response_mask"]], dim=1).bool()
            frac = compute_routing_agreement(stats.ids.long(), mb["routed_experts"].long(), valid)
            if not math.isnan(frac):
                n = int(valid.sum())
                total += frac * n
                count += n
            flipped, pairs = flip_counts(stats.ids, mb["routed_experts"], valid)
            has = ~torch.isnan(stats.margin) & valid[..., None]
            sums[0] += flipped.double()
            sums[1] += pairs.double()
            sums[2] += (has & (stats.margin < eps)).sum(dim=(0, 1)).double().cpu()
            sums[3] += stats.entropy.masked_fill(~has, 0.0).sum(dim=(0, 1)).double().cpu()
            known += has.sum(dim=(0, 1)).double().cpu()
            mass_load[0] += stats.gate_mass.to(mass_load.device)
            mass_load[1] += expert_load(stats.ids.flatten(0, 1), valid.flatten(), experts).to(mass_load.device)
        # The distance of two distributions is not a mean of per-rank distances: sum the mass and load first
        # (an SP group's rows once: only its first rank's count).
        if self.sp is not None and self.sp.rank != 0:
            mass_load.zero_()
        self.trained.strategy.all_reduce_sum(mass_load)
        metrics = weighted("actor/moe/routing_agreement", total, count) if count else {}
        for i in range(layers):
            if sums[1, i] > 0:
                metrics.update(weighted(f"actor/moe/flip_rate/layer_{i}", float(sums[0, i]), float(sums[1, i])))
            if known[i] > 0:
                metrics.update(weighted(f"actor/moe/near_tie/layer_{i}", float(sums[2, i]), float(known[i])))
                metrics.update(weighted(f"actor/moe/router_entropy/layer_{i}", float(sums[3, i]), float(known[i])))
        tv = gate_load_tv(mass_load[0].cpu(), mass_load[1].cpu())
        for i, value in enumerate(tv.tolist()):
            if not math.isnan(value):
                metrics[f"actor/moe/gate_load_tv/layer_{i}"] = value
        return self._result(meta, [], count_once(metrics, self.sp), "routing_agreement")

    def update_actor(self, meta: KVBatchMeta) -> KVBatchMeta:
        """One optimizer step over the handle's samples (this rank's share of one mini-batch)."""
        begin_phase(self.device)
        call = UpdateCall.from_extra_info(meta.extra_info)
        st, acfg = self.settings, self.settings.actor
        temperature = float(call.temperature)
        # Without an old-log-prob forward (bypass mode) the update's forward is where entropy gets reported.
        report_entropy = bool(call.calculate_entropy)
        # The step's only optimizer step: this forward, before it, is the proximal policy (docs/async.md).
        proximal = st.update_writes_old_log_probs
        group, own = group_share(self.sp, meta)
        td = self._get(group, self._update_fields())
        loss_mask = self._loss_mask(td)
        num_tokens, num_seqs = self._normalisers(td[loss_mask][own])
        self.model.train()
        self.trained.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        # Token-budget micro-batches regroup rows only: the normalisers above are the whole mini-batch's.
        passes = self.trained.passes(
            plan_micro_batches(
                td["prompt_mask"],
                td["response_mask"],
                acfg.ppo_micro_batch_size_per_gpu,
                group_budget(st.update_budget, self.sp),
                agree=self.trained.strategy.agree_count,
                packed=self.forward.packed,
            )
        )
        proximal_lps = torch.zeros(td["responses"].shape, dtype=torch.float32, device=self.device) if proximal else None
        with_entropy = acfg.entropy_coeff != 0 or report_entropy
        logits_needed = any(t.needs_logits for t in self.loss_terms)
        controls = self.router_controls
        for i, (sl, real) in enumerate(passes):
            mb, window = take(td, sl)  # under a budget, without the columns that are padding in all its rows
            routed = mb["routed_experts"].long() if st.update_replays_routing else None
            # The replay stays in force through the backward, where activation checkpointing recomputes the forward.
            with self.forward.update_replay(routed, mb):
                # Inside the replay: the tap reads each router's own choice before a replay hook replaces it.
                with controls.tap(self.forward.router_rows(mb, train=True), real) if controls else nullcontext():
                    log_prob, entropy, logits = student_forward(
                        self.forward, mb, temperature, with_entropy, routed, logits_needed, self.truncation
                    )
                old = (log_prob.detach() * mb["response_mask"]).float() if proximal else mb["old_log_probs"]
                if proximal and real:
                    proximal_lps[sl] = window.responses(old)
                norms = (num_tokens, num_seqs, st.loss_scale_factor)
                batch = MicroBatch(
                    mb, mb[loss_mask].bool(), log_prob, old, entropy, logits, temperature, *norms, real, sums
                )
                loss, mb_metrics = micro_batch_loss(self.loss_terms, batch)
                self.trained.backward(loss, real=real, last=i == len(passes) - 1)
            if real:
                merge_objective_metrics(sums, mb_metrics)
        if not report_entropy:  # compute_log_prob already logged the old policy's entropy under this name
            sums.pop("entropy@sum", None)
            sums.pop("entropy@count", None)
        metrics = {(k if k.startswith("distill/") else f"actor/{k}"): v for k, v in sums.items()}
        if proximal:  # for the metrics stage, which compares them with the rollout's
            self._put(meta, {"old_log_probs": proximal_lps[own]})
        metrics.update(self._step(call))
        return self._result(meta, [], count_once(metrics, self.sp), "update_actor")

    def _update_fields(self) -> list[str]:
        """The fields an update reads: the forward's, the loss terms', and what rejection and replay need."""
        st = self.settings
        fields = ["prompts", "prompt_mask", "responses", "response_mask"]
        if not st.update_writes_old_log_probs:
            fields.append("old_log_probs")
        if st.rejection and "rollout_log_probs" not in fields:
            fields.append("rollout_log_probs")
        if st.update_replays_routing:
            fields.append("routed_experts")
        for term in self.loss_terms:
            fields += [f for f in term.fields if f not in fields]
        return fields

    def _loss_mask(self, td: TensorDict) -> str:
        """The field of the tokens in the loss: verl's rollout_rs rejects tokens from it (and from its token count)."""
        rejection = [tuple(r) for r in self.settings.rejection]
        if not rejection:
            return "response_mask"
        keep, _ = compute_rejection_mask(td["old_log_probs"], td["rollout_log_probs"], td["response_mask"], rejection)
        td.set("loss_mask", keep)
        return "loss_mask"

    def _normalisers(self, own_mask: torch.Tensor) -> tuple[float, float]:
        """The mini-batch's tokens and sequences in the loss, over every rank (so the ranks' losses sum to the global
        loss); `own_mask` is this rank's own share only (an SP group's ranks all hold the group's rows)."""
        counts = torch.tensor([float(own_mask.sum()), float(len(own_mask))], dtype=torch.float64)
        self.trained.strategy.all_reduce_sum(counts)
        return counts[0].item(), counts[1].item()

    def _step(self, call: UpdateCall) -> dict[str, float]:
        """The optimizer step after the backward passes (and the router bias's), with their metrics."""
        metrics: dict[str, float] = {}
        if call.moe_metrics and self.moe is not None:
            # Before the step, which clips and then drops the gradients.
            metrics.update(expert_grad_norm_metrics(expert_grad_norms(self.model), "actor/moe"))
        grad_norm, stepped, lr, memory = self.trained.step(self.settings.actor.grad_clip)
        if not stepped:
            logger.warning("actor rank %d: non-finite grad norm %s; optimizer step skipped", self.rank, grad_norm)
            metrics["actor/skipped_steps@sum"] = 1.0
        controls = self.router_controls
        if controls is not None and controls.bias_on:
            metrics.update(controls.update_bias(self.trained.strategy.all_reduce_sum))
        metrics["actor/lr"] = lr
        metrics["actor/grad_norm"] = grad_norm
        metrics.update(memory)
        return metrics
