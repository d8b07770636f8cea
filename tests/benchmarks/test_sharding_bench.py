"""Smoke test: the sharding benchmark runs two ranks per strategy at a small size and meets its bar."""

from __future__ import annotations

import importlib
import re
import sys

import pytest

from benchmark_scripts import BENCHMARKS


def test_sharding_benchmark_small(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # Run in this process (its imports are paid already; a subprocess spent ~6 s on them). The script spawns
    # its ranks, which unpickle its rank function by module name: import it as `sharding` from benchmarks/,
    # a path the spawned ranks inherit.
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert "sharding" not in sys.modules
    try:
        bench = importlib.import_module("sharding")
        assert bench.__file__ == str(BENCHMARKS / "sharding.py")
        status = bench.main(["--hidden", "64", "--layers", "2"])
    finally:
        sys.modules.pop("sharding", None)
    out = capsys.readouterr().out
    assert status == 0, out[-2000:]
    match = re.search(r"fsdp2 / dp, parameters \+ gradients \+ optimizer state per rank: ([0-9.]+)x", out)
    assert match, out
    assert 0.45 <= float(match.group(1)) <= 0.6
    assert out.count("dp rank") == 2 and out.count("fsdp2 rank") == 2
