"""Smoke test: the sharding benchmark runs two ranks per strategy at a small size and meets its bar."""

from __future__ import annotations

import re

import pytest
from benchmark_scripts import spawning_script


def test_sharding_benchmark_small(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    with spawning_script("sharding", monkeypatch) as bench:
        status = bench.main(["--hidden", "64", "--layers", "2"])
    out = capsys.readouterr().out
    assert status == 0, out[-2000:]
    match = re.search(r"fsdp2 / dp, parameters \+ gradients \+ optimizer state per rank: ([0-9.]+)x", out)
    assert match, out
    assert 0.45 <= float(match.group(1)) <= 0.6
    assert out.count("dp rank") == 2 and out.count("fsdp2 rank") == 2
    # The EP row: the experts at rest as fsdp2's, one layer's gathered experts halved, rows through the all-to-all.
    gathered = re.findall(r"one layer's experts gathered for its forward: .*\(([0-9.]+)x\)", out)
    assert [float(g) for g in gathered] == [0.5, 0.5], out
    assert out.count("fsdp2+ep rank") == 2 and "through the all-to-all per step" in out
