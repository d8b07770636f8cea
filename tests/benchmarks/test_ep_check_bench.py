"""The one-device EP check (benchmarks/ep_check.py, what gpu_check.sh runs on a GPU) passes on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from benchmark_scripts import load_script, script_path


def test_ep_of_size_one_through_the_ep_path_equals_the_plain_model() -> None:
    done = subprocess.run(
        [sys.executable, str(script_path("ep_check")), "--hidden", "64", "--seq", "16"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "ep check: ok" in done.stdout
    figures = dict(line.rsplit(None, 1) for line in done.stdout.splitlines() if line.startswith(("perf/", "moe/")))
    # One rank's experts are all of them: what one layer gathers is one layer's experts, and every routed pair
    # (4 rows x 16 tokens x top-2, 2 layers) reached them through the all-to-all.
    assert float(figures["perf/ep_tokens_received_local"]) == 4 * 16 * 2 * 2
    assert float(figures["moe/ep_tokens_received_max_over_mean"]) == 1.0


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_check_computes_and_reduces_in_float32_on_any_device(device: str) -> None:
    """On a GPU fsdp2 computes in bfloat16 unless told otherwise, which no 1e-5 bar survives (it failed so there)."""
    strategy = load_script("ep_check").ep_strategy(torch.device(device))  # builds nothing on the device
    assert (strategy.param_dtype, strategy.reduce_dtype) == (torch.float32, torch.float32)
    assert strategy.expert_mesh
