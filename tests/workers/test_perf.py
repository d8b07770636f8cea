"""Per-phase peaks: a phase reports what it reached itself, not the process's lifetime peak."""

from __future__ import annotations

import sys

import pytest
import torch

from conveyor.workers.perf import memory_metrics, peak_memory_bytes, phase_memory_metrics, reset_peak_memory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM and clear_refs are Linux's")


def _touch(n_bytes: int) -> torch.Tensor:
    t = torch.ones(n_bytes // 4, dtype=torch.float32)  # ones, not empty: the pages must be resident
    return t


def test_reset_starts_a_new_window_after_a_large_phase():
    assert reset_peak_memory("cpu")
    big = _touch(256 * 2**20)
    peak_big = peak_memory_bytes("cpu")
    del big
    assert reset_peak_memory("cpu")
    small = _touch(8 * 2**20)
    peak_small = peak_memory_bytes("cpu")
    del small
    # The second window starts below the first one's peak: 256 MiB were freed in between.
    assert peak_big - peak_small > 200 * 2**20
    metrics = phase_memory_metrics("update_actor", "cpu")
    assert set(metrics) == {"perf/update_actor/max_memory_gb"}
    assert metrics["perf/update_actor/max_memory_gb"] == pytest.approx(peak_memory_bytes("cpu") / 2**30, rel=0.05)


def test_memory_metrics_report_the_window_peak_on_cpu():
    reset_peak_memory("cpu")
    held = _touch(64 * 2**20)
    m = memory_metrics("cpu")
    assert m["perf/max_memory_allocated_gb"] >= m["perf/cpu_memory_used_gb"] - 1e-3
    assert m["perf/max_memory_allocated_gb"] * 2**30 >= held.numel() * 4
