"""The reference worker: the frozen policy of one rank, which writes `ref_log_prob` for the KL terms.

It loads the policy's checkpoint frozen (no gradients, no optimizer), holds it
under its own strategy (`actor_rollout_ref.ref.strategy`: FSDP2 shards the
parameters and gathers them for each forward) and runs the same log-prob
forward as the actor (`conveyor.workers.ranks.forward.PolicyForward`), without
routing replay: the reference's routing is its own. Under `fsdp2` that forward
gathers one layer at a time; the whole model is never gathered.

What it deliberately does not do: sample, update, or save checkpoints (the
reference never changes; a resumed run loads it from the checkpoint again).
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict

from conveyor.data_plane.base import DataPlane
from conveyor.models.lean import resolve_forward_impl
from conveyor.models.moe_routing import moe_info
from conveyor.models.packing import setup_packing
from conveyor.models.vision import with_vision_fields
from conveyor.protocol import KVBatchMeta
from conveyor.workers.ranks.calls import LogProbCall
from conveyor.workers.ranks.forward import PolicyForward
from conveyor.workers.ranks.perf import begin_phase, phase_memory_metrics, result_handle, set_allocator_defaults
from conveyor.workers.ranks.settings import ReferenceSettings, role_strategy
from conveyor.workers.training.loading import load_role_model
from conveyor.workers.training.sequence_parallel import check_sequence_parallel, group_share
from conveyor.workers.training.trained_model import TrainedModel

__all__ = ["ReferenceWorker"]


class ReferenceWorker:
    """One rank of the frozen reference policy."""

    def __init__(
        self,
        settings: ReferenceSettings,
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
        m, ref = settings.model, settings.ref
        fsdp = ref.fsdp_config
        sp = settings.sequence_parallel_size
        strategy = role_strategy(ref.strategy, fsdp, world_size, self.device, sp=sp)
        # Under fsdp2 over several ranks only rank 0 reads the checkpoint (conveyor.workers.training.loading).
        self.model = load_role_model(
            model_path,
            strategy_name=strategy.name,
            world_size=world_size,
            rank=rank,
            device=self.device,
            dtype=m.dtype,
            trust_remote_code=m.trust_remote_code,
        )
        # Before wrapping: the lean forward keeps references to the model's own modules.
        lean = resolve_forward_impl(m.forward_impl, self.model)
        self.trained = TrainedModel(self.model, strategy, trainable=False)
        self.forward = PolicyForward(
            self.model,
            self.trained,
            lean,
            moe_info(self.model),
            packed=setup_packing(self.model, m.use_remove_padding),
            fused=m.use_fused_kernels,
        )
        check_sequence_parallel(
            self.model, sp, "actor_rollout_ref.ref.ulysses_sequence_parallel_size", packed=self.forward.packed
        )

    @property
    def optim_steps(self) -> int:
        """Always 0: the reference is never updated."""
        return self.trained.optim_steps

    def _get(self, meta: KVBatchMeta, fields: list[str]) -> TensorDict:
        # A forward over the prompts of a vision-language policy reads their pixels and positions too.
        fields = with_vision_fields(fields, meta.fields)
        return self.data_plane.kv_batch_get(keys=meta.keys, partition_id=meta.partition_id, select_fields=fields).to(
            self.device
        )

    @torch.no_grad()
    def compute_log_prob(self, meta: KVBatchMeta) -> KVBatchMeta:
        """Forward without grad: writes ref_log_prob (B, R)."""
        begin_phase(self.device)
        call = LogProbCall.from_extra_info(meta.extra_info)
        # Under SP the group's ranks compute the group's rows together; each writes its own share.
        group, own = group_share(self.forward.sp, meta)
        td = self._get(group, ["prompts", "prompt_mask", "responses", "response_mask"])
        log_probs, _, _ = self.forward.no_grad_log_probs(
            td,
            self.settings.ref.log_prob_micro_batch_size_per_gpu,
            call.temperature,
            budget=self.settings.log_prob_budget,
        )
        out: dict[str, Any] = {"ref_log_prob": log_probs[own].cpu()}
        self.data_plane.kv_batch_put(keys=meta.keys, partition_id=meta.partition_id, fields=out)
        return result_handle(meta, list(out), phase_memory_metrics("ref", self.device), self.device)
