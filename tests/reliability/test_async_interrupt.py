"""Ctrl-C in asynchronous training: the running step finishes and is saved, batches in flight are regenerated on
resume."""

from __future__ import annotations

import signal
from pathlib import Path

from conveyor.trainer.checkpoint import load_checkpoint

ASYNC = ("trainer.v1.trainer_mode=separate_async", "trainer.v1.sampler.max_off_policy_threshold=1")


def test_ctrl_c_in_async_mode_saves_the_step_and_resume_trains_every_step_once(rel, tmp_path: Path, processes) -> None:
    run_dir = tmp_path / "run"
    total = rel.TOTAL_STEPS
    proc = rel.TrainProcess(run_dir, f"trainer.total_training_steps={total}", *ASYNC)
    processes.append(proc)
    rel.wait_until(lambda: 2 in rel.logged_steps(run_dir), proc)
    proc.proc.send_signal(signal.SIGINT)
    assert proc.wait() == 130
    err = proc.stderr
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "interrupted"
    saved = rel.checkpoint_steps(run_dir)
    assert len(saved) == 1, saved
    k = saved[0]
    assert 2 <= k < total and rel.logged_steps(run_dir) == list(range(1, k + 1))
    state = load_checkpoint(run_dir / "checkpoints" / f"global_step_{k}")["trainer_state"]
    # The batch already handed to the rollout is not in the checkpoint: its prompts are drawn again.
    assert state["global_step"] == k and state["dataset"]["position"] == k * 8

    resumed = rel.run_cli(*rel.train_args(run_dir, f"trainer.total_training_steps={total}", *ASYNC))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert rel.logged_steps(run_dir) == list(range(1, total + 1))
