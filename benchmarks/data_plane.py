"""Time data-plane put + get against a plain `tensor.clone()` of the same data, and data-plane creation.

Two workloads, each a put of a batch followed by a get of the same keys:

- dense: `--samples` x `--seq-len` int64 (default 1024 x 4096 = 32 MiB), one
  field, the shape of a step's `input_ids`. The yardstick is `clone()` of the
  same tensor measured in the same run, so the ratio says how many "copies of
  the batch" a round trip through the data plane costs on this machine. A get
  in shuffled key order (what a mini-batch shuffle does) is timed as well.
- small-fields: `--small-samples` x `--small-fields` small columns (default
  10k samples x 20 fields, half (N, 4) float32, half (N,) int64), where the
  per-key bookkeeping rather than the bytes dominates.

Repetitions alternate between the contenders and medians are reported, so a
noisy neighbour hurts all of them alike. Every round trip is checked to give
back exactly what was put. Creation time is the median of
`make_data_plane(backend)` calls.

Backends: `memory` always; `ray` and `transferqueue` when their adapter
modules (`conveyor.data_plane.ray_store`, `conveyor.data_plane.transferqueue`)
and packages are installed, otherwise skipped with a note.

This script does not write files or install anything.

    python benchmarks/data_plane.py                            # both workloads, memory backend
    python benchmarks/data_plane.py --workload dense --reps 31 --threads 1
    python benchmarks/data_plane.py --backends memory ray
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from conveyor.data_plane import BACKENDS, DataPlane, make_data_plane

# Targets of the memory backend (checked and printed, not enforced).
TARGET_RATIO = 3.0  # dense put+get at most this many clones
TARGET_CREATE_MS = 50.0

_ADAPTERS = {
    "ray": ("conveyor.data_plane.ray_store", "ray"),
    "transferqueue": ("conveyor.data_plane.transferqueue", "transfer_queue"),
}


def _find(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def backend_unavailable(backend: str) -> str | None:
    """Why `backend` cannot run here (a missing adapter module or package), or None when it can."""
    if backend not in _ADAPTERS:
        return None
    adapter, package = _ADAPTERS[backend]
    if not _find(adapter):
        return f"{adapter} is not written yet"
    if not _find(package):
        return f"the {package!r} package is not installed"
    return None


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """(wall seconds, result) of one call."""
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def median_ms(seconds: Sequence[float]) -> float:
    """Median of `seconds`, in milliseconds."""
    return statistics.median(seconds) * 1e3


def summarize(nbytes: int, clone_s: list[float], put_s: list[float], get_s: list[float]) -> dict[str, Any]:
    """Medians of one workload's repetitions and their ratio to a clone of the same bytes."""
    roundtrip = [p + g for p, g in zip(put_s, get_s)]
    return {
        "bytes": nbytes,
        "clone_ms": median_ms(clone_s),
        "put_ms": median_ms(put_s),
        "get_ms": median_ms(get_s),
        "put_get_ms": median_ms(roundtrip),
        "ratio": statistics.median(roundtrip) / statistics.median(clone_s),
        "gb_per_s": nbytes / statistics.median(roundtrip) / 1e9,
        "clone_gb_per_s": nbytes / statistics.median(clone_s) / 1e9,
    }


