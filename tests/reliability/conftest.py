"""Shared helpers of the reliability tests: one small deterministic run, CLI subprocesses, metric comparison.

Every run here is a real `conveyor train` in a child process (or `run_training`
in this one), on the tiny MoE model with a short warm start so that rewards,
losses and gradients are not all zero: an exactness check on all-zero
metrics would prove nothing. Child processes use one thread, which keeps
them deterministic and cheap on a shared machine.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

_THIS = sys.modules[__name__]

ROOT = Path(__file__).resolve().parents[2]

# 8 prompts x 4 samples, two optimizer steps per training step; single-digit
# sums and a 40-step warm start so the policy answers with digits and earns
# partial credit from the first step.
BASE_RUN = [
    "data.train_batch_size=8",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "data.synthetic.num_train=64",
    "data.synthetic.num_val=8",
    "data.synthetic.max_operand=9",
    "actor_rollout_ref.model.tiny.warmstart_steps=40",
    "trainer.test_freq=0",
    "trainer.val_before_train=false",
    "trainer.logger=[jsonl]",
    "trainer.progress_bar=false",
    "trainer.dump_freq=0",
    # Runs here stop and resume with different trainer.total_training_steps; a cosine
    # schedule's horizon is that total, so only a constant lr makes their steps comparable.
    "actor_rollout_ref.actor.optim.lr_scheduler=constant",
]
TOTAL_STEPS = 6
"""Length of the reference run every crash test is compared with."""

# Metrics that depend on wall time or on the process's memory, not on the math.
_VOLATILE = re.compile(r"^(timing_s/|timing_cpu_s/|rollout/gen_time_s$|perf/throughput$|val/)|/perf/")

# The keys an exactness check must at least cover.
CORE_KEYS = ("reward/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "response_length/mean")


def cli_env() -> dict[str, str]:
    """The environment of a child `conveyor` process: this checkout, the session's model cache, one thread."""
    env = {k: v for k, v in os.environ.items() if k != "CONVEYOR_DEBUG"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    env["MKL_NUM_THREADS"] = "1"
    env["TOKENIZERS_PARALLELISM"] = "false"
    return env


def assert_usage_error(status: Any, stderr: str, needles: tuple[str, ...]) -> None:
    """Exit status 2, no traceback, and a last stderr line `error: ...` holding every one of `needles`."""
    assert status == 2, (status, stderr[-3000:])
    assert "Traceback" not in stderr, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("error: "), stderr[-3000:]
    for needle in needles:
        assert needle in last, (needle, last)


def main_in_process(argv: list[str], capsys: Any) -> tuple[int, str]:
    """Exit status and stderr of `conveyor ARGV` run by its entry point in this process (any exception escapes)."""
    from conveyor.cli import main

    root = logging.getLogger()
    for handler in list(root.handlers):  # main() sets up logging on the stderr of the moment, a capture now gone
        root.removeHandler(handler)
    capsys.readouterr()
    status = main(argv)
    return status, capsys.readouterr().err


_CASES_DRIVER = r"""
import contextlib, io, json, logging, sys, traceback

from conveyor.cli import main

cases = json.loads(open(sys.argv[1]).read())
results = {}
for case_id, argv in cases.items():
    root = logging.getLogger()
    for handler in list(root.handlers):  # main() sets up logging on this case's stderr
        root.removeHandler(handler)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(argv)
        except SystemExit as exc:
            status = exc.code
        except BaseException:
            status = "uncaught"
            err.write(traceback.format_exc())
    results[case_id] = {"status": status, "stdout": out.getvalue(), "stderr": err.getvalue()}
open(sys.argv[2], "w").write(json.dumps(results))
"""


def run_cases_in_one_process(cases: dict[str, list[str]], tmp: Path, timeout: float = 600) -> dict[str, dict]:
    """Each case's `conveyor` arguments through the command's entry point, one after another in one child process.

    The model stack is imported once for all of them (the child is forked from
    the server of `run_cli`, which has imported it already). The child runs in
    `tmp` (a relative run directory lands there) with stdin closed, as under a
    scheduler: nothing may wait for an answer. Returns case -> {"status",
    "stdout", "stderr"}.
    """
    (tmp / "cases.json").write_text(json.dumps(cases))
    (tmp / "driver.py").write_text(_CASES_DRIVER)
    proc = _cli_server().run(
        str(tmp / "cases.json"), str(tmp / "results.json"), script=tmp / "driver.py", cwd=tmp, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp / "results.json").read_text())
    assert results.keys() == cases.keys()
    return results


_SERVER: list = []  # the session's CliServer, started on first use


def run_cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """`python -m conveyor.cli ARGS` to completion in a fresh child process, output captured as text.

    The child is forked from a server that imported the stack once (tests/cli_server.py): a `conveyor train`
    spends ~6 s importing it. It runs the command's module as `__main__` in its own process, with its own
    stdout, stderr and exit status, and its stdin closed; a child still running after `timeout` seconds is killed
    (status -9).
    """
    return _cli_server().run(*args, timeout=timeout)


def _cli_server():
    if not _SERVER:
        from cli_server import CliServer

        _SERVER.append(CliServer(ROOT, cli_env(), Path(tempfile.mkdtemp(prefix="cli-server-")) / "stderr"))
    return _SERVER[0]


