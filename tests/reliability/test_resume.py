"""A run stopped after a checkpoint and resumed in a new process continues exactly as if never stopped.

Exactness is bitwise on CPU: rewards, losses, gradient norms, entropy,
response lengths and every other metric that does not measure time or memory
must equal those of the uninterrupted reference run (conftest.reference_run).
A wrong-path resume is covered with the other usage errors in test_bad_input.
"""

from __future__ import annotations

from pathlib import Path

from conveyor.trainer.checkpoint import load_checkpoint


def test_resume_in_a_new_process_repeats_the_uninterrupted_run(rel, reference_run, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = rel.run_cli(
        *rel.train_args(run_dir, "trainer.total_training_steps=2", "trainer.save_freq=1", "trainer.max_ckpt_to_keep=1")
    )
    assert first.returncode == 0, first.stderr[-3000:]
    # max_ckpt_to_keep=1: step 1's checkpoint was pruned when step 2's was written.
    assert rel.checkpoint_steps(run_dir) == [2]
    step2 = run_dir / "checkpoints" / "global_step_2"
    state = load_checkpoint(step2)["trainer_state"]
    assert state["global_step"] == 2 and state["dataset"]["position"] == 2 * 8
    stamp = {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in step2.iterdir()}

    # resume_path: continue step 2 of this run in another run directory.
    other = tmp_path / "other"
    branch = rel.run_cli(
        *rel.train_args(
            other,
            "trainer.total_training_steps=3",
            "trainer.resume_mode=resume_path",
            f"trainer.resume_from_path={step2}",
        )
    )
    assert branch.returncode == 0, branch.stderr[-3000:]
    assert "resumed from" in branch.stderr and "(step 2)" in branch.stderr
    assert rel.logged_steps(other) == [3] and rel.checkpoint_steps(other) == [3]
    rel.assert_same_steps(rel.read_steps(other), reference_run, [3])
    assert {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in step2.iterdir()} == stamp  # only read

    # auto: the newest checkpoint of the run directory itself.
    second = rel.run_cli(
        *rel.train_args(
            run_dir,
            "trainer.total_training_steps=4",
            "trainer.save_freq=1",
            "trainer.max_ckpt_to_keep=2",
            "trainer.resume_mode=auto",
        )
    )
    assert second.returncode == 0, second.stderr[-3000:]
    assert "(step 2)" in second.stderr
    assert rel.checkpoint_steps(run_dir) == [3, 4]  # pruned to the newest two
    assert rel.logged_steps(run_dir) == [1, 2, 3, 4]  # nothing repeated, nothing skipped
    rel.assert_same_steps(rel.read_steps(run_dir), reference_run, [1, 2, 3, 4])
    # Steps 3-4 carry a learning signal, so equality is not equality of zeros.
    assert any(reference_run[s]["actor/grad_norm"] > 0 for s in (3, 4))
    assert any(reference_run[s]["reward/mean"] > 0 for s in (3, 4))


def test_a_resumed_run_logs_the_router_metrics_of_the_uninterrupted_run(rel, base_model, tmp_path: Path) -> None:
    # Every 2 steps, so that the checkpoint of step 1 holds a half-full interval: the router-margin and load counts of
    # step 1, which step 2 logs with its own.
    moe = "actor_rollout_ref.rollout.moe_load_balance_metrics_interval=2"
    reference = tmp_path / "reference"
    whole = rel.run_cli(*rel.train_args(reference, moe, "trainer.total_training_steps=2", "trainer.save_freq=0"))
    assert whole.returncode == 0, whole.stderr[-3000:]
    run_dir = tmp_path / "run"
    first = rel.run_cli(*rel.train_args(run_dir, moe, "trainer.total_training_steps=1", "trainer.save_freq=1"))
    assert first.returncode == 0, first.stderr[-3000:]
    state = load_checkpoint(run_dir / "checkpoints" / "global_step_1")["trainer_state"]
    assert state["router_margins"]["known"] is not None and state["moe_load"]["counts"] is not None
    second = rel.run_cli(*rel.train_args(run_dir, moe, "trainer.total_training_steps=2", "trainer.resume_mode=auto"))
    assert second.returncode == 0, second.stderr[-3000:]
    assert "(step 1)" in second.stderr
    got, ref = rel.read_steps(run_dir), rel.read_steps(reference)
    rel.assert_same_steps(got, ref, [1, 2])
    logged = [k for k in ref[2] if k.startswith(("rollout/moe/near_tie/", "rollout/moe/margin_hist/"))]
    assert len(logged) > 4 and any(ref[2][k] > 0 for k in logged)  # the comparison covers them, and not as zeros
