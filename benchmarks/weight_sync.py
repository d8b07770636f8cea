"""Streamed weight sync against a plain broadcast of the same bytes: two gloo processes, dense Qwen3 models.

For each size, rank 0 (the trainer) and rank 1 (the engine) each build the same dense Qwen3 from
config (float32, random weights; the receiver's copy starts zeroed). Two ways to move rank 0's
weights into rank 1's model over the same gloo link:

  plain     one `torch.distributed.broadcast` per tensor, straight from the sender's parameter into
            the receiver's (no buckets, no packing, no metadata: the link's own speed for these bytes)
  streamed  conveyor.weights: the sender iterates the model (`iter_weights`), groups the
            tensors into `--bucket-mb` buckets and broadcasts each bucket's metadata, one flat buffer
            of its small tensors, and each large tensor from its own memory (`send_buckets`); the
            receiver takes each large tensor straight into its model's tensor of that name (`into`,
            as the hf replica does) and copies the rest in place (`receive_buckets` + `copy_into`)
  buffered  the same stream, received into the channel's buffer and copied into the model from
            there: an engine that loads through its own code (vLLM's reload) pays this copy

Each runs once cold (the first sync of a size, which allocates the staging buffers) and then
`--repeats` times warm, as every later training step would (the fastest is kept: the host is shared);
after each, the receiver's weights are checked bit for bit against the sender's (a checksum). Each rank's peak extra
memory during a sync is its resident
set's high-water mark (VmHWM, reset through /proc/self/clear_refs) over its resident set before the
sync: a sync that materialised the whole model would show the model's size there. The bar: streamed
within 1.2x of plain (buffered is reported beside it).

    python benchmarks/weight_sync.py                         # ~50M and ~500M parameters, 512 MB buckets
    python benchmarks/weight_sync.py --sizes tiny --bucket-mb 1   # a few seconds

`--delta` measures delta sync instead (conveyor.weights.delta), in one process: what travels is bytes, whichever
transport carries them. For each learning rate of `--lrs` a model of `--delta-size` is built from config (its
weights in `--master-dtype`, bf16 by default: TRL's setting), trained `--steps` AdamW steps on random tokens,
and synced after each step to a receiver's copy at bf16; each step prints the changed fraction, the bytes sent
against a whole sync's, whether the sync went whole, and the encode and decode seconds. Every decoded tensor is
checked bit for bit against the trainer's. The bar: at lr 1e-6 every delta sync <= 5% of whole.

    python benchmarks/weight_sync.py --delta                 # ~500M, lr 1e-6, 1e-5, 6e-4, 10 steps each
    python benchmarks/weight_sync.py --delta --delta-size tiny --steps 3   # a few seconds

The default bucket is 512 MB, verl's default for actor_rollout_ref.rollout.update_weights_bucket_megabytes
(verl/trainer/config/rollout/rollout.yaml): large enough that per-bucket overhead (two collectives
and a pickle of the metadata) is negligible, small enough to be a fraction of a GPU's memory.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import socket
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as tdist
import torch.multiprocessing as mp

#: The bar: a streamed sync within this factor of the plain broadcast's time.
BAR = 1.2

#: Dense Qwen3 shapes by name: (hidden, layers, intermediate, heads, kv heads, vocab); untied embeddings.
SIZES: dict[str, tuple[int, int, int, int, int, int]] = {
    "tiny": (64, 2, 128, 2, 1, 512),
    "50m": (512, 8, 1536, 8, 4, 32000),
    "500m": (1024, 24, 3072, 16, 8, 100000),
}


def build(size: str, dtype: torch.dtype, seed: int | None) -> torch.nn.Module:
    """A dense Qwen3 of `size` in `dtype`: random (seeded) weights, or zeros when `seed` is None."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    hidden, layers, inter, heads, kv, vocab = SIZES[size]
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=inter,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=hidden // heads,
        tie_word_embeddings=False,
        max_position_embeddings=512,
    )
    # Built on the meta device and filled directly: transformers' own init of 500M parameters takes minutes here.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(seed if seed is not None else 0)
    with torch.no_grad():
        for t in model.state_dict().values():
            if seed is None:
                t.zero_()
            elif t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float32).mul_(0.02))
    return model


