"""Rollout engines: turn prompts into sampled responses, their log-probs and (for MoE) their routing.

`HFRollout` (Hugging Face model, our own decode loop) is the default. This
package does not score responses or talk to the data plane; the rollout
worker does.
"""

from conveyor.rollout.hf import HFRollout

__all__ = ["HFRollout"]
