"""Asynchronous training with bounded staleness: rollout in its own process, samples streamed through the data plane.

`trainer.v1.trainer_mode=separate_async` runs the same stages as the
synchronous trainer (`PPOTrainer.step`), except where a step's samples come
from: a rollout process (`RolloutProcess`) holds its own copy of the policy
and generates batch after batch while the trainer updates. The trainer writes
each batch's prompts into the data plane when it hands the batch to the
rollout, and the rollout's fields (responses, masks, log-probs, routed
experts) into the same partition as they arrive, together with
`policy_version`: the number of updates the generating weights had seen.

The staleness bound (`trainer.v1.sampler.max_off_policy_threshold` = k) is
kept by the trainer alone, which is the only scheduler: the rollout process
applies weights and generates batches in the order it is sent them, so the
version of a batch is known when it is handed out. A batch handed out while
`o` batches are outstanding will be trained at version `v + o` (v = updates
so far); under `wait` it is handed out only once the weights last sent are
at least `v + o - k`, under `drop` at once, and a batch that would be trained
more than k versions after its weights is discarded when it arrives. At most
k + 1 batches are outstanding. Weights go out every
`trainer.v1.separate_async.parameter_sync_step` updates (validated <= k + 1,
so `wait` always makes progress). k = 0 hands out batch s only after update
s - 1 has reached the rollout: the synchronous trainer, bit for bit.

With `trainer.v1.separate_async.partial_rollout` the rollout process also
takes weights between two tokens of a generation (`_Inbox`): unfinished
samples continue with them, and every token records its version
(`token_policy_version`); a sample's `policy_version` stays its oldest
token's, so the bound above still holds.

See docs/async.md for the timeline and the measured speed. What it does not
do: the vllm rollout, multi-turn or dynamic sampling (the config rejects
those combinations). With Ray worker groups the ranks train on Ray and the
rollout process (on this machine) gets rank 0's full weights.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import multiprocessing
import os
import queue
import signal
import time
import traceback
from typing import Any

import torch

from conveyor.config import Config
from conveyor.protocol import KVBatchMeta
from conveyor.trainer.plan import RunPlan
from conveyor.trainer.ppo import PPOTrainer, StageResult, _timer, _timing_metrics
from conveyor.trainer.setup import resolve_device
from conveyor.trainer.signals import die_with_parent
from conveyor.workers.balance import sequence_lengths, with_seq_lens
from conveyor.workers.calls import GenerateCall
from conveyor.workers.group import WorkerError, WorkerUserError

logger = logging.getLogger(__name__)

__all__ = ["AsyncPPOTrainer", "RolloutProcess"]

# The rollout's and the reward's fields that come back from its process into the trainer's data plane.
_ROLLOUT_FIELDS = ("responses", "response_mask", "rollout_log_probs", "routed_experts", "rm_scores", "acc")


# --------------------------------------------------------------------------- the rollout process
def _rollout_main(cfg: Config, plan: RunPlan, model_path: str, device: str, num_threads: int, requests: Any,
                  results: Any, parent_pid: int) -> None:
    """The rollout process: apply weights and generate and score batches, in the order they are sent, until told to stop.

    It runs the actor worker's own `generate_sequences` and the reward worker's `compute_reward`
    over a data plane of its own, so the samples and scores are the ones the synchronous
    trainer's workers would produce from the same weights and seed.
    """
    # A trainer killed outright (SIGKILL) sends no "stop", and with many batches queued this process
    # would not look for one for a long time: it ends with the trainer instead.
    die_with_parent(parent_pid)
    # Ctrl-C and SIGTERM reach the whole process group: the trainer decides how to stop (finish the
    # step, save) and then stops this process (SIGKILL, which nothing ignores, if it does not stop on request).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    stage = "start-up"
    try:
        torch.set_num_threads(num_threads)
        import transformers

        # As in the trainer: no loading bars, and so no tqdm lock, a named semaphore that a killed
        # process would leave to the resource tracker's warning at exit.
        transformers.utils.logging.disable_progress_bar()
        from conveyor.data_plane import make_data_plane
        from conveyor.plugins import load_plugins
        from conveyor.workers.actor import PolicyWorker
        from conveyor.workers.settings import actor_settings

        load_plugins(list(cfg.trainer.plugins))
        local = make_data_plane("memory")
        from conveyor.workers.roles import worker_specs

        worker = PolicyWorker(actor_settings(cfg, plan), model_path=model_path, data_plane=local, device=device)
        reward = worker_specs(cfg, plan, model_path, local, worker.tokenizer, device)["reward"].build(rank=0,
                                                                                                    world_size=1)
        inbox = _Inbox(requests, worker.model)
        if cfg.trainer.v1.separate_async.partial_rollout:
            worker.interrupt = inbox.apply_newer_weights
        results.put(("ready", None))
        while True:
            stage = "waiting for requests"
            try:
                msg = inbox.next(timeout=1.0)
            except queue.Empty:
                continue
            kind = msg[0]
            if kind == "stop":
                break
            if kind == "weights":
                stage = "loading weights"
                inbox.load(msg)
                continue
            _, batch_id, wired, params = msg
            fields = from_wire(wired)
            t0, c0 = time.perf_counter(), time.process_time()
            part = f"rollout-{batch_id}"
            keys = [str(i) for i in range(len(fields["prompts"]))]
            meta = local.kv_batch_put(keys=keys, partition_id=part, fields=fields)
            start_version, inbox.switches = inbox.version, []
            stage = "generate_sequences"
            out = worker.generate_sequences(meta.with_extra_info(**params))
            stage = "compute_reward"
            scored = reward.compute_reward(out)
            names = [f for f in _ROLLOUT_FIELDS if f in scored.fields]
            td = local.kv_batch_get(keys=keys, partition_id=part, select_fields=names)
            local.kv_clear(part)
            got = {name: td[name] for name in names}
            # Every response token's generating version: the batch's starting one, then each mid-generation switch.
            token_versions = torch.full(got["responses"].shape, start_version, dtype=torch.long)
            for sampled, version in inbox.switches:
                token_versions[:, sampled:] = version
            got["token_policy_version"] = token_versions
            metrics = {k: [v] for info in (out.extra_info, scored.extra_info) for k, v in info.items()
                       if isinstance(v, (int, float)) and not k.startswith("perf/")}
            metrics["off_policy/rollout_cpu_s"] = [time.process_time() - c0]
            metrics["off_policy/weight_switches"] = [float(len(inbox.switches))]
            results.put(("batch", (batch_id, start_version, to_wire(got), metrics, time.perf_counter() - t0)))
    except BaseException as err:  # noqa: BLE001 - every failure, reported once to the trainer
        # A ValueError is the user's to fix (config, data, reward function), as in the synchronous workers.
        results.put(("error", (stage, type(err).__name__, str(err), traceback.format_exc(),
                               isinstance(err, ValueError))))


class _Inbox:
    """The rollout process's requests, in order, except that weights may be taken early (partial rollouts).

    Between two tokens of a generation, `apply_newer_weights` loads the newest weights waiting in the
    queue, even past batches queued before them: weights only get newer, so a batch that starts with
    them is fresher than the trainer scheduled, never staler.
    """

    def __init__(self, requests: Any, model: torch.nn.Module):
        self.requests, self.model = requests, model
        self.backlog: collections.deque = collections.deque()
        self.version = -1  # of the weights in the model
        self.switches: list[tuple[int, int]] = []  # (tokens sampled before, new version) within this generation

    def next(self, timeout: float) -> tuple:
        """The oldest request not yet handled (queue.Empty after `timeout` seconds without one)."""
        if self.backlog:
            return self.backlog.popleft()
        return self.requests.get(timeout=timeout)

    def load(self, msg: tuple) -> None:
        """Put a ("weights", version, tensors) message's weights into the model."""
        _, self.version, packed = msg
        state = from_wire(packed)
        from conveyor.models.lora import is_adapter_key

        # LoRA sends the adapters alone (the base weights never change): the rest of the model stays as loaded.
        adapters = bool(state) and all(is_adapter_key(k) for k in state)
        result = self.model.load_state_dict(state, strict=not adapters)
        if adapters and result.unexpected_keys:
            raise ValueError(f"the rollout process's model has no adapter tensors {result.unexpected_keys[:3]}")

    def apply_newer_weights(self, sampled: int) -> bool:
        """Load the newest weights waiting, if any (True: the generation continues with them)."""
        while True:
            try:
                self.backlog.append(self.requests.get_nowait())
            except queue.Empty:
                break
        newest = None
        for msg in self.backlog:
            if msg[0] == "weights":
                newest = msg
        if newest is None:
            return False
        self.backlog = collections.deque(m for m in self.backlog if m[0] != "weights")
        self.load(newest)
        self.switches.append((sampled, self.version))
        return True


