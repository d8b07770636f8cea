"""Tests of the data plane's Prometheus endpoint: served on a free local port, real HTTP scrapes, freed on close."""

from __future__ import annotations

import logging
import socket
import urllib.error
import urllib.request

import pytest
import torch
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from conveyor.data_plane import make_data_plane


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """GET /metrics over HTTP and index every sample by (name, sorted labels)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


MEM = (("backend", "memory"),)


def test_metrics_over_http(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="conveyor.data_plane")
    plane = make_data_plane("memory", metrics_enabled=True, metrics_port=0)
    try:
        server = plane.metrics_server
        assert server is not None and server.host == "127.0.0.1"
        port = server.port
        assert 0 < port < 65536
        assert server.url == f"http://127.0.0.1:{port}/metrics"
        assert any(str(port) in r.getMessage() for r in caplog.records), "the chosen port is logged"

        # 4 keys x (8 int64 + 1 float32) = 4 * (64 + 4) = 272 bytes; strings count no bytes
        plane.kv_batch_put(
            ["a", "b", "c", "d"],
            "step-1",
            {"ids": torch.zeros(4, 8, dtype=torch.int64), "score": torch.zeros(4), "text": ["w", "x", "y", "z"]},
        )
        plane.kv_batch_put(["e"], "step-2", {"ids": torch.zeros(1, 8, dtype=torch.int64)})  # 64 bytes
        plane.kv_batch_get(["b", "a"], "step-1", ["ids"])  # 2 * 64 = 128 bytes

        m = scrape(port)
        assert m[("conveyor_dataplane_put_bytes_total", MEM)] == 272 + 64
        assert m[("conveyor_dataplane_get_bytes_total", MEM)] == 128
        assert m[("conveyor_dataplane_put_samples_total", MEM)] == 5
        assert m[("conveyor_dataplane_get_samples_total", MEM)] == 2
        put_inf = (
            "conveyor_dataplane_op_latency_seconds_bucket",
            (("backend", "memory"), ("le", "+Inf"), ("op", "put")),
        )
        get_inf = (
            "conveyor_dataplane_op_latency_seconds_bucket",
            (("backend", "memory"), ("le", "+Inf"), ("op", "get")),
        )
        assert m[put_inf] == 2 and m[get_inf] == 1
        assert m[("conveyor_dataplane_op_latency_seconds_count", (("backend", "memory"), ("op", "put")))] == 2
        assert m[("conveyor_dataplane_op_latency_seconds_sum", (("backend", "memory"), ("op", "put")))] > 0
        live = "conveyor_dataplane_live_samples"
        assert m[(live, (("backend", "memory"), ("partition", "step-1")))] == 4
        assert m[(live, (("backend", "memory"), ("partition", "step-2")))] == 1

        plane.kv_clear("step-1", keys=["a"])
        plane.kv_clear("step-2")
        m = scrape(port)
        assert m[(live, (("backend", "memory"), ("partition", "step-1")))] == 3
        assert (live, (("backend", "memory"), ("partition", "step-2"))) not in m  # the series goes away
        plane.kv_clear("step-1")
        assert not any(name == live for name, _ in scrape(port))
    finally:
        plane.close()


def test_close_frees_the_port() -> None:
    plane = make_data_plane("memory", metrics_enabled=True, metrics_port=0)
    port = plane.metrics_server.port
    scrape(port)
    plane.close()
    assert plane.metrics_server is None
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
    # the same port can be served again, by a new plane ...
    again = make_data_plane("memory", metrics_enabled=True, metrics_port=port)
    try:
        assert again.metrics_server.port == port
        assert ("conveyor_dataplane_put_bytes_total", MEM) not in scrape(port)  # a fresh registry
    finally:
        again.close()
    # ... and by anything else
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))


def test_port_in_use_is_a_clear_error() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        port = sock.getsockname()[1]
        with pytest.raises(ValueError, match=f"127.0.0.1:{port}.*0 for a free one"):
            make_data_plane("memory", metrics_enabled=True, metrics_port=port)


def test_two_planes_have_separate_metrics() -> None:
    a = make_data_plane("memory", metrics_enabled=True)
    b = make_data_plane("memory", metrics_enabled=True)
    try:
        assert a.metrics_server.port != b.metrics_server.port
        a.kv_batch_put(["k"], "p", {"x": torch.zeros(1, 2)})
        assert scrape(a.metrics_server.port)[("conveyor_dataplane_put_bytes_total", MEM)] == 8
        assert ("conveyor_dataplane_put_bytes_total", MEM) not in scrape(b.metrics_server.port)
    finally:
        a.close()
        b.close()


def test_shared_registry_records_without_serving() -> None:
    # The trainer passes the registry it serves itself; the plane then only records.
    registry = CollectorRegistry()
    plane = make_data_plane("memory", registry=registry)
    try:
        assert plane.metrics_server is None
        plane.kv_batch_put(["a", "b"], "p", {"x": torch.zeros(2, 3, dtype=torch.int16)})
        plane.kv_batch_get(["a"], "p", ["x"])
        assert registry.get_sample_value("conveyor_dataplane_put_bytes_total", {"backend": "memory"}) == 12
        assert registry.get_sample_value("conveyor_dataplane_get_bytes_total", {"backend": "memory"}) == 6
        assert (
            registry.get_sample_value("conveyor_dataplane_live_samples", {"backend": "memory", "partition": "p"}) == 2
        )
    finally:
        plane.close()


def test_metrics_off_by_default() -> None:
    plane = make_data_plane("memory")
    try:
        assert plane.metrics_server is None and plane.metrics is None
    finally:
        plane.close()
