"""The run plan's reward-model decisions: whether a reward model and a judge score the responses, and where.

- on: `reward_model.enable`.
- placement: `reward_model.placement`, except in an asynchronous run on Ray, where the rollout thread scores a
  batch while the actor's ranks train: a reward model in the actor's processes would queue its forwards behind
  (and between) the actor's collectives, in an order the ranks need not share, so it gets ranks of its own.
- judge: `reward_model.judge.enable`; it always runs apart, on an engine of its own.

What it deliberately does not do: check single keys (the config does) or build anything.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from conveyor.config import Config

__all__ = ["reward_model_decision"]


def reward_model_decision(cfg: Config, why: list[str]) -> tuple[bool, str, bool]:
    """(whether a reward model runs, its placement, whether a judge runs); appends the reasons to `why`."""
    rm = cfg.reward_model
    judge = rm.judge
    if judge.enable:
        why.append(
            f"judge: {judge.model.path} on the {judge.engine} engine ({judge.parser} parser); reward adds "
            f"{judge.weight:g} x its score"
        )
    on, placement = _reward_model(cfg, why)
    return on, placement, judge.enable


def _reward_model(cfg: Config, why: list[str]) -> tuple[bool, str]:
    """(whether a reward model runs, its placement)."""
    from conveyor.workers.placement.group import use_ray

    rm = cfg.reward_model
    if not rm.enable:
        return False, rm.placement
    placement = rm.placement
    reason = f"reward_model.placement={placement}"
    if placement == "colocated" and cfg.trainer.v1.is_async and use_ray(cfg):
        placement = "separate"
        reason = (
            f"trainer.v1.trainer_mode={cfg.trainer.v1.trainer_mode} on Ray: it scores while the actor trains, so "
            "on ranks of its own"
        )
    why.append(
        f"reward model: {rm.model.path} ({placement}; {reason}); reward = {rm.model_weight:g} x its score + "
        f"{rm.rule_weight:g} x the rule reward"
    )
    return True, placement