def bench_dense(plane: DataPlane, samples: int, seq_len: int, reps: int, seed: int) -> dict[str, float]:
    """Put then get `samples` x `seq_len` int64 rows, `reps` times, next to a clone of the same tensor."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 50_000, (samples, seq_len), generator=gen, dtype=torch.int64)
    keys = [f"s{i}" for i in range(samples)]
    shuffled = [keys[i] for i in torch.randperm(samples, generator=gen).tolist()]
    want_shuffled = x[[int(k[1:]) for k in shuffled]]
    clone_s, put_s, get_s, shuf_s = [], [], [], []
    for rep in range(reps + 1):  # the first round warms up and is not counted
        part = f"dense-{rep}"
        t_clone, copy = timed(x.clone)
        t_put, _ = timed(lambda: plane.kv_batch_put(keys, part, {"input_ids": x}))
        t_get, got = timed(lambda: plane.kv_batch_get(keys, part, ["input_ids"]))
        t_shuf, got_shuf = timed(lambda: plane.kv_batch_get(shuffled, part, ["input_ids"]))
        plane.kv_clear(part)
        if not (torch.equal(got["input_ids"], x) and torch.equal(got_shuf["input_ids"], want_shuffled)):
            raise AssertionError(f"{plane.backend}: the dense round trip did not give back what was put")
        del copy, got, got_shuf
        if rep:
            clone_s.append(t_clone)
            put_s.append(t_put)
            get_s.append(t_get)
            shuf_s.append(t_shuf)
    return {
        **summarize(x.numel() * x.element_size(), clone_s, put_s, get_s),
        "get_shuffled_ms": median_ms(shuf_s),
        "shuffled_ratio": statistics.median([p + g for p, g in zip(put_s, shuf_s)]) / statistics.median(clone_s),
    }


def bench_small_fields(plane: DataPlane, samples: int, num_fields: int, reps: int, seed: int) -> dict[str, float]:
    """Put then get `num_fields` small columns of `samples` rows, next to a clone of every column."""
    gen = torch.Generator().manual_seed(seed)
    fields = {
        f"f{j}": torch.randn(samples, 4, generator=gen)
        if j % 2 == 0
        else torch.randint(0, 1000, (samples,), generator=gen, dtype=torch.int64)
        for j in range(num_fields)
    }
    keys = [f"s{i}" for i in range(samples)]
    names = list(fields)
    clone_s, put_s, get_s = [], [], []
    for rep in range(reps + 1):
        part = f"small-{rep}"
        t_clone, copies = timed(lambda: [v.clone() for v in fields.values()])
        t_put, _ = timed(lambda: plane.kv_batch_put(keys, part, fields))
        t_get, got = timed(lambda: plane.kv_batch_get(keys, part, names))
        plane.kv_clear(part)
        if not all(torch.equal(got[n], fields[n]) for n in names):
            raise AssertionError(f"{plane.backend}: the small-fields round trip did not give back what was put")
        del copies, got
        if rep:
            clone_s.append(t_clone)
            put_s.append(t_put)
            get_s.append(t_get)
    out = summarize(sum(v.numel() * v.element_size() for v in fields.values()), clone_s, put_s, get_s)
    out["samples_per_s"] = samples / (out["put_get_ms"] / 1e3)
    return out


def bench_create(backend: str, reps: int) -> float:
    """Median milliseconds of one `make_data_plane(backend)` (closing is not timed)."""
    times = []
    for rep in range(reps + 1):
        t, plane = timed(lambda: make_data_plane(backend))
        plane.close()
        if rep:
            times.append(t)
    return median_ms(times)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--backends",
        nargs="+",
        default=["memory"],
        metavar="NAME",
        help=f"any of {', '.join(BACKENDS)} (space or comma separated; default memory)",
    )
    parser.add_argument("--workload", choices=("dense", "small-fields", "both"), default="both")
    parser.add_argument("--samples", type=int, default=1024, help="dense: samples")
    parser.add_argument("--seq-len", type=int, default=4096, help="dense: int64 values per sample")
    parser.add_argument("--small-samples", type=int, default=10_000, help="small-fields: samples")
    parser.add_argument("--small-fields", type=int, default=20, help="small-fields: fields")
    parser.add_argument("--reps", type=int, default=15, help="timed repetitions (after one warm-up)")
    parser.add_argument("--create-reps", type=int, default=51, help="timed make_data_plane calls")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = leave as is)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.backends = [b for item in args.backends for b in item.split(",") if b]
    unknown = [b for b in args.backends if b not in BACKENDS]
    if unknown:
        parser.error(f"--backends: unknown {unknown}; choose from {list(BACKENDS)}")
    for name in ("samples", "seq_len", "small_samples", "small_fields", "reps", "create_reps"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0")
    return args


def _row(cells: Sequence[str], widths: Sequence[int]) -> str:
    return "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))


def print_table(results: dict[str, dict[str, Any]]) -> None:
    """One line per backend and workload: milliseconds, GB/s and the ratio to clone."""
    head = ["backend / workload", "MiB", "put ms", "get ms", "put+get ms", "clone ms", "x clone", "GB/s", "create ms"]
    rows = []
    for backend, res in results.items():
        for workload in ("dense", "small_fields"):
            if workload not in res:
                continue
            r = res[workload]
            rows.append(
                [
                    f"{backend} / {workload.replace('_', '-')}",
                    f"{r['bytes'] / 2**20:.1f}",
                    f"{r['put_ms']:.2f}",
                    f"{r['get_ms']:.2f}",
                    f"{r['put_get_ms']:.2f}",
                    f"{r['clone_ms']:.2f}",
                    f"{r['ratio']:.2f}",
                    f"{r['gb_per_s']:.2f}",
                    f"{res['create_ms']:.4f}",
                ]
            )
    widths = [max(len(str(c)) for c in col) for col in zip(head, *rows)]
    print(_row(head, widths))
    print(_row(["-" * w for w in widths], widths))
    for r in rows:
        print(_row(r, widths))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the chosen workloads on the chosen backends, print a table and the target checks; return the figures."""
    args = parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    out: dict[str, Any] = {"threads": torch.get_num_threads(), "backends": {}, "skipped": {}}
    print(f"torch {torch.__version__}, {out['threads']} threads, {args.reps} repetitions (medians)")
    started_ray = _start_ray_if_needed(args.backends)
    try:
        _run_backends(args, out)
    finally:
        if started_ray:
            import ray

            ray.shutdown()
    return out


