"""Smoke test: the served-plane benchmark replays a small batch's requests and reports every figure."""

from __future__ import annotations

import math

import pytest
from benchmark_scripts import load_script


def test_main_tiny(capsys: pytest.CaptureFixture[str]) -> None:
    result = load_script("served_plane").main(["--prompts", "2", "--n", "2", "--reps", "3"])
    out = capsys.readouterr().out
    names = ("read prompts", "read reward inputs", "write rollout fields", "write rewards")
    for name in names:
        for key in (f"server {name}", f"round trip {name}"):
            assert math.isfinite(result[key]) and result[key] > 0, key
    assert math.isclose(result["server batch"], sum(result[f"server {n}"] for n in names), rel_tol=1e-9)
    assert "one batch: 4 samples" in out and "through a TensorDict" in out and "a batch (four requests)" in out
