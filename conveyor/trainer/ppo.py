"""The synchronous PPO/GRPO trainer: one step is a pipeline of stages over the data plane.

Read `PPOTrainer.step` top to bottom: every stage is a method that passes a
handle (`KVBatchMeta`) to a worker group or reads the few fields it needs
itself, computes, and writes its outputs back to the step's partition. The
trainer holds no sample tensors between stages. Algorithms are picked by name
from registries in `conveyor.algos`; nothing here branches on the estimator
beyond "does it need a critic" and "is a KL term on".

What it deliberately does not do: place workers (the worker groups do),
reduce metrics across ranks itself (`conveyor.metrics.reduce` does), or know
how the data plane stores anything.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import signal
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from conveyor.algos.advantages import compute_advantage
from conveyor.algos.correction import bypass_old_log_prob, compute_is_metrics, compute_rejection_mask
from conveyor.algos.kl import apply_kl_penalty, make_kl_controller
from conveyor.config import Config, config_to_dict
from conveyor.data_plane.base import DataPlane
from conveyor.metrics.data import compute_data_metrics
from conveyor.metrics.moe_load_balance import (
    RolloutMoELoadBalanceMetricsAccumulator,
    compute_moe_lb_metrics,
    get_metric_data_with_optional_routed_experts,
)
from conveyor.metrics.reduce import mean_over_calls, reduce_rank_metrics
from conveyor.protocol import KVBatchMeta
from conveyor.tasks.dataset import PromptDataset, check_prompt_length, render_prompt
from conveyor.metrics.trackers import Tracking
from conveyor.models.loading import load_model_config, load_tokenizer
from conveyor.ray_utils import ensure_ray, needs_ray, shutdown_ray
from conveyor.trainer import checkpoint as ckpt
from conveyor.trainer.run_dir import check_resume, open_run_dir, write_config
from conveyor.trainer.plan import RunPlan, build_run_plan
from conveyor.trainer.setup import (
    build_data_plane,
    load_prompt_records,
    prepare_default_model,
    resolve_device,
)
from conveyor.workers.calls import GenerateCall, LogProbCall, UpdateCall
from conveyor.workers.roles import WorkerGroups, build_worker_groups

logger = logging.getLogger(__name__)

__all__ = ["PPOTrainer", "run_training", "NonFiniteError", "StopRequested"]


class NonFiniteError(ValueError):
    """A reward, advantage or loss became NaN or infinite; the message names the step and the field."""


class StopRequested(KeyboardInterrupt):
    """Training stopped on a signal (Ctrl-C or SIGTERM); the command exits with 128 + `signum`."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


