"""Smoke test: the lean-forward benchmark runs at a tiny size and reports sane figures."""

from __future__ import annotations

import math

import pytest
from benchmark_scripts import load_script


def test_main_tiny(capsys: pytest.CaptureFixture[str]) -> None:
    result = load_script("lean_forward").main(["--prompts", "3", "--n", "2", "--response-len", "3", "--repeats", "2"])
    out = capsys.readouterr().out
    for key in ("train_hf_ms", "train_lean_ms", "rollout_hf_ms", "rollout_lean_ms"):
        assert math.isfinite(result[key]) and result[key] > 0, key
    # 3 distinct prompts shared by 2 rows each: the lean forward computes fewer positions.
    assert 0 < result["lean_tokens"] < result["hf_tokens"]
    assert "train: forward + backward" in out and "rollout: generate" in out
