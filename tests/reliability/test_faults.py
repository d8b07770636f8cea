"""SIGKILL at the worst moments: in the middle of a step, and in the middle of writing a checkpoint.

After a kill -9 nothing of the run's own cleanup happens; what is on disk must
still be a consistent past: the newest complete checkpoint loads, a torn last
line of metrics.jsonl is skipped, and a run resumed with
`trainer.resume_mode=auto` produces exactly the metrics an uninterrupted run
with the same seed produces.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from conveyor.trainer.checkpoint import load_checkpoint

_TMP_CKPT = re.compile(r"^global_step_(\d+)\.tmp-")


def _kill(proc) -> None:
    os.kill(proc.proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL


def test_sigkill_mid_step_then_resume_matches_the_uninterrupted_run(
    rel, reference_run, tmp_path: Path, processes
) -> None:
    run_dir = tmp_path / "run"
    total, k = rel.TOTAL_STEPS, 3
    proc = rel.TrainProcess(
        run_dir, f"trainer.total_training_steps={total}", "trainer.save_freq=1", "trainer.max_ckpt_to_keep=null"
    )
    processes.append(proc)
    # Step k-1 is logged and saved, so step k is running: kill it there.
    rel.wait_until(lambda: rel.has_checkpoint(run_dir, k - 1) and k - 1 in rel.logged_steps(run_dir), proc)
    _kill(proc)
    assert rel.checkpoint_steps(run_dir) == list(range(1, k))
    assert rel.logged_steps(run_dir) == list(range(1, k))
    # A kill during a write leaves half a line: the resumed run and the reader must cope.
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(f'{{"step": {k}, "reward/mean": 0.12')

    resumed = rel.run_cli(
        *rel.train_args(
            run_dir, f"trainer.total_training_steps={total}", "trainer.save_freq=1", "trainer.max_ckpt_to_keep=null"
        )
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"(step {k - 1})" in resumed.stderr
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert lines[k - 1] == f'{{"step": {k}, "reward/mean": 0.12'  # the torn line stayed on a line of its own
    assert rel.logged_steps(run_dir) == list(range(1, total + 1))
    rel.assert_same_steps(rel.read_steps(run_dir), reference_run, range(1, total + 1))


def _kill_during_a_save(proc, run_dir: Path, min_step: int) -> int | None:
    """Kill the run the moment a checkpoint of step >= min_step is being written; that step, or None if none was."""
    ckpt_dir = run_dir / "checkpoints"
    deadline = time.monotonic() + 240
    while proc.proc.poll() is None and time.monotonic() < deadline:
        try:
            names = os.listdir(ckpt_dir)
        except FileNotFoundError:
            names = []
        for name in names:
            m = _TMP_CKPT.match(name)
            if m and int(m.group(1)) >= min_step:
                os.kill(proc.proc.pid, signal.SIGKILL)
                proc.wait()
                # Only a kill that beat the rename leaves the temporary directory behind.
                return int(m.group(1)) if (ckpt_dir / name).is_dir() else None
        time.sleep(0.0002)
    return None


def test_sigkill_while_saving_a_checkpoint_keeps_the_previous_one_and_resume_works(
    rel, reference_run, tmp_path: Path, processes
) -> None:
    run_dir = tmp_path / "run"
    total = rel.TOTAL_STEPS
    args = (f"trainer.total_training_steps={total}", "trainer.save_freq=1", "trainer.max_ckpt_to_keep=null")
    killed_at = None
    # Each attempt resumes the previous one, so a kill that missed its window still leaves a valid run.
    for _ in range(3):
        proc = rel.TrainProcess(run_dir, *args)
        processes.append(proc)
        killed_at = _kill_during_a_save(proc, run_dir, min_step=max(rel.checkpoint_steps(run_dir), default=0) + 2)
        if killed_at is not None:
            break
    if killed_at is None:
        pytest.fail("could not kill the run while it wrote a checkpoint in three attempts")

    ckpts = rel.checkpoint_steps(run_dir)
    assert killed_at not in ckpts and max(ckpts) == killed_at - 1
    assert any(_TMP_CKPT.match(p.name) for p in (run_dir / "checkpoints").iterdir())
    newest = load_checkpoint(run_dir / "checkpoints" / f"global_step_{killed_at - 1}")
    assert newest["trainer_state"]["global_step"] == killed_at - 1
    assert newest["trainer_state"]["dataset"]["position"] == (killed_at - 1) * 8
    assert set(newest) == {"actor", "trainer_state", "files"} and (newest["actor"] / "param_groups.json").is_file()
    assert newest["files"] == {}  # a synchronous run has no batches in flight: no part file of its own
    # Metrics are logged before the save, so the killed step is already in the file.
    assert killed_at in rel.logged_steps(run_dir)

    resumed = rel.run_cli(*rel.train_args(run_dir, *args))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"(step {killed_at - 1})" in resumed.stderr
    assert rel.checkpoint_steps(run_dir) == list(range(1, total + 1))
    assert not any(_TMP_CKPT.match(p.name) for p in (run_dir / "checkpoints").iterdir())  # cleaned on the next save
    # The killed step was logged twice (before the kill, and again after resuming); the reader keeps the last.
    logged = rel.logged_steps(run_dir)
    assert sorted(set(logged)) == list(range(1, total + 1)) and logged.count(killed_at) == 2
    rel.assert_same_steps(rel.read_steps(run_dir), reference_run, range(1, total + 1))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    twice = [rel.comparable(r) for r in records if r["step"] == killed_at]
    assert twice[0] == twice[1]  # the repeated step is the same step, not a different one
