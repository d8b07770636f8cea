"""The critic worker: values of response positions and the clipped value-loss update of one rank.

Under `fsdp2` the values' no-grad forward is the sharded module's own forward
(one layer gathered at a time, every rank running as many micro-batches as the
busiest); each endpoint reports its phase's peak memory
(`perf/values/max_memory_gb`, `perf/update_critic/max_memory_gb`). Under
`critic.ulysses_sequence_parallel_size` > 1 the ranks of a group compute the
group's rows together, each on its slice of every packed row
(`conveyor.workers.training.sequence_parallel`), and each writes its own share.

A vision-language policy's critic (`conveyor.models.value_head`: the vision
tower and text model with a value head) reads the prompts' pixels, image grids,
M-RoPE positions and rope deltas with them (`with_vision_fields`) and runs the
actor's forward keywords, padded and packed (`padded_kwargs`, `packed_kwargs`):
its values are of the sequence the policy's log-probs are of.
"""

from __future__ import annotations

import logging

import torch
from tensordict import TensorDict

from conveyor.algos.losses import compute_value_loss
from conveyor.algos.trajectory import response_span
from conveyor.data_plane.base import DataPlane
from conveyor.metrics.reduce import weighted
from conveyor.models.packing import PackedRows, setup_packing
from conveyor.models.value_head import ValueModel
from conveyor.models.vision import VisionBatch, with_vision_fields
from conveyor.protocol import KVBatchMeta
from conveyor.workers.ranks.forward import packed_kwargs, padded_kwargs, sequence_inputs
from conveyor.workers.ranks.perf import begin_phase, phase_memory_metrics, result_handle, set_allocator_defaults
from conveyor.workers.ranks.settings import CriticSettings, role_strategy
from conveyor.workers.training.batching import in_row_order, plan_micro_batches, take
from conveyor.workers.training.loading import load_role_model
from conveyor.workers.training.sequence_parallel import (
    SequenceParallel,
    check_sequence_parallel,
    count_once,
    group_budget,
    group_share,
)
from conveyor.workers.training.trained_model import CheckpointEndpoints, TrainedModel

logger = logging.getLogger(__name__)

__all__ = ["CriticWorker"]


