"""Smoke test: the distillation benchmark trains a teacher, exports it, distils a student and prints its table."""

from __future__ import annotations

import subprocess
import sys

import pytest
from benchmark_scripts import load_script, script_path


def test_first_reaching_needs_a_window_of_validations_at_the_target() -> None:
    bench = load_script("distillation")
    curve = [(0, 0.3), (10, 0.7), (20, 0.5), (30, 0.6), (40, 0.7), (50, 0.65), (60, 0.7)]
    # The lucky 0.7 at step 10 is not the curve reaching 0.64: (0.7 + 0.5 + 0.6) / 3 < 0.64.
    assert bench.first_reaching(curve, 0.64) == 30
    assert bench.first_reaching(curve, 0.64, window=1) == 10
    assert bench.first_reaching(curve, 0.9) is None


def test_the_recipe_is_the_example_config_with_the_runs_overrides() -> None:
    bench = load_script("distillation")
    assert bench.DISTILL_RUN.name == "distill_tiny.yaml"
    recipe = bench.load_recipe(bench.DISTILL_RUN, ["trainer.total_training_steps=300"])
    assert "loss_mode=full_reverse_kl, use_task_rewards=false, 256 prompts x n=1 per step" in recipe
    assert "lr 0.001 (cosine, floor 0," in recipe and recipe.endswith("300 steps")
    group = [
        "actor_rollout_ref.rollout.n=8",
        "data.train_batch_size=32",
        "actor_rollout_ref.actor.ppo_mini_batch_size=32",
    ]
    assert "32 prompts x n=8 per step (mini-batch 32 prompts)" in bench.load_recipe(bench.DISTILL_RUN, group)


@pytest.mark.slow
def test_distillation_benchmark_small(tmp_path) -> None:
    tiny = [
        "actor_rollout_ref.model.tiny.warmstart_steps=0",
        "data.synthetic.num_train=64",
        "data.synthetic.num_val=8",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.rollout.n=2",
    ]
    args = ["--seeds", "0", "--grpo-steps", "2", "--test-freq", "1", "--parallel", "1", "--out", str(tmp_path)]

    def bench(*more: str) -> str:
        done = subprocess.run(
            [sys.executable, str(script_path("distillation")), *args, *more, "--set", *tiny],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        return done.stdout

    out = bench()
    assert "teacher: GRPO seed 0 after 2 steps" in out
    assert "| 0 |" in out and "ratio distillation / GRPO" in out
    assert (tmp_path / "teacher" / "config.json").is_file()
    assert (tmp_path / "distill_seed0" / "metrics.jsonl").is_file()
    # A variant under --reuse keeps the finished GRPO run and trains only its own distillation run.
    grpo_metrics = tmp_path / "grpo_seed0" / "metrics.jsonl"
    before = grpo_metrics.stat().st_mtime_ns
    out = bench("--reuse", "--tag", "lr2", "--distill-lr", "2e-3")
    assert grpo_metrics.stat().st_mtime_ns == before
    assert "lr 0.002 (cosine" in out
    assert (tmp_path / "distill_lr2_seed0" / "metrics.jsonl").is_file()