class _Wire:
    """A tensor as plain bytes, pickled inline with its message.

    torch registers pickling that moves every tensor into a shared-memory segment of its own and
    passes a file descriptor for it; for the many small tensors of a tiny model's batch or state
    dict that costs more than copying their bytes.
    """

    __slots__ = ("dtype", "shape", "data")

    def __init__(self, t: torch.Tensor):
        t = t.detach().contiguous().cpu()
        self.dtype, self.shape = t.dtype, tuple(t.shape)
        self.data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""

    def tensor(self) -> torch.Tensor:
        if not self.data:
            return torch.empty(self.shape, dtype=self.dtype)
        return torch.frombuffer(bytearray(self.data), dtype=torch.uint8).view(self.dtype).reshape(self.shape)


def to_wire(fields: dict[str, Any]) -> dict[str, Any]:
    """Tensors of `fields` as `_Wire`s (other values as they are)."""
    return {k: _Wire(v) if isinstance(v, torch.Tensor) else v for k, v in fields.items()}


def from_wire(fields: dict[str, Any]) -> dict[str, Any]:
    """`to_wire`'s inverse: the same tensors, bit for bit."""
    return {k: v.tensor() if isinstance(v, _Wire) else v for k, v in fields.items()}


@dataclasses.dataclass
class _Pending:
    """A batch handed to the rollout and not yet trained or dropped."""

    batch_id: int
    meta: KVBatchMeta  # its prompts, in the trainer's data plane
    version: int  # the weights it is generated with
    data_state: dict[str, int]  # the prompt order before this batch was drawn (what a checkpoint keeps)
    arrived: bool = False
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)