# What a scheduler (Slurm, Kubernetes, `timeout`) or a person sends to stop a run.
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def _timer(name: str, timings: dict[str, float]) -> Iterator[None]:
    t0 = time.perf_counter()
    try:
        yield
    finally:
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - t0


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
        self.dp = data_plane
        self.workers = workers
        self.tokenizer = tokenizer
        self.train_data = PromptDataset(train_records, seed=cfg.data.seed, shuffle=cfg.data.shuffle)
        self._train_records = train_records
        self.val_records = val_records
        self.tracking = tracking
        self.run_dir = Path(run_dir)
        self.prometheus = prometheus
        self.model_config = model_config
        self.global_step = 0
        kc = cfg.algorithm.kl_ctrl
        self.kl_ctrl = make_kl_controller(kc.type, kc.kl_coef, target_kl=kc.target_kl, horizon=kc.horizon)
        self.moe_acc = RolloutMoELoadBalanceMetricsAccumulator(model_config)
        self.val_history: list[tuple[int, float]] = []
        self._prompt_ids: dict[str, list[int]] = {}
        self._train_width: int | None = None

    # ================================================================ the loop
    def fit(self) -> dict[str, float]:
        """Run (or continue) training to trainer.total_training_steps; returns the last step's metrics."""
        t = self.cfg.trainer
        self._maybe_resume()
        if self.global_step == 0 and t.val_before_train and self.val_records:
            self._log(self._validate(), step=0)
        last: dict[str, float] = {}
        bar = self._progress_bar()
        interrupted = False
        stopping = False  # the loop itself stopped, on Ctrl-C, between two steps
        saved_step = self.global_step  # a resumed run starts at a saved step
        self._stop_requested = 0  # the signal that asked the loop to stop after this step
        previous_handlers = self._install_stop_handlers()
        try:
            while self.global_step < t.total_training_steps:
                if self._stop_requested:
                    stopping = True
                    raise StopRequested(self._stop_requested)
                self.global_step += 1
                metrics = self.step()
                is_last = self.global_step == t.total_training_steps
                if self.val_records and ((t.test_freq and self.global_step % t.test_freq == 0) or is_last):
                    metrics.update(self._validate())
                # Logged before saved: a crash in between makes the resumed run repeat the
                # step (the metrics reader keeps its last record) rather than lose its record.
                self._log(metrics, step=self.global_step)
                if (t.save_freq and self.global_step % t.save_freq == 0) or is_last:
                    self.save_checkpoint()
                    saved_step = self.global_step
                last = metrics
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(reward=f"{metrics.get('reward/mean', float('nan')):.3f}")
        except KeyboardInterrupt:
            interrupted = True
            if stopping and self.global_step > saved_step:
                self.save_checkpoint()
            elif not stopping and self.global_step > saved_step:
                # The step had advanced the prompt order and maybe the model: a checkpoint
                # now would describe no step, so the newest one stays the last good state.
                logger.warning("interrupted in the middle of step %d: nothing saved; a resumed run repeats it",
                               self.global_step)
            raise
        finally:
            if bar is not None:
                bar.close()
            for signum, handler in previous_handlers.items():
                signal.signal(signum, handler)
            if not interrupted:
                self._report_accuracy()
        return last

    def step(self) -> dict[str, float]:
        """One synchronous step; returns its metrics (the partition is cleared whatever happens)."""
        step = self.global_step
        part = f"train-{step}"
        timings: dict[str, float] = {}
        metrics: dict[str, float] = {}
        t_start = time.perf_counter()
        try:
            meta = self._sample(part, timings, metrics)  # stages 1-3, repeated under dynamic sampling
            with _timer("old_log_prob", timings):
                meta = self._compute_old_log_prob(meta, metrics)
            if self.plan.use_reference:
                with _timer("ref", timings):
                    meta = self._compute_ref_log_prob(meta)
            if self.plan.use_critic:
                with _timer("values", timings):
                    meta = self._compute_values(meta)
            with _timer("adv", timings):
                meta = self._compute_advantage(meta, metrics)
            if self.plan.use_critic:
                with _timer("update_critic", timings):
                    metrics.update(self._update_critic(meta))
            with _timer("update_actor", timings):
                metrics.update(self._update_actor(meta))
            with _timer("metrics", timings):
                metrics.update(self._compute_metrics(meta, timings))
            if self.cfg.trainer.dump_freq and step % self.cfg.trainer.dump_freq == 0:
                self._dump_generations(meta)
        finally:
            self.dp.kv_clear(part)
        timings["step"] = time.perf_counter() - t_start
        metrics.update({f"timing_s/{k}": v for k, v in timings.items()})
        n_tokens = metrics.pop("_tokens", 0.0)
        metrics["perf/total_num_tokens"] = n_tokens
        metrics["perf/throughput"] = n_tokens / timings["step"] if timings["step"] > 0 else 0.0
        metrics["training/global_step"] = float(step)
        metrics["training/epoch"] = float(self.train_data.epoch)
        return metrics

    # ================================================================ stages
    def _sample(self, part: str, timings: dict[str, float], metrics: dict[str, float]) -> KVBatchMeta:
        """Stages 1-3 (prompts, generation, rewards) of one batch; under dynamic sampling, of as many as it takes.

        With `algorithm.filter_groups.enable`, groups whose samples all score
        the same are dropped (they carry no gradient under a group baseline)
        and new prompts are generated until `data.train_batch_size` varied
        groups are in hand; the surplus of the last batch is dropped too.
        """
        fg = self.cfg.algorithm.filter_groups
        want, n = self.cfg.data.train_batch_size, self.cfg.actor_rollout_ref.rollout.n
        kept: list[KVBatchMeta] = []
        n_kept = n_seen = 0
        gen_calls, reward_calls = [], []
        batch = 0
        while True:
            # The first batch keeps the keys and seed it has without filtering: turning the
            # filter on changes nothing in a step whose groups all vary.
            prefix, salt = (part, "gen") if batch == 0 else (f"{part}/b{batch}", f"gen{batch}")
            batch += 1
            records = self.train_data.next_batch(want)
            with _timer("prompts", timings):
                # Batches that share a partition share its column widths: pad to the maximum.
                meta = self._put_prompts(records, part, n=n, key_prefix=prefix,
                                         width=self._train_prompt_width() if fg.enable else None)
            with _timer("gen", timings):
                meta, gen_metrics = self._generate(meta, seed=self._seed(salt), pad=fg.enable)
            gen_calls.append(gen_metrics)
            with _timer("reward", timings):
                meta, reward_metrics = self._compute_reward(meta)
            reward_calls.append(reward_metrics)
            if self.cfg.algorithm.adv_estimator == "remax":
                with _timer("gen_baseline", timings):
                    self._remax_baselines(meta, records, salt)
            if not fg.enable:
                break
            varied = self._varied_groups(meta, fg.metric)
            n_seen += len(meta) // n
            n_kept += len(varied) // n
            kept.append(varied)
            if n_kept >= want:
                meta = KVBatchMeta.concat(kept).select(list(range(want * n)))
                break
            if fg.max_num_gen_batches and batch >= fg.max_num_gen_batches:
                raise ValueError(
                    f"step {self.global_step}: after {batch} generation batches only {n_kept} of the "
                    f"{want} prompt groups needed had rewards that differ (algorithm.filter_groups."
                    f"max_num_gen_batches={fg.max_num_gen_batches}); the data may be too hard or too easy for the "
                    "model. Raise max_num_gen_batches (0 = no limit), or set algorithm.filter_groups.enable=false"
                )
            if not fg.max_num_gen_batches and n_seen >= len(self.train_data) + want:
                # "No limit" must not mean "forever": a model that solves (or fails) every prompt
                # would otherwise generate without end in this step.
                raise ValueError(
                    f"step {self.global_step}: a whole epoch of prompts ({n_seen} groups) yielded only {n_kept} of "
                    f"the {want} groups needed with rewards that differ; the model solves or fails nearly every "
                    "prompt. Use harder or easier data, or set algorithm.filter_groups.enable=false"
                )
        metrics.update(mean_over_calls(gen_calls))
        metrics.update(mean_over_calls(reward_calls))
        if fg.enable:
            metrics["train/num_gen_batches"] = float(batch)
            metrics["train/filter_groups/kept_frac"] = n_kept / n_seen if n_seen else 0.0
        return meta

    def _train_prompt_width(self) -> int:
        """The longest training prompt in tokens (computed once): a common width for every generation batch."""
        if self._train_width is None:
            texts = list(dict.fromkeys(render_prompt(rec, self.tokenizer) for rec in self._train_records))
            ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
            self._train_width = min(max(len(x) for x in ids), self.cfg.data.max_prompt_length)
        return self._train_width

    def _varied_groups(self, meta: KVBatchMeta, metric: str) -> KVBatchMeta:
        """The samples of `meta` whose group's `metric` is not the same for all of its samples, in order."""
        field = "acc" if metric == "acc" else "rm_scores"
        td = self.dp.get(meta, [field, "uid"])
        # float64 sums and an exact comparison: a group of equal fractional scores
        # must count as constant, which a float32 std > 0 test gets wrong.
        values = td[field].double()
        scores = values if values.dim() == 1 else values.sum(-1)
        lo: dict[str, float] = {}
        hi: dict[str, float] = {}
        for uid, v in zip(td["uid"], scores.tolist()):
            lo[uid], hi[uid] = min(lo.get(uid, v), v), max(hi.get(uid, v), v)
        return meta.select([i for i, uid in enumerate(td["uid"]) if hi[uid] > lo[uid]])

    def _remax_baselines(self, meta: KVBatchMeta, records: list[dict], salt: str) -> None:
        """ReMax: greedy-decode each prompt once, score it, and store that score as every sample's `reward_baselines`."""
        part = f"{meta.partition_id}-greedy"  # its own partition: its responses have their own width
        try:
            base = self._put_prompts(records, part, n=1)
            base, _ = self._generate(base, seed=self._seed(salt), greedy=True)
            base, _ = self._compute_reward(base)
            scores = self.dp.get(base, ["rm_scores"])["rm_scores"].sum(-1)
        finally:
            self.dp.kv_clear(part)
        n = len(meta) // len(records)
        self.dp.put(meta, {"reward_baselines": scores.repeat_interleave(n)})

    def _put_prompts(self, records: list[dict], partition_id: str, n: int, key_prefix: str | None = None,
                     width: int | None = None) -> KVBatchMeta:
        """Stage 1: tokenize prompts, repeat each `n` times (one group per prompt) and write them (left-padded to `width`)."""
        d = self.cfg.data
        texts = [render_prompt(rec, self.tokenizer) for rec in records]
        # Prompts recur every epoch: tokenize each distinct text once per run, in one batched call.
        new = [t for t in dict.fromkeys(texts) if t not in self._prompt_ids]
        if new:
            for text, ids in zip(new, self.tokenizer(new, add_special_tokens=False)["input_ids"]):
                self._prompt_ids[text] = ids
        token_lists = []
        for rec, text in zip(records, texts):
            try:
                ids = check_prompt_length(self._prompt_ids[text], d.max_prompt_length, d.truncation)
            except ValueError as err:
                raise ValueError(f"prompt {text[:60]!r} (data_source {rec.get('data_source')!r}): {err}") from err
            if not ids:
                raise ValueError(f"prompt {text[:60]!r} is empty after tokenization")
            token_lists.append(ids)
        width = max([len(x) for x in token_lists] + [width or 0])
        pad = self.tokenizer.pad_token_id
        # Left padding, built as one tensor per batch and repeated n times (one group per prompt).
        padded = torch.tensor([[pad] * (width - len(ids)) + ids for ids in token_lists], dtype=torch.long)
        lengths = torch.tensor([len(ids) for ids in token_lists])
        mask = torch.arange(width).unsqueeze(0) >= (width - lengths).unsqueeze(1)
        prompts, mask = padded.repeat_interleave(n, dim=0), mask.repeat_interleave(n, dim=0)
        uids = [f"{key_prefix or partition_id}/p{i}" for i in range(len(records))]
        keys = [f"{uid}/s{j}" for uid in uids for j in range(n)]
        fields = {
            "prompts": prompts,
            "prompt_mask": mask,
            "uid": [uid for uid in uids for _ in range(n)],
            "data_source": [rec["data_source"] for rec in records for _ in range(n)],
            "ground_truth": [str(rec["reward_model"]["ground_truth"]) for rec in records for _ in range(n)],
            "raw_prompt": [text for text in texts for _ in range(n)],
        }
        tags = [{"seq_len": len(ids)} for ids in token_lists for _ in range(n)]
        return self.dp.kv_batch_put(keys=keys, partition_id=partition_id, fields=fields, tags=tags)

    def _generate(self, meta: KVBatchMeta, *, seed: int, validate: bool = False, greedy: bool = False,
                  pad: bool = False) -> tuple[KVBatchMeta, dict[str, float]]:
        """Stage 2: the rollout writes responses, response_mask, rollout_log_probs (and routed_experts)."""
        r = self.cfg.actor_rollout_ref.rollout
        kw = r.val_kwargs if validate else r
        greedy = greedy or (validate and (not r.val_kwargs.do_sample or r.val_kwargs.temperature == 0))
        call = GenerateCall(
            max_new_tokens=self.cfg.data.max_response_length,
            temperature=1.0 if greedy else kw.temperature,
            top_p=kw.top_p,
            top_k=kw.top_k,
            do_sample=False if greedy else kw.do_sample,
            seed=seed,
            capture_routing=self.plan.rollout_captures_routing and not validate and not greedy,
            pad_to_max_new_tokens=pad,
        )
        out = self.workers.actor.generate_sequences(meta.with_extra_info(**call.to_extra_info()))
        metrics = reduce_rank_metrics(out.extra_info, prefix="")
        gen = {k: v for k, v in metrics.items() if k.startswith("rollout/")}
        gen.update({f"actor/{k}": v for k, v in metrics.items() if k.startswith("perf/")})
        return out, gen

    def _compute_reward(self, meta: KVBatchMeta) -> tuple[KVBatchMeta, dict[str, float]]:
        """Stage 3: rule-based scores by data_source into rm_scores (and acc); returns the reward metrics too."""
        out = self.workers.reward.compute_reward(meta)
        return out, {k: v for k, v in reduce_rank_metrics(out.extra_info).items() if k.startswith("reward/")}

    def _compute_old_log_prob(self, meta: KVBatchMeta, metrics: dict[str, float]) -> KVBatchMeta:
        """Stage 4: old_log_probs (and entropy) by an actor forward, or copied from the rollout in bypass mode."""
        if self.plan.old_log_probs == "rollout":
            td = self.dp.get(meta, ["rollout_log_probs"])
            return self.dp.put(meta, {"old_log_probs": bypass_old_log_prob(td["rollout_log_probs"])})
        if self.plan.old_log_probs == "update":  # the update's own forward writes them (off-policy, one optimizer step)
            return meta
        call = LogProbCall(temperature=self.cfg.actor_rollout_ref.rollout.temperature, calculate_entropy=True,
                           compute_loss=False)
        out = self.workers.actor.compute_log_prob(meta.with_extra_info(**call.to_extra_info()))
        reduced = reduce_rank_metrics(out.extra_info)
        metrics.update({k: v for k, v in reduced.items() if k.startswith("actor/")})
        return out

    def _compute_ref_log_prob(self, meta: KVBatchMeta) -> KVBatchMeta:
        """Stage 5: ref_log_prob from the frozen reference policy."""
        call = LogProbCall(temperature=self.cfg.actor_rollout_ref.rollout.temperature, calculate_entropy=False,
                           compute_loss=False)
        return self.workers.ref.compute_log_prob(meta.with_extra_info(**call.to_extra_info()))

    def _compute_values(self, meta: KVBatchMeta) -> KVBatchMeta:
        """Stage 6: values from the critic."""
        return self.workers.critic.compute_values(meta)

    def _compute_advantage(self, meta: KVBatchMeta, metrics: dict[str, float]) -> KVBatchMeta:
        """Stage 7: token_level_rewards (after any in-reward KL), advantages and returns."""
        algo = self.cfg.algorithm
        fields = ["rm_scores", "response_mask", "uid"]
        remax = algo.adv_estimator == "remax"
        if remax:
            fields.append("reward_baselines")
        if algo.use_kl_in_reward:
            fields += ["old_log_probs", "ref_log_prob"]
        if self.plan.use_critic:
            fields.append("values")
        td = self.dp.get(meta, fields)
        mask = td["response_mask"].bool()
        _check_finite(self.global_step, "rm_scores", td["rm_scores"], mask)
        rewards = td["rm_scores"]
        if algo.use_kl_in_reward:
            rewards, current_kl = apply_kl_penalty(
                rewards, td["old_log_probs"], td["ref_log_prob"], mask, kl_coef=self.kl_ctrl.value, kind=algo.kl_penalty
            )
            self.kl_ctrl.update(current_kl, n_steps=self.cfg.data.train_batch_size)
            metrics["actor/reward_kl_penalty"] = current_kl
            metrics["actor/reward_kl_penalty_coeff"] = float(self.kl_ctrl.value)
        advantages, returns = compute_advantage(
            algo.adv_estimator, rewards, mask,
            values=td["values"] if self.plan.use_critic else None,
            group_index=list(td["uid"]),
            gamma=algo.gamma, lam=algo.lam, norm_adv_by_std=algo.norm_adv_by_std_in_grpo,
            reward_baselines=td["reward_baselines"] if remax else None,
        )
        _check_finite(self.global_step, "advantages", advantages, mask)
        return self.dp.put(meta, {"token_level_rewards": rewards, "advantages": advantages, "returns": returns})

    def _mini_batches(self, meta: KVBatchMeta, mini_batch_prompts: int, epochs: int, shuffle: bool, salt: str) -> list[KVBatchMeta]:
        """The handles of each optimizer step: `epochs` passes, each split into mini-batches of whole samples."""
        n = self.cfg.actor_rollout_ref.rollout.n
        size = mini_batch_prompts * n
        gen = torch.Generator().manual_seed(self._seed(salt))
        out = []
        for _ in range(epochs):
            order = torch.randperm(len(meta), generator=gen).tolist() if shuffle else list(range(len(meta)))
            out.extend(meta.select(order[i : i + size]) for i in range(0, len(order), size))
        return out

    def _update_critic(self, meta: KVBatchMeta) -> dict[str, float]:
        """Stage 8a: critic optimizer steps over mini-batches."""
        c = self.cfg.critic
        results = []
        for mb in self._mini_batches(meta, c.ppo_mini_batch_size, c.ppo_epochs, True, "critic"):
            out = self.workers.critic.update_critic(mb)
            results.append(reduce_rank_metrics(out.extra_info))
        merged = mean_over_calls(results)
        return {(k if k.startswith("critic/") else f"critic/{k}"): v for k, v in merged.items()}

    def _update_actor(self, meta: KVBatchMeta) -> dict[str, float]:
        """Stage 8b: PPO epochs over mini-batches, one actor optimizer step each."""
        a = self.cfg.actor_rollout_ref.actor
        results = []
        for mb in self._mini_batches(meta, a.ppo_mini_batch_size, a.ppo_epochs, a.shuffle, "actor"):
            call = UpdateCall(
                temperature=self.cfg.actor_rollout_ref.rollout.temperature,
                # Without an old-log-prob forward, the update's forward reports the entropy.
                calculate_entropy=self.plan.old_log_probs in ("rollout", "update"),
                compute_loss=True,
            )
            out = self.workers.actor.update_actor(mb.with_extra_info(**call.to_extra_info()))
            results.append(reduce_rank_metrics(out.extra_info))
        merged = mean_over_calls(results)
        if not math.isfinite(merged.get("actor/pg_loss", 0.0)):
            raise NonFiniteError(f"step {self.global_step}: field 'actor/pg_loss' is not finite ({merged['actor/pg_loss']})")
        return {(k if k.startswith("actor/") else f"actor/{k}"): v for k, v in merged.items()}

    def _compute_metrics(self, meta: KVBatchMeta, timings: dict[str, float]) -> dict[str, float]:
        """Stage 9: data metrics of the step (and, every interval, MoE router load balance)."""
        fields = ["rm_scores", "acc", "token_level_rewards", "advantages", "returns", "response_mask", "prompt_mask"]
        if not self.plan.bypass:
            # Sampler vs trainer log-probs; in bypass mode they are the same numbers by construction.
            fields += ["rollout_log_probs", "old_log_probs"]
        if self.plan.use_critic:
            fields.append("values")
        interval = self.cfg.actor_rollout_ref.rollout.moe_load_balance_metrics_interval
        td = get_metric_data_with_optional_routed_experts(
            meta.keys, meta.partition_id, fields, interval, self.global_step, self.moe_acc, self.dp.kv_batch_get
        )
        metrics = compute_data_metrics(td, use_critic=self.plan.use_critic,
                                       max_response_length=self.cfg.data.max_response_length)
        correction = self.cfg.algorithm.rollout_correction
        if self.plan.rollout_is_level is not None and not self.plan.bypass:
            upper, lower = correction.is_thresholds()
            metrics.update(compute_is_metrics(td["old_log_probs"], td["rollout_log_probs"], td["response_mask"],
                                              level=self.plan.rollout_is_level, threshold=upper, lower=lower))
        if correction.rollout_rs is not None and not self.plan.bypass:
            _, rs = compute_rejection_mask(td["old_log_probs"], td["rollout_log_probs"], td["response_mask"],
                                           correction.rejection())
            metrics.update({f"rollout_corr/{k}": v for k, v in rs.items()})
        with _timer("moe_metrics", timings):
            moe = compute_moe_lb_metrics(td, interval, self.global_step, self.moe_acc)
        if moe:
            metrics.update(moe)
            if moe.get("rollout/moe/routed_experts_found"):
                # Whose routing the numbers describe: 1 = the trainer's old-log-prob forward, 0 = the rollout's.
                metrics["rollout/moe/routing_from_trainer_forward"] = float(self.plan.load_balance_from_forward)
            self._save_expert_load()
            if moe.get("rollout/moe/routed_experts_found"):
                with _timer("moe_agreement", timings):
                    out = self.workers.actor.compute_routing_agreement(meta)
                reduced = reduce_rank_metrics(out.extra_info)
                metrics.update({k: v for k, v in reduced.items() if k.startswith("actor/moe/")})
        return metrics

    # ================================================================ validation
    def _validate(self) -> dict[str, float]:
        """Greedy decoding on the held-out prompts: val/accuracy (score >= 1) and val/reward."""
        part = f"val-{self.global_step}"
        try:
            meta = self._put_prompts(self.val_records, part, n=self.cfg.actor_rollout_ref.rollout.val_kwargs.n)
            meta, _ = self._generate(meta, seed=self._seed("val"), validate=True)
            meta, _ = self._compute_reward(meta)
            td = self.dp.get(meta, ["acc", "data_source", "response_mask"])
        finally:
            self.dp.kv_clear(part)
        scores = td["acc"].float()
        correct = (scores >= 1.0).float()
        out = {"val/accuracy": float(correct.mean()), "val/reward": float(scores.mean()),
               "val/response_length": float(td["response_mask"].sum(-1).float().mean())}
        sources = list(td["data_source"])
        if len(set(sources)) > 1:
            for src in sorted(set(sources)):
                idx = torch.tensor([s == src for s in sources])
                out[f"val/accuracy/{src}"] = float(correct[idx].mean())
        self.val_history.append((self.global_step, out["val/accuracy"]))
        return out

    def _report_accuracy(self) -> None:
        if len(self.val_history) < 2:
            return
        first_step, first = self.val_history[0]
        last_step, last = self.val_history[-1]
        ratio = f"{last / first:.1f}x" if first > 0 else "n/a (step-0 accuracy is 0)"
        msg = (f"held-out exact-match accuracy: step {first_step} = {first:.3f}, step {last_step} = {last:.3f} "
               f"({ratio})")
        print(msg, flush=True)

    # ================================================================ outputs
    def _log(self, metrics: dict[str, float], step: int) -> None:
        self.tracking.log(metrics, step=step)
        if self.prometheus is not None:
            self.prometheus.update(metrics, step)

    def _save_expert_load(self) -> None:
        counts = getattr(self.moe_acc, "last_counts", None)
        if counts is None:
            return
        import json

        record = {"step": self.global_step, "num_experts": int(counts.shape[1]), "counts": counts.tolist()}
        with open(self.run_dir / "moe_expert_load.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")

    def _dump_generations(self, meta: KVBatchMeta) -> None:
        from conveyor.metrics.dumps import response_turns, write_generations

        k = min(self.cfg.trainer.dump_num, len(meta))
        sub = meta.select(list(range(k)))
        td = self.dp.get(sub, ["raw_prompt", "responses", "response_mask", "ground_truth", "data_source", "acc",
                               "advantages"])
        rows = []
        for i in range(k):
            n = int(td["response_mask"][i].sum())
            # Through the last model token, with the tool turns marked when there are any (multi-turn).
            response, turns = response_turns(self.tokenizer, td["responses"][i], td["response_mask"][i])
            rows.append({
                "prompt": td["raw_prompt"][i],
                "response": response,
                "ground_truth": td["ground_truth"][i],
                "data_source": td["data_source"][i],
                "reward": float(td["acc"][i]),
                "advantage": float(td["advantages"][i][:max(n, 1)].mean()),
                "key": sub.keys[i],
                **({"turns": turns} if turns else {}),
            })
        write_generations(self.run_dir, self.global_step, rows)

    def _progress_bar(self):
        t = self.cfg.trainer
        if not t.progress_bar or not sys.stderr.isatty():
            return None
        from tqdm import tqdm

        return tqdm(total=t.total_training_steps, initial=self.global_step, desc="train", unit="step", file=sys.stderr)

    def _seed(self, salt: str) -> int:
        """A seed that depends only on (trainer.seed, step, purpose): resumed runs sample the same."""
        code = sum(ord(c) * 31**i for i, c in enumerate(salt)) % 1_000_003
        return (self.cfg.trainer.seed * 1_000_003 + self.global_step * 7_919 + code) % (2**62)

    def _install_stop_handlers(self) -> dict[int, Any]:
        # A step stopped half-way has advanced the prompt order and maybe the
        # model, so no checkpoint can describe it: with save_on_interrupt the
        # first Ctrl-C or SIGTERM lets the running step finish (fit then saves
        # it), a second one stops at once. Returns the handlers to restore.
        previous = {}
        for signum in _STOP_SIGNALS:
            try:
                old = signal.getsignal(signum)
                signal.signal(signum, self._on_stop_signal)
            except (ValueError, TypeError):  # not the main thread, where signals never arrive anyway
                continue
            previous[signum] = old if old is not None else signal.SIG_DFL
        return previous

    def _on_stop_signal(self, signum: int, frame: Any) -> None:
        if self._stop_requested or not self.cfg.trainer.save_on_interrupt:
            raise StopRequested(signum)
        self._stop_requested = signum
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        logger.warning("%s: finishing step %d, then saving a checkpoint and stopping (send it again to stop at "
                       "once, without saving)", name, self.global_step)

    # ================================================================ checkpoints
    @property
    def ckpt_root(self) -> Path:
        """Where checkpoints go."""
        return self.run_dir / "checkpoints"

    def save_checkpoint(self) -> Path:
        """Write every role's shards, the model's config and tokenizer, data order and RNG states of this step."""

        def write(tmp: Path) -> dict[str, Any]:
            roles = {"actor": self.workers.actor.save_checkpoint(str(tmp / "actor"))}
            if self.workers.critic is not None:
                roles["critic"] = self.workers.critic.save_checkpoint(str(tmp / "critic"))
            if self.model_config is not None:
                # What `conveyor export` needs besides the weights: a checkpoint is self-contained.
                self.model_config.save_pretrained(tmp / "hf")
                self.tokenizer.save_pretrained(tmp / "hf")
            return {
                "global_step": self.global_step,
                "config": config_to_dict(self.cfg),  # what a resume is checked against
                "roles": roles,
                "dataset": self.train_data.state_dict(),
                "rng": ckpt.rng_state(),
                "kl_coef": float(self.kl_ctrl.value),
                "moe_counts": self.moe_acc.counts,
                "moe_retry_step": self.moe_acc.routed_experts_retry_step,
                "val_history": list(self.val_history),
            }

        return ckpt.save_checkpoint(self.ckpt_root, self.global_step, write, self.cfg.trainer.max_ckpt_to_keep)

    def _maybe_resume(self) -> None:
        path = ckpt.resume_path(self.cfg.trainer, self.ckpt_root)
        if path is None:
            return
        parts = ckpt.load_checkpoint(path)
        if "actor" not in parts:
            raise ValueError(f"checkpoint {path} has no actor shards (no actor/ directory); it is incomplete")
        st = parts["trainer_state"]
        roles = st.get("roles", {})
        self.workers.actor.load_checkpoint(str(parts["actor"]), roles.get("actor", {}))
        if self.workers.critic is not None:
            if "critic" not in parts:
                raise ValueError(f"checkpoint {path} has no critic state but this run uses a critic")
            self.workers.critic.load_checkpoint(str(parts["critic"]), roles.get("critic", {}))
        self.global_step = int(st["global_step"])
        self.train_data.load_state_dict(st["dataset"])
        ckpt.set_rng_state(st["rng"])
        self.kl_ctrl.value = st["kl_coef"]
        self.moe_acc.counts = st.get("moe_counts")
        self.moe_acc.routed_experts_retry_step = st.get("moe_retry_step", 0)
        self.val_history = [tuple(x) for x in st.get("val_history", [])]
        logger.info("resumed from %s (step %d)", path, self.global_step)


