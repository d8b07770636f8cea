"""How long each stage of a step took: wall seconds and the CPU seconds of the thread that ran it.

`timer` adds a block's times to a step's `timings` dict; `timing_metrics` turns
that dict into the logged `timing_s/<stage>` and `timing_cpu_s/<stage>`
metrics. Both the trainer's loop and the sample sources (on whichever thread
generates) time their stages with them.

What it deliberately does not do: reduce times across ranks or steps (each
step logs its own), or time anything on the workers (they report their own
`perf/` metrics).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

__all__ = ["CPU", "timer", "timing_metrics"]

# A timings entry under this prefix holds the CPU seconds of the thread that ran the stage (logged as
# `timing_cpu_s/<stage>`); beside a stage's wall seconds it tells computing from waiting (for a lock, a core, a call).
CPU = "cpu:"


@contextlib.contextmanager
def timer(name: str, timings: dict[str, float]) -> Iterator[None]:
    """Add the block's wall time to `timings[name]` and its thread's CPU time to `timings[CPU + name]`."""
    t0, c0 = time.perf_counter(), time.thread_time()
    try:
        yield
    finally:
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - t0
        timings[CPU + name] = timings.get(CPU + name, 0.0) + time.thread_time() - c0


def timing_metrics(timings: dict[str, float]) -> dict[str, float]:
    """`timer`'s entries as metrics: `timing_s/<stage>` (wall) and `timing_cpu_s/<stage>` (the thread's CPU)."""
    return {
        f"timing_cpu_s/{k.removeprefix(CPU)}" if k.startswith(CPU) else f"timing_s/{k}": v for k, v in timings.items()
    }
