"""Short end-to-end runs: every metric the trainer promises is logged, for GRPO and for GAE with a critic."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from conveyor.config import load_config
from conveyor.metrics.trackers import read_metrics_jsonl
from conveyor.trainer.run import run_training

STEP_KEYS = [
    "reward/mean",
    "reward/max",
    "reward/min",
    "response_length/mean",
    "response_length/max",
    "response_length/clip_ratio",
    "advantages/mean",
    "advantages/max",
    "advantages/min",
    "returns/mean",
    "actor/entropy",
    "actor/pg_loss",
    "actor/pg_clipfrac",
    "actor/ppo_kl",
    "actor/grad_norm",
    "timing_s/gen",
    "timing_s/reward",
    "timing_s/old_log_prob",
    "timing_s/adv",
    "timing_s/update_actor",
    "timing_s/step",
    "perf/throughput",
    "actor/perf/max_memory_allocated_gb",
    "actor/perf/max_memory_reserved_gb",
    "actor/perf/cpu_memory_used_gb",
]


def _rows(run_dir):
    return {r["step"]: r for r in read_metrics_jsonl(run_dir / "metrics.jsonl")}


def test_grpo_run_logs_every_promised_metric(tiny_run, tmp_path):
    run_training(load_config(None, tiny_run + ["trainer.test_freq=2", "trainer.dump_freq=1"]))
    rows = _rows(tmp_path)
    assert sorted(rows) == [0, 1, 2]
    assert set(rows[0]) >= {"val/accuracy", "val/reward"}, "validation runs before the first update"
    assert "val/accuracy" in rows[2]
    for step in (1, 2):
        missing = [k for k in STEP_KEYS if k not in rows[step]]
        assert not missing, f"step {step} lacks {missing}"
        assert all(math.isfinite(rows[step][k]) for k in STEP_KEYS)
        assert rows[step]["actor/perf/max_memory_allocated_gb"] > 0
        # Bypass mode (the default here): no old-log-prob forward, so no sampler/trainer comparison.
        assert "rollout_corr/log_prob_abs_diff/mean" not in rows[step]
    assert (tmp_path / "config.yaml").is_file()
    # The run plan is saved next to the config: the decisions the run made, and why.
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["old_log_probs"] == "rollout" and plan["decisions"]
    assert (tmp_path / "checkpoints" / "global_step_2" / "actor" / ".metadata").is_file()
    assert sorted(p.name for p in (tmp_path / "generations").iterdir()) == ["step_000001.jsonl", "step_000002.jsonl"]


def test_gae_with_critic_and_kl_logs_critic_metrics(tiny_run, tmp_path):
    run_training(
        load_config(
            None,
            tiny_run
            + [
                "algorithm.adv_estimator=gae",
                "algorithm.gamma=0.99",
                "algorithm.lam=0.95",
                "actor_rollout_ref.actor.use_kl_loss=true",
                "algorithm.rollout_correction.bypass_mode=false",
                "trainer.dump_freq=100",
            ],
        )
    )
    rows = _rows(tmp_path)
    # Two steps with dump_freq 100: no step is a multiple of it, and the last step is dumped all the same.
    assert sorted(p.name for p in (tmp_path / "generations").iterdir()) == ["step_000002.jsonl"]
    for step in (1, 2):
        row = rows[step]
        # With the old-log-prob forward on, the sampler and the trainer agree on every log-prob.
        assert 0 <= row["rollout_corr/log_prob_abs_diff/max"] < 1e-4
        for key in (
            "critic/vf_loss",
            "critic/vf_clipfrac",
            "critic/grad_norm",
            "values/mean",
            "timing_s/values",
            "timing_s/update_critic",
            "timing_s/ref",
            "actor/kl_loss",
        ):
            assert key in row and math.isfinite(row[key]), key
    assert (tmp_path / "checkpoints" / "global_step_2" / "critic" / ".metadata").is_file()


@pytest.mark.parametrize("estimator", ["rloo", "reinforce_plus_plus"])
def test_other_estimators_run(tiny_run, tmp_path, estimator):
    run_training(
        load_config(None, tiny_run + [f"algorithm.adv_estimator={estimator}", "trainer.total_training_steps=1"])
    )
    assert 1 in _rows(tmp_path)


def test_cli_train_prints_accuracy_line(tiny_run, tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "conveyor.cli", "train", *tiny_run, "trainer.logger=[console,jsonl]"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    assert "held-out exact-match accuracy: step 0 = " in out.stdout
    assert "Traceback" not in out.stderr
