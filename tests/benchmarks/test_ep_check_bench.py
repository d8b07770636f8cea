"""The one-device EP check (benchmarks/ep_check.py, what gpu_check.sh runs on a GPU) passes on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys

from benchmark_scripts import script_path


def test_ep_of_size_one_through_the_ep_path_equals_the_plain_model() -> None:
    done = subprocess.run([sys.executable, str(script_path("ep_check")), "--hidden", "64", "--seq", "16"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "ep check: ok" in done.stdout
    figures = dict(line.rsplit(None, 1) for line in done.stdout.splitlines() if line.startswith(("perf/", "moe/")))
    # One rank's experts are all of them: what one layer gathers is one layer's experts, and every routed pair
    # (4 rows x 16 tokens x top-2, 2 layers) reached them through the all-to-all.
    assert float(figures["perf/ep_tokens_received_local"]) == 4 * 16 * 2 * 2
    assert float(figures["moe/ep_tokens_received_max_over_mean"]) == 1.0
