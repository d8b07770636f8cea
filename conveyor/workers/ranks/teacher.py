"""The teacher worker: one rank of the frozen teachers, which score the student's samples for distillation.

Each teacher is loaded from its own checkpoint (`distillation.teacher_models.<name>.model_path`),
frozen (no gradients, no optimizer, never synced from the actor) and held under
its own strategy (`strategy`, `fsdp_config`: FSDP2 shards its parameters over
the role's ranks, gathered a layer at a time in the forward; `param_offload`
keeps the shards in host memory between phases on a GPU), exactly as the
reference is. A rank's share of a batch is split by the value of
`distillation.teacher_key` (e.g. `data_source`): each sample is scored by its
own teacher, and only by it. Every rank runs every teacher's forward as many
times as the busiest rank does, so FSDP2's gathers pair up even when a rank
holds no sample of some teacher.

It writes what the loss needs (`conveyor.workers.ranks.distill.TEACHER_FIELDS`):
`teacher_log_probs` (B, R) always; the top-k log-probs and ids (B, R, K) for
`forward_kl_topk`; the log-probs over the whole vocabulary (B, R, V) for
`full_reverse_kl`. An MoE teacher's routing is recorded in its forward and
written as `teacher_routed_experts`; where the student's routing is on the data
plane, `distill/moe/routing_agreement` (the share of (token, layer) pairs whose
top-k expert sets agree) comes back in the metrics.

What it deliberately does not do: sample, update, save checkpoints, or decide
which teacher a sample belongs to beyond reading the key field.
"""

from __future__ import annotations

import logging
import math

import torch
from tensordict import TensorDict

from conveyor.algos.distill import full_log_probs, teacher_topk
from conveyor.algos.logprob import logprobs_from_logits
from conveyor.algos.trajectory import response_span
from conveyor.data_plane.base import DataPlane
from conveyor.metrics.reduce import weighted
from conveyor.models.lean import resolve_forward_impl
from conveyor.models.moe_routing import compute_routing_agreement, moe_info, routed_experts_dtype
from conveyor.models.packing import setup_packing
from conveyor.models.vision import with_vision_fields
from conveyor.protocol import KVBatchMeta
from conveyor.workers.ranks.calls import LogProbCall
from conveyor.workers.ranks.distill import TEACHER_FIELDS, TeacherModel, TeacherSettings
from conveyor.workers.ranks.forward import PolicyForward
from conveyor.workers.ranks.perf import begin_phase, phase_memory_metrics, result_handle, set_allocator_defaults
from conveyor.workers.ranks.settings import role_strategy
from conveyor.workers.training.batching import micro_batches
from conveyor.workers.training.loading import load_role_model
from conveyor.workers.training.trained_model import TrainedModel

logger = logging.getLogger(__name__)

__all__ = ["TeacherWorker"]


