"""Smoke test: the rewards benchmark runs at a tiny size, checks every program's result and reports ratios."""

from __future__ import annotations

import pytest
from benchmark_scripts import load_script


def test_main_tiny(capsys: pytest.CaptureFixture[str]) -> None:
    result = load_script("rewards").main(["--programs", "4", "--trials", "1", "--concurrency", "1", "2", "--smoke"])
    out = capsys.readouterr().out
    assert result["subprocess.run per sample / bare"] == 1.0
    for name in ("sandbox, max_concurrent=1", "sandbox, max_concurrent=2"):
        assert result[f"{name} exec/s"] > 0 and result[f"{name} / bare"] > 0
        assert name in out
    assert "x bare" in out and "isolation=" in out
    # The reward model's section, in the same run: both sides scored, and scored alike.
    assert result["reward model ratio"] > 0 and result["reward model max_abs_diff"] < 1e-3
    assert "ratio role / loop" in out
