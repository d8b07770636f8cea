"""The rollout engines a run can choose, and what each declares it can do.

`ROLLOUT_ENGINES` maps `actor_rollout_ref.rollout.name` to an `EngineSpec`:
the module that implements the engine (imported only when the engine is
built, so choosing among engines imports none of them) and its declared
capabilities on a device. The config reads its valid names from here, and the
run plan (`conveyor.trainer.plan`) reads the capabilities, so no other module
tests an engine's name to know what it can do.

It deliberately does not build engines or define their generate signature:
the actor worker builds them.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable

import torch

__all__ = ["EngineCapabilities", "EngineSpec", "ROLLOUT_ENGINES", "engine_spec"]


@dataclasses.dataclass(frozen=True)
class EngineCapabilities:
    """What one rollout engine can do on one device."""

    returns_routing: bool  # it reports each fed token's routed experts (routed_experts), for R3 and the metrics
    stop_sequences: bool  # it stops at token sequences (what the multi-turn agent loop needs)
    interruptible: bool  # it calls a hook between tokens that may change the weights (partial rollouts)
    shares_trainer_modules: bool  # it samples from the very modules and numerics the actor trains
    multi_rank: bool  # one engine per actor rank works


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """A registered rollout engine: its name, where it lives, and its capabilities on a device."""

    name: str
    module: str
    capabilities: Callable[[str], EngineCapabilities]

    def check_model(self, hf_config: Any, *, device: str, max_model_len: int | None, source: str,
                    length_key: str) -> None:
        """Refuse (ValueError) a model this engine cannot serve, before anything is built (`module.check_servable`).

        An engine whose module defines no `check_servable` serves what the trainer can run.
        """
        check = getattr(importlib.import_module(self.module), "check_servable", None)
        if check is not None:
            check(hf_config, device=device, max_model_len=max_model_len, source=source, length_key=length_key)


def _hf(device: str) -> EngineCapabilities:
    return EngineCapabilities(returns_routing=True, stop_sequences=True, interruptible=True,
                              shares_trainer_modules=True, multi_rank=True)


def _vllm(device: str) -> EngineCapabilities:
    # vLLM returns routed experts from its V2 model runner only, which runs on CUDA.
    return EngineCapabilities(returns_routing=torch.device(device).type == "cuda", stop_sequences=False,
                              interruptible=False, shares_trainer_modules=False, multi_rank=False)


ROLLOUT_ENGINES: dict[str, EngineSpec] = {
    "hf": EngineSpec("hf", "conveyor.rollout.hf", _hf),
    "vllm": EngineSpec("vllm", "conveyor.rollout.vllm", _vllm),
}


def engine_spec(name: str) -> EngineSpec:
    """The registered engine `name`; a ValueError naming the key and the valid names otherwise."""
    try:
        return ROLLOUT_ENGINES[name]
    except KeyError:
        raise ValueError(f"actor_rollout_ref.rollout.name: unknown engine {name!r}; valid: "
                         f"{sorted(ROLLOUT_ENGINES)}") from None
