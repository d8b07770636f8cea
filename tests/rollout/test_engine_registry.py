"""The engine registry: a newly registered engine is chosen by name, built by its module, and held to its word.

This module registers itself as an engine ("test_no_routing": the hf engine, claiming it returns routing
but returning none) and trains with it: the config takes the name, the worker builds it through
`build_engine`, and R3's first rollout fails with what to change instead of an update finding nothing.
"""

from __future__ import annotations

import pytest

from conveyor.config import load_config
from conveyor.rollout import base
from conveyor.rollout.base import EngineContext, EngineSpec, GenerationOutput, SamplingParams
from conveyor.rollout.hf import HFEngine
from conveyor.rollout.hf import build_engine as build_hf
from conveyor.trainer.run import run_training


class _NoRouting(HFEngine):
    """The hf engine, minus the routing it declares."""

    def generate(self, input_ids, attention_mask, params: SamplingParams, **kwargs) -> GenerationOutput:
        return super().generate(input_ids, attention_mask, params, **kwargs).replace(routed_experts=None)


def build_engine(context: EngineContext) -> HFEngine:
    """The registry's hook: this module's engine."""
    engine = build_hf(context)
    engine.__class__ = _NoRouting
    return engine


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setitem(
        base.ROLLOUT_ENGINES,
        "test_no_routing",
        EngineSpec("test_no_routing", __name__, base.ROLLOUT_ENGINES["hf"].capabilities),
    )
    return "test_no_routing"


def test_an_engine_that_returns_no_routing_fails_the_first_r3_rollout(registered, tiny_run) -> None:
    cfg = load_config(
        None,
        tiny_run + [f"actor_rollout_ref.rollout.name={registered}", "actor_rollout_ref.actor.router_replay.mode=R3"],
    )
    with pytest.raises(RuntimeError, match="returned no routed_experts.*router_replay.mode=R2") as info:
        run_training(cfg)
    assert "generate_sequences" in str(info.value)


def test_the_config_takes_its_names_from_the_registry(registered) -> None:
    assert (
        load_config(None, [f"actor_rollout_ref.rollout.name={registered}"]).actor_rollout_ref.rollout.name == registered
    )
    with pytest.raises(ValueError, match="test_no_routing"):
        load_config(None, ["actor_rollout_ref.rollout.name=nope"])
