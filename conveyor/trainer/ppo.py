"""The synchronous PPO/GRPO trainer: one step is a pipeline of stages over the data plane.

Read `PPOTrainer.step` top to bottom: every stage is a method that passes a
handle (`KVBatchMeta`) to a worker group or reads the few fields it needs
itself, computes, and writes its outputs back to the step's partition. The
trainer holds no sample tensors between stages. Algorithms are picked by name
from registries in `conveyor.algos`; nothing here branches on the estimator
beyond what its registration declares (`estimator_needs`: a critic, a
greedy baseline rollout) and "is a KL term on". Every stage takes the handle
of the batch and returns `(handle, metrics)`; `step` merges the metrics.

Stages 4-9 are this class's public methods (`compute_old_log_prob`, ...,
`update_actor`, `compute_metrics`), each `(handle) -> (handle, metrics)`, so a
test or a custom loop calls them as `step` does. Stages 1-3 (prompts,
generation, rewards) are the public methods of the
run's `Stages` (`trainer/stages.py`), which the sample source runs them
through. The run's composition root (building the parts, picking the trainer)
is `trainer/run.py`; checkpoint contents are `trainer/state.py`, stop signals
`trainer/signals.py`, validation `trainer/validation.py`.

What it deliberately does not do: place workers (the worker groups do),
reduce metrics across ranks itself (`conveyor.metrics.reduce` does), or know
how the data plane stores anything.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from conveyor.algos.advantages import compute_advantage, estimator_needs
from conveyor.algos.correction import bypass_old_log_prob, compute_is_metrics, compute_rejection_mask
from conveyor.algos.kl import apply_kl_penalty, make_kl_controller
from conveyor.algos.trajectory import session_heads, spread_over_sessions
from conveyor.config import Config
from conveyor.data_plane.base import DataPlane
from conveyor.metrics.data import compute_data_metrics
from conveyor.metrics.dumps import dump_due
from conveyor.metrics.moe_load_balance import (
    RolloutMoELoadBalanceMetricsAccumulator,
    compute_moe_lb_metrics,
    get_metric_data_with_optional_routed_experts,
)
from conveyor.metrics.moe_router import (
    ACTOR_LAYER_FAMILIES,
    RouterMarginAccumulator,
    rollout_router_metrics,
    summarise_layers,
)
from conveyor.metrics.reduce import mean_over_calls, reduce_rank_metrics
from conveyor.models.vision import vision_processor
from conveyor.protocol import KVBatchMeta
from conveyor.tasks.prompts import PromptEncoder
from conveyor.trainer.async_source import build_source
from conveyor.trainer.distillation import teacher_stage
from conveyor.trainer.estimator_inputs import estimator_fields, estimator_inputs
from conveyor.trainer.plan import RunPlan
from conveyor.trainer.rollout_dumps import ReplaySource, RolloutDumps
from conveyor.trainer.signals import StopRequested, StopSignals
from conveyor.trainer.stages import Stages
from conveyor.trainer.state import Checkpoints
from conveyor.trainer.timing import CPU, timer, timing_metrics
from conveyor.trainer.validation import Validation
from conveyor.workers.placement.roles import WorkerGroups
from conveyor.workers.ranks.calls import LogProbCall, UpdateCall

logger = logging.getLogger(__name__)

__all__ = ["PPOTrainer", "NonFiniteError", "StopRequested"]

# What every stage returns: the handle of the batch with the stage's fields written, and the stage's metrics.
StageResult = tuple[KVBatchMeta, dict[str, float]]


class NonFiniteError(ValueError):
    """A reward, advantage or loss became NaN or infinite; the message names the step and the field."""


def _phase_memory(extra_info: dict, role: str) -> dict[str, float]:
    """A call's `perf/<phase>/max_memory_gb` (max over ranks) as `<role>/perf/<phase>/max_memory_gb`.

    Also the split's `perf/<endpoint>/rank_token_imbalance`, when the call ran on several ranks.
    """
    reduced = reduce_rank_metrics(extra_info)
    return {
        f"{role}/{k}": v
        for k, v in reduced.items()
        if k.startswith("perf/") and k.endswith(("/max_memory_gb", "/rank_token_imbalance")) and k.count("/") == 2
    }


def _check_finite(step: int, name: str, t: torch.Tensor, mask: torch.Tensor | None = None) -> None:
    vals = t[mask.bool()] if mask is not None else t
    if vals.numel() and not bool(torch.isfinite(vals).all()):
        bad = int((~torch.isfinite(vals)).sum())
        raise NonFiniteError(f"step {step}: field {name!r} has {bad} NaN or infinite value(s)")


class PPOTrainer:
    """Drives the stages of each step through the worker groups and the data plane."""

    def __init__(
        self,
        cfg: Config,
        *,
        plan: RunPlan,
        data_plane: DataPlane,
        workers: WorkerGroups,
        tokenizer: Any,
        train_records: list[dict],
        val_records: list[dict],
        tracking: Any,
        run_dir: Path,
        model_config: Any = None,
        prometheus: Any = None,
    ):
        self.cfg = cfg
        self.plan = plan
        self.data_plane = data_plane
        self.workers = workers
        self.tokenizer = tokenizer
        self.val_records = val_records
        self.tracking = tracking
        self.run_dir = Path(run_dir)
        self.prometheus = prometheus
        self.model_config = model_config
        # What a checkpoint saves and restores: the roles' shards, and every part below that carries state from one
        # step to the next, registered by name where it is built (saved under that name; trainer/state.py).
        ck = self.checkpoints = Checkpoints(
            cfg, ckpt_root=self.run_dir / "checkpoints", workers=workers, model_config=model_config, tokenizer=tokenizer
        )
        t = cfg.trainer
        self.validation = ck.register(
            "val_history",
            Validation(val_records, every=t.test_freq, before_train=t.val_before_train),
            older=lambda st: [],
        )
        kc = cfg.algorithm.kl_ctrl
        # A registered controller need only have a `value` (conveyor.algos.kl): that is its state.
        self.kl_ctrl = ck.register(
            "kl_coef",
            make_kl_controller(kc.type, kc.kl_coef, target_kl=kc.target_kl, horizon=kc.horizon),
            save=lambda: float(self.kl_ctrl.value),
            load=lambda value: setattr(self.kl_ctrl, "value", float(value)),
        )
        # Checkpoints written before these had entries of their own kept the load counts under two flat keys, and
        # no router margins (such a resume starts the margin counts afresh, as it always did).
        self.moe_acc = ck.register(
            "moe_load",
            RolloutMoELoadBalanceMetricsAccumulator(model_config),
            older=lambda st: {"counts": st.get("moe_counts"), "retry_step": st.get("moe_retry_step", 0)},
        )
        self.margin_acc = ck.register(
            "router_margins",
            RouterMarginAccumulator(cfg.actor_rollout_ref.rollout.moe_near_tie_eps),
            older=lambda st: None,
        )
        # What the estimator needs beyond rewards: a greedy baseline rollout (ReMax), values.
        self.estimator = estimator_needs(cfg.algorithm.adv_estimator)
        # Stages 1-3 and what they need: the one object the sources and validation are handed.
        self.stages = Stages(
            cfg,
            plan=plan,
            data_plane=data_plane,
            workers=workers,
            train_records=train_records,
            prompts=PromptEncoder(
                tokenizer,
                cfg.data.max_prompt_length,
                cfg.data.truncation,
                vision=vision_processor(cfg.actor_rollout_ref.model.path, tokenizer, model_config),
                agent_images=cfg.actor_rollout_ref.rollout.agent.enabled,
            ),
            run_dir=self.run_dir,
        )
        # Where a step's samples come from: the one variable part of the loop (synchronous or asynchronous).
        # Or recorded batches (trainer/rollout_dumps.py: no engine was built), to the last bundle's step; the lr
        # schedule still spans the recorded run's trainer.total_training_steps.
        if t.replay_rollouts_from:
            self.source = ReplaySource(self.stages, greedy_baseline=self.estimator.greedy_baseline)
            self.last_step = self.source.last_step
        else:
            self.source = build_source(self.stages, greedy_baseline=self.estimator.greedy_baseline)
            self.last_step = t.total_training_steps
        # The prompt order (an asynchronous source's: before the oldest batch not yet trained); the step's seeds
        # come from the checkpoint's step.
        ck.register(
            "dataset",
            self.source,
            save=lambda: self.source.state_dict()["dataset"],
            load=lambda dataset: self.source.load_state_dict({"dataset": dataset}),
        )
        # An asynchronous source's batches in flight (their samples: a file of their own), restored after the prompt
        # order, which they move past; checkpoints written before they were kept draw those batches again. The save
        # of a stop (`_stopping`) keeps only the batches already generated or generating: the ones queued behind them
        # are cancelled next, and never start.
        self._stopping = False
        ck.register(
            "in_flight",
            self.source,
            save=lambda: self.source.in_flight_state(stopping=self._stopping),
            load=self.source.load_in_flight_state,
            older=lambda st: None,
            file="in_flight.pt",
        )
        self.rollout_dumps = RolloutDumps(self.stages, self.run_dir)

    @property
    def global_step(self) -> int:
        """The step being trained (updates so far, inside a step); the stages' seeds depend on it."""
        return self.stages.global_step

    @global_step.setter
    def global_step(self, step: int) -> None:
        self.stages.global_step = step

    # ================================================================ the loop
    def fit(self) -> dict[str, float]:
        """Run (or continue) training to trainer.total_training_steps; returns the last step's metrics."""
        self._maybe_resume()
        self.source.start()
        failed = True
        try:
            result = self._fit()
            failed = False
            return result
        finally:
            # A stop or a failure: what the source has in flight will never be trained.
            self.source.close(failed=failed)

    def _fit(self) -> dict[str, float]:
        t = self.cfg.trainer
        if self.global_step == 0 and self.validation.due(0):
            self._log(self.validation.run(self.stages, self.source.generate), step=0)
        last: dict[str, float] = {}
        bar = self._progress_bar()
        interrupted = False
        stopping = False  # the loop itself stopped, on Ctrl-C, between two steps
        saved_step = self.global_step  # a resumed run starts at a saved step
        stop = StopSignals(save_on_interrupt=t.save_on_interrupt, step=lambda: self.global_step).install()
        try:
            while self.global_step < self.last_step:
                if stop.requested:
                    stopping = True
                    raise StopRequested(stop.requested)
                self.global_step += 1
                metrics = self.step()
                is_last = self.global_step == self.last_step
                if self.validation.due(self.global_step, last=is_last):
                    metrics.update(self.validation.run(self.stages, self.source.generate))
                # Logged before saved: a crash in between makes the resumed run repeat the
                # step (the metrics reader keeps its last record) rather than lose its record.
                self._log(metrics, step=self.global_step)
                if self.checkpoints.due(self.global_step, last=is_last):
                    self.save_checkpoint()
                    saved_step = self.global_step
                last = metrics
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(reward=f"{metrics.get('reward/mean', float('nan')):.3f}")
        except KeyboardInterrupt:
            interrupted = True
            if stopping and self.global_step > saved_step:
                self._stopping = True
                self.save_checkpoint()
            elif not stopping and self.global_step > saved_step:
                # The step had advanced the prompt order and maybe the model: a checkpoint
                # now would describe no step, so the newest one stays the last good state.
                logger.warning(
                    "interrupted in the middle of step %d: nothing saved; a resumed run repeats it", self.global_step
                )
            raise
        finally:
            if bar is not None:
                bar.close()
            stop.restore()
            if not interrupted:
                self.validation.report()
        return last

    def step(self) -> dict[str, float]:
        """One synchronous step; returns its metrics (the partition is cleared whatever happens)."""
        step = self.global_step
        part = f"train-{step}"
        timings: dict[str, float] = {}
        metrics: dict[str, float] = {}

        def run(name: str | None, stage: Callable[[KVBatchMeta], StageResult], meta: KVBatchMeta) -> KVBatchMeta:
            with timer(name, timings) if name else contextlib.nullcontext():
                meta, stage_metrics = stage(meta)
            metrics.update(stage_metrics)
            return meta

        t_start, c_start = time.perf_counter(), time.thread_time()
        try:
            meta = KVBatchMeta(keys=[], partition_id=part)  # the step's partition, empty
            meta = run(None, self.sample, meta)  # stages 1-3 (timed inside), repeated under dynamic sampling
            if self.rollout_dumps.due(step):  # the batch as the update reads it, to replay the step from
                self.rollout_dumps.write(step, meta, metrics)
            meta = run("old_log_prob", self.compute_old_log_prob, meta)
            if self.plan.use_reference:
                meta = run("ref", self.compute_ref_log_prob, meta)
            if self.plan.use_teacher:
                meta = run("teacher", self.compute_teacher_log_prob, meta)
            if self.plan.use_critic:
                meta = run("values", self.compute_values, meta)
            meta = run("adv", self.compute_advantage, meta)
            if self.plan.use_critic:
                meta = run("update_critic", self.update_critic, meta)
            meta = run("update_actor", self.update_actor, meta)
            timings.update(self.source.updated())
            meta = run("metrics", self.compute_metrics, meta)
            if dump_due(step, self.cfg.trainer.dump_freq, last=step == self.last_step):
                self._dump_generations(meta)
        finally:
            self.data_plane.kv_clear(part)
            self.source.release()
        timings["step"] = time.perf_counter() - t_start
        timings[CPU + "step"] = time.thread_time() - c_start
        metrics.update(timing_metrics(timings))
        n_tokens = metrics.pop("_tokens", 0.0)
        metrics["perf/total_num_tokens"] = n_tokens
        metrics["perf/throughput"] = n_tokens / timings["step"] if timings["step"] > 0 else 0.0
        metrics["training/global_step"] = float(step)
        metrics["training/epoch"] = float(self.stages.train_data.epoch)
        return metrics

    # ================================================================ stages
    def sample(self, meta: KVBatchMeta) -> StageResult:
        """Stages 1-3 (prompts, generation, rewards): the step's batch from the run's sample source.

        `meta` is the step's (empty) partition; a synchronous source writes the samples into it, an
        asynchronous one hands out samples its rollout wrote ahead (`conveyor.trainer.sources`).
        """
        batch = self.source.next(meta)
        return batch.meta, {**batch.metrics, **timing_metrics(batch.timings)}

    def compute_old_log_prob(self, meta: KVBatchMeta) -> StageResult:
        """Stage 4: old_log_probs (and entropy) by an actor forward, or copied from the rollout in bypass mode."""
        if self.plan.old_log_probs == "rollout":
            td = self.data_plane.get(meta, ["rollout_log_probs"])
            return self.data_plane.put(meta, {"old_log_probs": bypass_old_log_prob(td["rollout_log_probs"])}), {}
        if self.plan.old_log_probs == "update":  # the update's own forward writes them (off-policy, one optimizer step)
            return meta, {}
        call = LogProbCall(
            temperature=self.cfg.actor_rollout_ref.rollout.temperature,
            calculate_entropy=True,
            compute_loss=False,
            calculate_sum_pi_squared=self.plan.forward_sum_pi_squared,
        )
        out = self.workers.actor.compute_log_prob(meta.with_extra_info(**call.to_extra_info()))
        reduced = reduce_rank_metrics(out.extra_info)
        return out, {
            **{k: v for k, v in reduced.items() if k.startswith("actor/")},
            **_phase_memory(out.extra_info, "actor"),
        }

    def compute_ref_log_prob(self, meta: KVBatchMeta) -> StageResult:
        """Stage 5: ref_log_prob from the frozen reference policy."""
        call = LogProbCall(
            temperature=self.cfg.actor_rollout_ref.rollout.temperature, calculate_entropy=False, compute_loss=False
        )
        out = self.workers.ref.compute_log_prob(meta.with_extra_info(**call.to_extra_info()))
        return out, _phase_memory(out.extra_info, "ref")

    def compute_teacher_log_prob(self, meta: KVBatchMeta) -> StageResult:
        """Stage 5b (on-policy distillation): each sample's teacher writes its log-probs."""
        return teacher_stage(self.workers.teacher, meta, self.cfg.actor_rollout_ref.rollout.temperature)

    def compute_values(self, meta: KVBatchMeta) -> StageResult:
        """Stage 6: values from the critic."""
        out = self.workers.critic.compute_values(meta)
        return out, _phase_memory(out.extra_info, "critic")

    def compute_advantage(self, meta: KVBatchMeta) -> StageResult:
        """Stage 7: token_level_rewards (after any in-reward KL), advantages and returns."""
        algo = self.cfg.algorithm
        metrics: dict[str, float] = {}
        fields = ["rm_scores", "response_mask", "uid"]
        if self.estimator.greedy_baseline:
            fields.append("reward_baselines")
        if algo.use_kl_in_reward:
            fields += ["old_log_probs", "ref_log_prob"]
        if self.plan.use_critic:
            fields.append("values")
        fields += [f for f in estimator_fields(self.plan, self.estimator) if f not in fields]
        if "agent_session" in meta.fields:
            fields.append("agent_session")
        td = self.data_plane.get(meta, fields)
        mask = td["response_mask"].bool()
        _check_finite(self.global_step, "rm_scores", td["rm_scores"], mask)
        # Agent sessions cut into several samples: the estimator sees each session once (its first sample) and
        # every sample of a session takes its advantage, so a session counts once in its group's baseline.
        heads, owner = session_heads(list(td["agent_session"])) if "agent_session" in fields else ([], [])
        if heads and len(heads) < len(owner) and not self.plan.use_critic and not algo.use_kl_in_reward:
            full_td, full_meta, full_mask = td, meta, mask
            td, meta, mask = td[heads], meta.select(heads), mask[heads]
        else:
            full_td = None
        rewards = td["rm_scores"]
        if algo.use_kl_in_reward:
            rewards, current_kl = apply_kl_penalty(
                rewards, td["old_log_probs"], td["ref_log_prob"], mask, kl_coef=self.kl_ctrl.value, kind=algo.kl_penalty
            )
            # verl's apply_kl_penalty: the batch's number of sequences (prompts x rollout.n), not of prompts.
            self.kl_ctrl.update(current_kl, n_steps=len(meta))
            metrics["actor/reward_kl_penalty"] = current_kl
            metrics["actor/reward_kl_penalty_coeff"] = float(self.kl_ctrl.value)
        advantages, returns = compute_advantage(
            algo.adv_estimator,
            rewards,
            mask,
            values=td["values"] if self.plan.use_critic else None,
            group_index=list(td["uid"]),
            gamma=algo.gamma,
            lam=algo.lam,
            norm_adv_by_std=algo.norm_adv_by_std_in_grpo,
            reward_baselines=td["reward_baselines"] if self.estimator.greedy_baseline else None,
            **estimator_inputs(td, meta, self.data_plane, self.cfg, self.plan, self.estimator),
        )
        if full_td is not None:
            advantages = spread_over_sessions(advantages, mask, owner, full_mask)
            returns = spread_over_sessions(returns, mask, owner, full_mask)
            rewards, meta, mask = full_td["rm_scores"], full_meta, full_mask
            metrics["rollout/agent/cut_sessions"] = float(len(owner) - len(heads))
        _check_finite(self.global_step, "advantages", advantages, mask)
        out = self.data_plane.put(meta, {"token_level_rewards": rewards, "advantages": advantages, "returns": returns})
        return out, metrics

    def _mini_batches(
        self, meta: KVBatchMeta, mini_batch_prompts: int, epochs: int, shuffle: bool, salt: str
    ) -> list[KVBatchMeta]:
        """The handles of each optimizer step: `epochs` passes, each split into mini-batches of whole samples."""
        n = self.cfg.actor_rollout_ref.rollout.n
        size = mini_batch_prompts * n
        gen = torch.Generator().manual_seed(self.stages.seed(salt))
        out = []
        for _ in range(epochs):
            order = torch.randperm(len(meta), generator=gen).tolist() if shuffle else list(range(len(meta)))
            out.extend(meta.select(order[i : i + size]) for i in range(0, len(order), size))
        return out

    def update_critic(self, meta: KVBatchMeta) -> StageResult:
        """Stage 8a: critic optimizer steps over mini-batches."""
        c = self.cfg.critic
        results = []
        for mb in self._mini_batches(meta, c.ppo_mini_batch_size, c.ppo_epochs, True, "critic"):
            out = self.workers.critic.update_critic(mb)
            results.append(reduce_rank_metrics(out.extra_info))
        merged = mean_over_calls(results)
        return meta, {(k if k.startswith("critic/") else f"critic/{k}"): v for k, v in merged.items()}

    def update_actor(self, meta: KVBatchMeta) -> StageResult:
        """Stage 8b: PPO epochs over mini-batches, one actor optimizer step each."""
        a = self.cfg.actor_rollout_ref.actor
        results = []
        for mb in self._mini_batches(meta, a.ppo_mini_batch_size, a.ppo_epochs, a.shuffle, "actor"):
            call = UpdateCall(
                temperature=self.cfg.actor_rollout_ref.rollout.temperature,
                # Without an old-log-prob forward, the update's forward reports the entropy.
                calculate_entropy=self.plan.old_log_probs in ("rollout", "update"),
                compute_loss=True,
                moe_metrics=self._moe_metrics_due(),
            )
            out = self.workers.actor.update_actor(mb.with_extra_info(**call.to_extra_info()))
            results.append(reduce_rank_metrics(out.extra_info))
        merged = mean_over_calls(results)
        if not math.isfinite(merged.get("actor/pg_loss", 0.0)):
            raise NonFiniteError(
                f"step {self.global_step}: field 'actor/pg_loss' is not finite ({merged['actor/pg_loss']})"
            )
        return meta, {(k if k.startswith(("actor/", "distill/")) else f"actor/{k}"): v for k, v in merged.items()}

    def compute_metrics(self, meta: KVBatchMeta) -> StageResult:
        """Stage 9: data metrics of the step (and, every interval, MoE router load balance)."""
        timings: dict[str, float] = {}
        fields = ["rm_scores", "acc", "token_level_rewards", "advantages", "returns", "response_mask", "prompt_mask"]
        if not self.plan.bypass:
            # Sampler vs trainer log-probs; in bypass mode they are the same numbers by construction.
            fields += ["rollout_log_probs", "old_log_probs"]
        if self.plan.use_critic:
            fields.append("values")
        interval = self.cfg.actor_rollout_ref.rollout.moe_load_balance_metrics_interval
        td = get_metric_data_with_optional_routed_experts(
            meta.keys, meta.partition_id, fields, interval, self.global_step, self.moe_acc, self.data_plane.kv_batch_get
        )
        metrics = compute_data_metrics(
            td, use_critic=self.plan.use_critic, max_response_length=self.cfg.data.max_response_length
        )
        correction = self.cfg.algorithm.rollout_correction
        if self.plan.rollout_is_level is not None and not self.plan.bypass:
            upper, lower = correction.is_thresholds()
            metrics.update(
                compute_is_metrics(
                    td["old_log_probs"],
                    td["rollout_log_probs"],
                    td["response_mask"],
                    level=self.plan.rollout_is_level,
                    threshold=upper,
                    lower=lower,
                )
            )
        if correction.rollout_rs is not None and not self.plan.bypass:
            _, rs = compute_rejection_mask(
                td["old_log_probs"], td["rollout_log_probs"], td["response_mask"], correction.rejection()
            )
            metrics.update({f"rollout_corr/{k}": v for k, v in rs.items()})
        with timer("moe_metrics", timings):
            moe = compute_moe_lb_metrics(td, interval, self.global_step, self.moe_acc)
            if interval > 0 and "routed_experts" in td.keys():
                due, counts = self._moe_metrics_due(), self.moe_acc.last_counts
                get = self.data_plane.kv_batch_get
                moe.update(
                    rollout_router_metrics(
                        self.margin_acc, get, meta.keys, meta.partition_id, td["response_mask"], due, counts
                    )
                )
        if moe:
            metrics.update(moe)
            if moe.get("rollout/moe/routed_experts_found"):
                # Whose routing the numbers describe: 1 = the trainer's old-log-prob forward, 0 = the rollout's.
                metrics["rollout/moe/routing_from_trainer_forward"] = float(self.plan.load_balance_from_forward)
            self._save_expert_load()
            if moe.get("rollout/moe/routed_experts_found"):
                with timer("moe_agreement", timings):
                    out = self.workers.actor.compute_routing_agreement(meta)
                reduced = reduce_rank_metrics(out.extra_info)
                metrics.update({k: v for k, v in reduced.items() if k.startswith("actor/moe/")})
                metrics.update(summarise_layers(metrics, "actor/moe", ACTOR_LAYER_FAMILIES))
                metrics.update(_phase_memory(out.extra_info, "actor"))
        metrics.update(timing_metrics(timings))
        return meta, metrics

    def _moe_metrics_due(self) -> bool:
        """Whether this step logs the MoE metrics (every `moe_load_balance_metrics_interval` steps)."""
        interval = self.cfg.actor_rollout_ref.rollout.moe_load_balance_metrics_interval
        return interval > 0 and self.global_step % interval == 0

    # ================================================================ outputs
    def _log(self, metrics: dict[str, float], step: int) -> None:
        self.tracking.log(metrics, step=step)
        if self.prometheus is not None:
            self.prometheus.update(metrics, step)

    def _save_expert_load(self) -> None:
        counts = getattr(self.moe_acc, "last_counts", None)
        if counts is None:
            return
        record = {"step": self.global_step, "num_experts": int(counts.shape[1]), "counts": counts.tolist()}
        with open(self.run_dir / "moe_expert_load.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")

    def _dump_generations(self, meta: KVBatchMeta) -> None:
        from conveyor.metrics.dumps import response_turns, write_generations

        k = min(self.cfg.trainer.dump_num, len(meta))
        sub = meta.select(list(range(k)))
        td = self.data_plane.get(
            sub, ["raw_prompt", "responses", "response_mask", "ground_truth", "data_source", "acc", "advantages"]
        )
        rows = []
        for i in range(k):
            n = int(td["response_mask"][i].sum())
            # Through the last model token, with the tool turns marked when there are any (multi-turn).
            response, turns = response_turns(self.tokenizer, td["responses"][i], td["response_mask"][i])
            rows.append(
                {
                    "prompt": td["raw_prompt"][i],
                    "response": response,
                    "ground_truth": td["ground_truth"][i],
                    "data_source": td["data_source"][i],
                    "reward": float(td["acc"][i]),
                    "advantage": float(td["advantages"][i][: max(n, 1)].mean()),
                    "key": sub.keys[i],
                    **({"turns": turns} if turns else {}),
                }
            )
        write_generations(self.run_dir, self.global_step, rows)

    def _progress_bar(self):
        t = self.cfg.trainer
        if not t.progress_bar or not sys.stderr.isatty():
            return None
        from tqdm import tqdm

        return tqdm(total=t.total_training_steps, initial=self.global_step, desc="train", unit="step", file=sys.stderr)

    # ================================================================ checkpoints
    @property
    def ckpt_root(self) -> Path:
        """Where checkpoints go."""
        return self.checkpoints.ckpt_root

    def save_checkpoint(self) -> Path:
        """Write every role's shards, the model's config and tokenizer, data order and RNG states of this step."""
        return self.checkpoints.save(self.global_step)

    def _maybe_resume(self) -> None:
        step = self.checkpoints.resume()
        if step is not None:
            self.global_step = step
