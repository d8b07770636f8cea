"""Per-rank memory figures that every worker call returns in its handle's `extra_info`.

On an accelerator these are the device allocator's peaks; on a CPU the process's
peak resident memory stands in for "allocated" and "reserved" (there is no
separate caching allocator to report).
"""

from __future__ import annotations

import resource
import sys

import torch

__all__ = ["memory_metrics", "reset_peak_memory", "result_handle"]

_GB = 1024**3


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        import os

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
        allocated = reserved = _peak_rss_bytes()
    return {
        "perf/max_memory_allocated_gb": allocated / _GB,
        "perf/max_memory_reserved_gb": reserved / _GB,
        "perf/cpu_memory_used_gb": _rss_bytes() / _GB,
    }


def reset_peak_memory(device: torch.device | str = "cpu") -> None:
    """Start a new peak window on an accelerator (the CPU peak RSS cannot be reset)."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats(device)


def result_handle(meta, fields: list[str], metrics: dict[str, float], device: torch.device | str = "cpu"):
    """The handle a worker endpoint returns: `meta` listing the new `fields`, `extra_info` = metrics + memory."""
    from conveyor.protocol import KVBatchMeta

    info = dict(metrics)
    info.update(memory_metrics(device))
    return KVBatchMeta(meta.keys, meta.partition_id, list(dict.fromkeys(meta.fields + fields)), meta.tags, info)
