"""One batch's call to a rollout replica in a process of its own: a Ray task against the replica's link.

With `trainer.v1.separate_async.rollout_process=own` every batch is one call
to each replica, carrying the batch's handle (`KVBatchMeta`: `--samples`
keys with their `seq_len` tags, the generation's parameters) and returning a
handle. This starts a local Ray (2 CPUs) unless one is running, one actor of the real rank-actor
class (`conveyor.workers.placement.ray_group`) hosting an echo worker, and times that
call both ways: as the Ray task `RayWorkerGroup.call` submits without links,
and over the Unix socket `RayRanks.open_links` opens (`conveyor/workers/placement/link.py`,
what the rollout group uses). Per way it prints the median wall milliseconds
of a call and the CPU milliseconds of this process per call (every thread:
the caller's, and Ray's own threads in the driver), over `--reps` calls after
a warm-up, alternating in `--rounds` rounds; then the ratios.

This script writes no files and installs nothing.

    python benchmarks/rollout_call.py
    python benchmarks/rollout_call.py --samples 1024 --reps 400
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from conveyor.protocol import KVBatchMeta
from conveyor.workers.placement.group import WorkerSpec


class Echo:
    """A worker whose endpoint returns the handle it was given, as a replica returns its batch's."""

    def __init__(self, **_: Any):
        pass

    def generate_sequences(self, meta: KVBatchMeta) -> KVBatchMeta:
        """The handle, with one metric as a replica's carries."""
        return meta.with_extra_info(**{"rollout/gen_time_s": [0.0]})


def handle(samples: int) -> KVBatchMeta:
    """A batch's handle as the rollout thread sends it: keys, fields, `seq_len` tags, generation parameters."""
    keys = [f"batch-7/p{i // 8}/s{i % 8}" for i in range(samples)]
    return KVBatchMeta(
        keys=keys,
        partition_id="batch-7",
        fields=["prompts", "prompt_mask", "uid", "data_source", "ground_truth", "raw_prompt"],
        tags=[{"seq_len": 40 + i % 7} for i in range(samples)],
        extra_info={
            "max_new_tokens": 6,
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": -1,
            "seed": 123,
            "do_sample": True,
            "capture_routing": True,
        },
    )


def timed(call: Any, reps: int) -> tuple[float, float]:
    """(median wall ms of `call()`, this process's CPU ms per call) over `reps` calls."""
    walls = []
    cpu0 = time.process_time()
    for _ in range(reps):
        t0 = time.perf_counter()
        call()
        walls.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(walls), 1e3 * (time.process_time() - cpu0) / reps


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run the comparison; returns every printed figure by name."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=256, help="samples in the handle (the default run: 32 x 8)")
    p.add_argument("--reps", type=int, default=200, help="calls per way and round")
    p.add_argument("--rounds", type=int, default=3, help="rounds, alternating the two ways")
    args = p.parse_args(argv)

    import ray

    from conveyor.workers.placement.ray_group import RayWorkerGroup

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        group = RayWorkerGroup(WorkerSpec("rollout", Echo, {}), world_size=1, num_cpus=0.5)
        meta = handle(args.samples)
        group.ranks.open_links()
        links = group.ranks.links

        def call() -> KVBatchMeta:
            out = group.call(Echo.generate_sequences, meta)
            assert len(out) == args.samples
            return out

        figures: dict[str, list[float]] = {}
        print(f"one call with a handle of {args.samples} samples, {args.reps} calls a round")
        for r in range(args.rounds):
            for way in ("ray task", "link"):
                group.ranks.links = links if way == "link" else None  # None: the Ray task path
                call()  # warm-up
                wall, cpu = timed(call, args.reps)
                figures.setdefault(f"{way} wall ms", []).append(wall)
                figures.setdefault(f"{way} cpu ms", []).append(cpu)
                print(f"  round {r + 1} {way:8s}  wall {wall:6.3f} ms   this process's CPU {cpu:6.3f} ms per call")
        result = {k: statistics.median(v) for k, v in figures.items()}
        result["wall ratio"] = result["ray task wall ms"] / result["link wall ms"]
        result["cpu ratio"] = result["ray task cpu ms"] / result["link cpu ms"]
        print(
            f"medians: a Ray task {result['ray task wall ms']:.3f} ms wall, {result['ray task cpu ms']:.3f} ms CPU; "
            f"the link {result['link wall ms']:.3f} ms wall, {result['link cpu ms']:.3f} ms CPU "
            f"({result['wall ratio']:.1f}x less wall time, {result['cpu ratio']:.1f}x less CPU)"
        )
        group.ranks.links = links
        group.shutdown()
        return result
    finally:
        if started:
            ray.shutdown()


if __name__ == "__main__":
    main()
