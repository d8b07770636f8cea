"""Smoke test: the reward-model benchmark scores a tiny batch through the role and the HF loop, and they agree."""

from __future__ import annotations

import pytest
from benchmark_scripts import load_script


def test_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_script("reward_model")
    assert bench.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    assert "ratio role / loop" in out and "hf loop" in out
    result = bench.measure(samples=6, hidden=32, layers=1, max_response=4, micro_batch=4, token_budget=64, repeats=1)
    assert result["role_seq_per_s_median"] > 0 and result["loop_seq_per_s_median"] > 0
    assert result["max_abs_diff"] < 1e-4


def test_judge_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_script("reward_model")
    assert bench.main(["--judge", "--smoke", "--micro-batch", "4"]) == 0
    out = capsys.readouterr().out
    assert "ratio judge role / generate loop" in out
    # Greedy on both sides, through the engine and through generate: the same judgements.
    assert "texts differing: 0.00" in out
