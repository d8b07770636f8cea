"""Smoke test: the sharding benchmark runs two ranks per strategy at a small size and meets its bar."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from benchmark_scripts import script_path


def test_sharding_benchmark_small() -> None:
    done = subprocess.run([sys.executable, str(script_path("sharding")), "--hidden", "64", "--layers", "2"],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    match = re.search(r"fsdp2 / dp, parameters \+ gradients \+ optimizer state per rank: ([0-9.]+)x", done.stdout)
    assert match, done.stdout
    assert 0.45 <= float(match.group(1)) <= 0.6
    assert done.stdout.count("dp rank") == 2 and done.stdout.count("fsdp2 rank") == 2