def _status(key: str) -> int:
    """A field of /proc/self/status in bytes (0 where the file is absent)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _reset_peak() -> int:
    """Reset this process's resident high-water mark to its current resident set; returns that resident set.

    The C heap's free memory is returned to the system first (malloc_trim): glibc keeps what earlier
    temporaries freed resident, which both inflates the baseline and hides later allocations.
    """
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    return _status("VmRSS")


def _plain(model: torch.nn.Module, rank: int) -> None:
    for t in model.state_dict().values():
        tdist.broadcast(t, src=0)


def _streamed(model: torch.nn.Module, rank: int, bucket_bytes: int, staging, in_place: bool = True) -> None:
    from conveyor import weights as ws

    if rank == 0:
        ws.send_buckets(ws.iter_weights(model), bucket_bytes=bucket_bytes, staging=staging)
    else:
        ws.receive_buckets(ws.copy_into(model), staging=staging, into=ws.into_model(model) if in_place else None)


def _same_as_sender(model: torch.nn.Module) -> bool:
    """Whether every tensor of this rank's model equals rank 0's bit for bit (a checksum broadcast)."""
    sums = torch.stack(
        [
            t.reshape(-1).view(torch.int32 if t.element_size() == 4 else torch.int16).double().sum()
            for t in model.state_dict().values()
        ]
    )
    theirs = sums.clone()
    tdist.broadcast(theirs, src=0)
    return bool(torch.equal(sums, theirs))


def _rank(rank: int, port: int, sizes: list[str], bucket_bytes: int, dtype: str, repeats: int, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    tdist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(minutes=20))
    from conveyor.weights import Staging

    dt = getattr(torch, dtype)
    rows = []
    staging = Staging("cpu")  # one per process, kept across syncs as a trainer and an engine would keep it
    warm = build(min(sizes, key=lambda s: SIZES[s][0]), dt, seed=1 if rank == 0 else None)
    _plain(warm, rank)
    _streamed(warm, rank, bucket_bytes, staging)
    del warm
    for size in sizes:
        model = build(size, dt, seed=1 if rank == 0 else None)
        nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        row = {"size": size, "params": sum(p.numel() for p in model.parameters()), "bytes": nbytes}
        staging.release()  # the first sync of a size allocates its bucket memory, and its peak shows it
        runs = {
            "plain": lambda m=model: _plain(m, rank),
            "streamed": lambda m=model: _streamed(m, rank, bucket_bytes, staging),
            "buffered": lambda m=model: _streamed(m, rank, bucket_bytes, staging, in_place=False),
        }
        for name, run in runs.items():
            # The first sync, then `repeats` like every later training step's (the fastest is kept: the host is shared).
            for trial in ["cold"] + ["warm"] * repeats:
                if rank == 1:
                    with torch.no_grad():
                        for t in model.state_dict().values():
                            t.zero_()
                tdist.barrier()
                before = _reset_peak()
                t0 = time.perf_counter()
                run()
                tdist.barrier()
                seconds = time.perf_counter() - t0
                row[f"{name}_{trial}_s"] = min(seconds, row.get(f"{name}_{trial}_s", seconds))
                row[f"{name}_{trial}_extra"] = max(_status("VmHWM") - before, row.get(f"{name}_{trial}_extra", 0))
                row[f"{name}_{trial}_ok"] = _same_as_sender(model) and row.get(f"{name}_{trial}_ok", True)
        rows.append(row)
        del model
    torch.save(rows, Path(out) / f"rank{rank}.pt")
    tdist.barrier()  # every rank past its last collective before any tears the group down
    tdist.destroy_process_group()


def _adamw_step(model: torch.nn.Module, opt: torch.optim.Optimizer, vocab: int, seed: int) -> None:
    """One AdamW step on a batch of random tokens (a loss whose gradient reaches every weight)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, 32), generator=g)
    opt.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()


