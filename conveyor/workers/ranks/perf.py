"""Per-rank memory figures that every worker call returns in its handle's `extra_info`.

On an accelerator these are the device allocator's peaks; on a CPU the process's
peak resident memory stands in for "allocated" and "reserved" (there is no
separate caching allocator to report).

A phase (the rollout, a log-prob pass, an update) measures its own peak: it
starts a new peak window (`reset_peak_memory`: the allocator's peak statistics
on an accelerator; on Linux, writing 5 to `/proc/self/clear_refs`, which sets
the process's high-water mark `VmHWM` back to its current resident set) and
reads the peak at its end (`phase_memory_metrics`), so each figure says what
that phase alone reached rather than the process's lifetime peak. Every worker
endpoint opens its phase with `begin_phase`, which on a GPU also hands the
previous phase's cached blocks back to the driver (`torch.cuda.empty_cache`),
so one phase's leftovers do not count against the next one's reserved peak.

`set_allocator_defaults` sets `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`
for a worker process unless the user set it (segments that grow in place
fragment far less when the phases' shapes alternate); it must run before the
process's first CUDA allocation, so the workers call it first thing, and a
process launcher can pass `allocator_env_defaults()` in the children's
environment.

`freeze_heap` is called once a process has built what it keeps for the run
(a rank actor after each worker; the trainer's process around `fit`,
`frozen_heap`): the interpreter's full garbage collections then skip the
libraries' objects.
"""

from __future__ import annotations

import contextlib
import gc
import os
import resource
import sys
from collections.abc import Iterator

import torch

__all__ = [
    "memory_metrics",
    "status_kb",
    "reset_peak_memory",
    "peak_memory_bytes",
    "phase_memory_metrics",
    "result_handle",
    "begin_phase",
    "allocator_env_defaults",
    "set_allocator_defaults",
    "freeze_heap",
    "frozen_heap",
]

# The environment a worker process gets unless the user set the variable already.
_ALLOCATOR_DEFAULTS = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}

_GB = 1024**3


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return _peak_rss_bytes()


def _peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports kilobytes, macOS bytes.
    return peak if sys.platform == "darwin" else peak * 1024


def memory_metrics(device: torch.device | str = "cpu") -> dict[str, float]:
    """This rank's `perf/max_memory_allocated_gb`, `perf/max_memory_reserved_gb`, `perf/cpu_memory_used_gb`."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        allocated = torch.cuda.max_memory_allocated(device)
        reserved = torch.cuda.max_memory_reserved(device)
    else:
        allocated = reserved = peak_memory_bytes(device)
    return {
        "perf/max_memory_allocated_gb": allocated / _GB,
        "perf/max_memory_reserved_gb": reserved / _GB,
        "perf/cpu_memory_used_gb": _rss_bytes() / _GB,
    }


def status_kb(field: str) -> int | None:
    """A `kB` line of /proc/self/status (VmHWM, VmRSS) in kB, or None where there is no such file (not Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def reset_peak_memory(device: torch.device | str = "cpu") -> bool:
    """Start a new peak window: the allocator's on an accelerator, the process's VmHWM on Linux; False if it cannot."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        # "5": reset the peak resident set size to the current one (Linux >= 4.0, proc(5)).
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False  # not Linux, or a kernel without it: the peak stays the lifetime peak


def peak_memory_bytes(device: torch.device | str = "cpu") -> int:
    """This process's peak since the last `reset_peak_memory`: allocated device bytes, or resident bytes on a CPU."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated(device))
    hwm = status_kb("VmHWM")
    return hwm * 1024 if hwm is not None else _peak_rss_bytes()


def allocator_env_defaults(env: dict[str, str] | None = None) -> dict[str, str]:
    """The allocator variables to add to `env` (default: this process's environment): those the user did not set."""
    env = os.environ if env is None else env
    return {k: v for k, v in _ALLOCATOR_DEFAULTS.items() if k not in env}


def set_allocator_defaults() -> None:
    """Set the allocator defaults in this process's environment (effective only before its first CUDA allocation)."""
    os.environ.update(allocator_env_defaults())


def freeze_heap() -> None:
    """Collect the garbage of start-up, then leave every object alive now out of later garbage collections."""
    # torch, transformers and the model hold about half a million objects that live as long as the process: a full
    # collection walks them all (about 0.2 s on a 2-core Xeon, three times in the default run's 600 steps, in the
    # trainer's process and in each replica's) and finds nothing to free. Reference counting still frees them.
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """`freeze_heap` for the block; after it the frozen objects are collectable again (a process that runs training
    more than once must not keep a finished run's cycles for good)."""
    freeze_heap()
    try:
        yield
    finally:
        gc.unfreeze()


def begin_phase(device: torch.device | str = "cpu") -> None:
    """Open a phase: on a GPU, free the cached blocks the previous phase left; then start a new peak window."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():  # GPU only: the CPU has no caching allocator
        torch.cuda.empty_cache()
    reset_peak_memory(device)


def phase_memory_metrics(phase: str, device: torch.device | str = "cpu") -> dict[str, float]:
    """The peak of `phase` since its `reset_peak_memory`, as `perf/{phase}/max_memory_gb` (reduced over ranks by
    max)."""
    return {f"perf/{phase}/max_memory_gb": peak_memory_bytes(device) / _GB}


def result_handle(meta, fields: list[str], metrics: dict[str, float], device: torch.device | str = "cpu"):
    """The handle a worker endpoint returns: `meta` listing the new `fields`, `extra_info` = metrics + memory."""
    from conveyor.protocol import KVBatchMeta

    info = dict(metrics)
    info.update(memory_metrics(device))
    return KVBatchMeta(meta.keys, meta.partition_id, list(dict.fromkeys(meta.fields + fields)), meta.tags, info)
