"""The weight channel: a standalone process group from the actor's rank 0 to separate engines, streaming buckets.

Three spawned processes on gloo: rank 0 sends a model's tensors in buckets much smaller than the model; two
receivers rebuild them bit for bit, one bucket at a time. The sender also runs a default process group of
its own (the actor's world), which the channel leaves alone.
"""

from __future__ import annotations

import torch
import torch.multiprocessing as mp

from conveyor.weights import WeightChannel, free_address


def _tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = [(f"layer.{i}.weight", torch.randn(64, 48, generator=g)) for i in range(6)]
    out += [
        ("big", torch.randn(300, 200, generator=g)),
        ("ids", torch.arange(7, dtype=torch.int64)),
        ("half", torch.randn(5, 3, generator=g).to(torch.bfloat16)),
        ("scalar", torch.tensor(2.5)),
    ]
    return out


def _member(rank: int, address: tuple[str, int], world_port: int, results, done) -> None:
    import torch.distributed as tdist

    if rank == 0:  # the actor's own world (of one rank here) beside the channel
        tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{world_port}", rank=0, world_size=1)
    channel = WeightChannel(address, rank, 3, device=torch.device("cpu"), timeout_s=60)
    for _ in range(2):  # two syncs over one channel
        if rank == 0:
            stats = channel.send(iter(_tensors()), bucket_bytes=16 << 10)
            results.put(("sent", stats.bytes, stats.buckets))
        else:
            # Receiver 2 names where "big" and "ids" may land; "ids" is packed with the small tensors after it (it
            # does not travel alone), so only "big" lands in its target.
            targets = {"big": torch.zeros(300, 200), "ids": torch.zeros(7, dtype=torch.int64)} if rank == 2 else {}
            got, placed = {}, []
            for name, tensor in channel.received(into=lambda name, dtype, shape: targets.get(name)):
                got[name] = tensor.clone()
                if name in targets and tensor.data_ptr() == targets[name].data_ptr():
                    placed.append(name)
            last = (channel.last.bytes, channel.last.buckets)
            results.put(("got", rank, got, channel.last.max_bucket_bytes, last, placed))
    if rank == 0:
        t = torch.ones(1)
        tdist.all_reduce(t)  # the actor's group still works
        results.put(("world", float(t)))
        tdist.destroy_process_group()
    channel.close()
    # The tensors put on the queue travel as file descriptors this process shares: it stays until they are read.
    done.wait(120)


def test_a_channel_streams_buckets_bit_for_bit_to_every_receiver() -> None:
    ctx = mp.get_context("spawn")
    results, done = ctx.Queue(), ctx.Event()
    address = free_address()
    world_port = free_address()[1]
    procs = [ctx.Process(target=_member, args=(r, address, world_port, results, done)) for r in range(3)]
    for p in procs:
        p.start()
    out = [results.get(timeout=120) for _ in range(2 * 3 + 1)]
    done.set()
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    want = dict(_tensors())
    total = sum(t.numel() * t.element_size() for t in want.values())
    sent = [o for o in out if o[0] == "sent"]
    assert len(sent) == 2 and all(s[1] == total for s in sent)
    buckets = sent[0][2]
    assert buckets >= 5  # 16 KiB buckets of a ~0.3 MB model; "big" (240 KB) travels alone
    got = [o for o in out if o[0] == "got"]
    assert len(got) == 4
    largest = max(t.numel() * t.element_size() for t in want.values())
    for _, rank, tensors, max_bucket, last, placed in got:
        assert placed == (["big"] if rank == 2 else [])
        assert list(tensors) == list(want)
        for name, tensor in want.items():
            assert tensors[name].dtype == tensor.dtype and torch.equal(tensors[name], tensor), name
        # A receiver holds a bucket at a time: at most the bucket size, or the one tensor larger than it.
        assert max_bucket <= max(16 << 10, largest) < total and last == (total, buckets)
    assert ("world", 1.0) in out
