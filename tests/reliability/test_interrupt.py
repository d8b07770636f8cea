"""Ctrl-C: the running step finishes and is saved, the data plane is closed, the exit is clean, resume continues.

A step cut off half-way has already advanced the prompt order and may have
updated the model, so no checkpoint can describe it: the trainer finishes the
step on the first Ctrl-C, and an interrupt that does land mid-step (a second
Ctrl-C) saves nothing rather than a checkpoint that lies about its step.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import pytest

from conveyor.config import load_config
from conveyor.data_plane.memory import MemoryDataPlane
from conveyor.trainer import run
from conveyor.trainer.checkpoint import load_checkpoint
from conveyor.trainer.run import run_training


def test_ctrl_c_saves_the_running_step_exits_130_and_resume_continues(
    rel, reference_run, tmp_path: Path, processes
) -> None:
    run_dir = tmp_path / "run"
    total = rel.TOTAL_STEPS
    # save_freq=0: the only checkpoint mid-run can come from the interrupt.
    proc = rel.TrainProcess(run_dir, f"trainer.total_training_steps={total}")
    processes.append(proc)
    rel.wait_until(lambda: 2 in rel.logged_steps(run_dir), proc)
    proc.proc.send_signal(signal.SIGINT)
    assert proc.wait() == 130
    err = proc.stderr
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == "interrupted"
    assert "Ctrl-C" in err  # the user is told what happens to the running step
    saved = rel.checkpoint_steps(run_dir)
    assert len(saved) == 1, saved
    k = saved[0]
    # The checkpoint is of the last step that finished, and every finished step was logged once.
    assert 2 <= k < total
    assert rel.logged_steps(run_dir) == list(range(1, k + 1))
    state = load_checkpoint(run_dir / "checkpoints" / f"global_step_{k}")["trainer_state"]
    assert state["global_step"] == k and state["dataset"]["position"] == k * 8

    resumed = rel.run_cli(*rel.train_args(run_dir, f"trainer.total_training_steps={total}"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"(step {k})" in resumed.stderr
    assert rel.logged_steps(run_dir) == list(range(1, total + 1))
    rel.assert_same_steps(rel.read_steps(run_dir), reference_run, range(1, total + 1))


class _InstrumentedPlane(MemoryDataPlane):
    """The real memory data plane; optionally raises KeyboardInterrupt at one read, as a Ctrl-C landing there would."""

    interrupt_at: tuple[str, str] | None = None  # (partition, a field the read asks for)

    def kv_batch_get(self, keys, partition_id, select_fields):
        if self.interrupt_at is not None:
            part, field = self.interrupt_at
            if partition_id == part and field in select_fields:
                raise KeyboardInterrupt
        return super().kv_batch_get(keys, partition_id, select_fields)

    def _release(self) -> None:
        self.left_at_close = self.list_partitions()  # what the run failed to clear itself
        super()._release()


class _Planes:
    """The data planes run_training built in a test (kept for inspection), and where the next one interrupts."""

    def __init__(self) -> None:
        self.made: list[_InstrumentedPlane] = []
        self.interrupt_at: tuple[str, str] | None = None

    def build(self, cfg, registry=None) -> _InstrumentedPlane:
        plane = _InstrumentedPlane()
        plane.interrupt_at = self.interrupt_at
        self.made.append(plane)
        return plane


@pytest.fixture
def planes(monkeypatch: pytest.MonkeyPatch) -> _Planes:
    """run_training builds instrumented (but real) memory data planes during the test."""
    recorder = _Planes()
    monkeypatch.setattr(run, "build_data_plane", recorder.build)
    return recorder


def test_sigint_in_process_finishes_the_step_and_closes_the_data_plane(rel, base_model, tmp_path: Path, planes) -> None:
    run_dir = tmp_path / "run"
    cfg = load_config(None, rel.BASE_RUN + [f"trainer.default_local_dir={run_dir}", "trainer.total_training_steps=40"])
    main = threading.main_thread().ident
    assert main == threading.get_ident()

    def interrupt_after_step_1() -> None:
        deadline = time.monotonic() + 120
        while 1 not in rel.logged_steps(run_dir) and time.monotonic() < deadline:
            time.sleep(0.002)
        signal.pthread_kill(main, signal.SIGINT)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    sender = threading.Thread(target=interrupt_after_step_1, daemon=True)
    sender.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            run_training(cfg)
    finally:
        sender.join()
        signal.signal(signal.SIGINT, previous)
    (plane,) = planes.made
    assert plane.closed and plane.left_at_close == []
    (k,) = rel.checkpoint_steps(run_dir)
    assert k == max(rel.logged_steps(run_dir)) and k < 40


def test_interrupt_in_the_middle_of_a_step_saves_no_mislabelled_checkpoint(
    rel, base_model, tmp_path: Path, planes
) -> None:
    run_dir = tmp_path / "run"
    cfg = load_config(
        None,
        rel.BASE_RUN
        + [
            f"trainer.default_local_dir={run_dir}",
            "trainer.total_training_steps=3",
            "trainer.save_freq=1",
            "trainer.max_ckpt_to_keep=null",
        ],
    )
    # Step 3's metrics read comes after its actor update: the model has moved, the step is not done.
    planes.interrupt_at = ("train-3", "returns")
    with pytest.raises(KeyboardInterrupt):
        run_training(cfg)
    assert planes.made[0].closed and planes.made[0].left_at_close == []
    assert rel.checkpoint_steps(run_dir) == [1, 2]
    assert rel.logged_steps(run_dir) == [1, 2]
    # Checkpoint 2 still describes the end of step 2, not a half-done step 3.
    state = load_checkpoint(run_dir / "checkpoints" / "global_step_2")["trainer_state"]
    assert state["global_step"] == 2 and state["dataset"]["position"] == 2 * 8

    planes.interrupt_at = None
    run_training(cfg)
    assert rel.logged_steps(run_dir) == [1, 2, 3]
    assert rel.checkpoint_steps(run_dir) == [1, 2, 3]