class RolloutProcess:
    """The trainer's end of the rollout process: send weights and batches, receive finished batches, in order."""

    def __init__(self, cfg: Config, plan: RunPlan, model_path: str, device: str = "cpu", num_threads: int = 1):
        ctx = multiprocessing.get_context("spawn")
        self._requests = ctx.Queue()
        self._results = ctx.Queue()
        self._proc = ctx.Process(target=_rollout_main, args=(cfg, plan, model_path, device, num_threads,
                                                             self._requests, self._results, os.getpid()),
                                 daemon=True, name="conveyor-rollout")
        self._proc.start()
        self.busy_s = 0.0  # generation time reported so far
        try:
            kind, payload = self._receive(timeout=None)
        except BaseException:
            # Ctrl-C or a failure while it starts: nobody else would stop it, and at exit Python would
            # wait for it for ever (it ignores the SIGTERM that multiprocessing sends a daemon child).
            self.close(at_once=True)
            raise
        if kind != "ready":  # pragma: no cover - _receive raises on errors
            raise RuntimeError(f"rollout process answered {kind!r} before starting")

    def send_weights(self, version: int, state: dict[str, torch.Tensor]) -> None:
        """The rollout generates every later batch with these weights (copied, so training cannot change them)."""
        self._requests.put(("weights", version, to_wire(state)))

    def submit(self, batch_id: int, fields: dict[str, Any], params: dict[str, Any]) -> None:
        """Generate and score one batch (`prompts`, `prompt_mask`, `data_source`, `ground_truth`) with `params`."""
        self._requests.put(("generate", batch_id, to_wire(fields), params))

    def receive(self, timeout: float | None) -> tuple[int, int, dict[str, torch.Tensor], dict, float] | None:
        """The next finished batch (batch_id, version, fields, metrics, seconds), or None after `timeout` seconds."""
        got = self._receive(timeout)
        if got is None:
            return None
        batch_id, version, fields, metrics, seconds = got[1]
        self.busy_s += seconds
        return batch_id, version, from_wire(fields), metrics, seconds

    def _receive(self, timeout: float | None) -> tuple[str, Any] | None:
        deadline = None if timeout is None else time.perf_counter() + timeout
        while True:
            wait = 1.0 if deadline is None else max(0.0, min(1.0, deadline - time.perf_counter()))
            try:
                kind, payload = self._results.get(timeout=wait)
            except queue.Empty:
                if not self._proc.is_alive():
                    raise self._died()
                if deadline is not None and time.perf_counter() >= deadline:
                    return None
                continue
            if kind == "error":
                stage, name, message, trace, user_error = payload
                if user_error:  # the user's to fix: one line, as the synchronous workers report it
                    err = WorkerUserError("rollout", 0, stage, ValueError(message))
                    err.args = (f"rollout rank 0 failed in {stage}: {name}: {message}",)  # the error's own type
                    raise err
                raise WorkerError("rollout", 0, stage,
                                  RuntimeError(f"{name}: {message}\n(in the rollout process)\n{trace}"))
            return kind, payload

    def _died(self) -> WorkerUserError:
        """The error for a rollout process that ended without a word (killed from outside, or crashed hard)."""
        code = self._proc.exitcode
        how = f"exited ({code})"
        if code is not None and code < 0:
            how = f"was killed by {signal.Signals(-code).name if -code in signal.valid_signals() else -code}"
        # Nothing the trainer can do about it, and no bug of the run's to show: one line, with what to do.
        return WorkerUserError("rollout", 0, "generate_sequences", RuntimeError(
            f"the rollout process (pid {self._proc.pid}) {how} without reporting an error, e.g. stopped from outside "
            "or by the out-of-memory killer; rerun the same command to resume from the newest checkpoint"))

    def close(self, at_once: bool = False) -> None:
        """Stop the process: on request, or with SIGKILL if it does not stop within 10 s or `at_once`."""
        try:
            if self._proc.is_alive() and not at_once:
                try:
                    self._requests.put(("stop",))
                    self._proc.join(timeout=10)
                except Exception:  # noqa: BLE001 - closing must not hide the error that brought us here
                    pass
        finally:  # also when a second Ctrl-C lands in the wait: the process must not outlive the run
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(timeout=10)
            for q in (self._requests, self._results):
                q.cancel_join_thread()
                q.close()


