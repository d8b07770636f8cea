"""The data plane: a key-value store of samples that every stage reads from and writes to.

`make_data_plane(backend, **options)` is the one way to create one; the
backends are the `BACKENDS` registry: `memory` (embedded, default), `ray` and
`transferqueue` built in, and whatever `register_data_plane` adds (from a
`trainer.plugins` file, say), selectable as `transfer_queue.backend` at once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from conveyor.data_plane.base import DataPlane, FieldNotFoundError
from conveyor.registry import lookup, registrar

__all__ = ["DataPlane", "FieldNotFoundError", "make_data_plane", "register_data_plane", "BACKENDS"]

logger = logging.getLogger(__name__)

DataPlaneFactory = Callable[..., DataPlane]
"""`factory(metrics=<DataPlaneMetrics or None>, **options) -> DataPlane`: one backend's constructor."""

BACKENDS: dict[str, DataPlaneFactory] = {}
"""Backend name -> factory; `transfer_queue.backend` is checked against it."""


def register_data_plane(name: str, *, overwrite: bool = False) -> Callable[[DataPlaneFactory], DataPlaneFactory]:
    """Decorator registering `factory(metrics=..., **options) -> DataPlane` as data-plane backend `name`."""
    return registrar(BACKENDS, name, "data-plane backend", overwrite=overwrite)


# The built-in factories import their backend only when it is chosen: ray and transferqueue are optional extras.
@register_data_plane("memory")
def _memory(metrics: Any = None, **options: Any) -> DataPlane:
    from conveyor.data_plane.memory import MemoryDataPlane

    if options:
        raise ValueError(f"the memory data plane takes no options, got {sorted(options)}")
    return MemoryDataPlane(metrics=metrics)


@register_data_plane("ray")
def _ray(metrics: Any = None, **options: Any) -> DataPlane:
    try:
        from conveyor.data_plane.ray_store import RayDataPlane
    except ImportError as err:
        raise ValueError(f"transfer_queue.backend=ray needs Ray: pip install 'conveyor[ray]' ({err})") from err
    return RayDataPlane(metrics=metrics, **options)


@register_data_plane("transferqueue")
def _transferqueue(metrics: Any = None, **options: Any) -> DataPlane:
    try:
        from conveyor.data_plane.transferqueue import TransferQueueDataPlane
    except ImportError as err:
        raise ValueError(
            f"transfer_queue.backend=transferqueue needs the transferqueue package: "
            f"pip install 'conveyor[transferqueue]' ({err})"
        ) from err
    return TransferQueueDataPlane(metrics=metrics, **options)


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
    factory = lookup(BACKENDS, backend, "transfer_queue.backend")
    metrics = None
    server = None
    if metrics_enabled or registry is not None:
        from conveyor.data_plane.prometheus import DataPlaneMetrics, serve_registry

        metrics = DataPlaneMetrics(backend, registry=registry)
        if metrics_enabled and registry is None:
            server, port = serve_registry(metrics.registry, host=metrics_host, port=metrics_port)
            logger.info("data-plane metrics on port %d", port)
    plane = factory(metrics=metrics, **options)
    plane.metrics_server = server
    return plane
