"""The OpenAI-compatible agent gateway: any program that speaks the OpenAI API as the rollout (docs/agent.md).

`server.py` serves HTTP, `session.py` turns requests into token ids, `trajectory.py` cuts a session's calls into
samples, `agents.py` runs the agents, and `loop.py` (`GatewayLoop`) drives the engine and returns the rows. Nothing
here is imported until a run uses the gateway (the web stack is an optional dependency: conveyor[agent]).
"""

from __future__ import annotations

from typing import Any

__all__ = ["GatewayLoop", "GatewaySettings", "build_gateway_loop", "Call", "Sample", "SessionTrajectories"]


def __getattr__(name: str) -> Any:
    if name in ("GatewayLoop", "GatewaySettings", "build_gateway_loop"):
        from conveyor.rollout.gateway import loop

        return getattr(loop, name)
    if name in ("Call", "Sample", "SessionTrajectories"):
        from conveyor.rollout.gateway import trajectory

        return getattr(trajectory, name)
    raise AttributeError(name)