# --------------------------------------------------------------------------- the trainer
class AsyncPPOTrainer(PPOTrainer):
    """The synchronous trainer's stages, fed by a rollout process that runs up to k policy versions ahead."""

    def __init__(self, cfg: Config, *, model_path: str, **kwargs: Any):
        super().__init__(cfg, **kwargs)
        v1 = cfg.trainer.v1
        self.k = v1.sampler.max_off_policy_threshold
        self.strategy = v1.sampler.max_off_policy_strategy
        self.sync_every = v1.separate_async.parameter_sync_step
        self.model_path = model_path
        self.rollout: RolloutProcess | None = None
        self._pending: list[_Pending] = []
        self._next_batch = 0
        self._sent_version: int | None = None
        self._dropped = 0
        self._batch_part: str | None = None
        self._clock: float | None = None
        self._cpu_clock = 0.0
        self._rollout_busy_at_clock = 0.0

    # ------------------------------------------------------------------ lifecycle
    def fit(self) -> dict[str, float]:
        """Start the rollout process, train as the synchronous trainer does, and stop the process whatever happens."""
        total = torch.get_num_threads()
        # k = 0 alternates rollout and update: each gets all the threads (and the synchronous numerics).
        # Otherwise both run at once and share the cores.
        rollout_threads = total if self.k == 0 else max(1, total // 2)
        if self.k > 0 and total > 1:
            torch.set_num_threads(max(1, total - rollout_threads))
        self.rollout = RolloutProcess(self.cfg, self.plan, self.model_path, self.plan.device, rollout_threads)
        failed = True
        try:
            result = super().fit()
            failed = False
            return result
        finally:
            # A stop or a failure ends the process at once: what it is generating will never be trained.
            self.rollout.close(at_once=failed)
            self.rollout = None
            torch.set_num_threads(total)
            for p in self._pending:
                self.data_plane.kv_clear(p.meta.partition_id)

    def step(self) -> dict[str, float]:
        """One step of the synchronous trainer on the next batch the rollout finished within the bound."""
        try:
            return super().step()
        finally:
            if self._batch_part is not None:
                self.data_plane.kv_clear(self._batch_part)
                self._batch_part = None

    def save_checkpoint(self):
        """The synchronous checkpoint, with the prompt order of the oldest batch not yet trained.

        Batches in flight are not saved: a resumed run draws their prompts again and regenerates
        them (with the resumed weights), so every prompt of the data order is trained once.
        """
        live = self.train_data.state_dict()
        if self._pending:
            self.train_data.load_state_dict(self._pending[0].data_state)
        try:
            return super().save_checkpoint()
        finally:
            self.train_data.load_state_dict(live)

    # ------------------------------------------------------------------ the sampling stage
    def _sample(self, meta: KVBatchMeta) -> StageResult:
        """Stages 1-3: the next batch the rollout generated within the staleness bound, with its rewards."""
        timings: dict[str, float] = {}
        metrics: dict[str, float] = {}
        version = self.global_step - 1  # updates so far: the version this step trains
        if self._next_batch == 0:  # first step of this run (or of a resumed one)
            self._next_batch = self.global_step
        with _timer("async/dispatch", timings):
            self._dispatch(version, in_training=0)
        dropped_before = self._dropped
        with _timer("async/wait", timings):
            pending = self._take(version)
        self._batch_part = pending.meta.partition_id
        meta = pending.meta.with_fields(list(pending.meta.fields) + ["policy_version"])
        # Hand out the next batches before this step's update: the rollout generates them meanwhile.
        with _timer("async/dispatch", timings):
            self._dispatch(version, in_training=1)
        # Scored in the rollout process (rm_scores, acc): the reward stage's metrics came with the batch.
        metrics.update({k: float(v) for k, v in pending.metrics.items()})
        staleness = version - pending.version
        dropped = (self._dropped - dropped_before) * len(meta)
        metrics["off_policy/staleness_mean"] = float(staleness)
        metrics["off_policy/staleness_max"] = float(staleness)
        metrics["off_policy/dropped_frac"] = dropped / (dropped + len(meta))
        metrics["off_policy/policy_version"] = float(pending.version)
        metrics.update(self._idle_fractions(timings))
        metrics.update(self._log_versions(meta, version, pending))
        metrics.update(_timing_metrics(timings))
        return meta, metrics

    def _idle_fractions(self, timings: dict[str, float]) -> dict[str, float]:
        """The trainer's and the rollout's idle fractions since the previous step's sampling stage."""
        out: dict[str, float] = {}
        if self._clock is not None:
            wall = max(time.perf_counter() - self._clock, 1e-9)
            out["off_policy/trainer_idle_frac"] = min(1.0, timings.get("async/wait", 0.0) / wall)
            busy = self.rollout.busy_s - self._rollout_busy_at_clock
            out["off_policy/rollout_idle_frac"] = max(0.0, 1.0 - busy / wall)
            # CPU seconds of this process over the same span: on a busy machine, the wall time the
            # trainer's share of a step would take on an idle one.
            out["off_policy/trainer_cpu_s"] = time.process_time() - self._cpu_clock
        self._clock = time.perf_counter()
        self._cpu_clock = time.process_time()
        self._rollout_busy_at_clock = self.rollout.busy_s
        return out

    def _dispatch(self, version: int, in_training: int) -> None:
        """Send weights when due, then hand out batches while the bound and the buffer (k + 1 batches) allow.

        `in_training`: 1 once this step has taken its batch (it is trained at `version`, the next at
        `version + 1`), else 0.
        """
        if self._sent_version is None or version - self._sent_version >= self.sync_every:
            state = self.workers.actor.model_state_dict()
            self.rollout.send_weights(version, state)
            self._sent_version = version
        while len(self._pending) + in_training < self.k + 1:
            # Trained, if nothing is dropped, at version + (batches ahead of it).
            trained_at = version + in_training + len(self._pending)
            # A batch no step of this run would train is never handed out: a bound far beyond the run's
            # length would otherwise draw batches without end before the first step.
            if trained_at >= self.cfg.trainer.total_training_steps:
                break
            if self.strategy == "wait" and self._sent_version < trained_at - self.k:
                break
            self._submit()

    def _submit(self) -> None:
        batch_id = self._next_batch
        self._next_batch += 1
        data_state = self.train_data.state_dict()
        records = self.train_data.next_batch(self.cfg.data.train_batch_size)
        n = self.cfg.actor_rollout_ref.rollout.n
        meta = self._put_prompts(records, f"batch-{batch_id}", n=n)
        names = ["prompts", "prompt_mask", "data_source", "ground_truth"]  # what generation and scoring read
        td = self.data_plane.get(meta, names)
        params = self._generation_params(self._seed_at("gen", batch_id))
        fields = {name: td[name] if isinstance(td[name], torch.Tensor) else list(td[name]) for name in names}
        self.rollout.submit(batch_id, fields, params)
        self._pending.append(_Pending(batch_id, meta, self._sent_version, data_state))

    def _take(self, version: int) -> _Pending:
        """Wait for the oldest outstanding batch; drop it (and hand out another) when it is too old to train now."""
        while True:
            if not self._pending:
                self._dispatch(version, in_training=0)
            head = self._pending[0]
            while not head.arrived:
                self._receive()
            self._pending.pop(0)
            if version - head.version <= self.k:
                return head
            # Only `drop` hands out batches that can end up too old.
            assert self.strategy == "drop", (head.version, version, self.k)
            self._dropped += 1
            self.data_plane.kv_clear(head.meta.partition_id)
            self._dispatch(version, in_training=0)

    def _receive(self) -> None:
        """Write the next finished batch into the data plane (blocking until one arrives)."""
        batch_id, gen_version, fields, extra, _ = self.rollout.receive(timeout=None)
        pending = next(p for p in self._pending if p.batch_id == batch_id)
        # A partial rollout may have started the batch with weights sent after it was handed out: never older.
        assert gen_version >= pending.version, (gen_version, pending.version)
        pending.version = gen_version
        fields = dict(fields)
        # A sample's version is that of its oldest token: the batch's starting weights.
        fields["policy_version"] = torch.full((len(pending.meta),), gen_version, dtype=torch.long)
        self.data_plane.put(pending.meta, fields)
        pending.meta = pending.meta.with_fields(list(fields))
        # As the generation endpoint does: later splits over ranks balance prompt + response tokens.
        prompt_mask = self.data_plane.get(pending.meta, ["prompt_mask"])["prompt_mask"]
        pending.meta = with_seq_lens(pending.meta, sequence_lengths(prompt_mask, fields["response_mask"]))
        from conveyor.metrics.reduce import reduce_rank_metrics

        metrics = reduce_rank_metrics(extra, prefix="")
        pending.metrics = {k: v for k, v in metrics.items() if k.startswith(("rollout/", "reward/", "off_policy/"))}
        pending.arrived = True

    def _generation_params(self, seed: int) -> dict[str, Any]:
        """The synchronous rollout's parameters for a training batch (`PPOTrainer._generate`'s, not greedy)."""
        r = self.cfg.actor_rollout_ref.rollout
        return GenerateCall(
            max_new_tokens=self.cfg.data.max_response_length, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
            do_sample=r.do_sample, seed=seed, capture_routing=self.plan.rollout_captures_routing,
            pad_to_max_new_tokens=False,
        ).to_extra_info()

    def _seed_at(self, salt: str, step: int) -> int:
        """`_seed(salt)` as it is at training step `step`: batch b samples with step b's seed."""
        saved, self.global_step = self.global_step, step
        try:
            return self._seed(salt)
        finally:
            self.global_step = saved

    def _log_versions(self, meta: KVBatchMeta, version: int, pending: _Pending) -> dict[str, float]:
        """One line per step in async_versions.jsonl (the version trained, every sample's and token's generating
        versions); returns the token-level staleness metrics."""
        td = self.data_plane.get(meta, ["policy_version", "token_policy_version", "response_mask"])
        mask = td["response_mask"].bool()
        tokens = td["token_policy_version"]
        # Per sample, the oldest and newest version among its response tokens (they differ when a partial
        # rollout continued it): versions only grow along a response, so the two bound every token's.
        oldest = tokens.masked_fill(~mask, version + 1).min(dim=-1).values
        newest = tokens.masked_fill(~mask, -1).max(dim=-1).values
        record = {"step": self.global_step, "trained_at": version, "batch": pending.batch_id,
                  "sample_versions": td["policy_version"].tolist(),
                  "token_version_range": torch.stack([oldest, newest], dim=-1).tolist(),
                  "dropped_batches": self._dropped}
        with open(self.run_dir / "async_versions.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        stale = (version - tokens)[mask].float()
        return {"off_policy/token_staleness_mean": float(stale.mean()) if stale.numel() else 0.0,
                "off_policy/partial_frac": float((newest > oldest).float().mean())}
