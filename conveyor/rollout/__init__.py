"""Rollout engines: turn prompts into sampled responses, their log-probs and (for MoE) their routing.

Every engine is a `GenerationEngine` (`conveyor.rollout.base`): it takes `SamplingParams`, returns a
`GenerationOutput` and declares its capabilities; `ROLLOUT_ENGINES` is the registry
`actor_rollout_ref.rollout.name` chooses from. `HFEngine` (Hugging Face model, our own decode loop) is
the default; `conveyor.rollout.vllm` serves with vLLM. `AgentLoop` runs multi-turn rollouts with tools
over any engine that stops at token sequences (actor_rollout_ref.rollout.multi_turn; see docs/agent.md),
and the trajectory masks it re-exports (`conveyor.algos.trajectory`) say where a response with tool tokens
ends. The trainer's weights reach an engine through `conveyor.weights`. This package does not score
responses or talk to the data plane; the workers do.
"""

from conveyor.algos.trajectory import response_span, segments, span_lengths
from conveyor.rollout.agent_loop import AgentLoop, AgentLoopSettings, build_agent_loop, build_rollout_loop
from conveyor.rollout.base import (
    ROLLOUT_ENGINES,
    EngineCapabilities,
    EngineContext,
    EngineSpec,
    GenerationEngine,
    GenerationOutput,
    SamplingParams,
    engine_spec,
    mask_unfed_routing,
)
from conveyor.rollout.hf import HFEngine

__all__ = [
    "AgentLoop",
    "AgentLoopSettings",
    "EngineCapabilities",
    "EngineContext",
    "EngineSpec",
    "HFEngine",
    "ROLLOUT_ENGINES",
    "GenerationEngine",
    "GenerationOutput",
    "SamplingParams",
    "build_agent_loop",
    "build_rollout_loop",
    "engine_spec",
    "mask_unfed_routing",
    "response_span",
    "segments",
    "span_lengths",
]
