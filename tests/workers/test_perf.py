"""Per-phase peaks: a phase reports what it reached itself, not the process's lifetime peak."""

from __future__ import annotations

import sys

import pytest
import torch

from conveyor.workers.ranks.perf import memory_metrics, peak_memory_bytes, phase_memory_metrics, reset_peak_memory

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


def test_allocator_defaults_leave_a_user_setting_alone(monkeypatch: pytest.MonkeyPatch):
    from conveyor.workers.ranks.perf import allocator_env_defaults, set_allocator_defaults

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert allocator_env_defaults() == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    set_allocator_defaults()
    assert (
        torch.cuda.is_available() or __import__("os").environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    )
    assert allocator_env_defaults({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}) == {}


def test_a_worker_phase_that_allocates_more_reports_more(monkeypatch: pytest.MonkeyPatch):
    """An endpoint's perf/<phase>/max_memory_gb is the peak of that call alone: 256 MiB more inside it shows."""
    from update_batches import ragged_update_fields

    from conveyor.config import load_config
    from conveyor.data_plane import make_data_plane
    from conveyor.trainer.plan import build_run_plan
    from conveyor.trainer.setup import prepare_default_model
    from conveyor.workers.ranks.actor import PolicyWorker
    from conveyor.workers.ranks.calls import LogProbCall
    from conveyor.workers.ranks.settings import actor_settings

    cfg = load_config(
        None,
        ["data.synthetic.num_train=64", "data.synthetic.num_val=8", "actor_rollout_ref.model.tiny.warmstart_steps=0"],
    )
    plane = make_data_plane("memory")
    fields = ragged_update_fields(7, 4, 3, 40, torch.Generator().manual_seed(0))
    meta = plane.kv_batch_put([f"s{i}" for i in range(7)], "p", fields).with_extra_info(
        **LogProbCall(temperature=1.0, calculate_entropy=False).to_extra_info()
    )
    worker = PolicyWorker(
        actor_settings(cfg, build_run_plan(cfg, "cpu")), model_path=prepare_default_model(cfg), data_plane=plane
    )
    key = "perf/old_log_prob/max_memory_gb"
    plain = worker.compute_log_prob(meta).extra_info[key]
    real = worker.forward.no_grad_token_stats  # what compute_log_prob calls

    def allocating(*args, **kwargs):
        held = _touch(256 * 2**20)
        out = real(*args, **kwargs)
        del held
        return out

    monkeypatch.setattr(worker.forward, "no_grad_token_stats", allocating)
    heavy = worker.compute_log_prob(meta).extra_info[key]
    assert heavy - plain > 200 / 1024, (plain, heavy)
    assert worker.compute_log_prob(meta).extra_info[key] > 0
