"""Smoke test: the router margin/flip benchmark runs at a tiny size and its figures are consistent."""

from __future__ import annotations

import math

import pytest
from benchmark_scripts import load_script


def test_main_tiny(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_script("router")
    result = bench.main(["--seeds", "0", "--layers", "3", "--batch", "8", "--response-len", "6"])
    out = capsys.readouterr().out
    assert len(result["rows"]) == 3
    for row in result["rows"]:
        assert 0.0 <= row["near_tie"] <= 1.0 and 0.0 <= row["flip_rate"] <= 1.0 and row["pairs"] > 0
    assert math.isnan(result["spearman"]) or -1.0 <= result["spearman"] <= 1.0
    assert "Spearman over 3 (layer, seed) points" in out


def test_spearman_by_hand() -> None:
    spearman = load_script("router").spearman
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # Ties take their mean rank: ranks (1.5, 1.5, 3) against (1, 2, 3) -> 0.866.
    assert spearman([1, 1, 2], [1, 2, 3]) == pytest.approx(math.sqrt(3) / 2)
