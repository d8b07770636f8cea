"""Where a step's samples come from: sample sources over the data plane.

`PPOTrainer.step` takes its batch from one source (`build_source`, in
`trainer/async_source.py` beside the asynchronous one it may choose); everything
after stage 3 is the same whatever the source is. A source runs stages 1-3
through the run's `Stages` (`trainer/stages.py`) and hands out handles
(`KVBatchMeta`) to samples already in the data plane, scored; it never passes
sample tensors to the trainer.

- `SyncSource`: today's sampling, every step: prompts, then the rollout and
  the rewards, with the weights of the step before.
- `AsyncSource` (`trainer/async_source.py`): the rollout worker group
  generates up to k policy versions ahead, on a thread of its own, while the
  trainer updates (bounded staleness; docs/async.md). With k = 0 it is the
  synchronous source, bit for bit.
- `DynamicSampling` wraps either: it draws batches until enough prompt
  groups with varied rewards are in hand (`algorithm.filter_groups`).
- `GreedyBaseline` (ReMax) wraps the batch pipeline both sources run: each
  batch's greedy rollout is generated with the weights that sampled it, on
  the thread that sampled it.

A source's `state_dict` is part of the checkpoint: the prompt order from
which a resumed run draws again (for `AsyncSource`, the order before the
oldest batch not yet trained), and so is its `in_flight_state`: the
batches drawn and not yet trained (an asynchronous source's; none for the
others).

What it deliberately does not do: compute anything after the rewards, or know
where the engines run (the rollout group does).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from conveyor.metrics.reduce import mean_over_calls
from conveyor.protocol import KVBatchMeta
from conveyor.trainer.stages import Generate, Stages
from conveyor.trainer.timing import timer

__all__ = [
    "Batch",
    "SampleSource",
    "SyncSource",
    "DynamicSampling",
    "Pipeline",
    "GenerateAndScore",
    "GreedyBaseline",
]


@dataclasses.dataclass
class Batch:
    """Scored samples in the data plane: their handle, the metrics of the stages that made them, their timings."""

    meta: KVBatchMeta
    metrics: dict[str, float]
    timings: dict[str, float]


# --------------------------------------------------------------------------- the batch pipeline
class Pipeline:
    """Prompts already in the data plane -> a scored batch: what both sources run on every batch they draw."""

    def __call__(
        self, meta: KVBatchMeta, records: list[dict], seed: int, *, pad: bool, generate: Generate, scored: bool = False
    ) -> Batch:
        """The batch of `meta`'s prompts (drawn from `records`), sampled with `seed` by `generate` (which also scores
        them when `scored`: the reward worker in the rollout's processes, in the same call)."""
        raise NotImplementedError


class GenerateAndScore(Pipeline):
    """Stage 2 (the rollout) and stage 3 (the rewards)."""

    def __init__(self, stages: Stages):
        self.stages = stages

    def __call__(
        self, meta: KVBatchMeta, records: list[dict], seed: int, *, pad: bool, generate: Generate, scored: bool = False
    ) -> Batch:
        """Responses by `generate`, then rule-based scores."""
        timings: dict[str, float] = {}
        with timer("gen", timings):
            meta, gen = self.stages.generate(meta, seed=seed, pad=pad, generate=generate)
        with timer("reward", timings):
            meta, reward = self.stages.compute_reward(meta, scored=scored)
        return Batch(meta, {**gen, **reward}, timings)


class GreedyBaseline(Pipeline):
    """ReMax: after `inner`, greedy-decode each prompt once with the same engine and weights, score it, and store the
    score as every sample's `reward_baselines`."""

    def __init__(self, inner: Pipeline, stages: Stages):
        self.inner, self.stages = inner, stages

    def __call__(
        self, meta: KVBatchMeta, records: list[dict], seed: int, *, pad: bool, generate: Generate, scored: bool = False
    ) -> Batch:
        """`inner`'s batch with `reward_baselines` written."""
        batch = self.inner(meta, records, seed, pad=pad, generate=generate, scored=scored)
        stages, dp = self.stages, self.stages.data_plane
        with timer("gen_baseline", batch.timings):
            part = f"{batch.meta.partition_id}-greedy"  # its own: its responses have their own width
            try:
                base = stages.put_prompts(records, part, n=1)
                base, _ = stages.generate(base, seed=seed, greedy=True, generate=generate)
                base, _ = stages.compute_reward(base, scored=scored)
                scores = dp.get(base, ["rm_scores"])["rm_scores"].sum(-1)
            finally:
                dp.kv_clear(part)
            n = len(batch.meta) // len(records)
            batch.meta = dp.put(batch.meta, {"reward_baselines": scores.repeat_interleave(n)})
        return batch


