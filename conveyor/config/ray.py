"""The `ray` section: how to reach or start Ray, used only when workers or the data plane run on it.

The whole section may change on resume. It deliberately does not import Ray:
`conveyor.workers.placement.ray_group` does, when a run needs it.
"""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.config.fields import F

__all__ = ["RayConfig"]


@dataclass
class RayConfig:
    """How to reach or start Ray (only when workers or the data plane use it)."""

    address: str | None = F(None, "existing cluster address (auto = the local head); null = start a local one")
    num_cpus: int | None = F(None, "logical CPUs of a locally started Ray (null = the machine's)", gt=0)
    worker_cpus: float = F(0.5, "logical CPUs each worker actor reserves (fractional so small machines fit)", ge=0)
    timeout_s: float = F(60.0, "seconds to wait for resources before failing", gt=0)
