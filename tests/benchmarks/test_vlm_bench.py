"""Smoke test: the VLM cost benchmark runs both trainings and prints the vlm, text and ratio rows."""

from __future__ import annotations

from benchmark_scripts import load_script


def test_both_runs_report_every_column_and_the_ratios(capsys) -> None:
    bench = load_script("vlm")
    bench.main(["--smoke"])
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if "step_s" in line).split()
    rows = {
        line.split()[0]: line.split()[1:] for line in lines if line.split()[:1] in (["vlm"], ["text"], ["vlm/text"])
    }
    assert set(rows) == {"vlm", "text", "vlm/text"} and all(len(r) == len(header) for r in rows.values())
    vlm, text = ({k: float(v) for k, v in zip(header, rows[n])} for n in ("vlm", "text"))
    assert vlm["step_s"] > 0 and text["step_s"] > 0 and vlm["rss_gb"] > 0.1
    # The ratio row is the two rows divided (up to their printed rounding).
    assert (
        abs(float(rows["vlm/text"][0]) - vlm["step_s"] / text["step_s"]) < 0.05 * vlm["step_s"] / text["step_s"] + 0.01
    )