def train_args(run_dir: Path, *extra: str) -> list[str]:
    """`train` arguments of the base run writing into `run_dir`, then `extra` overrides."""
    return ["train", *BASE_RUN, f"trainer.default_local_dir={run_dir}", *extra]


class TrainProcess:
    """A `conveyor train` child running in the background; its output goes to files beside the run."""

    def __init__(self, run_dir: Path, *extra: str):
        self.run_dir = run_dir
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        stem = run_dir.parent / f"{run_dir.name}-{time.monotonic_ns()}"
        self.stdout_path, self.stderr_path = stem.with_suffix(".out"), stem.with_suffix(".err")
        with open(self.stdout_path, "w") as out, open(self.stderr_path, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "conveyor.cli", *train_args(run_dir, *extra)],
                cwd=ROOT,
                env=cli_env(),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
            )

    @property
    def stderr(self) -> str:
        """Everything the child wrote to stderr so far."""
        return self.stderr_path.read_text()

    def wait(self, timeout: float = 240) -> int:
        """Wait for the child to exit; its exit status (negative: killed by that signal)."""
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        """End the child if it is still running (cleanup after a failed assertion)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def processes():
    """Collects TrainProcess objects and kills any still running when the test ends."""
    started: list[TrainProcess] = []
    yield started
    for p in started:
        p.kill()


def wait_until(cond: Callable[[], bool], proc: TrainProcess, timeout: float = 180, interval: float = 0.002) -> None:
    """Poll `cond` until true; fail if the child exits first or the time runs out."""
    deadline = time.monotonic() + timeout
    while not cond():
        if proc.proc.poll() is not None:
            pytest.fail(f"the run exited with {proc.proc.returncode} before the awaited point:\n{proc.stderr[-3000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for the run:\n{proc.stderr[-3000:]}")
        time.sleep(interval)


def logged_steps(run_dir: Path) -> list[int]:
    """Steps of every complete line of metrics.jsonl, in file order (duplicates kept, a torn line skipped)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    steps = []
    for line in path.read_text().splitlines():
        try:
            steps.append(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return steps


def checkpoint_steps(run_dir: Path) -> list[int]:
    """Steps of the complete checkpoints of a run, oldest first."""
    from conveyor.trainer.checkpoint import list_checkpoints

    return [s for s, _ in list_checkpoints(run_dir / "checkpoints")]


def has_checkpoint(run_dir: Path, step: int) -> bool:
    """Whether checkpoint `step` is complete (it only ever appears complete, by one rename)."""
    return (run_dir / "checkpoints" / f"global_step_{step}" / "trainer_state.pt").is_file()


def read_steps(run_dir: Path) -> dict[int, dict[str, Any]]:
    """Step -> metrics record as the run's reader returns them (last record per step)."""
    from conveyor.metrics.trackers import read_metrics_jsonl

    return {r["step"]: r for r in read_metrics_jsonl(run_dir / "metrics.jsonl")}


def comparable(record: dict[str, Any]) -> dict[str, Any]:
    """The metrics of a step that must repeat exactly: everything but timings, memory and validation."""
    return {k: v for k, v in record.items() if not _VOLATILE.search(k)}


def assert_same_steps(got: dict[int, dict], ref: dict[int, dict], steps: range | list[int]) -> None:
    """Each of `steps` has exactly the reference run's metrics (bitwise equal floats, same keys)."""
    for s in steps:
        assert s in got, f"step {s} is missing from the metrics (have {sorted(got)})"
        a, b = comparable(got[s]), comparable(ref[s])
        assert all(k in b for k in CORE_KEYS), sorted(b)
        assert a.keys() == b.keys(), (s, sorted(a.keys() ^ b.keys()))
        diff = {k: (a[k], b[k]) for k in a if a[k] != b[k]}
        assert not diff, f"step {s} differs from the uninterrupted run: {diff}"


@pytest.fixture(scope="session")
def rel() -> Any:
    """This module's helpers for the test modules (a conftest cannot be imported by name reliably)."""
    yield _THIS
    while _SERVER:
        server = _SERVER.pop()
        server.close()
        shutil.rmtree(server.log.parent, ignore_errors=True)


@pytest.fixture(scope="session")
def base_model(_conveyor_cache: str) -> str:
    """Build (once per session) the warm-started tiny model every run here uses."""
    from conveyor.config import load_config
    from conveyor.trainer.setup import prepare_default_model

    return prepare_default_model(load_config(None, BASE_RUN))


@pytest.fixture(scope="session")
def reference_run(base_model: str, tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    """Metrics of an uninterrupted TOTAL_STEPS run of the base config (never checkpointed mid-way)."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    proc = run_cli(*train_args(run_dir, f"trainer.total_training_steps={TOTAL_STEPS}"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = read_steps(run_dir)
    assert sorted(steps) == list(range(1, TOTAL_STEPS + 1))
    # The comparison is only worth something if the run actually learns.
    assert any(steps[s]["actor/grad_norm"] > 0 for s in steps)
    assert any(steps[s]["reward/mean"] > 0 for s in steps)
    return steps
