"""The default-run sweep's reporting: seed pairs parsed, each run's line, the spread, and the exit status."""

from __future__ import annotations

import argparse
import json

import pytest
from benchmark_scripts import load_script


def test_sweep_prints_each_pair_and_the_spread_and_fails_below_the_bar(tmp_path, monkeypatch, capsys):
    bench = load_script("default_run")
    assert bench.parse_pair("2:1") == (2, 1)
    with pytest.raises(argparse.ArgumentTypeError, match="MODEL_SEED:TRAINER_SEED"):
        bench.parse_pair("2")
    assert len(bench.DEFAULT_PAIRS) >= 6
    assert len({m for m, _ in bench.DEFAULT_PAIRS}) > 1 and len({t for _, t in bench.DEFAULT_PAIRS}) > 1

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"step": 0, "val/accuracy": 0.25},
                {"step": 1, "reward/mean": 0.5},
                {"step": 2, "val/accuracy": 0.75},
            ]
        )
    )
    assert bench.val_accuracy(run) == [(0, 0.25), (2, 0.75)]

    finals = {(0, 0): 0.75, (1, 1): 0.5, (2, 2): 0.625}
    seen = []

    def fake_run(model_seed, trainer_seed, out, threads, overrides, config):
        seen.append((model_seed, trainer_seed, threads, tuple(overrides), config))
        return {
            "model_seed": model_seed,
            "trainer_seed": trainer_seed,
            "status": 0,
            "wall_s": 60.0 + model_seed,
            "cpu_s": 50.0,
            "first": (0, 0.25),
            "last": (600, finals[(model_seed, trainer_seed)]),
            "warm_start_steps": 400,
            "log": "x.log",
        }

    monkeypatch.setattr(bench, "run_pair", fake_run)
    args = ["--pairs", "0:0", "1:1", "2:2", "--parallel", "2", "--set", "trainer.test_freq=50", "--out", str(tmp_path)]
    assert bench.main(args) == 0
    assert sorted(seen) == [(m, t, 1, ("trainer.test_freq=50",), bench.DEFAULT_RUN) for m, t in sorted(finals)]
    out = capsys.readouterr().out
    assert "model seed 1  trainer seed 1:  held-out accuracy 0.250 -> 0.500 at step 600" in out
    assert "final held-out accuracy: min 0.500  median 0.625  max 0.750" in out
    assert "wall time per run (s):   min 60  median 61  max 62" in out
    assert "3 of 3 runs reached >= 0.5" in out
    assert bench.main(args + ["--bar", "0.6"]) == 1
