"""benchmarks/fault.py's reading of a run: steps/s, the fault metrics, and what must equal an untouched run."""

from __future__ import annotations

import json

from benchmark_scripts import load_script


def test_a_runs_rate_its_faults_and_its_comparable_records(tmp_path):
    bench = load_script("fault")
    rows = [
        {"step": 1, "timing_s/step": 0.5, "reward/mean": 0.25, "off_policy/trainer_cpu_s": 0.1},
        {
            "step": 2,
            "timing_s/step": 1.5,
            "reward/mean": 0.5,
            "rollout/weight_sync_s": 0.01,
            "fault/rollout_restarts": 1.0,
            "fault/rollout_recovery_s": 9.5,
            "fault/rollout_restart_s": 8.0,
            "actor/perf/max_memory_allocated_gb": 1.0,
        },
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    r = bench.read_run(tmp_path)
    assert r["steps"] == 2 and r["steps_per_s"] == 1.0
    assert r["faults"] == [
        {"fault/rollout_restarts": 1.0, "fault/rollout_recovery_s": 9.5, "fault/rollout_restart_s": 8.0}
    ]
    # Only what the math decides is compared: measured seconds, memory and the fault metrics are left out.
    assert [json.loads(c) for c in r["comparable"]] == [
        {"step": 1, "reward/mean": 0.25},
        {"step": 2, "reward/mean": 0.5},
    ]
