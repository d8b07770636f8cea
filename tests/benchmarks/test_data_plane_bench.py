"""Smoke test: the data-plane benchmark runs end to end at a tiny size and reports sane figures."""

from __future__ import annotations

import math
from types import ModuleType

import pytest
from benchmark_scripts import load_script


def load_benchmark() -> ModuleType:
    """Import benchmarks/data_plane.py as a module."""
    return load_script("data_plane")


TINY = [
    "--samples",
    "8",
    "--seq-len",
    "16",
    "--small-samples",
    "12",
    "--small-fields",
    "3",
    "--reps",
    "2",
    "--create-reps",
    "3",
]


def test_main_tiny_both_workloads(capsys: pytest.CaptureFixture[str]) -> None:
    result = load_benchmark().main(TINY)
    out = capsys.readouterr().out
    mem = result["backends"]["memory"]
    dense, small = mem["dense"], mem["small_fields"]
    assert dense["bytes"] == 8 * 16 * 8  # int64
    assert small["bytes"] == 12 * 4 * 4 * 2 + 12 * 8 * 1  # f0, f2: (12, 4) float32; f1: (12,) int64
    for figures in (dense, small):
        for key in ("clone_ms", "put_ms", "get_ms", "put_get_ms", "ratio", "gb_per_s"):
            assert math.isfinite(figures[key]) and figures[key] > 0, key
        assert math.isclose(figures["ratio"], figures["put_get_ms"] / figures["clone_ms"], rel_tol=1e-9)
    assert math.isfinite(dense["shuffled_ratio"]) and dense["get_shuffled_ms"] > 0
    assert 0 < mem["create_ms"] < 1000
    assert isinstance(result["targets_met"], bool)
    assert "memory / dense" in out and "memory / small-fields" in out and "x clone" in out
    assert "target memory put+get <= 3 x clone" in out and "target memory creation < 50 ms" in out
    assert result["skipped"] == {}


def test_workload_flag_selects_one(capsys: pytest.CaptureFixture[str]) -> None:
    result = load_benchmark().main([*TINY, "--workload", "small-fields"])
    mem = result["backends"]["memory"]
    assert "small_fields" in mem and "dense" not in mem
    assert "memory / dense " not in capsys.readouterr().out


def test_unwritten_backends_are_skipped_with_a_note(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_benchmark()
    # One timed creation: a transferqueue plane takes ~13 s to start here, and --create-reps 3 would start it
    # five times (one for the workload, one warm-up and three timed).
    result = bench.main(
        [*TINY, "--workload", "dense", "--create-reps", "1", "--backends", "memory,ray", "transferqueue"]
    )
    out = capsys.readouterr().out
    assert "memory" in result["backends"]
    for backend in ("ray", "transferqueue"):
        reason = bench.backend_unavailable(backend)
        if reason is None:  # the adapter and its package exist here: it must have been measured or noted
            assert backend in result["backends"] or backend in result["skipped"]
        else:
            assert result["skipped"][backend] == reason
            assert f"note: backend {backend} skipped: {reason}" in out


def test_bad_arguments_exit() -> None:
    bench = load_benchmark()
    with pytest.raises(SystemExit):
        bench.main(["--backends", "redis"])
    with pytest.raises(SystemExit):
        bench.main(["--reps", "0"])
