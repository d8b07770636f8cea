"""The asynchronous sample source: a rollout that generates up to k policy versions ahead of the trainer.

`AsyncSource` hands the rollout worker group batches on a thread of its own
(or to replicas in processes of their own) while the trainer updates, within
a staleness bound (docs/async.md); with k = 0 it is the synchronous source,
bit for bit. Its checkpoint is the prompt order (`state_dict`) and, in a file
of its own, the batches in flight (`in_flight_state`): waited for, read back
from the data plane with the scheduler's counters, so a resumed run trains
exactly what the uninterrupted one would.

What it deliberately does not do: decide what a step does with its batch
(`PPOTrainer`), or know where the engines run (the rollout group does).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from conveyor.data_plane.served import THREAD_PREFIX as DATA_PLANE_THREADS
from conveyor.protocol import KVBatchMeta
from conveyor.trainer.sources import (
    Batch,
    DynamicSampling,
    GenerateAndScore,
    GreedyBaseline,
    Pipeline,
    SampleSource,
    SyncSource,
)
from conveyor.trainer.stages import Stages
from conveyor.trainer.timing import CPU, timer
from conveyor.weights import THREAD_PREFIX as WEIGHT_THREADS
from conveyor.workers.training.balance import SEQ_LEN_TAG

if TYPE_CHECKING:
    from tensordict import TensorDict

__all__ = ["AsyncSource", "ROLLOUT_THREAD", "SWITCH_INTERVAL_S", "build_source", "helper_threads_cpu"]

# The name of the thread an asynchronous source generates on (its prefix: the executor numbers it).
ROLLOUT_THREAD = "conveyor-rollout"

# What the asynchronous source reads of a generated batch: the versions that generated it, and which tokens count.
_VERSION_FIELDS = ("policy_version", "token_policy_version", "response_mask")

# How often a thread holding the interpreter lock hands it over while both threads of an asynchronous run in one
# process compute (Python's default is 5 ms; measured on the default run, docs/async.md).
SWITCH_INTERVAL_S = 0.0002


@dataclasses.dataclass
class _Pending:
    """A batch handed to the rollout and not yet trained or dropped."""

    batch_id: int
    meta: KVBatchMeta  # its prompts in the data plane (its samples, once generated)
    version: int  # the weights it was scheduled with (the ones that generated it, once it is done)
    data_state: dict[str, int]  # the prompt order before this batch was drawn (what a checkpoint keeps)
    future: concurrent.futures.Future
    batch: Batch | None = None
    versions: TensorDict | None = None  # its _VERSION_FIELDS, once generated


class AsyncSource(SampleSource):
    """Batches the rollout worker group generates up to k policy versions ahead, while the trainer updates.

    The trainer is the only scheduler: the rollout thread runs weight loads and batches in the order it
    is given them, so the version of a batch is known when it is handed out. A batch handed out while
    `o` batches are outstanding is trained at version `v + o` at the latest (v = updates so far); under
    `wait` it is handed out only once the weights last sent are at least `v + o - k`, under `drop` at
    once, and a batch that would be trained more than k versions after its weights is discarded. At
    most k + 1 batches are outstanding; weights go out every `parameter_sync_step` updates.
    """

    def __init__(self, stages: Stages, pipeline: Pipeline, *, pad: bool = False):
        v1 = stages.cfg.trainer.v1
        self.stages, self.pipeline, self.pad = stages, pipeline, pad
        self.replicas = stages.workers.rollout
        assert self.replicas is not None, "the plan places the rollout in its own group under asynchronous training"
        self.k = v1.sampler.max_off_policy_threshold
        self.strategy = v1.sampler.max_off_policy_strategy
        self.sync_every = v1.separate_async.parameter_sync_step
        self.partial = v1.separate_async.partial_rollout
        # Batches that share a partition share its column widths, which dynamic sampling needs to join them.
        self.shared = "rollout-samples" if pad else None
        # Stage 1 of a batch: replicas in processes of their own render its prompts themselves (it rides on the
        # generation call), so the trainer's process neither tokenizes nor writes them; else the trainer puts them.
        self._prompts = (
            functools.partial(stages.prompts_to_render, replicas=self.replicas.world_size)
            if self.replicas.renders_prompts
            else stages.put_prompts
        )
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._threads: int | None = None
        self._switch = 0.005
        self._pending: list[_Pending] = []
        self._taken: list[KVBatchMeta] = []  # handed to this step: cleared when it is over
        self._syncs: list[concurrent.futures.Future] = []
        self._next_batch = 0
        self._sent_version: int | None = None
        self._dropped = 0
        # A checkpoint's last weights sent, which `start` sends again under the same version (None: nothing to send).
        self._resend: int | None = None
        self._busy_s = 0.0  # the rollout thread's wall time on batches so far
        self._clock: float | None = None
        self._cpu_clock = 0.0
        self._process_clock = 0.0
        self._busy_at_clock = 0.0
        self._helper_clock: dict[str, float] = {}

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the rollout thread; in one process the two threads share the cores' torch threads."""
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=ROLLOUT_THREAD)
        if self.partial:
            self.replicas.take_weights_between_tokens()
        if self.k > 0 and self.replicas.in_process:
            # Both threads compute at once: each op on one thread keeps them from spinning against each other.
            self._threads = torch.get_num_threads()
            torch.set_num_threads(max(1, self._threads // 2))
            # A thread leaving a torch op waits for the interpreter lock until the other thread's Python gives it up,
            # by default up to 5 ms: with ops of tens of microseconds (a tiny model) that wait would dominate.
            self._switch = sys.getswitchinterval()
            sys.setswitchinterval(SWITCH_INTERVAL_S)
        if self._resend is not None:
            # A resumed run: the rollout first gets the weights the uninterrupted run's had, under the same version
            # (they are the checkpoint's when the last weights sent were its step's; else the next dispatch sends
            # the checkpoint's under their own version).
            if self._resend == self.stages.global_step:
                self._syncs.append(self._submit(self.replicas.stage_weights(self._resend)))
                self._sent_version = self._resend
            self._resend = None

    def close(self, failed: bool) -> None:
        """Stop handing out batches, wait for the one being generated (a thread cannot be stopped), free them all."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
        if self._threads is not None:
            torch.set_num_threads(self._threads)
            sys.setswitchinterval(self._switch)
            self._threads = None
        for p in self._pending:
            self._clear(p.meta)
        self._pending = []
        self.release()

    # ------------------------------------------------------------------ batches
    def next(self, step_meta: KVBatchMeta, draw: int = 0) -> Batch:
        """The next batch the rollout generated within the staleness bound, with its rewards."""
        timings: dict[str, float] = {}
        version = self.stages.global_step - 1  # updates so far: the version this step trains
        if self._next_batch == 0:  # first step of this run (or of a resumed one): batch b is step b's draw
            self._next_batch = self.stages.global_step
        if draw == 0:
            with timer("async/dispatch", timings):
                self._dispatch(version, in_training=0)
        dropped_before = self._dropped
        with timer("async/wait", timings):
            pending = self._take(version)
        # Hand out the next batches before this step's update: the rollout generates them meanwhile.
        with timer("async/dispatch", timings):
            self._dispatch(version, in_training=1)
        batch = pending.batch
        assert batch is not None
        self._taken.append(batch.meta)
        metrics = dict(batch.metrics)
        switches = metrics.pop("rollout/weight_switches", None)
        if switches is not None:
            metrics["off_policy/weight_switches"] = switches
        staleness = version - pending.version
        dropped = (self._dropped - dropped_before) * len(batch.meta)
        metrics["off_policy/staleness_mean"] = float(staleness)
        metrics["off_policy/staleness_max"] = float(staleness)
        metrics["off_policy/dropped_frac"] = dropped / (dropped + len(batch.meta))
        metrics["off_policy/policy_version"] = float(pending.version)
        metrics.update(self._sync_metrics())
        if draw == 0:
            metrics.update(self._idle_fractions(timings))
        metrics.update(self._log_versions(version, pending))
        # The batch's own stages ran on the rollout thread, beside the trainer's: apart from the step's timings.
        timings.update(
            {
                f"{CPU}async/rollout_{k.removeprefix(CPU)}" if k.startswith(CPU) else f"async/rollout_{k}": v
                for k, v in batch.timings.items()
            }
        )
        return Batch(batch.meta, metrics, timings)

    def generate(self, meta: KVBatchMeta) -> KVBatchMeta:
        """Validation: the trainer's current weights go to the rollout, which generates after the batches before it."""
        label = self.stages.global_step  # updates so far
        # Sent already when the step's update ended (`updated`): the rollout thread loads them before this call.
        load = self.replicas.stage_weights(label) if self._sent_version != label else None
        self._sent_version = label

        def run() -> KVBatchMeta:
            if load is not None:
                load()
            return self.replicas.generate_sequences(meta, sync=False)

        return self._submit(run).result()

    def updated(self) -> dict[str, float]:
        """The weights the update just made leave for the rollout now, when a sync is due and a later step trains
        what they generate: the rollout gets them while the step computes its metrics and logs, not after."""
        timings: dict[str, float] = {}
        version = self.stages.global_step  # updates so far, this step's included
        if version < self.stages.cfg.trainer.total_training_steps:
            with timer("async/stage_weights", timings):
                self._stage_if_due(version)
        return timings

    def release(self) -> None:
        """Free the batches this step trained."""
        for meta in self._taken:
            self._clear(meta)
        self._taken = []

    def state_dict(self) -> dict[str, Any]:
        """The prompt order before the oldest batch not yet trained: a run resumed without `in_flight_state` (a
        checkpoint written before it existed) draws it again and regenerates it with the resumed weights, so every
        prompt of the order is trained once."""
        if self._pending:
            return {"dataset": dict(self._pending[0].data_state)}
        return {"dataset": self.stages.train_data.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the prompt order of a checkpoint."""
        self.stages.train_data.load_state_dict(state["dataset"])

    def in_flight_state(self, stopping: bool = False) -> dict[str, Any]:
        """The batches handed out and not yet trained, waited for and read back whole from the data plane (every
        field, the handle's tags, the metrics of their stages), and the scheduler's counters: a resumed run
        trains them at the versions the uninterrupted run does, and continues the prompt order after them.

        `stopping`: only the batches generated or generating are kept; the resumed run draws the ones queued behind
        them again (from the prompt order before the first of them) and generates them with its own weights.
        """
        kept = self._pending
        dataset, next_batch = self.stages.train_data.state_dict(), self._next_batch
        if stopping:
            # Decided before waiting for any: the rollout thread starts the next batch while the save waits. It runs
            # batches in order, so every batch after the first one not started is queued too.
            started = [p.future.running() or p.future.done() for p in kept]
            if not all(started):
                first = kept[started.index(False)]
                dataset, next_batch = dict(first.data_state), first.batch_id
                kept = kept[: started.index(False)]
        batches = []
        for p in kept:
            if p.future.exception() is not None:
                # The checkpoint keeps what was trained and the batches before this one; the resumed run draws this
                # one and those after it again. The failure itself (a replica past its restarts, say) is raised
                # where a step takes the batch, as the run's own error, not as a failed save.
                dataset, next_batch = dict(p.data_state), p.batch_id
                break
            batch, seconds, cpu = p.future.result()
            meta = batch.meta
            columns = self.stages.data_plane.kv_batch_get_columns(meta.keys, meta.partition_id, meta.fields)
            batches.append(
                {
                    "batch_id": p.batch_id,
                    "version": p.version,
                    "data_state": dict(p.data_state),
                    "partition_id": meta.partition_id,
                    "keys": list(meta.keys),
                    "fields": list(meta.fields),
                    "tags": [dict(t) for t in meta.tags],
                    "extra_info": dict(meta.extra_info),
                    "columns": {name: _saved_column(value) for name, value in columns.items()},
                    "metrics": dict(batch.metrics),
                    "timings": dict(batch.timings),
                    "seconds": float(seconds),
                    "cpu_s": float(cpu),
                }
            )
        return {
            "dataset": dataset,  # after the batches kept were drawn
            "next_batch": next_batch,
            "sent_version": self._sent_version,
            "dropped": self._dropped,
            "batches": batches,
        }

    def load_in_flight_state(self, state: dict[str, Any] | None) -> None:
        """Put a checkpoint's batches in flight back into the data plane as generated batches not yet trained, and
        its counters back (None: a checkpoint without them, whose prompt order draws those batches again)."""
        if state is None:
            return
        dp = self.stages.data_plane
        pending = []
        for b in state["batches"]:
            columns = {name: _loaded_column(value) for name, value in b["columns"].items()}
            dp.kv_batch_put(b["keys"], b["partition_id"], columns, tags=b["tags"])
            meta = KVBatchMeta(b["keys"], b["partition_id"], b["fields"], b["tags"], b["extra_info"])
            future: concurrent.futures.Future = concurrent.futures.Future()
            future.set_result((Batch(meta, dict(b["metrics"]), dict(b["timings"])), b["seconds"], b["cpu_s"]))
            pending.append(_Pending(int(b["batch_id"]), meta, int(b["version"]), dict(b["data_state"]), future))
        self._pending = pending
        self.stages.train_data.load_state_dict(state["dataset"])
        self._next_batch = int(state["next_batch"])
        self._dropped = int(state["dropped"])
        sent = state["sent_version"]
        self._resend = None if sent is None else int(sent)

    # ------------------------------------------------------------------ the scheduler
    def _submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        if self._executor is None:
            raise RuntimeError("the asynchronous source is not started (PPOTrainer.fit starts it)")
        return self._executor.submit(fn)

    def _dispatch(self, version: int, in_training: int) -> None:
        """Send weights when due, then hand out batches while the bound and the buffer (k + 1 batches) allow.

        `in_training`: 1 once this step has taken its batch (it is trained at `version`, the next at
        `version + 1`), else 0.
        """
        self._stage_if_due(version)
        total = self.stages.cfg.trainer.total_training_steps
        while len(self._pending) + in_training < self.k + 1:
            # Trained, if nothing is dropped, at version + (batches ahead of it), or sooner.
            trained_at = version + in_training + len(self._pending)
            # A batch no step of this run would train is never handed out: a bound far beyond the run's
            # length would otherwise draw batches without end before the first step.
            if trained_at >= total:
                break
            if self.strategy == "wait" and self._sent_version < trained_at - self.k:
                break
            self._hand_out()

    def _stage_if_due(self, version: int) -> None:
        """Send the weights of `version` (updates so far) to the rollout if `parameter_sync_step` updates have
        passed since the last ones sent; the rollout thread loads them after the batches handed out before."""
        if self._sent_version is None or version - self._sent_version >= self.sync_every:
            self._syncs.append(self._submit(self.replicas.stage_weights(version)))
            self._sent_version = version

    def _hand_out(self) -> None:
        """Draw the next prompts (into the data plane, or onto the call of replicas that render them) and queue their
        batch on the rollout thread."""
        stages = self.stages
        batch_id = self._next_batch
        self._next_batch += 1
        data_state = stages.train_data.state_dict()
        records = stages.train_data.next_batch(stages.cfg.data.train_batch_size)
        n = stages.cfg.actor_rollout_ref.rollout.n
        if self.shared:
            meta = self._prompts(
                records, self.shared, n=n, key_prefix=f"{self.shared}/b{batch_id}", width=stages.train_prompt_width()
            )
        else:
            meta = self._prompts(records, f"batch-{batch_id}", n=n)
        seed = stages.seed("gen", step=batch_id)  # batch b samples with step b's seed, as the synchronous source
        future = self._submit(lambda: self._generate_batch(meta, records, seed))
        self._pending.append(_Pending(batch_id, meta, self._sent_version, data_state, future))

    def _generate_batch(self, meta: KVBatchMeta, records: list[dict], seed: int) -> tuple[Batch, float, float]:
        """On the rollout thread: the pipeline over the rollout group, with the weights loaded last; its seconds."""
        t0, c0 = time.perf_counter(), time.thread_time()
        # Replicas in processes of their own score what they generate in the same call (one round trip a batch).
        scored = self.replicas.colocated_reward
        batch = self.pipeline(
            meta,
            records,
            seed,
            pad=self.pad,
            scored=scored,
            generate=lambda m: self.replicas.generate_sequences(m, sync=False, score=scored),
        )
        # The generation endpoint tagged prompt + response tokens (later splits over ranks balance them), and every
        # later stage's handle keeps the tags.
        assert all(SEQ_LEN_TAG in tag for tag in batch.meta.tags), "a generated batch's handle lost its seq_len tags"
        return batch, time.perf_counter() - t0, time.thread_time() - c0

    def _take(self, version: int) -> _Pending:
        """Wait for the oldest outstanding batch; drop it (and hand out another) when it is too old to train now."""
        while True:
            if not self._pending:
                self._dispatch(version, in_training=0)
            head = self._pending.pop(0)
            batch, seconds, cpu = head.future.result()  # a failure on the rollout thread is raised here
            self._busy_s += seconds
            # The versions it was generated with, read once: the staleness check here, the log when it is trained.
            head.versions = self.stages.data_plane.get(batch.meta, list(_VERSION_FIELDS))
            # A partial rollout may have started the batch with weights sent after it was handed out: never older.
            generated = int(head.versions["policy_version"].min())
            assert generated >= head.version, (generated, head.version)
            head.version, head.batch = generated, batch
            batch.metrics["off_policy/rollout_cpu_s"] = cpu
            if version - head.version <= self.k:
                return head
            # Only `drop` hands out batches that can end up too old.
            assert self.strategy == "drop", (head.version, version, self.k)
            self._dropped += 1
            self._clear(batch.meta)
            self._dispatch(version, in_training=0)

    def _clear(self, meta: KVBatchMeta) -> None:
        if self.shared:
            self.stages.data_plane.kv_clear(meta.partition_id, meta.keys)
        else:
            self.stages.data_plane.kv_clear(meta.partition_id)

    # ------------------------------------------------------------------ what it reports
    def _sync_metrics(self) -> dict[str, float]:
        """The weight loads finished since the last step's: their mean seconds, and the latest one's delta-sync
        figures (`rollout/weight_sync/*`: what it sent, and whether it was whole)."""
        done = [f for f in self._syncs if f.done()]
        self._syncs = [f for f in self._syncs if not f.done()]
        results = [f.result() for f in done]
        seconds = [r["rollout/weight_sync_s"] for r in results if "rollout/weight_sync_s" in r]
        out = {"rollout/weight_sync_s": sum(seconds) / len(seconds)} if seconds else {}
        for r in results:  # in the order they were sent: the latest wins
            out.update({k: v for k, v in r.items() if k.startswith("rollout/weight_sync/")})
        return out

    def _idle_fractions(self, timings: dict[str, float]) -> dict[str, float]:
        """The trainer's and the rollout's idle fractions since the previous step's draw."""
        out: dict[str, float] = {}
        if self._clock is not None:
            wall = max(time.perf_counter() - self._clock, 1e-9)
            out["off_policy/trainer_idle_frac"] = min(1.0, timings.get("async/wait", 0.0) / wall)
            out["off_policy/rollout_idle_frac"] = max(0.0, 1.0 - (self._busy_s - self._busy_at_clock) / wall)
            # CPU seconds of the trainer's thread over the same span: on a busy machine, the wall time the
            # trainer's share of a step would take on an idle one.
            out["off_policy/trainer_cpu_s"] = time.thread_time() - self._cpu_clock
            # The whole process's: with the rollout elsewhere, what serving it costs here (data plane, weights).
            out["off_policy/trainer_process_cpu_s"] = time.process_time() - self._process_clock
        threads = helper_threads_cpu()
        if self._clock is not None:
            # ...and which of the process's helper threads spent it (the rest: Ray's and torch's own threads).
            out.update(
                {
                    f"off_policy/helper_cpu_s/{k}": max(0.0, v - self._helper_clock.get(k, 0.0))
                    for k, v in threads.items()
                }
            )
        self._helper_clock = threads
        self._clock = time.perf_counter()
        self._cpu_clock = time.thread_time()
        self._process_clock = time.process_time()
        self._busy_at_clock = self._busy_s
        return out

    def _log_versions(self, version: int, pending: _Pending) -> dict[str, float]:
        """One line per draw in async_versions.jsonl (the version trained, every sample's and token's generating
        versions); returns the token-level staleness metrics."""
        td = pending.versions
        assert td is not None, "a batch is logged once it is taken"
        mask = td["response_mask"].bool()
        tokens = td["token_policy_version"]
        # Per sample, the oldest and newest version among its response tokens (they differ when a partial
        # rollout continued it): versions only grow along a response, so the two bound every token's.
        oldest = tokens.masked_fill(~mask, version + 1).min(dim=-1).values
        newest = tokens.masked_fill(~mask, -1).max(dim=-1).values
        record = {
            "step": self.stages.global_step,
            "trained_at": version,
            "batch": pending.batch_id,
            "sample_versions": td["policy_version"].tolist(),
            "token_version_range": torch.stack([oldest, newest], dim=-1).tolist(),
            "dropped_batches": self._dropped,
        }
        with open(self.stages.run_dir / "async_versions.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        stale = (version - tokens)[mask].float()
        return {
            "off_policy/token_staleness_mean": float(stale.mean()) if stale.numel() else 0.0,
            "off_policy/partial_frac": float((newest > oldest).float().mean()),
        }


def _saved_column(value: Any) -> Any:
    """A column read from the data plane as a checkpoint holds it (tensors and plain values): a jagged tensor as its
    values and offsets, which `_loaded_column` joins again."""
    if isinstance(value, torch.Tensor) and value.is_nested:
        return {"jagged_values": value.values(), "jagged_offsets": value.offsets()}
    return value


def _loaded_column(value: Any) -> Any:
    """`_saved_column`'s inverse: what `kv_batch_put` takes to write the column back as it was."""
    if isinstance(value, dict) and set(value) == {"jagged_values", "jagged_offsets"}:
        return torch.nested.nested_tensor_from_jagged(value["jagged_values"], offsets=value["jagged_offsets"])
    return value


# conveyor's helper threads in the trainer's process, by what they do (name prefixes -> metric names).
_HELPERS = ((ROLLOUT_THREAD, "rollout"), (DATA_PLANE_THREADS, "data_plane"), (WEIGHT_THREADS, "weights"))


def helper_threads_cpu() -> dict[str, float]:
    """CPU seconds so far of this process's helper threads, summed by what they do (rollout, data_plane, weights).

    Read from /proc/self/task/<id>/schedstat (nanoseconds on CPU); empty where there is no such file (not Linux).
    A thread that has ended takes its seconds with it: the helpers live as long as the run.
    """
    out: dict[str, float] = {}
    for thread in threading.enumerate():
        group = next((g for prefix, g in _HELPERS if thread.name.startswith(prefix)), None)
        if group is None:
            continue
        try:
            with open(f"/proc/self/task/{thread.native_id}/schedstat") as f:
                ns = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue
        out[group] = out.get(group, 0.0) + ns / 1e9
    return out


def build_source(stages: Stages, *, greedy_baseline: bool = False) -> SampleSource:
    """The run's source: synchronous or asynchronous, its pipeline with ReMax's baseline (`greedy_baseline`), dynamic
    sampling around it."""
    cfg = stages.cfg
    pipeline: Pipeline = GenerateAndScore(stages)
    if greedy_baseline:
        pipeline = GreedyBaseline(pipeline, stages)
    pad = cfg.algorithm.filter_groups.enable
    source: SampleSource
    if cfg.trainer.v1.is_async:
        source = AsyncSource(stages, pipeline, pad=pad)
    else:
        source = SyncSource(stages, pipeline, pad=pad)
    if cfg.algorithm.filter_groups.enable:
        source = DynamicSampling(source, stages)
    return source
