"""Smoke test: the visual-task benchmark builds (here warm-starts) and trains a seed in two processes and reports
both."""

from __future__ import annotations

from benchmark_scripts import load_script


def test_a_seed_warm_starts_trains_and_reports_its_cpu_time(tmp_path, capsys) -> None:
    bench = load_script("vlm_task")
    # A warm start of 3 steps ends short of 0.5: it warns and the run goes on.
    assert bench.main(["--smoke", "--seeds", "0", "--warmstart-until", "0.5", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("0 | "))
    steps, accuracy, gain, cpu = row.split(" | ")[1:]
    assert steps == "3" and "->" in accuracy and gain.startswith(("+", "-"))
    warm, rl = (float(x) for x in cpu.split(" = ")[0].split(" + "))
    assert warm > 0 and rl > 0
    # The bar: a gain of 0.3 within the CPU budget.
    row = {"status": 0, "first": 0.1, "last": 0.45, "warm_cpu_s": 100.0, "rl_cpu_s": 400.0}
    assert bench.passed(row, 0.3, 600) and not bench.passed({**row, "last": 0.35}, 0.3, 600)
    assert not bench.passed({**row, "rl_cpu_s": 550.0}, 0.3, 600)