# --------------------------------------------------------------------------- sources
class SampleSource:
    """Scored batches for training steps, from the data plane."""

    def start(self) -> None:
        """Before the first step of `fit`."""

    def next(self, step_meta: KVBatchMeta, draw: int = 0) -> Batch:
        """The `draw`-th batch of this step (`step_meta`: the step's own, empty partition)."""
        raise NotImplementedError

    def generate(self, meta: KVBatchMeta) -> KVBatchMeta:
        """Stage 2 outside training (validation), with the trainer's current weights."""
        raise NotImplementedError

    def updated(self) -> dict[str, float]:
        """The step's actor update just ended (its weights are the next version); returns timings to log."""
        return {}

    def release(self) -> None:
        """The step is over: free what the source wrote outside the step's partition."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: the prompt order a resumed run draws from."""
        raise NotImplementedError

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint's `state_dict`."""
        raise NotImplementedError

    def in_flight_state(self, stopping: bool = False) -> dict[str, Any] | None:
        """What a checkpoint keeps of the batches drawn and not yet trained (None: there are none); `stopping`: the
        run stops after this save, so what has not started need not be waited for."""
        return None

    def load_in_flight_state(self, state: dict[str, Any] | None) -> None:
        """A checkpoint's `in_flight_state` (after `load_state_dict`). A source that keeps none (an asynchronous
        run resumed as a synchronous one) draws those batches again: `state_dict`'s prompt order is before them."""

    def close(self, failed: bool) -> None:
        """After `fit` (also on a stop or a failure)."""