class CriticWorker(CheckpointEndpoints):
    """One rank of the value model (a copy of the policy's backbone plus a scalar head)."""

    def __init__(
        self,
        settings: CriticSettings,
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
        model_cfg = settings.model
        ccfg = settings.critic
        fsdp = ccfg.fsdp_config
        strategy = role_strategy(ccfg.strategy, fsdp, world_size, self.device, sp=ccfg.ulysses_sequence_parallel_size)
        # Under fsdp2 over several ranks only rank 0 reads the checkpoint (conveyor.workers.training.loading).
        base = load_role_model(
            model_path,
            strategy_name=strategy.name,
            world_size=world_size,
            rank=rank,
            device=self.device,
            dtype=model_cfg.dtype,
            trust_remote_code=model_cfg.trust_remote_code,
            lm_head=False,  # the value head replaces it: a critic may start from a reward model's body
        )
        # The body is taken, not copied: the causal LM is dropped here (its LM head with it).
        # Packed forwards are set up on the causal LM, whose config the body shares.
        self.packed = setup_packing(base, model_cfg.use_remove_padding)
        sp_key = "critic.ulysses_sequence_parallel_size"
        check_sequence_parallel(base, ccfg.ulysses_sequence_parallel_size, sp_key, packed=self.packed)
        self.model = ValueModel.from_causal_lm(base, copy=False)
        del base
        # The critic's own step count (its settings'): its mini-batch size and epochs may differ from the actor's.
        self.trained = TrainedModel(
            self.model,
            strategy,
            trainable=True,
            optim_cfg=ccfg.optim,
            total_steps=settings.total_optim_steps,
            gradient_checkpointing=model_cfg.enable_gradient_checkpointing,
        )
        # The sequence-parallel group (None at size 1): packed rows are split by tokens over it.
        self.sp = SequenceParallel.of(strategy)

    @property
    def optim_steps(self) -> int:
        """Update calls so far (the lr schedule's position)."""
        return self.trained.optim_steps

    def _get(self, meta: KVBatchMeta, fields: list[str]) -> TensorDict:
        # A forward over the prompts of a vision-language policy reads their pixels and positions too.
        fields = with_vision_fields(fields, meta.fields)
        return self.data_plane.kv_batch_get(keys=meta.keys, partition_id=meta.partition_id, select_fields=fields).to(
            self.device
        )

    def _values(self, td: TensorDict, train: bool = False) -> torch.Tensor:
        """Values (B, R): the value of the state before each response token (`train`: through the strategy)."""
        input_ids, attention_mask, position_ids = sequence_inputs(td)
        resp_len = td["responses"].shape[1]
        module = self.trained.forward_module if train else self.model
        config = self.model.config
        if self.packed:
            packed = PackedRows.from_masks(attention_mask, response_span(td["response_mask"]))
            if self.sp is not None:  # this rank's slice of the row; the values gathered into whole rows
                if VisionBatch.from_fields(td) is not None:
                    raise ValueError(
                        "prompts with images do not run under sequence parallelism yet; set "
                        "critic.ulysses_sequence_parallel_size=1 (docs/vlm.md)"
                    )
                shard = self.sp.shard(packed)
                kwargs = shard.model_kwargs(input_ids, position_ids)
                ids, positions = kwargs.pop("input_ids"), kwargs.pop("position_ids")
                kwargs.pop("attention_mask")
                local = module(ids, None, positions, **kwargs)[0, shard.keep]
                values = packed.responses(shard.gather_predicted(local[:, None].float())[:, 0], resp_len)
                return values * td["response_mask"]
            # With images: their pixels and each sample's M-RoPE positions in the row, as the actor's forward has them.
            values = module(**packed_kwargs(packed, td, input_ids, attention_mask, position_ids, config))
            values = packed.responses(values[0, packed.predict], resp_len)
            return values.float() * td["response_mask"]
        values = module(**padded_kwargs(td, input_ids, attention_mask, position_ids, config))
        return values[:, -resp_len - 1 : -1].float() * td["response_mask"]

    def _result(self, meta: KVBatchMeta, fields: list[str], metrics: dict[str, float], phase: str) -> KVBatchMeta:
        metrics = {**metrics, **phase_memory_metrics(phase, self.device)}
        return result_handle(meta, fields, metrics, self.device)

    @torch.no_grad()
    def compute_values(self, meta: KVBatchMeta) -> KVBatchMeta:
        """Writes `values` (B, R) for the handle's samples."""
        begin_phase(self.device)
        group, own = group_share(self.sp, meta)
        td = self._get(group, ["prompts", "prompt_mask", "responses", "response_mask"])
        self.model.eval()
        batches = plan_micro_batches(
            td["prompt_mask"],
            td["response_mask"],
            self.settings.critic.ppo_micro_batch_size_per_gpu,
            group_budget(self.settings.forward_budget, self.sp),
            agree=self.trained.strategy.agree_count,
            packed=self.packed,
        )
        with self.trained.strategy.sharded_no_grad():
            # Every rank runs as many forwards as the busiest (each gathers layer by layer); extra ones are dropped.
            outs = []
            for sl, real in self.trained.passes(batches):
                mb, window = take(td, sl)  # under a budget, without the columns that are padding in all its rows
                outs.append((window.responses(self._values(mb)), real))
        values = in_row_order([v for v, real in outs if real], batches)[own]
        self.data_plane.kv_batch_put(keys=meta.keys, partition_id=meta.partition_id, fields={"values": values.cpu()})
        return self._result(meta, ["values"], {}, "values")

    def update_critic(self, meta: KVBatchMeta) -> KVBatchMeta:
        """One optimizer step of the clipped value loss over the handle's samples."""
        begin_phase(self.device)
        ccfg = self.settings.critic
        group, own = group_share(self.sp, meta)
        td = self._get(group, ["prompts", "prompt_mask", "responses", "response_mask", "values", "returns"])
        mask = td["response_mask"].bool()
        # This rank's own share only: an SP group's ranks all hold the group's rows.
        counts = torch.tensor([float(mask[own].sum()), float(len(mask[own]))], dtype=torch.float64)
        self.trained.strategy.all_reduce_sum(counts)
        num_tokens, num_seqs = counts[0].item(), counts[1].item()
        self.model.train()
        self.trained.optimizer.zero_grad(set_to_none=True)
        metrics: dict[str, float] = {"critic/vf_loss@sum": 0.0}
        clip_sum = vpred_sum = 0.0
        # Token-budget micro-batches regroup rows only: the normalisers above are the whole mini-batch's.
        passes = self.trained.passes(
            plan_micro_batches(
                td["prompt_mask"],
                td["response_mask"],
                ccfg.ppo_micro_batch_size_per_gpu,
                group_budget(self.settings.update_budget, self.sp),
                agree=self.trained.strategy.agree_count,
                packed=self.packed,
            )
        )
        for k, (sl, real) in enumerate(passes):
            mb, _ = take(td, sl)
            mmask = mb["response_mask"].bool()
            vpreds = self._values(mb, train=True)
            vf_loss, vf_clipfrac = compute_value_loss(
                vpreds,
                mb["returns"],
                mb["values"],
                mmask,
                cliprange_value=ccfg.cliprange_value,
                loss_agg_mode=ccfg.loss_agg_mode,
                num_tokens=num_tokens,
                num_seqs=num_seqs,
                loss_scale_factor=self.settings.loss_scale_factor,
            )
            self.trained.backward(vf_loss, real=real, last=k == len(passes) - 1)
            if not real:
                continue
            metrics["critic/vf_loss@sum"] += vf_loss.item()
            ntok = float(mmask.sum())
            clip_sum += float(vf_clipfrac) * ntok
            vpred_sum += float((vpreds.detach() * mmask).sum())
        grad_norm, stepped, lr, memory = self.trained.step(ccfg.grad_clip)
        if not stepped:
            logger.warning("critic rank %d: non-finite grad norm; optimizer step skipped", self.rank)
        metrics["critic/lr"] = lr
        metrics.update(memory)
        local_tokens = float(mask.sum())
        metrics.update(weighted("critic/vf_clipfrac", clip_sum, local_tokens))
        metrics.update(weighted("critic/vpred_mean", vpred_sum, local_tokens))
        metrics["critic/grad_norm"] = grad_norm
        return self._result(meta, [], count_once(metrics, self.sp), "update_critic")
