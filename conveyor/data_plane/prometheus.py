"""Prometheus metrics of the data plane, and the one HTTP server that serves a registry.

Each data plane gets its own `CollectorRegistry` unless one is passed in (the
trainer passes the registry that also holds its training gauges, so one scrape
sees both). Nothing here is global: two data planes in one process never
collide on metric names.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

logger = logging.getLogger(__name__)

__all__ = ["DataPlaneMetrics", "serve_registry", "MetricsServer"]

# Put/get of one step's batch spans ~10 us (a few keys, memory backend) to
# seconds (a large batch over Ray); buckets cover that range.
_LATENCY_BUCKETS = (1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.5, 1.0, 5.0, 30.0)


class MetricsServer:
    """A running HTTP endpoint for a registry; `shutdown()` stops it and frees the port."""

    def __init__(self, httpd, thread: threading.Thread):
        self._httpd = httpd
        self._thread = thread
        self.host, self.port = httpd.server_address[:2]

    @property
    def url(self) -> str:
        """The scrape URL."""
        return f"http://{self.host}:{self.port}/metrics"

    def shutdown(self) -> None:
        """Stop serving and close the socket (idempotent)."""
        if self._httpd is None:
            return
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)
        self._httpd = None


def serve_registry(registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0) -> tuple[MetricsServer, int]:
    """Serve `registry` over HTTP on host:port (port 0 picks a free one); returns (server, bound_port)."""
    from prometheus_client import start_http_server

    try:
        httpd, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as err:
        raise ValueError(
            f"cannot serve Prometheus metrics on {host}:{port} ({err}); choose another port, or 0 for a free one"
        ) from err
    server = MetricsServer(httpd, thread)
    logger.info("Prometheus metrics at %s", server.url)
    return server, server.port


class DataPlaneMetrics:
    """Counters and histograms of data-plane traffic: bytes and samples put/got, latency, live samples."""

    def __init__(self, backend: str, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        labels = ["backend"]
        self._backend = backend
        self.bytes_put = Counter(
            "conveyor_dataplane_put_bytes", "Bytes written to the data plane", labels, registry=self.registry
        )
        self.bytes_got = Counter(
            "conveyor_dataplane_get_bytes", "Bytes read from the data plane", labels, registry=self.registry
        )
        self.samples_put = Counter("conveyor_dataplane_put_samples", "Samples written", labels, registry=self.registry)
        self.samples_got = Counter("conveyor_dataplane_get_samples", "Samples read", labels, registry=self.registry)
        self.latency = Histogram(
            "conveyor_dataplane_op_latency_seconds",
            "Latency of data-plane operations",
            ["backend", "op"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.live_samples = Gauge(
            "conveyor_dataplane_live_samples",
            "Samples stored per partition",
            ["backend", "partition"],
            registry=self.registry,
        )

    @contextmanager
    def time(self, op: str) -> Iterator[None]:
        """Observe the latency of one operation that succeeds (a failed one raises and is not observed)."""
        t0 = time.perf_counter()
        yield
        self.latency.labels(self._backend, op).observe(time.perf_counter() - t0)

    def record_put(self, num_samples: int, num_bytes: int) -> None:
        """Count one put."""
        self.samples_put.labels(self._backend).inc(num_samples)
        self.bytes_put.labels(self._backend).inc(num_bytes)

    def record_get(self, num_samples: int, num_bytes: int) -> None:
        """Count one get."""
        self.samples_got.labels(self._backend).inc(num_samples)
        self.bytes_got.labels(self._backend).inc(num_bytes)

    def set_live(self, partition_id: str, num_samples: int) -> None:
        """Set the live sample count of a partition (removes the series when it reaches zero)."""
        if num_samples:
            self.live_samples.labels(self._backend, partition_id).set(num_samples)
        else:
            try:
                self.live_samples.remove(self._backend, partition_id)
            except KeyError:
                pass
