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


def test_the_grid_covers_heads_replay_and_top_p_and_the_exact_runs(tmp_path) -> None:
    bench = load_script("mismatch")
    rows = bench.measure_grid(64, 500, 32, 1.0, 2**-8, 1)
    arms = {(r["top_p"], r["head"], r["replay"]): r for r in rows}
    assert set(arms) == {(p, h, r) for p in (1.0, 0.8) for h in ("bf16", "fp32") for r in (False, True)}
    assert arms[(1.0, "bf16", False)]["time_ratio"] == 1.0 and all(r["time_ratio"] > 0 for r in rows)
    for head in ("bf16", "fp32"):
        # top_p=0.8 without the replay is off by the kept mass; the replay leaves the heads' rounding alone.
        assert arms[(0.8, head, False)]["k3_kl"] > 10 * arms[(0.8, head, True)]["k3_kl"]
        assert abs(arms[(0.8, head, True)]["is_mean"] - 1) < 2e-2 < abs(arms[(0.8, head, False)]["is_mean"] - 1)
    # At top_p 1 the float32 head's gap is the body's alone: smaller than with the bf16 head's rounding on top.
    assert arms[(1.0, "fp32", False)]["abs_diff_mean"] < arms[(1.0, "bf16", False)]["abs_diff_mean"]
    runs = {r["arm"]: r for r in bench.exact_runs(1, str(tmp_path))}
    assert runs["hf, rollout.exact=true"]["log_prob_abs_diff_max"] == 0.0
    assert runs["hf, rollout_is=token (old-log-prob forward)"]["log_prob_abs_diff_max"] > 0.0
    assert all(r["step_s"] > 0 for r in runs.values())
