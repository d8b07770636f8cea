"""Training metrics as Prometheus gauges, for scraping a live run.

Every step metric becomes one series of a single gauge family,
`conveyor_train_metric{name="<metric name>"}`, holding the latest value logged
(a metric logged only at some steps, such as `val/accuracy`, keeps its last
value until it is logged again). `conveyor_train_step` is the latest step and
`conveyor_train_last_update_timestamp_seconds` the wall-clock time of the
last update, so an alert can fire when a run stalls.

The gauges live in the registry the caller passes (the trainer shares it with
the data plane so one scrape sees both). Serving is `serve_registry` in
`conveyor.data_plane.prometheus`; this module keeps no history and starts no
server.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Gauge

__all__ = ["TrainingGauges", "TRAIN_METRIC", "TRAIN_STEP", "TRAIN_LAST_UPDATE"]

TRAIN_METRIC = "conveyor_train_metric"
TRAIN_STEP = "conveyor_train_step"
TRAIN_LAST_UPDATE = "conveyor_train_last_update_timestamp_seconds"


class TrainingGauges:
    """The latest value of every training metric as `conveyor_train_metric{name=...}`, plus the step."""

    def __init__(self, registry: CollectorRegistry):
        if not isinstance(registry, CollectorRegistry):
            raise ValueError(f"registry must be a prometheus_client.CollectorRegistry, got {type(registry).__name__}")
        self.registry = registry
        self._metric = Gauge(
            TRAIN_METRIC, "Latest value of a training metric, by metric name", ["name"], registry=registry
        )
        self._step = Gauge(TRAIN_STEP, "Latest training step logged", registry=registry)
        self._last_update = Gauge(
            TRAIN_LAST_UPDATE, "Unix time of the latest training metrics update", registry=registry
        )

    def update(self, metrics: Mapping[str, Any], step: int) -> None:
        """Set the gauge of every metric in `metrics` (name -> number) and the step gauge."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        values = {}
        for name, value in metrics.items():
            try:
                values[name] = float(value)
            except (TypeError, ValueError):
                raise ValueError(f"metric {name!r} has value {value!r}, which is not a number") from None
        for name, value in values.items():
            # Prometheus carries NaN and +-Inf natively; no need to drop them.
            self._metric.labels(name=name).set(value)
        self._step.set(step)
        self._last_update.set(time.time())
