"""Smoke test: the mismatch benchmark runs at a tiny size; the replay closes the gap that truncation opens."""

from __future__ import annotations

from benchmark_scripts import load_script

from conveyor.algos.sampling_mask import Truncation


def test_the_replay_closes_the_gap_and_costs_a_measured_time() -> None:
    bench = load_script("mismatch")
    off = bench.measure(64, 500, Truncation(), 1.0, 0.0, 1)
    # Nothing to replay: the two ways are one, and the gap is float32 rounding (two log-softmax formulas).
    assert off["kl_full"] == off["kl_replay"] and abs(off["kl_full"]) < 1e-6
    top_p = bench.measure(64, 500, Truncation(top_p=0.8), 0.7, 0.0, 1)
    assert top_p["kl_full"] > 1e-2 and abs(top_p["is_mean_full"] - 1) > 1e-2
    assert abs(top_p["kl_replay"]) < 1e-6 and abs(top_p["is_mean_replay"] - 1) < 1e-6
    assert top_p["time_ratio_replay_over_full"] > 0
