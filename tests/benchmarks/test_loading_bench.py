"""Smoke test: the loading benchmark runs two fsdp2 ranks at a small size and prints rank 1's ratio."""

from __future__ import annotations

import re

import pytest
from benchmark_scripts import spawning_script


def test_loading_benchmark_small(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    with spawning_script("loading", monkeypatch) as bench:
        status = bench.main(["--hidden", "64", "--layers", "2"])
    out = capsys.readouterr().out
    assert status == 0, out[-2000:]
    assert re.search(r"rank 1 loading peak / model bytes: [0-9.]+x", out), out
    assert out.count("rank 0: loading peak") == 1 and out.count("rank 1: loading peak") == 1
