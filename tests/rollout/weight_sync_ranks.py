"""Two gloo ranks exercising conveyor.weights, for tests/rollout/test_weight_sync.py.

    python weight_sync_ranks.py CASE[,CASE...] OUT_DIR

The cases run in turn in the same two processes (starting them is most of the cost). A CASE is `transport` (rank 0
streams mixed tensors in small buckets to rank 1, which records what it
received and how many buckets' views were alive at once), `apart` (the same tensors with every one of 256 bytes
or more broadcast on its own, received straight into tensors the receiver names where they fit), or `fsdp2`
(a tiny Qwen3-MoE sharded with
FSDP2 over both ranks; each rank streams its whole state dict with `iter_weights`). Each rank writes
OUT_DIR/<case>_<rank>.pt.
"""

from __future__ import annotations

import os
import socket
import sys
import weakref
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as tdist
import torch.multiprocessing as mp

BUCKET = 4096


def transport_tensors() -> list[tuple[str, torch.Tensor]]:
    """Tensors of several dtypes and shapes (0-dim, empty, non-contiguous, larger than a bucket)."""
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(16, 48, generator=g)
    return [
        ("a.weight", torch.randn(7, 5, generator=g)),
        ("b.bf16", torch.randn(33, generator=g).to(torch.bfloat16)),
        ("c.scalar", torch.tensor(3.25, dtype=torch.float64)),
        ("d.ids", torch.arange(11, dtype=torch.int64)),
        ("e.mask", torch.rand(13, generator=g) > 0.5),
        ("f.empty", torch.empty(0, 4)),
        ("g.transposed", wide.t()),  # non-contiguous: packed into the buffer
        ("h.big", torch.randn(3000, generator=g)),  # 12000 bytes, over a bucket: travels alone
        ("i.half", torch.randn(9, 3, generator=g).half()),
    ]


def _transport(rank: int, out: Path) -> None:
    from conveyor import weights as ws

    if rank == 0:
        stats = ws.send_buckets(iter(transport_tensors()), bucket_bytes=BUCKET)
        torch.save({"buckets": stats.buckets, "bytes": stats.bytes}, out / "transport_0.pt")
        # The lazy receiver, fed a second time.
        ws.send_buckets(iter(transport_tensors()), bucket_bytes=BUCKET)
        return
    received: dict[str, torch.Tensor] = {}
    alive_before: list[int] = []  # views of earlier buckets still alive when a bucket arrives
    sizes: list[int] = []
    refs: list[weakref.ref] = []

    def load(bucket: list[tuple[str, torch.Tensor]]) -> None:
        alive_before.append(sum(r() is not None for r in refs))
        refs.clear()
        sizes.append(sum(t.numel() * t.element_size() for _, t in bucket))
        for name, tensor in bucket:
            received[name] = tensor.clone()
            refs.append(weakref.ref(tensor))

    stats = ws.receive_buckets(load)
    lazy, lazy_alive = {}, []
    lazy_refs: list[weakref.ref] = []
    for name, tensor in ws.iter_received():
        lazy_alive.append(sum(r() is not None for r in lazy_refs))
        lazy_refs.append(weakref.ref(tensor))
        lazy[name] = tensor.clone()
        del tensor
    torch.save(
        {
            "received": received,
            "alive_before": alive_before,
            "sizes": sizes,
            "buckets": stats.buckets,
            "lazy": lazy,
            "lazy_alive": lazy_alive,
        },
        out / "transport_1.pt",
    )


APART = 256


def apart_targets() -> dict[str, torch.Tensor]:
    """What rank 1 offers `into` in the `apart` case: fitting tensors, and ones that must not be used."""
    sent = dict(transport_tensors())
    return {
        "a.weight": torch.zeros(7, 5),  # 140 bytes: under APART, so packed however it is offered
        "g.transposed": torch.zeros(16, 48).t(),  # non-contiguous at the sender: packed
        "h.big": torch.zeros(3000),  # fits: received in place
        "d.ids": torch.zeros(11, dtype=torch.int32),  # wrong dtype (and small): not used
        "wide.float": torch.zeros(40, 20),  # fits
        "wide.wrong_shape": torch.zeros(20, 40),  # wrong shape: not used
        "wide.strided": torch.zeros(40, 40)[:, ::2],  # not contiguous: not used
        **{n: torch.zeros_like(sent[n]) for n in ("i.half",)},
    }


def apart_tensors() -> list[tuple[str, torch.Tensor]]:
    """`transport_tensors` and three more of 3200 bytes, so buckets mix packed and lone tensors."""
    g = torch.Generator().manual_seed(1)
    wide = [(n, torch.randn(40, 20, generator=g)) for n in ("wide.float", "wide.wrong_shape", "wide.strided")]
    return transport_tensors()[:4] + wide + transport_tensors()[4:]


def _apart(rank: int, out: Path) -> None:
    from conveyor import weights as ws

    if rank == 0:
        ws.send_buckets(iter(apart_tensors()), bucket_bytes=BUCKET, apart_bytes=APART)
        return
    targets = apart_targets()
    received, placed = {}, []
    for name, tensor in ws.iter_received(into=lambda name, dtype, shape: targets.get(name)):
        received[name] = tensor.clone()
        if name in targets and tensor.data_ptr() == targets[name].data_ptr():
            placed.append(name)
    torch.save({"received": received, "placed": placed, "targets": targets}, out / "apart_1.pt")


def _fsdp2(rank: int, out: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from conveyor import weights as ws
    from conveyor.models.tiny import build_tiny_model
    from conveyor.models.tokenizer import build_char_tokenizer

    model = build_tiny_model("qwen3_moe", build_char_tokenizer(), seed=0, hidden_size=64, num_heads=2, num_kv_heads=2)
    mesh = init_device_mesh("cpu", (2,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    local = sum(p.to_local().numel() for p in model.parameters())
    names, tensors, peak, alive = [], {}, 0, []
    for name, tensor in ws.engine_names(ws.iter_weights(model), layout="per_expert", model_type="qwen3_moe"):
        names.append(name)
        tensors[name] = tensor.clone()
        alive.append(weakref.ref(tensor))
        peak = max(peak, sum(r() is not None for r in alive))
        del tensor
    torch.save({"tensors": tensors, "local_numel": local, "peak_alive": peak}, out / f"fsdp2_{rank}.pt")


def _rank_main(rank: int, case: str, out: str, port: int) -> None:
    torch.set_num_threads(1)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    tdist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(minutes=3))
    try:
        for name in case.split(","):
            {"transport": _transport, "apart": _apart, "fsdp2": _fsdp2}[name](rank, Path(out))
            tdist.barrier()
    finally:
        tdist.destroy_process_group()


def main() -> None:
    """Spawn the two ranks of the case named on the command line."""
    case, out = sys.argv[1], sys.argv[2]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank_main, args=(case, out, port), nprocs=2, join=True)


if __name__ == "__main__":
    main()