def delta_rows(size: str, lr: float, steps: int, master: torch.dtype, full_every: int) -> list[dict[str, float]]:
    """Per step: a sync of the model after one more AdamW step, delta-encoded against the one before, decoded and
    checked bit for bit against the trainer's weights at bf16."""
    from conveyor import weights as ws

    model = build(size, master, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    encoder, decoder = ws.DeltaEncoder(ws.DeltaSettings(full_every=full_every)), ws.DeltaDecoder("cpu")
    vocab = SIZES[size][5]
    rows = []
    for step in range(steps + 1):  # step 0: the first, whole sync
        if step:
            _adamw_step(model, opt, vocab, step)
        t0 = time.perf_counter()
        encoded = list(encoder.encode(ws.cast_weights(ws.iter_weights(model), torch.bfloat16)))
        t1 = time.perf_counter()
        exact = True
        for name, tensor in decoder.decode(iter(encoded)):
            # Bit for bit, as the deltas compare: a NaN that travelled is the trainer's NaN (torch.equal says not).
            want = model.state_dict()[name].detach().to(torch.bfloat16)
            exact &= torch.equal(tensor.view(torch.int16), want.view(torch.int16))
        t2 = time.perf_counter()
        del encoded
        stats = encoder.last
        rows.append(
            {
                "step": step,
                "changed_frac": stats.changed_frac,
                "bytes": stats.bytes,
                "full_bytes": stats.full_bytes,
                "full": stats.full,
                "forced": stats.forced,
                "encode_s": t1 - t0,
                "decode_s": t2 - t1,
                "exact": exact and decoder.mismatches == 0,
                "held": encoder.held_bytes,
            }
        )
    return rows


def delta_main(args: argparse.Namespace) -> int:
    """Delta sync per step for each learning rate; 0 if every sync is exact and lr 1e-6's deltas are <= 5% of whole."""
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "0") or 0) or torch.get_num_threads()))
    master = getattr(torch, args.master_dtype)
    hidden, layers, inter, heads, kv, vocab = SIZES[args.delta_size]
    print(
        f"delta sync: dense Qwen3 from config ({args.delta_size}: hidden {hidden}, {layers} layers, vocab {vocab}), "
        f"weights in {args.master_dtype}, synced at bfloat16; AdamW, {args.steps} steps of 32 random tokens; "
        f"full_every={args.full_every}; {os.cpu_count()} CPUs"
    )
    ok = True
    for lr in [float(x) for x in args.lrs.split(",")]:
        t0 = time.perf_counter()
        rows = delta_rows(args.delta_size, lr, args.steps, master, args.full_every)
        full = rows[0]["full_bytes"]
        print(f"\nlr {lr:g}  (whole sync {full / 1e6:.1f} MB; sender's copy {rows[0]['held'] / 1e6:.1f} MB)")
        print(
            f"{'step':>4}{'changed':>10}{'MB sent':>10}{'of whole':>10}{'whole?':>8}{'encode s':>10}{'decode s':>10}"
            "  exact"
        )
        for r in rows:
            whole = "forced" if r["forced"] else ("yes" if r["full"] else "no")
            print(
                f"{r['step']:>4}{r['changed_frac']:>10.4%}{r['bytes'] / 1e6:>10.2f}"
                f"{r['bytes'] / r['full_bytes']:>10.2%}{whole:>8}{r['encode_s']:>10.2f}{r['decode_s']:>10.2f}"
                f"  {r['exact']}"
            )
        deltas = [r for r in rows[1:] if not r["forced"]]
        mean = sum(r["bytes"] for r in deltas) / max(1, len(deltas)) / full
        print(f"mean of the delta syncs: {mean:.2%} of whole ({time.perf_counter() - t0:.0f} s for this lr)")
        ok &= all(r["exact"] for r in rows)
        if lr <= 1e-6:
            ok &= all(r["bytes"] <= 0.05 * r["full_bytes"] for r in deltas)
    print(f"\ndelta sync: {'exact, and <= 5% of whole at lr 1e-6' if ok else 'NOT all exact or over 5% at lr 1e-6'}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    """Run the three syncs for each size and print the table; 0 if every streamed sync is within BAR and bit-exact."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="50m,500m", help=f"comma-separated, of {list(SIZES)}")
    parser.add_argument("--bucket-mb", type=float, default=512.0, help="bucket size in MiB (verl's default: 512)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed syncs of each kind after the first; the fastest is kept"
    )
    parser.add_argument("--delta", action="store_true", help="measure delta sync per training step instead")
    parser.add_argument("--delta-size", default="500m", choices=list(SIZES), help="--delta: the model's size")
    parser.add_argument("--lrs", default="1e-6,1e-5,6e-4", help="--delta: comma-separated AdamW learning rates")
    parser.add_argument("--steps", type=int, default=10, help="--delta: AdamW steps (and delta syncs) per lr")
    parser.add_argument("--master-dtype", default="bfloat16", choices=["float32", "bfloat16"], help="--delta")
    parser.add_argument("--full-every", type=int, default=100, help="--delta: delta_sync.full_every (100: never)")
    args = parser.parse_args(argv)
    if args.delta:
        return delta_main(args)
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown or not sizes:
        parser.error(f"--sizes: unknown {unknown}; choose from {list(SIZES)}")
    bucket_bytes = int(args.bucket_mb * 2**20)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_rank, args=(port, sizes, bucket_bytes, args.dtype, args.repeats, out), nprocs=2, join=True)
        sender, receiver = (torch.load(Path(out) / f"rank{r}.pt") for r in (0, 1))
    print(
        f"dense Qwen3 from config, {args.dtype}, 2 gloo processes on one host ({os.cpu_count()} CPUs); "
        f"bucket {args.bucket_mb:g} MiB"
    )
    print(
        f"{'size':<6}{'params':>9}{'GB':>7}{'plain s':>9}{'GB/s':>6}{'streamed s':>12}{'GB/s':>6}{'ratio':>7}"
        f"{'buffered s':>12}{'ratio':>7}{'cold streamed s':>17}{'send extra MiB':>16}{'recv extra MiB':>16}"
        f"{'buffered recv MiB':>19}{'plain extra':>13}  exact"
    )
    ok = True
    kinds = ("plain", "streamed", "buffered")
    for s_row, r_row in zip(sender, receiver):
        gb = s_row["bytes"] / 1e9
        plain, streamed, buffered = (r_row[f"{k}_warm_s"] for k in kinds)
        ratio = streamed / plain
        exact = all(r_row[f"{n}_{t}_ok"] for n in kinds for t in ("cold", "warm"))
        ok &= exact and ratio <= BAR
        plain_extra = max(row[f"plain_{t}_extra"] for row in (s_row, r_row) for t in ("cold", "warm"))
        buffered_extra = max(r_row[f"buffered_{t}_extra"] for t in ("cold", "warm"))
        print(
            f"{s_row['size']:<6}{s_row['params'] / 1e6:>8.1f}M{gb:>7.3f}{plain:>9.3f}{gb / plain:>6.2f}"
            f"{streamed:>12.3f}{gb / streamed:>6.2f}{ratio:>6.2f}x{buffered:>12.3f}{buffered / plain:>6.2f}x"
            f"{r_row['streamed_cold_s']:>17.3f}"
            f"{s_row['streamed_cold_extra'] / 2**20:>16.1f}{r_row['streamed_cold_extra'] / 2**20:>16.1f}"
            f"{buffered_extra / 2**20:>19.1f}{plain_extra / 2**20:>13.1f}  {exact}"
        )
    print(
        f"times: the fastest of {args.repeats} syncs of each kind after the first (steady state); cold: the first, "
        "allocating its staging buffer. extra: peak resident set over the resident set before a sync, per process"
    )
    print(
        f"model bytes vs peak extra: the whole model is {max(r['bytes'] for r in sender) / 2**20:.1f} MiB at the "
        f"largest size; a bucket is {bucket_bytes / 2**20:.4g} MiB"
    )
    verdict = f"all within {BAR}x" if ok else f"NOT all within {BAR}x (or not exact)"
    print(f"streamed / plain: {verdict} (bar <= {BAR}x)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
