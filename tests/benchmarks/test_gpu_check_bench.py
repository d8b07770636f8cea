"""benchmarks/gpu_check.sh and its checks (benchmarks/gpu_steps.py) keep working between GPU runs.

The GPU runs them rarely and briefly; here every check runs on the CPU (smaller, float32), the script's
step machinery runs up to its device test, and the wheels it carries are the versions the suite runs with.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
from benchmark_scripts import BENCHMARKS, script_path

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _steps(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(script_path("gpu_steps")), *args], capture_output=True, text=True, timeout=300, env=ENV
    )


@pytest.mark.parametrize("check", ["varlen", "fsdp-step", "packspeed", "fused-logprob", "sp-step"])
def test_each_device_check_passes_on_the_cpu(check: str) -> None:
    done = _steps(check, "--device", "cpu", "--repeats", "1")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.splitlines()[-1].startswith("FIGURE: ")


def _run_dir(root: Path, name: str, norm: float) -> Path:
    run = root / name
    run.mkdir()
    rows = [
        {"step": 1, "actor/grad_norm": norm, "timing_s/step": 2.0, "actor/perf/update_actor/max_memory_gb": 1.5},
        {
            "step": 2,
            "actor/grad_norm": norm / 2,
            "timing_s/step": 1.0,
            "actor/perf/update_actor/max_memory_gb": 1.25,
            "actor/perf/max_memory_allocated_gb": 2.0,
        },
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_report_and_gradient_norm_agreement(tmp_path: Path) -> None:
    a, b = _run_dir(tmp_path, "a", 0.5), _run_dir(tmp_path, "b", 0.5 * (1 + 1e-5))
    done = _steps("report", str(a))
    assert done.returncode == 0
    assert "FIGURE: 2 steps, 1.00 s/step, peaks GiB: update_actor 1.25, step-1 grad norm 0.5" in done.stdout
    assert _steps("same-grad-norm", str(a), str(b)).returncode == 0
    # Norms that differ, or are zero (all advantages zero: nothing was compared), fail the check.
    assert _steps("same-grad-norm", str(a), str(_run_dir(tmp_path, "c", 0.6))).returncode == 1
    zero = _run_dir(tmp_path, "z", 0.0)
    assert _steps("same-grad-norm", str(zero), str(zero)).returncode == 1


def test_the_script_runs_its_steps_and_stops_without_a_device(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = subprocess.run(
        ["bash", str(BENCHMARKS / "gpu_check.sh")],
        capture_output=True,
        text=True,
        timeout=300,
        env={**ENV, "OUT": str(out), "PY": sys.executable, "WHEELS": str(tmp_path / "none")},
    )
    summary = (out / "summary.md").read_text()
    assert summary.startswith("| step | result | seconds | figure |")
    assert "| env | pass |" in summary and "torch " in summary
    assert done.returncode == 1 and "| cuda | FAIL |" in summary


def test_the_carried_wheels_are_the_versions_the_suite_runs_with() -> None:
    pins = dict(
        line.split("==")
        for line in (BENCHMARKS / "requirements-gpu-check.txt").read_text().splitlines()
        if line and not line.startswith("#")
    )
    # The packages conveyor pins (pyproject.toml) are carried at the very version the suite runs with. The others
    # float with the package index (a fresh install takes the newest regex, say), so the carried wheel need only
    # be one the suite's requirement allows: same major version. omegaconf is left out: 2.4 carries its own
    # parser (2.3 needs the antlr4 runtime, which the image lacks), and conveyor reads configs through the API
    # both have.
    for name in ("transformers", "peft"):
        assert pins[name] == version(name), name
    for name in ("tensordict", "regex", "pyvers"):
        assert pins[name].split(".")[0] == version(name).split(".")[0], (name, pins[name], version(name))
