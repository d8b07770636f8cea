"""What a vision-language policy runs with so far, checked at start: every other path is refused naming its key.

A run whose policy checkpoint has a vision tower (`is_vlm_config`) samples on
the hf engine, alone, in the multi-turn tool loop (tools answer text) or
through the agent gateway (images as `image_url` parts), and trains with the
padded or packed forward, on one rank or several (FSDP2 or DDP); the
reference (a KL loss), the critic (GAE: a value head on the vision tower and
text model) and a teacher (distillation) run the same forward over the same
pixels. Each setting that would take a path that does not carry images yet
(sequence parallelism, vLLM, a reward model or a judge) stops the run before
any worker is built, with one line naming the key to change (docs/vlm.md). A
teacher that would not read the pixels as the policy does (a text teacher,
other vision tokens or image processing) is refused by
`conveyor.trainer.distillation.check_teachers`; a tool that returns an image
stops the run at its first call (`conveyor.tools.base.ToolOutputRefused`).

It deliberately checks settings only; the data's images are checked where
they are read (`conveyor.models.vision`).
"""

from __future__ import annotations

from typing import Any

from conveyor.config import Config, ConfigError

__all__ = ["check_vlm_run"]


def _refusals(cfg: Config, plan: Any) -> list[tuple[bool, str]]:
    """(whether the setting is on, the key and what to set it to) for every path images do not take yet."""
    arr = cfg.actor_rollout_ref
    a, ro = arr.actor, arr.rollout
    ref_sp = arr.ref.ulysses_sequence_parallel_size
    return [
        (a.ulysses_sequence_parallel_size > 1, "actor_rollout_ref.actor.ulysses_sequence_parallel_size=1"),
        (ref_sp is not None and ref_sp > 1, "actor_rollout_ref.ref.ulysses_sequence_parallel_size=1"),
        (ro.name != "hf", "actor_rollout_ref.rollout.name=hf (vLLM's multimodal inputs are not passed yet)"),
        (
            plan.use_critic and cfg.critic.ulysses_sequence_parallel_size > 1,
            "critic.ulysses_sequence_parallel_size=1 (sequence parallelism does not cut images yet)",
        ),
        (plan.use_reward_model, "reward_model.enable=false (a text reward model would not see the images)"),
        (plan.use_judge, "reward_model.judge.enable=false (a text judge would not see the images)"),
    ]


def check_vlm_run(cfg: Config, plan: Any, model_config: Any) -> None:
    """Refuse, naming the key, a setting a vision-language policy (`model_config` has a vision tower) cannot run."""
    from conveyor.models.tiny_vlm import is_vlm_config

    if not is_vlm_config(model_config):
        return
    for on, what in _refusals(cfg, plan):
        if on:
            raise ConfigError(
                f"the policy {cfg.actor_rollout_ref.model.path!r} is a vision-language model, which runs only the "
                f"paths that carry images so far: set {what} (docs/vlm.md)"
            )