class SyncSource(SampleSource):
    """Every step: draw prompts, then the rollout and rewards with the weights of the step before."""

    def __init__(self, stages: Stages, pipeline: Pipeline, *, pad: bool = False):
        self.stages, self.pipeline, self.pad = stages, pipeline, pad

    def next(self, step_meta: KVBatchMeta, draw: int = 0) -> Batch:
        """One batch into the step's partition: the first with the step's keys and seed, later ones under a prefix."""
        stages = self.stages
        part = step_meta.partition_id
        prefix, salt = (part, "gen") if draw == 0 else (f"{part}/b{draw}", f"gen{draw}")
        records = stages.train_data.next_batch(stages.cfg.data.train_batch_size)
        timings: dict[str, float] = {}
        with timer("prompts", timings):
            # Batches that share a partition share its column widths: pad to the maximum.
            meta = stages.put_prompts(
                records,
                part,
                n=stages.cfg.actor_rollout_ref.rollout.n,
                key_prefix=prefix,
                width=stages.train_prompt_width() if self.pad else None,
            )
        batch = self.pipeline(
            meta, records, stages.seed(salt), pad=self.pad, generate=stages.workers.generate_sequences
        )
        batch.timings = {**timings, **batch.timings}
        return batch

    def generate(self, meta: KVBatchMeta) -> KVBatchMeta:
        """Where the step's rollout runs (the rollout group syncs first when the actor has moved on)."""
        return self.stages.workers.generate_sequences(meta)

    def state_dict(self) -> dict[str, Any]:
        """The prompt order now."""
        return {"dataset": self.stages.train_data.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the prompt order of a checkpoint."""
        self.stages.train_data.load_state_dict(state["dataset"])


class DynamicSampling(SampleSource):
    """DAPO's dynamic sampling over any source: batches until `data.train_batch_size` prompt groups whose rewards
    differ are in hand (groups that all score the same carry no gradient under a group baseline); the surplus of the
    last batch is dropped too."""

    def __init__(self, inner: SampleSource, stages: Stages):
        self.inner, self.stages = inner, stages

    def next(self, step_meta: KVBatchMeta, draw: int = 0) -> Batch:
        """As many of `inner`'s batches as it takes, their varied groups as one handle."""
        stages = self.stages
        fg = stages.cfg.algorithm.filter_groups
        want, n = stages.cfg.data.train_batch_size, stages.cfg.actor_rollout_ref.rollout.n
        kept: list[KVBatchMeta] = []
        n_kept = n_seen = 0
        calls: list[dict[str, float]] = []
        timings: dict[str, float] = {}
        draws = 0
        while True:
            batch = self.inner.next(step_meta, draws)
            draws += 1
            calls.append(batch.metrics)
            for k, v in batch.timings.items():
                timings[k] = timings.get(k, 0.0) + v
            varied = self._varied_groups(batch.meta, fg.metric)
            n_seen += len(batch.meta) // n
            n_kept += len(varied) // n
            kept.append(varied)
            if n_kept >= want:
                meta = KVBatchMeta.concat(kept).select(list(range(want * n)))
                break
            if fg.max_num_gen_batches and draws >= fg.max_num_gen_batches:
                raise ValueError(
                    f"step {stages.global_step}: after {draws} generation batches only {n_kept} of the "
                    f"{want} prompt groups needed had rewards that differ (algorithm.filter_groups."
                    f"max_num_gen_batches={fg.max_num_gen_batches}); the data may be too hard or too easy for the "
                    "model. Raise max_num_gen_batches (0 = no limit), or set algorithm.filter_groups.enable=false"
                )
            if not fg.max_num_gen_batches and n_seen >= len(stages.train_data) + want:
                # "No limit" must not mean "forever": a model that solves (or fails) every prompt
                # would otherwise generate without end in this step.
                raise ValueError(
                    f"step {stages.global_step}: a whole epoch of prompts ({n_seen} groups) yielded only {n_kept} of "
                    f"the {want} groups needed with rewards that differ; the model solves or fails nearly every "
                    "prompt. Use harder or easier data, or set algorithm.filter_groups.enable=false"
                )
        metrics = mean_over_calls(calls)
        metrics["train/num_gen_batches"] = float(draws)
        metrics["train/filter_groups/kept_frac"] = n_kept / n_seen if n_seen else 0.0
        return Batch(meta, metrics, timings)

    def _varied_groups(self, meta: KVBatchMeta, metric: str) -> KVBatchMeta:
        """The samples of `meta` whose group's `metric` is not the same for all of its samples, in order."""
        field = "acc" if metric == "acc" else "rm_scores"
        td = self.stages.data_plane.get(meta, [field, "uid"])
        # float64 sums and an exact comparison: a group of equal fractional scores
        # must count as constant, which a float32 std > 0 test gets wrong.
        values = td[field].double()
        scores = values if values.dim() == 1 else values.sum(-1)
        lo: dict[str, float] = {}
        hi: dict[str, float] = {}
        for uid, v in zip(td["uid"], scores.tolist()):
            lo[uid], hi[uid] = min(lo.get(uid, v), v), max(hi.get(uid, v), v)
        return meta.select([i for i, uid in enumerate(td["uid"]) if hi[uid] > lo[uid]])

    def start(self) -> None:
        """`inner`'s."""
        self.inner.start()

    def generate(self, meta: KVBatchMeta) -> KVBatchMeta:
        """`inner`'s."""
        return self.inner.generate(meta)

    def updated(self) -> dict[str, float]:
        """`inner`'s."""
        return self.inner.updated()

    def release(self) -> None:
        """`inner`'s."""
        self.inner.release()

    def state_dict(self) -> dict[str, Any]:
        """`inner`'s."""
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """`inner`'s."""
        self.inner.load_state_dict(state)

    def in_flight_state(self, stopping: bool = False) -> dict[str, Any] | None:
        """`inner`'s."""
        return self.inner.in_flight_state(stopping)

    def load_in_flight_state(self, state: dict[str, Any] | None) -> None:
        """`inner`'s."""
        self.inner.load_in_flight_state(state)

    def close(self, failed: bool) -> None:
        """`inner`'s."""
        self.inner.close(failed)
