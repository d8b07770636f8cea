"""Training gauges served over real HTTP and scraped; the Grafana dashboard's queries match what is exported."""

from __future__ import annotations

import json
import math
import re
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from conveyor.data_plane.prometheus import DataPlaneMetrics, serve_registry
from conveyor.metrics.train_prometheus import TrainingGauges

DASHBOARD = Path(__file__).resolve().parents[2] / "examples" / "grafana_dashboard.json"


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200
        return resp.read().decode()


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_gauges_are_served_and_hold_the_latest_value():
    registry = CollectorRegistry()
    gauges = TrainingGauges(registry)
    gauges.update({"critic/score/mean": 0.25, "val/accuracy": 0.5, "actor/pg_loss": float("nan")}, 3)
    gauges.update({"critic/score/mean": 0.875, "actor/grad_norm": 2}, 4)
    server, port = serve_registry(registry, host="127.0.0.1", port=0)
    try:
        assert port > 0
        samples = _samples(_scrape(port))
    finally:
        server.shutdown()
    assert samples[("conveyor_train_metric", (("name", "critic/score/mean"),))] == 0.875
    # A metric not logged at the latest step keeps its last value.
    assert samples[("conveyor_train_metric", (("name", "val/accuracy"),))] == 0.5
    assert samples[("conveyor_train_metric", (("name", "actor/grad_norm"),))] == 2.0
    assert math.isnan(samples[("conveyor_train_metric", (("name", "actor/pg_loss"),))])
    assert samples[("conveyor_train_step", ())] == 4.0
    assert samples[("conveyor_train_last_update_timestamp_seconds", ())] > 1.6e9


def test_update_rejects_bad_input():
    gauges = TrainingGauges(CollectorRegistry())
    with pytest.raises(ValueError, match="'actor/pg_loss'"):
        gauges.update({"actor/pg_loss": "low"}, 1)
    with pytest.raises(ValueError, match="step"):
        gauges.update({"a": 1.0}, -2)
    with pytest.raises(ValueError, match="registry"):
        TrainingGauges(None)  # type: ignore[arg-type]


def _dashboard_exprs(dashboard: dict) -> list[str]:
    exprs = []
    for panel in dashboard["panels"]:
        exprs.extend(t["expr"] for t in panel.get("targets", []))
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            exprs.append(var["query"]["query"])
    return exprs


def test_grafana_dashboard_queries_name_exported_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    registry = CollectorRegistry()
    TrainingGauges(registry).update({"critic/score/mean": 0.5}, 1)
    dp = DataPlaneMetrics("memory", registry=registry)
    dp.record_put(4, 1024)
    dp.record_get(4, 1024)
    with dp.time("put"):
        pass
    dp.set_live("p0", 4)
    server, port = serve_registry(registry)
    try:
        exported = {name for name, _ in _samples(_scrape(port))}
    finally:
        server.shutdown()

    used = {m for expr in _dashboard_exprs(dashboard) for m in re.findall(r"\bconveyor_[a-z_]+\b", expr)}
    assert used, "the dashboard queries no conveyor metric"
    assert used <= exported, f"dashboard queries metrics nobody exports: {sorted(used - exported)}"
    # Both families are on the dashboard.
    assert any(m.startswith("conveyor_train_") for m in used) and any(m.startswith("conveyor_dataplane_") for m in used)

    # Every panel reads the datasource variable, and the variable is a Prometheus picker.
    ds_var = next(v for v in dashboard["templating"]["list"] if v["name"] == "datasource")
    assert ds_var["type"] == "datasource" and ds_var["query"] == "prometheus"
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"])
    titles = {p["title"] for p in dashboard["panels"]}
    wanted_panels = (
        "Reward",
        "Validation accuracy",
        "Accuracy",
        "Losses",
        "KL",
        "Entropy",
        "Throughput",
        "Step time",
        "Bytes per second",
        "Operation latency (p50, p99)",
    )
    for wanted in wanted_panels:
        assert wanted in titles
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
