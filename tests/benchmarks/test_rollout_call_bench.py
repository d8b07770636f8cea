"""Smoke test: the rollout-call benchmark times one handle's call both ways and reports every figure."""

from __future__ import annotations

import math

import pytest
from benchmark_scripts import load_script

pytest.importorskip("ray")


def test_main_tiny(capsys: pytest.CaptureFixture[str]) -> None:
    result = load_script("rollout_call").main(["--samples", "16", "--reps", "5", "--rounds", "1"])
    out = capsys.readouterr().out
    for way in ("ray task", "link"):
        for unit in ("wall ms", "cpu ms"):
            assert math.isfinite(result[f"{way} {unit}"]) and result[f"{way} {unit}"] > 0, (way, unit)
    assert math.isclose(result["wall ratio"], result["ray task wall ms"] / result["link wall ms"])
    assert "round 1 ray task" in out and "round 1 link" in out and "less wall time" in out
