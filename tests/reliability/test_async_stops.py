"""Stops in asynchronous training always end: with many batches queued on the rollout's thread, and when it fails.

Each case runs `conveyor train` in async mode as a user would (stdin closed),
and checks the exit status, the last stderr line and that no process of the
run is left behind. The rollout runs on a thread of the trainer's process
(`rollout_process=trainer`: a SIGKILL takes it down with the trainer) and,
in the last cases, in Ray actors of its own, which a SIGKILL of the trainer
must not leave behind.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import psutil
import pytest

# A staleness bound far beyond the run's length: the trainer still hands out only batches some step will train.
ASYNC = (
    "trainer.v1.trainer_mode=separate_async",
    "trainer.v1.sampler.max_off_policy_threshold=1000",
    "trainer.v1.separate_async.rollout_process=trainer",
)
OWN = ASYNC[:2] + ("trainer.v1.separate_async.rollout_process=own", "ray.num_cpus=4")


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _assert_all_gone(procs: list[psutil.Process], within: float) -> None:
    """Every one of `procs` has ended (or is a zombie nobody reaps) within `within` seconds."""
    deadline = time.monotonic() + within
    alive = procs
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.1)
    assert not alive, [(p.pid, p.cmdline()) for p in alive]


def _kill_all(procs: list[psutil.Process]) -> None:
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass


@pytest.mark.parametrize(
    "signum, status, last", [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "stopped by SIGTERM")]
)
def test_a_stop_during_start_up_ends_the_run(
    rel, base_model, tmp_path: Path, processes, signum: int, status: int, last: str
) -> None:
    # Before the first step: the workers, the rollout worker group and the data plane are being built.
    proc = rel.TrainProcess(tmp_path / "run", "trainer.total_training_steps=2", *ASYNC)
    processes.append(proc)
    rel.wait_until(lambda: "run plan:" in proc.stderr, proc, interval=0.01)
    children = _descendants(proc.proc.pid)
    proc.proc.send_signal(signum)
    try:
        assert proc.wait(timeout=60) == status, proc.stderr[-3000:]
    finally:
        _kill_all(children)
    err = proc.stderr
    assert "Traceback" not in err and err.strip().splitlines()[-1] == last, err[-3000:]
    _assert_all_gone(children, within=5)


def _after_step_1(rel, processes, tmp_path: Path, mode: tuple[str, ...] = ASYNC):
    """An async run that has logged step 1, with far more batches queued ahead than the rollout can finish soon."""
    run_dir = tmp_path / "run"
    proc = rel.TrainProcess(run_dir, "trainer.total_training_steps=200", *mode)
    processes.append(proc)
    # Step 1 ends although the bound (1000) is far beyond the run: only batches a step will train are handed out.
    rel.wait_until(lambda: 1 in rel.logged_steps(run_dir), proc)
    return proc


@pytest.mark.parametrize(
    "signum, status, last, mode",
    [
        (signal.SIGINT, 130, "interrupted", ASYNC),
        (signal.SIGTERM, 143, "stopped by SIGTERM", ASYNC),
        (signal.SIGTERM, 143, "stopped by SIGTERM", OWN),
    ],
    ids=["sigint", "sigterm", "sigterm-own-process"],
)
def test_a_stop_with_batches_queued_ends_the_run_without_generating_them(
    rel, base_model, tmp_path: Path, processes, signum: int, status: int, last: str, mode: tuple[str, ...]
) -> None:
    if mode is OWN:
        pytest.importorskip("ray")
    proc = _after_step_1(rel, processes, tmp_path, mode)
    children = _descendants(proc.proc.pid)
    proc.proc.send_signal(signum)
    t0 = time.monotonic()
    try:
        assert proc.wait(timeout=60) == status, proc.stderr[-3000:]
    finally:
        _kill_all(children)  # a failed test must not leave them running either
    # The step in progress finishes and the batch being generated ends; the ~200 queued ones never start.
    assert time.monotonic() - t0 < 30
    err = proc.stderr
    assert "Traceback" not in err and err.strip().splitlines()[-1] == last, err[-3000:]
    _assert_all_gone(children, within=5)
    assert rel.checkpoint_steps(tmp_path / "run")  # the finished step was saved


def test_a_reward_function_that_raises_in_async_mode_is_one_error(rel, base_model, tmp_path: Path) -> None:
    plugin = tmp_path / "raises.py"
    plugin.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    raise RuntimeError('grader crashed on ' + repr(solution_str))\n"
    )
    done = rel.run_cli(
        *rel.train_args(
            tmp_path / "run", "trainer.total_training_steps=2", *ASYNC, f"reward.custom_reward_function.path={plugin}"
        )
    )
    rel.assert_usage_error(
        done.returncode, done.stderr, ("compute_reward", "raises.py", "RuntimeError: grader crashed")
    )


def test_sigkill_of_the_trainer_leaves_no_process_of_a_rollout_in_processes_of_its_own(
    rel, base_model, tmp_path: Path, processes
) -> None:
    pytest.importorskip("ray")
    proc = _after_step_1(rel, processes, tmp_path, OWN)
    family = _descendants(proc.proc.pid)  # Ray's raylet and agents, the rollout replica, the reward worker
    assert any("RankActor" in " ".join(p.cmdline()) for p in family if p.is_running()), [p.cmdline() for p in family]
    proc.proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    try:
        _assert_all_gone(family, within=10)
    finally:
        _kill_all(family)
