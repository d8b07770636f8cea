"""The weight channel: a process group of its own from the actor's rank 0 to separate rollout engines.

Under `actor_rollout_ref.rollout.placement=separate` the engines live in
processes outside the actor's `torch.distributed` world, so the weights
cannot travel on its process group. `WeightChannel` is a second, standalone
group (its own TCP store; gloo on CPUs, nccl on GPUs): rank 0 is the actor's
rank 0, ranks 1..R are the rollout replicas. It is built once, on the first
sync, and carries every later one.

A sync streams the weights: the sender takes the actor's tensors one at a
time (`conveyor.weights.stream`: under FSDP2 every actor rank gathers
each tensor in turn, a collective), packs them into buckets of at most
`rollout.update_weights_bucket_megabytes`, and broadcasts each bucket as one
flat byte buffer after its table of names, dtypes and shapes; a receiver
rebuilds the bucket's tensors as views of that buffer and its engine loads
them, one lazy stream for the whole sync, before the next bucket arrives. No side ever holds more than one
bucket beyond the engine's own weights, and the delta sync's copies (`conveyor.weights.delta`): after the
first sync only the elements that changed travel; rank 0 encodes, each receiver decodes before its engine
loads, and at the end of a sync the receivers' checksum mismatches are summed over the group (an all-reduce)
so that rank 0 sends the next sync whole when any receiver's copy went wrong.

What it deliberately does not do: decide when to sync (the weight shipper
does, by version) or name tensors for an engine (the engine's loader does).
"""

from __future__ import annotations

import pickle
import socket
import time
from collections.abc import Iterable, Iterator
from datetime import timedelta

import torch
import torch.distributed as tdist

from conveyor.weights.buckets import Staging, SyncStats
from conveyor.weights.collective import Into, iter_received, send_buckets
from conveyor.weights.delta import DeltaDecoder, DeltaEncoder, DeltaSettings

__all__ = ["WeightChannel", "free_address", "send_over", "THREAD_PREFIX"]

# The names of the threads that send weights over a channel start with it (the asynchronous source's CPU
# metrics group them by it).
THREAD_PREFIX = "conveyor-weight"


def free_address() -> tuple[str, int]:
    """(this host's address as other nodes reach it, a free TCP port) for a channel's rendezvous."""
    try:
        import ray

        host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
    except Exception:  # no Ray: a single-host run
        host = "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return host, s.getsockname()[1]


class WeightChannel:
    """One member of a weight channel: rank 0 sends, every other rank receives."""

    def __init__(
        self, address: tuple[str, int], rank: int, size: int, *, device: torch.device, timeout_s: float = 600.0
    ) -> None:
        self.rank, self.size, self.device = rank, size, torch.device(device)
        timeout = timedelta(seconds=timeout_s)
        store = tdist.TCPStore(address[0], int(address[1]), size, is_master=rank == 0, timeout=timeout)
        if self.device.type == "cuda":
            self.group = tdist.ProcessGroupNCCL(store, rank, size, tdist.ProcessGroupNCCL.Options())
        else:
            self.group = tdist.ProcessGroupGloo(store, rank, size, timeout)
        self._store = store  # the group keeps using it
        self.last = SyncStats()  # what the latest sync received
        self.staging = Staging(self.device)  # one bucket's buffer, reused across buckets and syncs
        # Delta sync: rank 0's last shipped copy, each receiver's own copy (both at the engine's dtype); off until
        # `configure_delta` turns it on (a receiver follows whatever rank 0 sends).
        self.encoder = DeltaEncoder(DeltaSettings(enable=False)) if rank == 0 else None
        self.decoder = DeltaDecoder(self.device) if rank != 0 else None
        self.mismatches = 0  # receivers' checksum mismatches in the latest sync (every member learns the sum)

    def configure_delta(self, settings: DeltaSettings) -> None:
        """Rank 0: when syncs send only what changed (actor_rollout_ref.rollout.delta_sync); the next sync is whole."""
        if self.rank == 0:
            self.encoder = DeltaEncoder(settings)

    def broadcast_tensor(self, tensor: torch.Tensor, src: int) -> None:
        """`tensor` from channel rank `src` on every member."""
        opts = tdist.BroadcastOptions()
        opts.rootRank = src
        self.group.broadcast([tensor], opts).wait()

    def broadcast_object(self, obj: object, src: int) -> object:
        """A picklable `obj` from `src` on every member (a length, then the pickled bytes)."""
        mine = self.rank == src
        data = pickle.dumps(obj) if mine else b""
        size = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        self.broadcast_tensor(size, src)
        buf = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
            if mine
            else torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        )
        self.broadcast_tensor(buf, src)
        return obj if mine else pickle.loads(buf.cpu().numpy().tobytes())

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> SyncStats:
        """Rank 0: stream the tensors to every receiver, bucket by bucket (`collective.send_buckets`)."""
        assert self.rank == 0 and self.encoder is not None, "only the channel's rank 0 sends"
        stats = send_buckets(
            self.encoder.encode(named_tensors),
            bucket_bytes=bucket_bytes,
            group=self,
            src=0,
            device=self.device,
            staging=self.staging,
        )
        self.mismatches = self._sum_mismatches(0)
        self.encoder.report_mismatch(self.mismatches)
        return stats

    def received(self, into: Into | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """A receiver: one sync's tensors as they arrive (`collective.iter_received`, `into` where the engine says
        large tensors may land); `last` then holds its stats."""
        assert self.rank != 0 and self.decoder is not None, "rank 0 sends"
        self.last = SyncStats()
        yield from self.decoder.decode(
            iter_received(group=self, src=0, device=self.device, stats=self.last, staging=self.staging, into=into)
        )
        self.mismatches = self._sum_mismatches(self.decoder.mismatches)

    def _sum_mismatches(self, mine: int) -> int:
        """Every member's checksum mismatches of the sync just ended, summed over the channel (each member calls it)."""
        count = torch.tensor([mine], dtype=torch.int64, device=self.device)
        self.group.allreduce([count]).wait()
        return int(count.item())

    def close(self) -> None:
        """Leave the channel's group."""
        shutdown = getattr(self.group, "shutdown", None)
        if callable(shutdown):
            shutdown()


def send_over(
    channel: WeightChannel | None, named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> dict[str, float]:
    """One actor rank's part of a sync over the channel: rank 0 (`channel` given) sends; the others walk the same
    stream, whose gathers are collectives; the sync's sending metrics."""
    t0 = time.perf_counter()
    sent = count = 0
    delta: dict[str, float] = {}
    if channel is not None:
        stats = channel.send(named, bucket_bytes)
        sent, count = stats.bytes, stats.buckets
        assert channel.encoder is not None
        delta = channel.encoder.last.metrics()
        delta["rollout/weight_sync/checksum_mismatches"] = float(channel.mismatches)
    else:
        for _ in named:  # the gathers are collectives: every rank walks the same tensors
            pass
    return {
        "rollout/weight_send_s": time.perf_counter() - t0,
        "rollout/weight_send_gb": sent / 1e9,
        "rollout/weight_send_buckets": float(count),
        **delta,
    }
