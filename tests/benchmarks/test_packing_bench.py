"""Smoke test: the packing benchmark runs padded and packed actors on 2 fsdp2 ranks at a tiny size."""

from __future__ import annotations

import pytest
from benchmark_scripts import spawning_script


def test_smoke(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    with spawning_script("packing", monkeypatch) as bench:
        assert bench.main(["--smoke", "--ranks", "2"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line[:1] in ("1", "2")]
    assert [r[0] for r in rows] == ["2"], out
    for row in rows:
        padded, packed = float(row[1]), float(row[2])
        assert padded > 0 and packed > 0
        assert float(row[4]) > 1.0  # the padded rows hold more tokens than the real ones