def run_training(cfg: Config) -> dict[str, float]:
    """Build everything from `cfg`, train, and close the data plane (and workers) whatever happens."""
    import transformers

    # Loading and saving tiny checkpoints is instant; the library's bars are noise in our console.
    transformers.utils.logging.disable_progress_bar()
    device = resolve_device(cfg)  # an unusable device fails before anything is built or written
    plan = build_run_plan(cfg, device)  # every decision of the run, once; a contradiction fails here
    logger.info("%s", plan.describe())
    if plan.replay_reason:
        logger.warning("%s", plan.replay_reason)
    run_dir = cfg.run_dir
    lock = open_run_dir(cfg)
    try:
        return _train_in(cfg, run_dir, device, plan)
    finally:
        lock.release()


def _resume_check(cfg: Config, run_dir: Path) -> bool:
    """Check the checkpoint a resume would load against this config before anything is built (True: accepted change)."""
    path = ckpt.resume_path(cfg.trainer, run_dir / "checkpoints")
    if path is None:
        return False
    state = ckpt.load_checkpoint(path)["trainer_state"]
    return check_resume(cfg, path, state.get("config"))


def _train_in(cfg: Config, run_dir: Path, device: str, plan: RunPlan) -> dict[str, float]:
    """run_training's body, with the run directory locked."""
    changed = _resume_check(cfg, run_dir)
    try:
        write_config(cfg, run_dir, keep_previous=changed)
        (run_dir / "plan.json").write_text(json.dumps(plan.to_dict(), indent=2) + "\n")
    except OSError as err:
        raise ValueError(f"cannot write {run_dir / 'config.yaml'} ({err.strerror or err}); choose a writable run "
                         "directory with trainer.default_local_dir") from err
    torch.manual_seed(cfg.trainer.seed)
    np.random.seed(cfg.trainer.seed % 2**32)

    model_path = prepare_default_model(cfg)
    trust = cfg.actor_rollout_ref.model.trust_remote_code
    tokenizer = load_tokenizer(cfg.actor_rollout_ref.model.tokenizer_path or model_path, trust_remote_code=trust)
    train_records, val_records = load_prompt_records(cfg, tokenizer)  # the run's tokenizer, loaded once

    registry = server = gauges = None
    if cfg.trainer.prometheus.enabled:
        from prometheus_client import CollectorRegistry

        from conveyor.data_plane.prometheus import serve_registry
        from conveyor.metrics.train_prometheus import TrainingGauges

        registry = CollectorRegistry()
        gauges = TrainingGauges(registry)
        server, port = serve_registry(registry, cfg.trainer.prometheus.host, cfg.trainer.prometheus.port)
        logger.info("training metrics for Prometheus at http://%s:%d/metrics", cfg.trainer.prometheus.host, port)

    data_plane = None
    workers = None
    tracking = None
    failed = True
    ray_started = False
    try:
        ray_started = ensure_ray(cfg) if needs_ray(cfg) else False
        data_plane = build_data_plane(cfg, registry=registry)
        workers = build_worker_groups(cfg, plan, model_path, data_plane, tokenizer, device)
        tracking = Tracking(cfg.trainer.logger, run_dir=run_dir, project=cfg.trainer.project_name,
                            experiment=cfg.trainer.experiment_name, config=config_to_dict(cfg))
        trainer_cls: Any = PPOTrainer
        extra: dict[str, Any] = {}
        if cfg.trainer.v1.is_async:  # rollout in its own process, concurrently with the updates
            from conveyor.trainer.async_loop import AsyncPPOTrainer

            trainer_cls, extra = AsyncPPOTrainer, {"model_path": model_path}
        trainer = trainer_cls(
            cfg, plan=plan, data_plane=data_plane, workers=workers, tokenizer=tokenizer, train_records=train_records,
            val_records=val_records, tracking=tracking, run_dir=run_dir,
            model_config=load_model_config(model_path, trust_remote_code=trust), prometheus=gauges, **extra,
        )
        result = trainer.fit()
        failed = False
        return result
    finally:
        if tracking is not None:
            tracking.close(failed=failed)
        if workers is not None:
            workers.shutdown()
        if data_plane is not None:
            data_plane.close()
        if server is not None:
            server.shutdown()
        shutdown_ray(ray_started)  # after the data plane: its storage actors live in Ray
