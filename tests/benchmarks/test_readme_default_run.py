"""The README's table of the default run is the committed sweep's: regenerate both together or this fails."""

from __future__ import annotations

import json
from pathlib import Path

from benchmark_scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "default_run.json"


def test_the_readme_table_is_the_committed_sweep() -> None:
    bench = load_script("default_run")
    results = json.loads(RESULTS.read_text())
    assert len(results["runs"]) >= 6, "the README's sweep is the default one (3 model seeds x 2 trainer seeds)"
    table = bench.results_table(results)
    readme = (ROOT / "README.md").read_text()
    assert table in readme, (
        "README.md's default-run table differs from benchmarks/results/default_run.json; paste the output of "
        "`python benchmarks/default_run.py --table benchmarks/results/default_run.json` into README.md"
    )


def test_the_table_is_rendered_from_a_results_file(tmp_path, capsys) -> None:
    bench = load_script("default_run")
    run = {"status": 0, "wall_s": 95.4, "cpu_s": 93.2, "first": [0, 0.305], "last": [600, 0.8125]}
    results = {
        "machine": "a CPU, 2 logical CPUs",
        "commit": "abc1234",
        "bar": 0.75,
        "runs": [
            {**run, "model_seed": 1, "trainer_seed": 0, "warm_start_steps": 900, "last": [600, 0.5]},
            {**run, "model_seed": 0, "trainer_seed": 0, "warm_start_steps": 457},
        ],
    }
    path = tmp_path / "r.json"
    path.write_text(json.dumps(results))
    assert bench.main(["--table", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.index("| 0 | 0 | 457 steps | 0.305 → 0.812 | 93 s |") < out.index("| 1 | 0 | 900 steps")
    assert "step 0 → 600" in out
    assert "final held-out accuracy min 0.500  median 0.656  max 0.812" in out
    assert "1 of 2 runs reached 0.75" in out
