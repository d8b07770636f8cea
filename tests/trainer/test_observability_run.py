"""A real training run feeds the user's tools: TensorBoard, MLflow, Prometheus, plots."""

from __future__ import annotations

import re
import threading
import time
import urllib.request

import pytest

from conveyor.config import load_config
from conveyor.metrics.trackers import read_metrics_jsonl
from conveyor.trainer.run import run_training


def test_run_writes_tensorboard_and_mlflow(tiny_run, tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_training(load_config(None, tiny_run + ["trainer.logger=[console,jsonl,tensorboard,mlflow]"]))
    rows = {r["step"]: r for r in read_metrics_jsonl(tmp_path / "metrics.jsonl")}

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    events = acc.Scalars("reward/mean")
    assert [e.step for e in events] == [1, 2]
    assert [e.value for e in events] == pytest.approx([rows[1]["reward/mean"], rows[2]["reward/mean"]])

    import mlflow
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("conveyor")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "actor/pg_loss")
    assert [(m.step, pytest.approx(m.value)) for m in history] == [
        (1, rows[1]["actor/pg_loss"]),
        (2, rows[2]["actor/pg_loss"]),
    ]
    del mlflow


def test_prometheus_endpoint_serves_reward_during_a_run(tiny_run, tmp_path, caplog):
    cfg = load_config(
        None,
        tiny_run
        + ["trainer.total_training_steps=20", "trainer.prometheus.enabled=true", "transfer_queue.metrics.enabled=true"],
    )
    found: dict = {}

    def scrape():
        # Wait for the log line that names the port, then scrape until the reward gauge shows up.
        deadline = time.time() + 300
        port = None
        while time.time() < deadline and not found:
            if port is None:
                for rec in caplog.records:
                    m = re.search(
                        r"training metrics for Prometheus at http://127\.0\.0\.1:(\d+)/metrics", rec.getMessage()
                    )
                    if m:
                        port = int(m.group(1))
            if port is not None:
                try:
                    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
                except OSError:
                    body = ""
                m = re.search(r'conveyor_train_metric\{name="reward/mean"\} ([0-9.e+-]+)', body)
                if m:
                    found["reward"] = float(m.group(1))
                    found["dataplane"] = "conveyor_dataplane_put_bytes_total" in body
            time.sleep(0.05)

    with caplog.at_level("INFO"):
        t = threading.Thread(target=scrape)
        t.start()
        run_training(cfg)
        t.join()
    assert "reward" in found, "the reward gauge was never scraped"
    assert 0.0 <= found["reward"] <= 1.0
    assert found["dataplane"], "the data-plane metrics share the endpoint"


def test_plot_after_a_run(tiny_run, tmp_path):
    pytest.importorskip("matplotlib")
    from PIL import Image

    from conveyor.cli import main

    run_training(
        load_config(
            None, tiny_run + ["actor_rollout_ref.rollout.moe_load_balance_metrics_interval=1", "trainer.test_freq=1"]
        )
    )
    assert main(["plot", str(tmp_path)]) == 0
    names = {p.name for p in (tmp_path / "plots").iterdir()}
    assert {"reward.png", "moe_expert_load.png", "moe_expert_load_over_time.png"} <= names
    for name in names:
        img = Image.open(tmp_path / "plots" / name).convert("L")
        lo, hi = img.getextrema()
        assert hi - lo > 50, f"{name} looks blank"
