"""benchmarks/async.py's reading of a run: steps/s, the CPU-time estimate, and accuracy at equal training time."""

from __future__ import annotations

import json

import pytest
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

    # A GPU's warm-up left out: steps/s and the estimates from steps 2-3, the curve's times still from step 1.
    w = bench.read_run(run, skip=1)
    assert w["steps"] == 2 and w["train_s"] == 2.0 and w["steps_per_s"] == 2 / 1.5 and w["curve"] == r["curve"]
    assert abs(w["cpu_steps_per_s"] - 2 / (0.3 + 0.4)) < 1e-12

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
        {
            "step": 1,
            "timing_s/step": 0.5,
            "off_policy/trainer_process_cpu_s": 0.3,
            "rollout/perf/cpu_s": 0.2,
            "reward/perf/cpu_s": 0.2,
        },
        {
            "step": 2,
            "timing_s/step": 0.5,
            "off_policy/trainer_process_cpu_s": 0.4,
            "rollout/perf/cpu_s": 0.1,
            "reward/perf/cpu_s": 0.1,
        },
    ]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    r = bench.read_run(run)
    assert abs(r["cores_steps_per_s"] - 2 / (0.4 + 0.4)) < 1e-12  # the longer side, rollout + reward in series
    assert abs(r["two_cores_steps_per_s"] - 2 / ((0.7 + 0.6) / 2)) < 1e-12  # all of it over two cores


def test_the_cpu_sides_and_what_other_machines_would_give(tmp_path):
    bench = load_script("async")
    sync, own = tmp_path / "sync", tmp_path / "own"
    sync.mkdir()
    own.mkdir()
    # A synchronous step: 60 ms of CPU, 20 of them on the rollout's side (prompts, gen, reward).
    step = {
        "timing_s/step": 0.062,
        "timing_cpu_s/step": 0.060,
        "timing_cpu_s/prompts": 0.002,
        "timing_cpu_s/gen": 0.014,
        "timing_cpu_s/reward": 0.004,
        "timing_cpu_s/update_actor": 0.030,
    }
    (sync / "metrics.jsonl").write_text("\n".join(json.dumps({"step": s, **step}) for s in range(1, 4)))
    mine = {
        "timing_s/step": 0.05,
        "timing_cpu_s/step": 0.038,
        "off_policy/trainer_process_cpu_s": 0.050,
        "rollout/perf/cpu_s": 0.018,
        "reward/perf/cpu_s": 0.004,
    }
    (own / "metrics.jsonl").write_text("\n".join(json.dumps({"step": s, **mine}) for s in range(1, 4)))
    s, o = bench.cpu_sides(sync, skip=0), bench.cpu_sides(own, skip=0)
    assert abs(s["trainer"] - 40.0) < 1e-9 and abs(s["rollout"] - 20.0) < 1e-9
    assert abs(o["trainer"] - 50.0) < 1e-9 and abs(o["rollout"] - 22.0) < 1e-9
    stages = bench.stage_medians(sync, skip=0)
    assert abs(stages["timing_cpu_s/gen"] - 14.0) < 1e-9 and bench._label("timing_cpu_s/gen") == "gen CPU"
    p = bench.projections(s, o, sync_step_ms=62.0, gpu_step_ms=1000.0)
    assert abs(p["overhead_ms"] - 10.0) < 1e-9  # the trainer's process against the synchronous trainer side
    assert abs(p["cores"] - 62.0 / 50.0) < 1e-9  # a core per process: the trainer's process is the longer side
    assert abs(p["ceiling"] - 60.0 / 40.0) < 1e-9
    # A 1 s synchronous step split 2:1, the overhead on the trainer's 667 ms: 1000 / 676.7.
    assert abs(p["gpu"] - 1000.0 / (1000.0 * 2 / 3 + 10.0)) < 1e-9
    # A run without CPU figures (an older one) has no sides.
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "metrics.jsonl").write_text(json.dumps({"step": 1, "timing_s/step": 0.05}))
    assert bench.cpu_sides(tmp_path / "old", skip=0) == {}


def test_where_the_compositions_cpu_goes():
    bench = load_script("async")
    sync = {
        "timing_cpu_s/step": 53.0,
        "timing_cpu_s/update_actor": 26.0,
        "timing_cpu_s/adv": 1.5,
        "timing_cpu_s/prompts": 1.8,
        "timing_cpu_s/gen": 16.0,
    }
    own = {
        "timing_cpu_s/step": 41.0,
        "timing_cpu_s/update_actor": 30.0,
        "timing_cpu_s/adv": 2.0,
        "timing_cpu_s/async/dispatch": 3.0,
        "timing_cpu_s/async/wait": 0.5,
        "timing_cpu_s/async/rollout_gen": 1.5,
        "off_policy/trainer_cpu_s": 40.0,
        "off_policy/trainer_process_cpu_s": 50.0,
        "off_policy/helper_cpu_s/data_plane": 3.0,
        "off_policy/helper_cpu_s/weights": 2.5,
        "off_policy/helper_cpu_s/rollout": 1.5,
    }
    items = bench.overhead_items(sync, own)
    # The rest of the step: own 41 - (30 + 2 + 0.5 + 3) = 5.5 against sync 53 - (26 + 1.5 + 1.8 + 16) = 7.7.
    assert items.pop("rest of the step") == pytest.approx(5.5 - 7.7)
    assert items == {
        "adv": 0.5,
        "update_actor": 4.0,
        "async/wait": 0.5,
        "async/dispatch": 3.0,
        "rollout threads": 1.5,
        "data_plane threads": 3.0,
        "weights threads": 2.5,
        "other threads": 3.0,
    }


def test_figures_over_rounds_are_medians_of_those_every_round_has():
    bench = load_script("async")
    rounds = [{"a": 1.0, "b": 5.0}, {"a": 3.0, "b": 7.0, "c": 1.0}, {"a": 2.0, "b": 6.0}]
    assert bench.over_rounds(rounds) == {"a": 2.0, "b": 6.0}
    assert bench.over_rounds([]) == {}
