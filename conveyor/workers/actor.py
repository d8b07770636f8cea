"""The policy worker: rollout, log-probs and the PPO update of one rank; also serves as the frozen reference.

Every endpoint takes a handle, reads the fields it needs from the data plane,
computes, writes its outputs back and returns a handle whose `extra_info` holds
this rank's metrics (token-weighted ones as `@sum`/`@count` pairs, see
`conveyor.metrics.reduce`) and memory figures. It knows its rank and world size
only to all-reduce gradients and normalisers; where it runs is the worker
group's business.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict

from conveyor.algos.logprob import logprobs_and_entropy
from conveyor.algos.objective import compute_policy_objective, merge_objective_metrics
from conveyor.config import Config
from conveyor.data_plane.base import DataPlane
from conveyor.metrics.reduce import weighted
from conveyor.models.lean import resolve_forward_impl
from conveyor.models.loading import load_causal_lm, load_tokenizer
from conveyor.models.moe_routing import RoutingRecorder, compute_routing_agreement, moe_info, replay_routing
from conveyor.protocol import KVBatchMeta
from conveyor.rollout.hf import HFRollout
from conveyor.workers import dist
from conveyor.workers.optim import build_optimizer, total_optim_steps
from conveyor.workers.perf import result_handle

logger = logging.getLogger(__name__)

__all__ = ["PolicyWorker", "sequence_inputs"]


def sequence_inputs(td: TensorDict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, position_ids), each (B, P+R), from left-padded prompts and right-padded responses."""
    input_ids = torch.cat([td["prompts"], td["responses"]], dim=1)
    attention_mask = torch.cat([td["prompt_mask"].long(), td["response_mask"].long()], dim=1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return input_ids, attention_mask, position_ids


class PolicyWorker:
    """One rank of the actor (role "actor": rollout + update) or of the reference policy (role "ref")."""

    def __init__(
        self,
        cfg: Config,
        *,
        model_path: str,
        data_plane: DataPlane,
        role: str = "actor",
        rank: int = 0,
        world_size: int = 1,
        device: str = "cpu",
    ):
        assert role in ("actor", "ref")
        self.cfg = cfg
        self.role = role
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)
        self.dp = data_plane
        arr = cfg.actor_rollout_ref
        self.model = load_causal_lm(model_path, dtype=arr.model.dtype, device=self.device)
        self.tokenizer = load_tokenizer(arr.model.tokenizer_path or model_path)
        self.moe = moe_info(self.model)
        # None: the Hugging Face forward (models the lean one does not cover, or forward_impl=hf).
        self.lean = resolve_forward_impl(arr.model.forward_impl, self.model)
        if role == "ref":
            self.model.requires_grad_(False)
            self.model.eval()
            self.optimizer = self.scheduler = None
        else:
            # The worker counts its own steps: the schedule must not depend on what a caller passes.
            total = total_optim_steps(cfg.trainer.total_training_steps, cfg.data.train_batch_size,
                                      arr.actor.ppo_mini_batch_size, arr.actor.ppo_epochs)
            self.optimizer, self.scheduler = build_optimizer(self.model.parameters(), arr.actor.optim, total)
            self.rollout = HFRollout(
                self.model, pad_token_id=self.tokenizer.pad_token_id, eos_token_id=self.tokenizer.eos_token_id,
                lean=self.lean,
            )

    @property
    def optim_steps(self) -> int:
        """Update calls so far (the lr schedule's position); 0 for the reference."""
        return self.scheduler.last_epoch if self.scheduler is not None else 0

    # ------------------------------------------------------------------ helpers
    def _result(self, meta: KVBatchMeta, fields: list[str], metrics: dict[str, float]) -> KVBatchMeta:
        return result_handle(meta, fields, metrics, self.device)

    def _get(self, meta: KVBatchMeta, fields: list[str]) -> TensorDict:
        return self.dp.kv_batch_get(keys=meta.keys, partition_id=meta.partition_id, select_fields=fields).to(self.device)

    def _put(self, meta: KVBatchMeta, fields: dict[str, Any]) -> None:
        cpu = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in fields.items()}
        self.dp.kv_batch_put(keys=meta.keys, partition_id=meta.partition_id, fields=cpu)

    def _forward(
        self, td: TensorDict, temperature: float, with_entropy: bool, routed_experts: torch.Tensor | None = None,
        record_routing: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Response log-probs (B, R), entropy (B, R) or None, and this forward's own routing when recorded."""
        logits, own_routing = self._response_logits(td, routed_experts, record_routing)
        logits = logits.float()
        if temperature != 1.0:
            logits = logits / temperature
        log_probs, entropy = logprobs_and_entropy(logits, td["responses"], with_entropy)
        return log_probs, entropy, own_routing

    def _response_logits(
        self, td: TensorDict, routed_experts: torch.Tensor | None, record_routing: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (B, R, V) predicting each response token, and the forward's routing (B, P+R, L, K) when recorded."""
        if self.lean is not None:
            return self.lean.response_logits(
                td["prompts"], td["prompt_mask"], td["responses"], td["response_mask"],
                routed_experts=routed_experts, record_routing=record_routing,
            )
        input_ids, attention_mask, position_ids = sequence_inputs(td)
        resp_len = td["responses"].shape[1]
        replay = replay_routing(self.model, routed_experts) if routed_experts is not None else contextlib.nullcontext()
        recorder = RoutingRecorder(self.model) if record_routing else None
        with replay, (recorder if recorder is not None else contextlib.nullcontext()):
            # Only the positions that predict response tokens need the LM head.
            out = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=False,
                logits_to_keep=resp_len + 1,
            )
            own_routing = recorder.pop() if recorder is not None else None
        return out.logits[:, :-1, :], own_routing

    def _micro_batches(self, n: int, size: int) -> list[slice]:
        return [slice(i, min(i + size, n)) for i in range(0, n, size)]

    # ------------------------------------------------------------------ endpoints
    def generate_sequences(self, meta: KVBatchMeta) -> KVBatchMeta:
        """Sample responses for the handle's prompts: writes responses, response_mask, rollout_log_probs (+ routed_experts)."""
        info = meta.extra_info
        td = self._get(meta, ["prompts", "prompt_mask"])
        generator = None
        if info.get("seed") is not None:
            generator = torch.Generator(device=self.device).manual_seed(int(info["seed"]) + 7919 * self.rank)
        t0 = time.perf_counter()
        out = self.rollout.generate(
            td["prompts"],
            td["prompt_mask"],
            max_new_tokens=int(info["max_new_tokens"]),
            temperature=float(info.get("temperature", 1.0)),
            top_p=float(info.get("top_p", 1.0)),
            top_k=int(info.get("top_k", 0)),
            do_sample=bool(info.get("do_sample", True)),
            generator=generator,
            capture_routing=bool(info.get("capture_routing", False)),
        )
        elapsed = time.perf_counter() - t0
        fields = {k: out[k] for k in ("responses", "response_mask", "rollout_log_probs")}
        if "routed_experts" in out:
            from conveyor.models.moe_routing import routed_experts_dtype

            fields["routed_experts"] = out["routed_experts"].to(routed_experts_dtype(self.moe.num_experts))
        self._put(meta, fields)
        n_tokens = float(out["response_mask"].sum())
        metrics = {"rollout/generated_tokens@sum": n_tokens, "rollout/gen_time_s": elapsed}
        return self._result(meta, list(fields), metrics)

    @torch.no_grad()
    def compute_log_prob(self, meta: KVBatchMeta) -> KVBatchMeta:
        """Forward without grad: writes old_log_probs (+ entropy) for the actor, ref_log_prob for the reference."""
        info = meta.extra_info
        temperature = float(info.get("temperature", 1.0))
        with_entropy = bool(info.get("calculate_entropy", False)) and self.role == "actor"
        replay_on = self.role == "actor" and self.cfg.actor_rollout_ref.actor.router_replay.mode == "R3"
        fields = ["prompts", "prompt_mask", "responses", "response_mask"]
        if replay_on:
            fields.append("routed_experts")
        td = self._get(meta, fields)
        micro = (
            self.cfg.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu
            if self.role == "actor"
            else self.cfg.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu
        )
        self.model.eval()
        lps, ents = [], []
        for sl in self._micro_batches(len(td), micro):
            mb = td[sl]
            routed = mb["routed_experts"].long() if replay_on else None
            lp, ent, _ = self._forward(mb, temperature, with_entropy, routed)
            lps.append(lp)
            if ent is not None:
                ents.append(ent)
        mask = td["response_mask"].bool()
        log_probs = torch.cat(lps) * mask
        metrics: dict[str, float] = {}
        if self.role == "ref":
            out = {"ref_log_prob": log_probs}
        else:
            out = {"old_log_probs": log_probs}
            if ents:
                entropy = torch.cat(ents) * mask
                out["entropy"] = entropy
                metrics.update(weighted("actor/entropy", float(entropy.sum()), float(mask.sum())))
        self._put(meta, out)
        return self._result(meta, list(out), metrics)

    @torch.no_grad()
    def compute_routing_agreement(self, meta: KVBatchMeta) -> KVBatchMeta:
        """How often this rank's own routing (no replay) picks the rollout's top-k set; writes nothing."""
        assert self.moe is not None, "routing agreement needs an MoE model"
        td = self._get(meta, ["prompts", "prompt_mask", "responses", "response_mask", "routed_experts"])
        self.model.eval()
        total, count = 0.0, 0
        micro = self.cfg.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu
        for sl in self._micro_batches(len(td), micro):
            mb = td[sl]
            _, own = self._response_logits(mb, None, record_routing=True)
            attention_mask = torch.cat([mb["prompt_mask"], mb["response_mask"]], dim=1)
            valid = attention_mask.bool()
            frac = compute_routing_agreement(own.long(), mb["routed_experts"].long(), valid)
            if not math.isnan(frac):
                n = int(valid.sum())
                total += frac * n
                count += n
        metrics = weighted("actor/moe/routing_agreement", total, count) if count else {}
        return self._result(meta, [], metrics)

    def update_actor(self, meta: KVBatchMeta) -> KVBatchMeta:
        """One optimizer step over the handle's samples (this rank's share of one mini-batch)."""
        assert self.role == "actor", "the reference policy is never updated"
        acfg = self.cfg.actor_rollout_ref.actor
        correction = self.cfg.algorithm.rollout_correction
        info = meta.extra_info
        temperature = float(info.get("temperature", 1.0))
        # Without an old-log-prob forward (bypass mode) the update's forward is where entropy gets reported.
        report_entropy = bool(info.get("calculate_entropy", False))
        replay_on = acfg.router_replay.mode == "R3" and self.moe is not None
        fields = ["prompts", "prompt_mask", "responses", "response_mask", "old_log_probs", "advantages"]
        if acfg.use_kl_loss:
            fields.append("ref_log_prob")
        if correction.rollout_is is not None:
            fields.append("rollout_log_probs")
        if replay_on:
            fields.append("routed_experts")
        td = self._get(meta, fields)

        # Normalisers over the whole mini-batch on every rank, so ranks' losses sum to the global loss.
        counts = torch.tensor([float(td["response_mask"].sum()), float(len(td))], dtype=torch.float64)
        dist.all_reduce_sum(counts, self.world_size)
        num_tokens, num_seqs = counts[0].item(), counts[1].item()

        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        for sl in self._micro_batches(len(td), acfg.ppo_micro_batch_size_per_gpu):
            mb = td[sl]
            routed = mb["routed_experts"].long() if replay_on else None
            log_prob, entropy, _ = self._forward(mb, temperature, acfg.entropy_coeff != 0 or report_entropy, routed)
            loss, mb_metrics = compute_policy_objective(
                mb["old_log_probs"], log_prob, mb["advantages"], mb["response_mask"].bool(),
                entropy=entropy,
                ref_log_prob=mb["ref_log_prob"] if acfg.use_kl_loss else None,
                rollout_log_probs=mb["rollout_log_probs"] if correction.rollout_is is not None else None,
                loss_mode=acfg.policy_loss.loss_mode,
                clip_ratio_low=acfg.clip_ratio_low if acfg.clip_ratio_low is not None else acfg.clip_ratio,
                clip_ratio_high=acfg.clip_ratio_high if acfg.clip_ratio_high is not None else acfg.clip_ratio,
                clip_ratio_c=acfg.clip_ratio_c,
                loss_agg_mode=acfg.loss_agg_mode,
                entropy_coeff=acfg.entropy_coeff,
                kl_loss_type=acfg.kl_loss_type,
                kl_loss_coef=acfg.kl_loss_coef,
                rollout_is=correction.rollout_is,
                rollout_is_threshold=correction.rollout_is_threshold,
                num_tokens=num_tokens,
                num_seqs=num_seqs,
            )
            loss.backward()
            merge_objective_metrics(sums, mb_metrics)

        if not report_entropy:
            # compute_log_prob already logged the old policy's entropy under this name.
            sums.pop("entropy@sum", None)
            sums.pop("entropy@count", None)
        metrics = {f"actor/{k}": v for k, v in sums.items()}
        dist.all_reduce_grads(self.model, self.world_size)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), acfg.grad_clip)
        metrics["actor/lr"] = self.scheduler.get_last_lr()[0]
        if torch.isfinite(grad_norm):
            self.optimizer.step()
        else:
            logger.warning("actor rank %d: non-finite grad norm %s; optimizer step skipped", self.rank, grad_norm)
            metrics["actor/skipped_steps@sum"] = 1.0
        self.optimizer.zero_grad(set_to_none=True)
        # A skipped step still advances the schedule: its position counts update calls, as the run plans them.
        self.scheduler.step()
        metrics["actor/grad_norm"] = float(grad_norm)
        return self._result(meta, [], metrics)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer and lr-schedule state of this rank (rank 0's is what a checkpoint keeps)."""
        state = {"model": self.model.state_dict(), "optim_steps": self.optim_steps}
        if self.optimizer is not None:
            state["optimizer"] = self.optimizer.state_dict()
            state["lr_scheduler"] = self.scheduler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore model, optimizer and lr-schedule state."""
        self.model.load_state_dict(state["model"])
        if self.optimizer is not None and "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["lr_scheduler"])

    def save_hf(self, path: str) -> str:
        """Write the current policy as a Hugging Face checkpoint directory (for serving or evaluation)."""
        Path(path).mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        return path
