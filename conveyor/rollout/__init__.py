"""Rollout engines: turn prompts into sampled responses, their log-probs and (for MoE) their routing.

`HFRollout` (Hugging Face model, our own decode loop) is the default.
`AgentLoop` runs multi-turn rollouts with tools over it
(actor_rollout_ref.rollout.multi_turn; see docs/agent.md), and `trajectory`
says where a response with tool tokens ends. This package does not score
responses or talk to the data plane; the rollout worker does.
"""

from conveyor.rollout.agent_loop import AgentLoop, AgentLoopSettings, build_agent_loop
from conveyor.rollout.hf import HFRollout
from conveyor.rollout.trajectory import response_span, segments, span_lengths

__all__ = ["AgentLoop", "AgentLoopSettings", "HFRollout", "build_agent_loop", "response_span", "segments",
           "span_lengths"]