class TeacherWorker:
    """One rank of every teacher of the run."""

    def __init__(
        self,
        settings: TeacherSettings,
        *,
        data_plane: DataPlane,
        rank: int = 0,
        world_size: int = 1,
        device: str = "cpu",
    ):
        set_allocator_defaults()
        self.settings = settings
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)
        self.data_plane = data_plane
        self.forwards: dict[str, PolicyForward] = {t.name: self._load(t) for t in settings.teachers}
        self._warned: set[str] = set()

    def _load(self, teacher: TeacherModel) -> PolicyForward:
        """One teacher, frozen, under its own strategy (only rank 0 reads the checkpoint under fsdp2)."""
        m = self.settings.model
        strategy = role_strategy(teacher.strategy, teacher.fsdp_config, self.world_size, self.device)
        model = load_role_model(
            teacher.model_path,
            strategy_name=strategy.name,
            world_size=self.world_size,
            rank=self.rank,
            device=self.device,
            dtype=m.dtype,
            trust_remote_code=m.trust_remote_code,
        )
        lean = resolve_forward_impl(m.forward_impl, model)
        trained = TrainedModel(model, strategy, trainable=False)
        return PolicyForward(model, trained, lean, moe_info(model), packed=setup_packing(model, m.use_remove_padding))

    def _rows_of(self, td: TensorDict) -> dict[str, list[int]]:
        """Each teacher's rows of `td` (by the teacher_key field); every row belongs to exactly one teacher."""
        st = self.settings
        if len(st.teachers) == 1 and st.teachers[0].key is None:
            return {st.teachers[0].name: list(range(len(td)))}
        by_key = {t.key: t.name for t in st.teachers}
        rows: dict[str, list[int]] = {t.name: [] for t in st.teachers}
        for i, value in enumerate(td[st.teacher_key]):
            name = by_key.get(str(value))
            if name is None:
                raise ValueError(
                    f"distillation.teacher_key={st.teacher_key}: a sample has {st.teacher_key}={value!r}, which no "
                    f"teacher scores (distillation.teacher_models.<name>.key are {sorted(by_key)})"
                )
            rows[name].append(i)
        return rows

    @torch.no_grad()
    def compute_teacher_log_prob(self, meta: KVBatchMeta) -> KVBatchMeta:
        """Forward of each sample's teacher: writes the teacher's fields (and teacher_routed_experts for an MoE)."""
        begin_phase(self.device)
        st = self.settings
        call = LogProbCall.from_extra_info(meta.extra_info)
        fields = ["prompts", "prompt_mask", "responses", "response_mask"]
        multi = not (len(st.teachers) == 1 and st.teachers[0].key is None)
        if multi:
            fields.append(st.teacher_key)
        if st.routing_agreement:
            fields.append("routed_experts")
        # A vision-language student's samples carry their pixels and M-RoPE positions: the teacher's forward reads
        # them as the student's does (a teacher that would read them otherwise is refused at start).
        fields = with_vision_fields(fields, meta.fields)
        td = self.data_plane.kv_batch_get(keys=meta.keys, partition_id=meta.partition_id, select_fields=fields)
        rows = self._rows_of(td)
        td = td.exclude(st.teacher_key) if multi else td
        td = td.to(self.device)
        out: dict[str, torch.Tensor] = {}
        metrics: dict[str, float] = {}
        agree_sum, agree_count = 0.0, 0
        for teacher in st.teachers:
            forward = self.forwards[teacher.name]
            idx = torch.tensor(rows[teacher.name], dtype=torch.long)
            part = td[idx.to(self.device)] if len(idx) else td[:1]
            fields_of, routing = self._score(forward, part, teacher.micro_batch_size, float(call.temperature), len(idx))
            if not len(idx):
                continue
            for name, value in fields_of.items():
                if name not in out:
                    out[name] = torch.zeros((len(td), *value.shape[1:]), dtype=value.dtype)
                out[name][idx] = value
            if routing is not None:
                if "teacher_routed_experts" not in out:
                    out["teacher_routed_experts"] = torch.full((len(td), *routing.shape[1:]), -1, dtype=routing.dtype)
                out["teacher_routed_experts"][idx] = routing
                if st.routing_agreement:
                    s, c = self._agreement(part, routing, teacher.name)
                    agree_sum, agree_count = agree_sum + s, agree_count + c
        if agree_count:
            metrics.update(weighted("distill/moe/routing_agreement", agree_sum, agree_count))
        self.data_plane.kv_batch_put(keys=meta.keys, partition_id=meta.partition_id, fields=out)
        memory = phase_memory_metrics("teacher", self.device)
        return result_handle(meta, list(out), {**metrics, **memory}, self.device)

    def _score(
        self, forward: PolicyForward, td: TensorDict, micro_batch_size: int, temperature: float, real_rows: int
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        """One teacher's fields over `td` (CPU tensors, rows in order) and its routing (B, P+R, L, K) when MoE.

        `real_rows` 0: this rank holds none of the teacher's samples; it runs the passes the other ranks run
        (their collectives must pair up) and keeps nothing.
        """
        st = self.settings
        record = forward.moe is not None
        slices = micro_batches(len(td), micro_batch_size) if real_rows else []
        n = forward.trained.strategy.agree_count(len(slices))
        if n == 0:
            return {}, None
        passes = [(slices[i], True) if i < len(slices) else (slice(0, 1), False) for i in range(n)]
        parts: dict[str, list[torch.Tensor]] = {}
        routings: list[torch.Tensor] = []
        forward.model.eval()
        with forward.trained.strategy.sharded_no_grad():
            for sl, real in passes:
                mb = td[sl]
                logits, own = forward.response_logits(mb, None, record)
                if not real:
                    continue
                lp = logprobs_from_logits(logits, mb["responses"], temperature=temperature)
                parts.setdefault("teacher_log_probs", []).append(lp.cpu())
                if st.needs == "topk":
                    top_lp, top_ids = teacher_topk(logits, st.topk, temperature=temperature)
                    parts.setdefault("teacher_topk_log_probs", []).append(top_lp.cpu())
                    parts.setdefault("teacher_topk_ids", []).append(top_ids.to(torch.int32).cpu())
                elif st.needs == "full":
                    parts.setdefault("teacher_full_log_probs", []).append(
                        full_log_probs(logits, temperature=temperature).cpu()
                    )
                if own is not None:
                    routings.append(own.cpu())
        if not real_rows:
            return {}, None
        fields = {name: torch.cat(values) for name, values in parts.items()}
        assert set(fields) == set(TEACHER_FIELDS[st.needs])
        routing = None
        if routings:
            fed = torch.cat([td["prompt_mask"].bool(), response_span(td["response_mask"]).bool()], dim=1).cpu()
            own = torch.cat(routings).long()
            routing = torch.where(fed[:, :, None, None], own, torch.full_like(own, -1))
            routing = routing.to(routed_experts_dtype(forward.moe.num_experts))
        return fields, routing

    def _agreement(self, td: TensorDict, teacher_routing: torch.Tensor, name: str) -> tuple[float, int]:
        """(agreeing pairs, counted tokens) between the student's routed_experts and the teacher's own routing."""
        student = td["routed_experts"].cpu()
        if student.shape != teacher_routing.shape:
            if name not in self._warned:
                self._warned.add(name)
                logger.warning(
                    "teacher %s routes %s experts per token, the student %s: no distill/moe/routing_agreement",
                    name,
                    tuple(teacher_routing.shape[2:]),
                    tuple(student.shape[2:]),
                )
            return 0.0, 0
        valid = torch.cat([td["prompt_mask"].bool(), response_span(td["response_mask"]).bool()], dim=1).cpu()
        frac = compute_routing_agreement(teacher_routing.long(), student.long(), valid)
        if math.isnan(frac):
            return 0.0, 0
        n = int(valid.sum())
        return frac * n, n
