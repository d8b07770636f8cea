"""A rollout replica in a process of its own that dies or hangs costs the run nothing.

Asynchronous runs (k = 1) with the rollout in a Ray actor of its own
(`rollout_process=own`), 12 steps on the warm-started tiny model, as a user
would run them (`conveyor train`, stdin closed). The replica's process is
found by its pid, as an operator would find it, and killed (SIGKILL) or
stopped (SIGSTOP) in the middle of the run: the run replaces it, generates the
batch again with the same seeds, and logs, step for step, exactly the metrics
of a run nobody touched (all but the measured times: `timing_s/*`, `perf/*`,
`fault/*` and the other wall or CPU seconds). Past `max_restarts` the run stops
with one `error:` line naming the replica, and its newest checkpoint loads.

Each run starts a local Ray and rebuilds replicas (a new process importing the
model stack): slow-marked.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import psutil
import pytest

from conveyor.trainer.checkpoint import load_checkpoint

pytestmark = [pytest.mark.slow]

STEPS = 12
OWN = (
    f"trainer.total_training_steps={STEPS}",
    "trainer.v1.trainer_mode=separate_async",
    "trainer.v1.sampler.max_off_policy_threshold=1",
    "trainer.v1.separate_async.rollout_process=own",
    "ray.num_cpus=4",
)

# vLLM's CPU build as the engine: the tiny model with heads its CPU attention serves (32 wide), the engine in the
# replica's process.
VLLM = (
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.model.tiny.num_heads=2",
    "actor_rollout_ref.model.tiny.num_kv_heads=2",
)

# Measured seconds (wall or CPU time, idle fractions) and the fault metrics themselves: all that may differ.
_MEASURED = re.compile(r"^(timing_s/|timing_cpu_s/|fault/)|(^|/)perf/|_s$|_cpu_s/|_idle_frac$")


def _records(run_dir: Path) -> list[str]:
    """metrics.jsonl without the measured keys, one canonical JSON text per step."""
    out = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        out.append(json.dumps({k: v for k, v in record.items() if not _MEASURED.search(k)}, sort_keys=True))
    return out


def _fault_metrics(run_dir: Path) -> dict[int, dict[str, float]]:
    steps = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        fault = {k: v for k, v in record.items() if k.startswith("fault/")}
        if fault:
            steps[record["step"]] = fault
    return steps


def _replica(proc) -> psutil.Process:
    """The replica's process (a Ray actor named RankActor), a descendant of the run's."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for p in psutil.Process(proc.proc.pid).children(recursive=True):
            try:
                if "RankActor" in " ".join(p.cmdline()):
                    return p
            except psutil.Error:
                continue
        time.sleep(0.05)
    raise AssertionError("no replica process found")


