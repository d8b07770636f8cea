"""The data plane: a key-value store of samples that every stage reads from and writes to.

`make_data_plane(backend, **options)` is the one way to create one; the
backends are `memory` (embedded, default), `ray` and `transferqueue`.
"""

from __future__ import annotations

import logging
from typing import Any

from conveyor.data_plane.base import DataPlane, FieldNotFoundError

__all__ = ["DataPlane", "FieldNotFoundError", "make_data_plane", "BACKENDS"]

logger = logging.getLogger(__name__)

BACKENDS = ("memory", "ray", "transferqueue")


def make_data_plane(
    backend: str = "memory",
    *,
    metrics_enabled: bool = False,
    metrics_port: int = 0,
    metrics_host: str = "127.0.0.1",
    registry: Any = None,
    **options: Any,
) -> DataPlane:
    """Create a data plane of the given backend; with metrics_enabled, serve its Prometheus metrics."""
    if backend not in BACKENDS:
        raise ValueError(f"transfer_queue.backend={backend!r} is not a backend; choose one of {list(BACKENDS)}")
    metrics = None
    server = None
    if metrics_enabled or registry is not None:
        from conveyor.data_plane.prometheus import DataPlaneMetrics, serve_registry

        metrics = DataPlaneMetrics(backend, registry=registry)
        if metrics_enabled and registry is None:
            server, port = serve_registry(metrics.registry, host=metrics_host, port=metrics_port)
            logger.info("data-plane metrics on port %d", port)
    if backend == "memory":
        from conveyor.data_plane.memory import MemoryDataPlane

        if options:
            raise ValueError(f"the memory data plane takes no options, got {sorted(options)}")
        plane: DataPlane = MemoryDataPlane(metrics=metrics)
    elif backend == "ray":
        try:
            from conveyor.data_plane.ray_store import RayDataPlane
        except ImportError as err:
            raise ValueError(f"transfer_queue.backend=ray needs Ray: pip install 'conveyor[ray]' ({err})") from err
        plane = RayDataPlane(metrics=metrics, **options)
    else:
        try:
            from conveyor.data_plane.transferqueue import TransferQueueDataPlane
        except ImportError as err:
            raise ValueError(
                f"transfer_queue.backend=transferqueue needs the transferqueue package: "
                f"pip install 'conveyor[transferqueue]' ({err})"
            ) from err
        plane = TransferQueueDataPlane(metrics=metrics, **options)
    plane.metrics_server = server
    return plane
