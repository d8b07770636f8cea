"""Smoke test: the loading benchmark runs two fsdp2 ranks at a small size and prints rank 1's ratio."""

from __future__ import annotations

import importlib
import re
import sys

import pytest

from benchmark_scripts import BENCHMARKS


def test_loading_benchmark_small(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # In this process, imported as `loading` from benchmarks/ (its spawned ranks unpickle its rank function by
    # module name and inherit that path), as the sharding benchmark's smoke test does.
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert "loading" not in sys.modules
    try:
        bench = importlib.import_module("loading")
        assert bench.__file__ == str(BENCHMARKS / "loading.py")
        status = bench.main(["--hidden", "64", "--layers", "2"])
    finally:
        sys.modules.pop("loading", None)
    out = capsys.readouterr().out
    assert status == 0, out[-2000:]
    assert re.search(r"rank 1 loading peak / model bytes: [0-9.]+x", out), out
    assert out.count("rank 0: loading peak") == 1 and out.count("rank 1: loading peak") == 1
