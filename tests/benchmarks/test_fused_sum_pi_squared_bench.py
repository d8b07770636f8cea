"""Smoke test: the fused-Σπ² benchmark's measurement runs at a tiny size, and both ways give the same Σπ²."""

from __future__ import annotations

from pathlib import Path

import torch
from benchmark_scripts import load_script


def test_each_way_reports_its_peak_and_time_and_the_same_sum_pi_squared(tmp_path: Path) -> None:
    """What each child measures, run in this process: the logits path's and the fused head's Σπ² agree."""
    bench = load_script("fused_sum_pi_squared")
    got = {}
    for way in ("logits", "fused"):
        res = bench.child(way, 48, 3000, 16, 1, str(tmp_path / f"{way}.pt"))
        assert res["way"] == way and res["added"] >= 0 and res["seconds"] > 0
        got[way] = torch.load(tmp_path / f"{way}.pt")
    assert got["fused"].shape == (48,) and bool((got["fused"] > 0).all())
    torch.testing.assert_close(got["fused"], got["logits"], atol=1e-6, rtol=1e-6)