def _start_ray_if_needed(backends: Sequence[str]) -> bool:
    """Start one local Ray for the Ray-based backends (logical CPUs, so it fits a 2-core machine)."""
    if not any(b in ("ray", "transferqueue") and backend_unavailable(b) is None for b in backends):
        return False
    import ray

    if ray.is_initialized():
        return False
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    return True


def _run_backends(args: argparse.Namespace, out: dict[str, Any]) -> None:
    for backend in args.backends:
        reason = backend_unavailable(backend)
        if reason is None:
            try:
                plane = make_data_plane(backend)
            except (ValueError, ImportError, RuntimeError) as err:
                reason = f"cannot create it here ({err})"
        if reason is not None:
            print(f"note: backend {backend} skipped: {reason}")
            out["skipped"][backend] = reason
            continue
        res: dict[str, Any] = {}
        try:
            if args.workload in ("dense", "both"):
                res["dense"] = bench_dense(plane, args.samples, args.seq_len, args.reps, args.seed)
            if args.workload in ("small-fields", "both"):
                res["small_fields"] = bench_small_fields(
                    plane, args.small_samples, args.small_fields, args.reps, args.seed
                )
        finally:
            plane.close()
        res["create_ms"] = bench_create(backend, args.create_reps)
        out["backends"][backend] = res
    if out["backends"]:
        print_table(out["backends"])
    mem = out["backends"].get("memory")
    if mem is not None:
        checks = []
        if "dense" in mem:
            d = mem["dense"]
            print(
                f"memory / dense: get in shuffled order {d['get_shuffled_ms']:.2f} ms "
                f"(put + shuffled get = {d['shuffled_ratio']:.2f} x clone)"
            )
            checks.append((f"put+get <= {TARGET_RATIO:g} x clone", d["ratio"] <= TARGET_RATIO, f"{d['ratio']:.2f} x"))
        checks.append(
            (f"creation < {TARGET_CREATE_MS:g} ms", mem["create_ms"] < TARGET_CREATE_MS, f"{mem['create_ms']:.4f} ms")
        )
        out["targets_met"] = all(ok for _, ok, _ in checks)
        for name, ok, value in checks:
            print(f"target memory {name}: {'met' if ok else 'MISSED'} ({value})")
    ray_res, tq_res = out["backends"].get("ray", {}), out["backends"].get("transferqueue", {})
    if "dense" in ray_res and "dense" in tq_res:
        speedup = tq_res["dense"]["put_get_ms"] / ray_res["dense"]["put_get_ms"]
        out["ray_vs_transferqueue"] = speedup
        print(
            f"target ray put+get >= 2x faster than transferqueue: {'met' if speedup >= 2 else 'MISSED'} "
            f"({speedup:.2f}x)"
        )


if __name__ == "__main__":
    main()
