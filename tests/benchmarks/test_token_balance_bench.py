"""Smoke test: the token-balance benchmark runs at a tiny size and reports sane figures."""

from __future__ import annotations

import pytest
from benchmark_scripts import load_script


def test_main_tiny(capsys: pytest.CaptureFixture[str]) -> None:
    result = load_script("token_balance").main(
        ["--prompts", "8", "--n", "4", "--ranks", "4", "--trials", "2", "--budget", "12000"]
    )
    out = capsys.readouterr().out
    assert 1.0 <= result["split_for_ranks (KK)"] <= result["in-order chunks"]
    assert result["lower_bound_passes"] <= result["packed_passes"] <= result["budget_passes"]
    assert result["processed_per_real"] >= 1.0
    assert "split_for_ranks (KK)" in out and "tokens processed per real one" in out
