"""The weight channel: a process group of its own from the actor's rank 0 to separate rollout engines.

Under `actor_rollout_ref.rollout.placement=separate` the engines live in
processes outside the actor's `torch.distributed` world, so the weights
cannot travel on its process group. `WeightChannel` is a second, standalone
group (its own TCP store; gloo on CPUs, nccl on GPUs): rank 0 is the actor's
rank 0, ranks 1..R are the rollout replicas. It is built once, on the first
sync, and carries every later one.

A sync streams the weights: the sender takes the actor's tensors one at a
time (`conveyor.rollout.weight_sync`: under FSDP2 every actor rank gathers
each tensor in turn, a collective), packs them into buckets of at most
`rollout.update_weights_bucket_megabytes`, and broadcasts each bucket as one
flat byte buffer after its table of names, dtypes and shapes; a receiver
rebuilds the bucket's tensors as views of that buffer and its engine loads
them, one lazy stream for the whole sync, before the next bucket arrives. No side ever holds more than one
bucket beyond the engine's own weights.

What it deliberately does not do: decide when to sync (the rollout group
does, by version) or name tensors for an engine (the engine's loader does).
"""

from __future__ import annotations

import pickle
import socket
from collections.abc import Iterable, Iterator
from datetime import timedelta

import torch
import torch.distributed as tdist

from conveyor.rollout.weight_sync import buckets

__all__ = ["WeightChannel", "free_address"]


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

    def __init__(self, address: tuple[str, int], rank: int, size: int, *, device: torch.device,
                 timeout_s: float = 600.0) -> None:
        self.rank, self.size, self.device = rank, size, torch.device(device)
        timeout = timedelta(seconds=timeout_s)
        store = tdist.TCPStore(address[0], int(address[1]), size, is_master=rank == 0, timeout=timeout)
        if self.device.type == "cuda":
            self.group = tdist.ProcessGroupNCCL(store, rank, size, tdist.ProcessGroupNCCL.Options())
        else:
            self.group = tdist.ProcessGroupGloo(store, rank, size, timeout)
        self._store = store  # the group keeps using it
        self.last = (0, 0)  # (bytes, buckets) of the latest sync

    def _broadcast(self, tensor: torch.Tensor) -> None:
        opts = tdist.BroadcastOptions()
        opts.rootRank = 0
        self.group.broadcast([tensor], opts).wait()

    def _broadcast_object(self, obj: object = None) -> object:
        """`obj` from rank 0 on every rank (a pickled header: a length, then the bytes)."""
        data = pickle.dumps(obj) if self.rank == 0 else b""
        size = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        self._broadcast(size)
        buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device) if self.rank == 0
               else torch.empty(int(size.item()), dtype=torch.uint8, device=self.device))
        self._broadcast(buf)
        return obj if self.rank == 0 else pickle.loads(buf.cpu().numpy().tobytes())

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> tuple[int, int]:
        """Rank 0: stream the tensors to every receiver, bucket by bucket; (bytes, buckets) sent."""
        assert self.rank == 0, "only the channel's rank 0 sends"
        sent = count = 0
        for bucket in buckets(named_tensors, bucket_bytes):
            table = [(name, t.dtype, tuple(t.shape)) for name, t in bucket]
            self._broadcast_object(table)
            flat = torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8).to(self.device)
                              for _, t in bucket])
            self._broadcast(flat)
            sent += flat.numel()
            count += 1
        self._broadcast_object(None)  # the end of this sync
        return sent, count

    def received(self) -> Iterator[tuple[str, torch.Tensor]]:
        """A receiver: one sync's tensors as they arrive, each a view of its bucket's buffer, valid until the next
        bucket (an engine's loader copies each into its weights as it goes). `last` holds (bytes, buckets)."""
        assert self.rank != 0, "rank 0 sends"
        got = count = 0
        while True:
            table = self._broadcast_object()
            if table is None:
                self.last = (got, count)
                return
            sizes = [torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
                     for _, dtype, shape in table]
            flat = torch.empty(sum(sizes), dtype=torch.uint8, device=self.device)
            self._broadcast(flat)
            offset = 0
            for (name, dtype, shape), n in zip(table, sizes):
                yield name, flat[offset:offset + n].view(dtype).view(shape)
                offset += n
            got += flat.numel()
            count += 1

    def close(self) -> None:
        """Leave the channel's group."""
        shutdown = getattr(self.group, "shutdown", None)
        if callable(shutdown):
            shutdown()
