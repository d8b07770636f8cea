"""The critic worker: values of response positions and the clipped value-loss update of one rank."""

from __future__ import annotations

import logging
from typing import Any

import torch
from tensordict import TensorDict

from conveyor.algos.losses import compute_value_loss
from conveyor.config import Config
from conveyor.data_plane.base import DataPlane
from conveyor.models.loading import load_causal_lm
from conveyor.models.value_head import ValueModel
from conveyor.protocol import KVBatchMeta
from conveyor.workers import dist
from conveyor.workers.actor import sequence_inputs
from conveyor.workers.optim import build_optimizer, total_optim_steps
from conveyor.workers.perf import result_handle
from conveyor.metrics.reduce import weighted

logger = logging.getLogger(__name__)

__all__ = ["CriticWorker"]


class CriticWorker:
    """One rank of the value model (a copy of the policy's backbone plus a scalar head)."""

    def __init__(self, cfg: Config, *, model_path: str, data_plane: DataPlane, rank: int = 0, world_size: int = 1,
                 device: str = "cpu"):
        self.cfg = cfg
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)
        self.dp = data_plane
        base = load_causal_lm(model_path, dtype=cfg.actor_rollout_ref.model.dtype, device=self.device)
        self.model = ValueModel.from_causal_lm(base).to(self.device)
        del base
        # The critic's own step count: its mini-batch size and epochs may differ from the actor's.
        total = total_optim_steps(cfg.trainer.total_training_steps, cfg.data.train_batch_size,
                                  cfg.critic.ppo_mini_batch_size, cfg.critic.ppo_epochs)
        self.optimizer, self.scheduler = build_optimizer(self.model.parameters(), cfg.critic.optim, total)

    @property
    def optim_steps(self) -> int:
        """Update calls so far (the lr schedule's position)."""
        return self.scheduler.last_epoch

    def _get(self, meta: KVBatchMeta, fields: list[str]) -> TensorDict:
        return self.dp.kv_batch_get(keys=meta.keys, partition_id=meta.partition_id, select_fields=fields).to(self.device)

    def _values(self, td: TensorDict) -> torch.Tensor:
        """Values (B, R): the value of the state before each response token."""
        input_ids, attention_mask, position_ids = sequence_inputs(td)
        resp_len = td["responses"].shape[1]
        values = self.model(input_ids, attention_mask, position_ids)
        return values[:, -resp_len - 1 : -1].float() * td["response_mask"]

    def _result(self, meta: KVBatchMeta, fields: list[str], metrics: dict[str, float]) -> KVBatchMeta:
        return result_handle(meta, fields, metrics, self.device)

    @torch.no_grad()
    def compute_values(self, meta: KVBatchMeta) -> KVBatchMeta:
        """Writes `values` (B, R) for the handle's samples."""
        td = self._get(meta, ["prompts", "prompt_mask", "responses", "response_mask"])
        self.model.eval()
        micro = self.cfg.critic.ppo_micro_batch_size_per_gpu
        values = torch.cat([self._values(td[i : i + micro]) for i in range(0, len(td), micro)])
        self.dp.kv_batch_put(keys=meta.keys, partition_id=meta.partition_id, fields={"values": values.cpu()})
        return self._result(meta, ["values"], {})

    def update_critic(self, meta: KVBatchMeta) -> KVBatchMeta:
        """One optimizer step of the clipped value loss over the handle's samples."""
        ccfg = self.cfg.critic
        td = self._get(meta, ["prompts", "prompt_mask", "responses", "response_mask", "values", "returns"])
        mask = td["response_mask"].bool()
        counts = torch.tensor([float(mask.sum()), float(len(td))], dtype=torch.float64)
        dist.all_reduce_sum(counts, self.world_size)
        num_tokens, num_seqs = counts[0].item(), counts[1].item()
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        metrics: dict[str, float] = {"critic/vf_loss@sum": 0.0}
        clip_sum = vpred_sum = 0.0
        for i in range(0, len(td), ccfg.ppo_micro_batch_size_per_gpu):
            mb = td[i : i + ccfg.ppo_micro_batch_size_per_gpu]
            mmask = mb["response_mask"].bool()
            vpreds = self._values(mb)
            vf_loss, vf_clipfrac = compute_value_loss(
                vpreds, mb["returns"], mb["values"], mmask, cliprange_value=ccfg.cliprange_value,
                loss_agg_mode=ccfg.loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs,
            )
            vf_loss.backward()
            metrics["critic/vf_loss@sum"] += vf_loss.item()
            ntok = float(mmask.sum())
            clip_sum += float(vf_clipfrac) * ntok
            vpred_sum += float((vpreds.detach() * mmask).sum())
        dist.all_reduce_grads(self.model, self.world_size)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), ccfg.grad_clip)
        metrics["critic/lr"] = self.scheduler.get_last_lr()[0]
        if torch.isfinite(grad_norm):
            self.optimizer.step()
        else:
            logger.warning("critic rank %d: non-finite grad norm; optimizer step skipped", self.rank)
        self.optimizer.zero_grad(set_to_none=True)
        # A skipped step still advances the schedule: its position counts update calls, as the run plans them.
        self.scheduler.step()
        local_tokens = float(mask.sum())
        metrics.update(weighted("critic/vf_clipfrac", clip_sum, local_tokens))
        metrics.update(weighted("critic/vpred_mean", vpred_sum, local_tokens))
        metrics["critic/grad_norm"] = float(grad_norm)
        return self._result(meta, [], metrics)

    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer and lr-schedule state."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "lr_scheduler": self.scheduler.state_dict(), "optim_steps": self.optim_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore model, optimizer and lr-schedule state."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["lr_scheduler"])
