"""benchmarks/async.py's reading of a run: steps/s, the CPU-time estimate, and accuracy at equal training time."""

from __future__ import annotations

import json

from benchmark_scripts import load_script


def test_steps_per_second_and_accuracy_at_equal_training_time(tmp_path):
    bench = load_script("async")
    run = tmp_path / "run"
    run.mkdir()
    rows = [
        {"step": 0, "val/accuracy": 0.25},
        {"step": 1, "timing_s/step": 0.5},
        {"step": 2, "timing_s/step": 0.5, "off_policy/trainer_cpu_s": 0.2, "off_policy/rollout_cpu_s": 0.3},
        {"step": 2, "val/accuracy": 0.5},
        {"step": 3, "timing_s/step": 1.0, "off_policy/trainer_cpu_s": 0.4, "off_policy/rollout_cpu_s": 0.1},
        {"step": 3, "val/accuracy": 0.75},
    ]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    r = bench.read_run(run)
    assert r["steps"] == 3 and r["train_s"] == 2.0 and r["steps_per_s"] == 1.5
    assert abs(r["cpu_steps_per_s"] - 3 / (0.5 + 0.3 + 0.4)) < 1e-12  # the longer of the two per step
    assert r["curve"] == [(0, 0.0, 0.25), (2, 1.0, 0.5), (3, 2.0, 0.75)]
    # No process CPU figures (a synchronous run, or a thread): the step's wall time stands for the trainer's.
    assert abs(r["cores_steps_per_s"] - 1.5) < 1e-12 and abs(r["two_cores_steps_per_s"] - 3.0) < 1e-12

    assert bench.accuracy_at(r["curve"], 1.5) == 0.5
    assert bench.accuracy_at(r["curve"], 2.0) == 0.75
    assert bench.accuracy_at(r["curve"], 0.0) == 0.25
    assert set(bench.MODES) == {"sync", "async_k1", "async_k1_thread"}
    # The breakdown: median ms per step of each stage and each side's CPU, after the first `skip` steps.
    stages = bench.stage_medians(run, skip=1)
    assert stages["timing_s/step"] == 750.0 and stages["off_policy/rollout_cpu_s"] == 200.0
    assert "timing_s/gen" not in stages  # a stage a run does not log is left out


def test_the_estimates_of_a_rollout_in_processes_of_its_own(tmp_path):
    bench = load_script("async")
    run = tmp_path / "run"
    run.mkdir()
    rows = [
        {"step": 1, "timing_s/step": 0.5, "off_policy/trainer_process_cpu_s": 0.3, "rollout/perf/cpu_s": 0.2,
         "reward/perf/cpu_s": 0.2},
        {"step": 2, "timing_s/step": 0.5, "off_policy/trainer_process_cpu_s": 0.4, "rollout/perf/cpu_s": 0.1,
         "reward/perf/cpu_s": 0.1},
    ]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    r = bench.read_run(run)
    assert abs(r["cores_steps_per_s"] - 2 / (0.4 + 0.4)) < 1e-12  # the longer side, rollout + reward in series
    assert abs(r["two_cores_steps_per_s"] - 2 / ((0.7 + 0.6) / 2)) < 1e-12  # all of it over two cores
