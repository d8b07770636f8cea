"""What a vision-language policy runs with so far, checked at start: every other path is refused naming its key.

A run whose policy checkpoint has a vision tower (`is_vlm_config`) samples on
the hf engine, colocated, and trains with the padded or packed forward, on one
rank or under FSDP2; the reference (a KL loss) and the critic (GAE: a value head on the
vision tower and text model) run the same forward. Each setting that would
take a path that does not carry images yet (sequence parallelism, vLLM,
several ranks under another strategy than FSDP2, multi-turn
tools and agents, a reward model
or a judge, a teacher) stops the run before any worker is built, with one
line naming the key to change (docs/vlm.md).

It deliberately checks settings only; the data's images are checked where
they are read (`conveyor.models.vision`).
"""

from __future__ import annotations

from typing import Any

from conveyor.config import Config, ConfigError
from conveyor.workers.training.strategy import resolve_strategy

__all__ = ["check_vlm_run"]


def _refusals(cfg: Config, plan: Any) -> list[tuple[bool, str]]:
    """(whether the setting is on, the key and what to set it to) for every path images do not take yet."""
    arr = cfg.actor_rollout_ref
    a, ro = arr.actor, arr.rollout
    ranks = cfg.trainer.nnodes * max(cfg.trainer.n_gpus_per_node, cfg.trainer.num_cpu_workers)
    ref_sp = arr.ref.ulysses_sequence_parallel_size
    return [
        (a.ulysses_sequence_parallel_size > 1, "actor_rollout_ref.actor.ulysses_sequence_parallel_size=1"),
        (ref_sp is not None and ref_sp > 1, "actor_rollout_ref.ref.ulysses_sequence_parallel_size=1"),
        (ro.name != "hf", "actor_rollout_ref.rollout.name=hf (vLLM's multimodal inputs are not passed yet)"),
        (
            ranks > 1 and resolve_strategy(a.strategy, ranks) != "fsdp2",
            "actor_rollout_ref.actor.strategy=fsdp2 (several ranks with images are tested under fsdp2 only)",
        ),
        (bool(ro.multi_turn.enable), "actor_rollout_ref.rollout.multi_turn.enable=false (tools returning images)"),
        (
            bool(ro.agent.command or ro.agent.callable),
            "actor_rollout_ref.rollout.agent.command/callable=null (the gateway's image parts are not accepted yet)",
        ),
        (
            plan.use_critic and cfg.critic.ulysses_sequence_parallel_size > 1,
            "critic.ulysses_sequence_parallel_size=1 (sequence parallelism does not cut images yet)",
        ),
        (
            plan.use_critic and ranks > 1 and resolve_strategy(cfg.critic.strategy, ranks) != "fsdp2",
            "critic.strategy=fsdp2 (several ranks with images are tested under fsdp2 only)",
        ),
        (plan.use_reward_model, "reward_model.enable=false (a text reward model would not see the images)"),
        (plan.use_judge, "reward_model.judge.enable=false (a text judge would not see the images)"),
        (plan.use_teacher, "distillation.enabled=false (the teacher's forward carries no images yet)"),
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
