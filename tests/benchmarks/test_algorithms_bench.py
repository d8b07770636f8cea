"""Smoke test: the algorithms benchmark trains two algorithms for a few steps and prints its table."""

from __future__ import annotations

import subprocess
import sys

from benchmark_scripts import load_script, script_path


def test_algorithms_benchmark_small(tmp_path) -> None:
    tiny = [
        "actor_rollout_ref.model.tiny.warmstart_steps=0",
        "data.synthetic.num_train=64",
        "data.synthetic.num_val=8",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.rollout.n=2",
        "trainer.test_freq=0",
    ]
    done = subprocess.run(
        [
            sys.executable,
            str(script_path("algorithms")),
            "--algorithms",
            "GRPO",
            "DAPO",
            "--seeds",
            "0",
            "--steps",
            "2",
            "--out",
            str(tmp_path),
            "--set",
            *tiny,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "GRPO seed 0: held-out accuracy" in done.stdout and "DAPO seed 0" in done.stdout
    assert "| GRPO |" in done.stdout and "| DAPO |" in done.stdout
    assert (tmp_path / "dapo" / "model0_trainer0" / "metrics.jsonl").exists()


def test_every_benchmarked_algorithm_is_a_valid_config() -> None:
    from conveyor.config import load_config

    bench = load_script("algorithms")
    for _name, overrides in bench.ALGORITHMS.items():
        load_config(None, overrides)  # a renamed key would fail here, not after an hour of sweeping
