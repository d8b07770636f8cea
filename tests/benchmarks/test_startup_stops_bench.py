"""benchmarks/startup_stops.py: a SIGTERM at a random moment of an asynchronous run's start-up (Ray starting, the
replicas being built) ends the run with 143, no traceback or native stack, nothing of it left running.

One try per suite run (the moment drawn anew each time, printed on failure); the script's 10 tries of each signal
are recorded in docs/RELIABILITY.md.
"""

from __future__ import annotations

import random
import signal

import pytest
from benchmark_scripts import load_script


def test_a_sigterm_at_a_random_moment_of_start_up_ends_the_run_cleanly(tmp_path):
    pytest.importorskip("ray")
    bench = load_script("startup_stops")
    # The first log line comes ~1 s before Ray starts; a step comes ~10 s after it on this machine.
    delay = random.uniform(0.5, 6.0)
    r = bench.try_once(signal.SIGTERM, delay, tmp_path)
    if r["missed"]:  # start-up was over sooner than ever seen: a stop in the training loop is another test's
        r = bench.try_once(signal.SIGTERM, delay / 4, tmp_path)
    assert r["ok"], r
    assert r["last_line"] == "stopped by SIGTERM", r
