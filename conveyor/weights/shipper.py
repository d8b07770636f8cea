"""The rollout group's weight shipping: which transport carries a sync, when it runs, and what the replicas load.

`WeightShipper` is what a rollout group delegates its weights to. It picks the transport from where the two
roles run:

- actor and replica in this process: the actor's stream straight into the engine (`sync`), or a copy left in
  a `WeightInbox` for the rollout's thread (`stage`);
- both on Ray: the weight channel from the actor's rank 0 (`channel`), streamed into the engines, or into a
  staged copy beside the generation in progress;
- the actor here on CPUs, replicas on Ray (rollout_process=own): a packed copy into a shared-memory slot
  (`shared`) when the replicas are on this machine and a slot is free, else into Ray's object store
  (`object_store`); an actor here on GPUs sends over the channel from a thread of its own.

Exchanges with replicas on Ray run one at a time on a sending thread, in order, and each returns what waits
for it on the rollout's thread and has the replicas load that version at the start of their next generation
call (`loading`), in order with the batches.

Delta sync (`conveyor.weights.delta`, `delta`): after a whole sync only what changed travels. In this process the
shipper encodes and decodes itself (the engine is handed whole tensors); into Ray's object store it encodes and the
replica's `StagedWeights` decodes; over the channel the actor's rank 0 encodes (`WeightChannel.configure_delta`).
Into a shared-memory slot the trainer encodes and every replica decodes the slot into its staged copy at once (a
whole sync there is read from the slot straight into the engine when the generation call that loads it comes).

The workers' methods reach it as an `Endpoints` table, so this package names no worker class and the workers
may import it; Ray's pending calls bring their own ways to wait (`together`, `beside`).

What it deliberately does not do: generate, decide when the trainer syncs (the sample source does), or load
tensors into an engine (the workers' endpoints do).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from conveyor.weights.buckets import ALIGN, Table, layout, pack
from conveyor.weights.channel import THREAD_PREFIX
from conveyor.weights.delta import DeltaDecoder, DeltaEncoder, DeltaSettings
from conveyor.weights.object_store import put_packed
from conveyor.weights.shared import SharedSlots
from conveyor.weights.staged import LOAD_SHARED, LOAD_STAGED, WeightInbox, staged_copy
from conveyor.weights.stream import cast_weights

__all__ = ["Endpoints", "WeightShipper"]

Metrics = dict[str, float]


@dataclasses.dataclass(frozen=True)
class Endpoints:
    """The worker methods a sync calls, by role (passed in by the group: this package imports no worker)."""

    version: Callable[..., Any]  # actor: the optimizer-step count of its weights
    address: Callable[..., Any]  # actor: rank 0's (host, port) for the channel's rendezvous
    join_sender: Callable[..., Any]  # actor: rank 0 joins the channel as its sender
    send: Callable[..., Any]  # actor: stream the weights over the channel
    join_receiver: Callable[..., Any]  # replica: join the channel as a receiver
    receive: Callable[..., Any]  # replica: take one sync from the channel (into the engine, or staged)
    take: Callable[..., Any]  # replica: stage a sync packed into Ray's object store
    between_tokens: Callable[..., Any]  # replica: load new weights between two tokens (partial rollouts)
    take_shared: Callable[..., Any] | None = None  # replica: stage a delta sync packed into a shared-memory slot
    load_staged: Callable[..., Any] | None = None  # replica: load a staged sync now (restoring a replaced replica)


class WeightShipper:
    """Moves the actor's weights into a rollout group's replicas: synchronous syncs, staged syncs and their loading."""

    def __init__(
        self,
        actor: Any,
        replicas: Any,
        endpoints: Endpoints,
        *,
        bucket_bytes: int,
        dtype: torch.dtype | None,
        actor_here: bool,
        replicas_here: bool,
        delta: DeltaSettings | None = None,
    ) -> None:
        self.actor, self.replicas, self.ends = actor, replicas, endpoints
        self.bucket_bytes = bucket_bytes
        # The dtype the replicas' engines hold, where known: weights are cast to it before they leave, so bf16
        # engines fed by fp32 masters get half the bytes (None: sent as held).
        self.dtype = dtype
        self.actor_here, self.replicas_here = actor_here, replicas_here
        self.served: int | None = None  # the version every replica serves (None: not synced yet)
        self._channel = False
        self._inbox = WeightInbox()
        self._sender: concurrent.futures.ThreadPoolExecutor | None = None
        self._load_next: int | None = None  # staged weights the next generation loads first (replicas on Ray)
        # Replicas on Ray on this machine, the actor here on CPUs: syncs packed into shared memory (`SharedSlots`);
        # the slot of `_load_next` when it is there, freed once the call that loads it returns.
        self._slots: SharedSlots | None = None
        self._load_slot: int | None = None
        self._between_tokens = False  # partial rollouts: weights must reach a replica mid-generation
        self._on_this_machine: bool | None = None
        # Replicas that may be replaced (`retain`): a packed copy of every sync from the one they serve on, so that a
        # new replica gets its predecessor's weights (`restore`); the version they loaded last (None: the model's).
        self.retain = False
        self._retained: dict[int, tuple[torch.Tensor, Table]] = {}
        self._replicas_loaded: int | None = None
        # Delta sync where this process encodes (None: every sync whole): the last shipped copy, and, for a replica in
        # this process, its own copy too.
        enabled = delta is not None and delta.enable
        self._encoder = DeltaEncoder(delta) if enabled else None
        self._decoder = DeltaDecoder() if enabled and self.in_process else None

    @property
    def delta_held_bytes(self) -> int:
        """Bytes this process keeps for delta syncs between syncs: the sender's copy, and a local replica's."""
        return sum(c.held_bytes for c in (self._encoder, self._decoder) if c is not None)

    @property
    def in_process(self) -> bool:
        """Whether the replicas and the actor run in this process (one local replica)."""
        return self.actor_here and self.replicas_here

    def sync(self) -> Metrics:
        """Give every replica the actor's current weights if they serve older ones; the sync's metrics."""
        version = self.actor.call_all(self.ends.version)[0]
        if self.served == version:
            return {}
        if self.in_process:
            # One process: the actor's stream goes straight into the engine, tensor by tensor.
            stream = cast_weights(self.actor.worker.weight_stream(), self.dtype)
            if self._encoder is not None and self._decoder is not None:
                stream = self._decoder.decode(self._encoder.encode(stream))
            metrics = {"rollout/weight_sync_s": self.replicas.worker.load_weights(stream, version)}
            if self._encoder is not None and self._decoder is not None:
                self._encoder.report_mismatch(self._decoder.mismatches)
                metrics.update(self._encoder.last.metrics())
                metrics["rollout/weight_sync/checksum_mismatches"] = float(self._decoder.mismatches)
        else:
            metrics = self._sync_over_channel(version)
        self.served = version
        return metrics

    def stage(self, label: int) -> Callable[[], Metrics]:
        """The actor's weights as they are now, labelled `label`; returns what gives them to the replicas (run it on
        the thread that generates, before the batches that are to use them)."""
        self.served = None  # labelled by the caller: a later `sync` compares optimizer steps again
        if self.actor_here and not self.in_process and self.actor.worker.device.type == "cpu":
            named = list(cast_weights(self.actor.worker.weight_stream(), self.dtype))
            if self.retain:
                self._retained[label] = pack(named)  # a copy: the actor's tensors change with its next update
            if not self._between_tokens and self._same_machine():
                # Replicas on this machine: one copy into a shared-memory slot, loaded by the next generation call
                # (no object store, no call of its own); when both slots still wait for their loads, as below.
                load = self._into_slot(label, named)
                if load is not None:
                    return load
            # One packed copy into Ray's object store, which replicas on this node read in place from shared memory
            # (no channel, no sending thread streaming buckets); the replicas stage it beside the generation, decoding
            # a delta into their copies (`StagedWeights`).
            if self._encoder is None:
                return self._put_weights(label, *pack(named))
            encoded = pack(self._encoder.encode(named))
            return self._put_weights(label, *encoded, delta=self._encoder.last.metrics())
        # A copy when the actor is here: it goes on training while the rollout finishes the batch it is generating.
        staged = (
            [(name, staged_copy(t, self.dtype)) for name, t in self.actor.worker.weight_stream()]
            if self.actor_here
            else None
        )
        if not self.in_process:
            # Replicas on Ray take the weights beside the generation in progress, into a staged copy; the exchange
            # starts now, and the rollout's thread waits for it and has them load it, in order with the batches.
            return self._exchange(label, staged)
        self._inbox.offer(label, staged)
        worker = self.replicas.worker

        def load() -> Metrics:
            taken = self._inbox.take()
            if taken is None:  # a partial rollout took these (or newer) between two tokens
                return {}
            version, tensors = taken
            return {"rollout/weight_sync_s": worker.load_weights(iter(tensors), version)}

        return load

    @contextlib.contextmanager
    def loading(self, meta: Any) -> Iterator[Any]:
        """`meta` with the staged weights the replicas load before they generate, if any (where they are rides on
        the call); once the call returns, their shared-memory slot is free again."""
        slot, loads = self._load_slot, self._load_next
        if self._load_next is not None:
            info: dict[str, Any] = {LOAD_STAGED: self._load_next}
            if slot is not None:  # ...from shared memory
                assert self._slots is not None
                info[LOAD_SHARED] = self._slots.handle(slot)
            meta = meta.with_extra_info(**info)
            self._load_next = self._load_slot = None
        try:
            yield meta
            if loads is not None:
                self._replicas_loaded = loads
                for version in [v for v in self._retained if v < loads]:  # never to be served again
                    del self._retained[version]
        finally:
            self._check_released()
            if slot is not None:
                assert self._slots is not None
                self._slots.release(slot)  # loaded by every replica (or never to be: the call failed)
        if slot is not None:
            self._slots.unlink()  # every replica has mapped the file: nothing to leave behind in /dev/shm

    @property
    def can_restore(self) -> bool:
        """Whether replaced replicas can be given their predecessors' weights: the actor here on CPUs packs every
        sync (`retain`), replicas on Ray, whole generations (not partial rollouts)."""
        return (
            self.actor_here
            and not self.replicas_here
            and self.actor.worker.device.type == "cpu"
            and not self._between_tokens
            and self.ends.load_staged is not None
        )

    def restore(self, meta: Any) -> Any:
        """After the replicas were replaced: load the weights their predecessors served and stage the ones `meta`'s
        call was to load (from this process's copies, through Ray's object store); the handle to issue again."""
        assert self.retain, "restore needs retain set before the first sync"
        if self._encoder is not None:
            self._encoder.forget()  # the new replicas hold no copies to apply a delta to: the next sync is whole
        if self._replicas_loaded is not None:
            self._hand_over(self._replicas_loaded)
            self.replicas.call_all(self.ends.load_staged, self._replicas_loaded)
        version = meta.extra_info.get(LOAD_STAGED)
        if version is None:
            return meta
        self._hand_over(int(version))  # staged: the call loads it first, as it would have from shared memory
        return dataclasses.replace(meta, extra_info={k: v for k, v in meta.extra_info.items() if k != LOAD_SHARED})

    def _hand_over(self, version: int) -> None:
        """Stage the retained copy of `version` in every replica."""
        buffer, table = self._retained[version]
        self.replicas.call_all(self.ends.take, version, put_packed(buffer), table)

    def take_between_tokens(self) -> None:
        """Partial rollouts: weights reach the replicas between two tokens of a generation: in this process from the
        inbox, on Ray from the staged copy a sync leaves beside the generation in progress."""
        self._between_tokens = True
        if self.in_process:
            self.replicas.worker.take_weights_between_tokens(self._inbox)
        else:
            self.replicas.call_all(self.ends.between_tokens)

    def close(self) -> None:
        """Stop the sending thread and remove the shared-memory file, if any."""
        if self._sender is not None:
            self._sender.shutdown(wait=False, cancel_futures=True)
            self._sender = None
        if self._slots is not None:
            self._slots.close()
            self._slots = None

    def _check_released(self) -> None:
        """Forget what the replicas serve when a generation ended with their weights released (a level-2 sleep), so
        that the next one syncs even if the actor has not moved on.

        vLLM's adapter never sleeps a separate replica (`conveyor.rollout.vllm.sleeps_between_rollouts`); an engine
        that does anyway says so by its `weights_version` (None), which a replica in this process shows here.
        """
        engine = getattr(self.replicas.worker, "engine", None) if self.replicas_here else None
        if engine is not None and engine.weights_version is None:
            self.served = None

    def _same_machine(self) -> bool:
        """Whether every replica runs on this process's machine (Ray node); asked once."""
        if self._on_this_machine is None:
            import ray

            here = ray.get_runtime_context().get_node_id()
            self._on_this_machine = all(w["node_id"] == here for w in self.replicas.rank_info())
        return self._on_this_machine

    def _into_slot(self, label: int, named: list[tuple[str, torch.Tensor]]) -> Callable[[], Metrics] | None:
        """Pack `named` into a free shared-memory slot; returns what has the replicas load it, or None when no slot is
        free (both hold syncs whose loading calls have not returned).

        A whole sync rides on the next generation call (`loading`). A delta sync must reach every replica's decoder,
        in order with any other: the replicas read it at once, beside the generation in progress, into their staged
        copies (`take_shared`), on the sending thread like an object-store sync, and the slot is free again after.
        """
        t0 = time.perf_counter()
        encoded = named if self._encoder is None else list(self._encoder.encode(named))
        table, nbytes = layout(encoded)
        if self._slots is None:
            # A delta's parts (indices or bitmap, values, checksum) are each aligned: room for that beyond a whole sync.
            margin = 0 if self._encoder is None else ALIGN * (3 * len(named) + 1)
            self._slots = SharedSlots(layout(named)[1] + margin)
        slot = self._slots.write(encoded, table, nbytes)
        if self._encoder is not None:
            delta = self._encoder.last.metrics()
            if slot is None:  # both slots in use, or larger than a slot: encoded already, through the object store
                return self._put_weights(label, *pack(encoded), delta=delta)
            return self._take_shared(label, slot, delta, time.perf_counter() - t0)
        if slot is None:
            return None
        sent = {
            "rollout/weight_sync_s": time.perf_counter() - t0,
            "rollout/weight_send_gb": nbytes / 1e9,
            "rollout/weight_send_buckets": 1.0,
        }

        def load() -> Metrics:
            self._load_first(label, slot)
            return sent

        return load

    def _take_shared(self, version: int, slot: int, delta: Metrics, packed_s: float) -> Callable[[], Metrics]:
        """Have every replica decode the delta sync in shared-memory slot `slot` into its staged copy (on the sending
        thread, in order with the other exchanges); the slot is free again once they have."""
        assert self._slots is not None
        handle = self._slots.handle(slot)

        def send() -> tuple[Metrics, list[Metrics]]:
            sent = {
                "rollout/weight_send_s": packed_s,
                "rollout/weight_send_gb": handle[3] / 1e9,
                "rollout/weight_send_buckets": 1.0,
            }
            try:
                return sent, self.replicas.submit_all(self.ends.take_shared, version, *handle).together()[0]
            finally:
                assert self._slots is not None
                self._slots.release(slot)
                self._slots.unlink()  # every replica has mapped the file: nothing to leave behind in /dev/shm

        return self._in_order(version, lambda: self._delivered(send, delta))

    def _load_first(self, version: int, slot: int | None) -> None:
        """On the rollout's thread, in order with the batches: the next generation call loads `version` first (from
        shared-memory slot `slot`, or the replicas' staged copy). A sync queued before it and not yet loaded never
        will be now (the replicas load the newest): its slot is free again."""
        if self._load_slot is not None:
            assert self._slots is not None
            self._slots.release(self._load_slot)
        self._load_next, self._load_slot = version, slot

    def _join_channel(self) -> None:
        """Build the weight channel from the actor's rank 0 to every replica (once)."""
        if self._channel:
            return
        size = 1 + self.replicas.world_size
        address = self.actor.call_all(self.ends.address)[0]
        joins = self.replicas.submit_all(self.ends.join_receiver, address, size)
        if self.actor_here:
            joins.beside(lambda: self.actor.worker.join_weight_channel(address, size), "actor", "join_weight_channel")
        else:
            joins.together(self.actor.submit_all(self.ends.join_sender, address, size))
        self._channel = True

    def _sync_over_channel(self, version: int) -> Metrics:
        """A synchronous run on Ray: the actor's rank 0 streams its current weights into every replica's engine.

        (An actor in this process with replicas on Ray is only asynchronous, rollout_process=own: `_exchange`.)
        """
        assert not self.actor_here and not self.replicas_here, (
            "a synchronous sync over the channel needs both roles on Ray"
        )
        self._join_channel()
        sends = self.actor.submit_all(self.ends.send, self.bucket_bytes, dtype=self.dtype)
        sent, received = sends.together(self.replicas.submit_all(self.ends.receive, version))
        return _sync_metrics(sent[0], received)

    def _exchange(self, version: int, staged: list[tuple[str, torch.Tensor]] | None) -> Callable[[], Metrics]:
        """Start sending the weights (`staged`, a copy taken here, or the Ray actor's current ones) into every
        replica's staging copy; returns what waits for it and gives its metrics."""
        self._join_channel()
        sends = None
        if staged is None:  # submitted from the trainer's thread: the actor sends before the update submitted next
            sends = self.actor.submit_all(self.ends.send, self.bucket_bytes, dtype=self.dtype)
        worker = self.actor.worker if staged is not None else None

        def run() -> Metrics:
            # One exchange at a time, in order (this thread runs them): a replica runs two calls at once, and two
            # receives side by side would share the channel.
            receives = self.replicas.submit_all(self.ends.receive, version, stage=True)
            if sends is not None:
                sent, received = sends.together(receives)
                return _sync_metrics(sent[0], received)
            mine, received = receives.beside(
                lambda: worker.send_weights(self.bucket_bytes, staged, dtype=self.dtype), "actor", "send_weights"
            )
            return _sync_metrics(mine, received)

        return self._in_order(version, run)

    def _put_weights(
        self, version: int, buffer: torch.Tensor, table: Table, delta: Metrics | None = None
    ) -> Callable[[], Metrics]:
        """Start handing the packed weights (`delta`: the metrics of the delta they encode) to every replica through
        Ray's object store, into its staging copy; returns what waits for it and gives its metrics."""

        def send() -> tuple[Metrics, list[Metrics]]:
            t0 = time.perf_counter()
            refs = put_packed(buffer)
            sent = {
                "rollout/weight_send_s": time.perf_counter() - t0,
                "rollout/weight_send_gb": buffer.numel() / 1e9,
                "rollout/weight_send_buckets": 1.0,
            }
            return sent, self.replicas.submit_all(self.ends.take, version, refs, table).together()[0]

        return self._in_order(version, lambda: self._delivered(send, delta))

    def _delivered(self, send: Callable[[], tuple[Metrics, list[Metrics]]], delta: Metrics | None) -> Metrics:
        """Run one packed sync's `send` (the sender's metrics, each replica's); the sync's metrics, and a replica's
        checksum mismatch reported to the encoder (its next sync is then whole)."""
        sent, received = send()
        metrics = _sync_metrics(sent, received)
        if delta is not None and self._encoder is not None:
            metrics.update(delta)
            self._encoder.report_mismatch(int(metrics.get("rollout/weight_sync/checksum_mismatches", 0)))
        return metrics

    def _in_order(self, version: int, run: Callable[[], Metrics]) -> Callable[[], Metrics]:
        """Run one exchange (`run`) on the sending thread, after the ones started before; returns what waits for it
        on the rollout's thread and has the replicas load `version` before they next generate."""
        if self._sender is None:
            self._sender = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=f"{THREAD_PREFIX}-send"
            )
        done = self._sender.submit(run)

        def load() -> Metrics:
            # On the rollout's thread, in order with the batches: these weights, not a later sync's that may already
            # have arrived beside the generation. The replicas load them at the start of the next generation call
            # (no round trip of its own).
            metrics = done.result()
            self._load_first(version, None)
            return metrics

        return load


def _sync_metrics(sent: Metrics, received: list[Metrics]) -> Metrics:
    """One sync's metrics: the sender's, and the slowest replica's."""
    metrics = dict(sent)
    metrics.update({k: max(r[k] for r in received) for k in received[0]})
    return metrics
