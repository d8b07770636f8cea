"""Rollout engines: turn prompts into sampled responses, their log-probs and (for MoE) their routing.

Every engine is a `RolloutEngine` (`conveyor.rollout.base`): it takes `SamplingParams`, returns a
`RolloutOutput` and declares its capabilities; `ROLLOUT_ENGINES` is the registry
`actor_rollout_ref.rollout.name` chooses from. `HFRollout` (Hugging Face model, our own decode loop) is
the default; `conveyor.rollout.vllm` serves with vLLM. `AgentLoop` runs multi-turn rollouts with tools
over any engine that stops at token sequences (actor_rollout_ref.rollout.multi_turn; see docs/agent.md),
and `trajectory` says where a response with tool tokens ends (the trainer's weights reach an engine
through `conveyor.weights`). This package does not score responses or talk to the data plane; the workers do.
"""

from conveyor.rollout.agent_loop import AgentLoop, AgentLoopSettings, build_agent_loop
from conveyor.rollout.base import (ROLLOUT_ENGINES, EngineCapabilities, EngineContext, EngineSpec, RolloutEngine,
                                   RolloutOutput, SamplingParams, engine_spec, mask_unfed_routing)
from conveyor.rollout.hf import HFRollout
from conveyor.algos.trajectory import response_span, segments, span_lengths

__all__ = ["AgentLoop", "AgentLoopSettings", "EngineCapabilities", "EngineContext", "EngineSpec", "HFRollout",
           "ROLLOUT_ENGINES", "RolloutEngine", "RolloutOutput", "SamplingParams", "build_agent_loop", "engine_spec",
           "mask_unfed_routing", "response_span", "segments", "span_lengths"]
