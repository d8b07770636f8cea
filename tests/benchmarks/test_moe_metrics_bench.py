"""Smoke test: the MoE metrics benchmark runs end to end at a tiny size and reports sane figures."""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
from types import ModuleType

import pytest
import torch
from benchmark_scripts import load_script, script_path

from conveyor.metrics.moe_load_balance import count_expert_assignments

SCRIPT = script_path("moe_metrics")


def load_benchmark() -> ModuleType:
    """Import benchmarks/moe_metrics.py as a module."""
    return load_script("moe_metrics")


TINY = [
    "--batch",
    "3",
    "--seq-len",
    "24",
    "--response-len",
    "16",
    "--layers",
    "2",
    "--top-k",
    "2",
    "--experts",
    "4",
    "--reps",
    "2",
]


def test_main_tiny(capsys: pytest.CaptureFixture[str]) -> None:
    # verl is compared in a subprocess below: importing it here would change this process's
    # root logger and environment for the tests that follow.
    result = load_benchmark().main([*TINY, "--no-verl"])
    out = capsys.readouterr().out
    assert result["shape"] == (3, 24, 2, 2) and result["dtype"] == "torch.int16"
    for key in ("clone_ms", "conveyor_ms", "conveyor_ratio"):
        assert math.isfinite(result[key]) and result[key] > 0, key
    assert result["metric_keys"] == 2 * 3 + 6  # per-layer max/min/avg for 2 layers + 6 cross-layer keys
    assert 0.0 <= result["masked_fraction"] < 1.0
    assert "conveyor" in out and "x clone" in out


@pytest.mark.skipif(importlib.util.find_spec("verl") is None, reason="verl is not installed (make install-dev adds it)")
def test_verl_computes_the_same_metrics_on_the_same_inputs() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), *TINY], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "verl comparison skipped" not in proc.stdout, proc.stdout
    assert "conveyor vs verl metrics: agree" in proc.stdout, proc.stdout


def test_no_verl_flag_skips_comparison(capsys: pytest.CaptureFixture[str]) -> None:
    result = load_benchmark().main([*TINY, "--no-verl"])
    assert "verl_ms" not in result and "verl" not in capsys.readouterr().out


def test_inputs_mark_the_last_valid_slot_unknown() -> None:
    routed, mask = load_benchmark().make_inputs(4, 20, 12, 3, 2, 5, 1 / 3, seed=1)
    assert routed.dtype == torch.int16 and mask.shape == (4, 12)
    lengths = mask.sum(dim=1)
    assert bool((lengths >= 1).all())
    for b, length in enumerate(lengths.tolist()):
        assert mask[b, :length].all() and not mask[b, length:].any()  # right-padded
        assert bool((routed[b, 20 - 12 + length - 1] == -1).all())
        assert bool((routed[b, 20 - 12 : 20 - 12 + length - 1] >= 0).all())
    # The -1 slots are exactly one per sequence per layer per top-k slot, so they cost that many counts.
    counts = count_expert_assignments(routed, mask, 5)
    assert int(counts.sum()) == (int(lengths.sum()) - 4) * 3 * 2


def test_bad_flags_are_rejected() -> None:
    with pytest.raises(SystemExit):
        load_benchmark().main(["--seq-len", "8", "--response-len", "16"])


def test_overhead_mode_times_every_piece_against_a_short_default_run() -> None:
    result = load_benchmark().main(["--overhead", "--steps", "2", "--reps", "1"])
    for key in ("step_ms", "rollout_plain_ms", "rollout_margins_ms", "stats_pass_ms", "routing_pass_ms"):
        assert math.isfinite(result[key]) and result[key] > 0, key
    assert result["grad_norms_ms"] > 0 and result["count_ms"] > 0
    assert result["overhead_share"] == pytest.approx(result["overhead_ms"] / result["step_ms"])
    assert result["overhead_ms"] == pytest.approx(result["per_step_ms"] + result["per_interval_ms"] / 10)
