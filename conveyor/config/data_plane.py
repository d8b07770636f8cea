"""The `transfer_queue` section: which data-plane backend holds the samples, and its options.

Backend names are read from `conveyor.data_plane.BACKENDS` when checked. The
whole section may change on resume (where samples are held does not change
what a run computes). It deliberately passes `transferqueue` through
unchecked: that mapping belongs to the transferqueue package.
"""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.config.fields import F, S, check, registry
from conveyor.config.trainer import MetricsEndpointConfig

__all__ = ["TransferQueueConfig"]


@dataclass
class TransferQueueConfig:
    """The data plane."""

    backend: str = F(
        "memory",
        "data-plane backend (memory is embedded in the trainer's process and served to "
        "Ray workers on this machine; ray instead for Ray workers on GPUs or several machines)",
        choices=registry("conveyor.data_plane", "BACKENDS"),
    )
    num_storage_actors: int = F(1, "ray backend: storage actors", gt=0)
    storage_actor_cpus: float = F(0.05, "ray backend: logical CPUs each storage actor reserves", ge=0)
    transferqueue: dict = F({}, "transferqueue backend: passed through to the transferqueue package")
    host: str = F(
        "127.0.0.1",
        "transferqueue backend: the address its controller and storage units listen on "
        "(127.0.0.1 = this machine only; its protocol is unauthenticated pickle, so give a node's address, "
        "or auto for Ray's node address, only on a trusted network)",
    )
    metrics: MetricsEndpointConfig = S(MetricsEndpointConfig, "Prometheus metrics of the data plane")

    def validate(self, prefix: str) -> None:
        """The host is one address or name."""
        check(
            bool(self.host.strip()) and not any(c.isspace() for c in self.host),
            f"{prefix}.host",
            f"must be an IP address or host name (or auto), got {self.host!r}",
        )