@pytest.fixture(scope="module")
def reference(rel, base_model, tmp_path_factory) -> Path:
    """An uninterrupted 12-step run of the same settings and seed."""
    pytest.importorskip("ray")
    run_dir = tmp_path_factory.mktemp("untouched") / "run"
    done = rel.run_cli(*rel.train_args(run_dir, *OWN), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "replacing it" not in done.stderr
    return run_dir


@pytest.fixture(scope="module")
def vllm_reference(rel, base_model, tmp_path_factory) -> Path:
    """An uninterrupted 12-step run with vLLM's CPU build generating."""
    pytest.importorskip("ray")
    pytest.importorskip("vllm")
    run_dir = tmp_path_factory.mktemp("untouched-vllm") / "run"
    done = rel.run_cli(*rel.train_args(run_dir, *OWN, *VLLM), timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "replacing it" not in done.stderr
    return run_dir


def test_sigkill_of_the_replica_in_steps_3_and_7_leaves_the_metrics_of_an_untouched_run(
    rel, reference: Path, tmp_path: Path, processes
) -> None:
    _kill_in_steps_3_and_7(rel, reference, tmp_path / "run", processes, OWN)


def test_sigkill_of_a_vllm_replica_in_steps_3_and_7_leaves_the_metrics_of_an_untouched_run(
    rel, vllm_reference: Path, tmp_path: Path, processes
) -> None:
    # The new replica starts a new engine, which gets the weights its predecessor served and generates the batch
    # again with the same per-request seeds.
    _kill_in_steps_3_and_7(rel, vllm_reference, tmp_path / "run", processes, (*OWN, *VLLM))


def _kill_in_steps_3_and_7(rel, reference: Path, run_dir: Path, processes, overrides: tuple[str, ...]) -> None:
    proc = rel.TrainProcess(run_dir, *overrides)
    processes.append(proc)
    killed = []
    for step in (3, 7):
        rel.wait_until(lambda s=step: s - 1 in rel.logged_steps(run_dir), proc, timeout=600)
        replica = _replica(proc)
        assert replica.pid not in killed  # the one started in place of the first
        os.kill(replica.pid, signal.SIGKILL)
        killed.append(replica.pid)
    assert proc.wait(timeout=900) == 0, proc.stderr[-3000:]
    err = proc.stderr
    assert "Traceback" not in err
    assert err.count("replacing it (restart") == 2, err[-3000:]
    assert _records(run_dir) == _records(reference)
    faults = _fault_metrics(run_dir)
    assert max(f["fault/rollout_restarts"] for f in faults.values()) == 2.0, faults
    assert all(f["fault/reissued_groups"] == 8.0 and f["fault/rollout_restart_s"] > 0 for f in faults.values())


def test_a_stopped_replica_is_taken_as_hung_within_its_timeout_and_replaced(
    rel, reference: Path, tmp_path: Path, processes
) -> None:
    run_dir = tmp_path / "run"
    timeout_s = 4.0
    proc = rel.TrainProcess(
        run_dir,
        *OWN,
        f"actor_rollout_ref.rollout.fault_tolerance.timeout_s={timeout_s}",
        "actor_rollout_ref.rollout.fault_tolerance.health_check_interval_s=0.5",
    )
    processes.append(proc)
    rel.wait_until(lambda: 2 in rel.logged_steps(run_dir), proc, timeout=300)
    replica = _replica(proc)
    replica.send_signal(signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        rel.wait_until(lambda: "answered no call within" in proc.stderr, proc, timeout=120)
        # A stopped replica is noticed once a call to it has waited timeout_s (the call may start a little later).
        assert time.monotonic() - t0 < timeout_s + 10
        assert proc.wait(timeout=600) == 0, proc.stderr[-3000:]
        # The stopped process was killed, not left behind.
        assert not replica.is_running() or replica.status() == psutil.STATUS_ZOMBIE
    finally:
        if replica.is_running():
            replica.kill()
    assert "Traceback" not in proc.stderr
    assert _records(run_dir) == _records(reference)
    assert max(f["fault/rollout_restarts"] for f in _fault_metrics(run_dir).values()) == 1.0


def test_past_max_restarts_the_run_stops_with_one_error_naming_the_replica_and_its_checkpoint_loads(
    rel, base_model, tmp_path: Path, processes
) -> None:
    pytest.importorskip("ray")
    run_dir = tmp_path / "run"
    proc = rel.TrainProcess(
        run_dir, *OWN, "trainer.save_freq=1", "actor_rollout_ref.rollout.fault_tolerance.max_restarts=0"
    )
    processes.append(proc)
    rel.wait_until(lambda: rel.has_checkpoint(run_dir, 2), proc, timeout=300)
    replica = _replica(proc)
    os.kill(replica.pid, signal.SIGKILL)
    assert proc.wait(timeout=300) == 1, proc.stderr[-3000:]
    err = proc.stderr
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"error: rollout replica 0 (pid {replica.pid}) died"), last
    assert "max_restarts=0" in last and "the last complete checkpoint is " in last, last
    newest = Path(last.split("the last complete checkpoint is ")[1].split(":")[0])
    assert newest == run_dir / "checkpoints" / f"global_step_{rel.checkpoint_steps(run_dir)[-1]}"
    state = load_checkpoint(newest)["trainer_state"]
    assert int(state["global_step"]) >= 2
