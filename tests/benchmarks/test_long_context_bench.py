"""Smoke test: the long-context benchmark's measurements run at a tiny size, and its memory cap ends a child."""

from __future__ import annotations

from pathlib import Path

import pytest
from benchmark_scripts import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("long_context")


@pytest.fixture(scope="module")
def model(bench, tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("long-context") / "model"
    assert bench.build_model(path, 2048, 64, 2, 128) > 0
    return str(path)


def test_one_update_each_way_reports_its_peak_and_time(bench, model: str) -> None:
    """What each child measures, run in this process: the same update through the fused head and the logits."""
    runs = {fused: bench.child_update(model, 96, fused, 1, None) for fused in (False, True)}
    for fused, res in runs.items():
        assert res["fused"] is fused and res["fits"] and res["tokens"] == 96
        assert res["peak"] >= res["added"] > 0 and res["seconds"] > 0
    head = bench.child_head(64, 2048, 32, 1)
    assert head["fused"] > 0 and head["logits"] > 0


def test_the_cap_ends_a_child_that_goes_over_it(bench, model: str) -> None:
    """A cap below what the process already holds: the watchdog ends the child at once, as a run that does not fit."""
    status, res = bench._child(["--child-update", model, "64", "1", "1", "0.05"], timeout=300)
    assert status == bench.OVER_CAP and res is None
    assert Path(bench.__file__).name == "long_context.py"


def test_two_ranks_update_one_sequence_split_or_one_each(bench, model: str) -> None:
    """Tables 4 and 5's measurement: a pair of gloo ranks under fsdp2, SP=2 splitting one sequence over both
    (rank 1 handed no keys of its own), SP=1 a sequence each; a cap below what a rank holds ends both ranks."""
    split = bench.ranks_update(model, 64, True, 2, None)
    assert split is not None and split["fits"] and split["peak"] > 0 and split["seconds"] > 0
    assert split["update_tokens"] == 64 + bench.PROMPT
    assert bench.ranks_update(model, 64, True, 2, 0.05) is None
