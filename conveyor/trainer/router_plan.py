"""The run plan's MoE router decisions: which replay `router_replay.mode=auto` runs, and which engines a
loss-free balancing bias can reach.

`auto_replay` reads how far the updates of a step move from the policy that sampled it, from the run's plan:
`k`, the optimizer steps per rollout batch (`ppo_epochs` x mini-batches per batch), and `s`, the staleness
an asynchronous run allows (`trainer.v1.sampler.max_off_policy_threshold`). ms-swift's guidance for MoE RL
(on-policy needs neither replay, a global batch twice the mini-batch R2, four times and more R3) gives:

- `k == 1` and `s == 0`: disabled. The one update's ratio is taken against the policy that sampled, and
  the routing of its forward is that policy's own.
- `s > 0` or `k >= 4`: R3. The rollout's policy is several steps behind the weights being trained, so the
  routing the samples were drawn under is the one to hold; replaying it also pins every update's ratio.
- otherwise (`k` of 2 or 3): R2. The later updates of the step see a moved router; replaying the old-log-prob
  forward's routing pins the experts the ratio compares.

R3 under `algorithm.rollout_correction.bypass_mode=true` on an engine that returns no routing would run as
R2, which bypass mode rules out: auto then picks disabled and says so; R2 under bypass mode picks R3 where
the engine returns routing, else disabled. A dense model gets disabled.

What it deliberately does not do: turn R3 into R2 on an engine without routing (`build_run_plan` does that
for every request, `auto`'s included), or check single keys (the config does).
"""

from __future__ import annotations

import math
from typing import Any

from conveyor.config import Config, ConfigError

__all__ = ["auto_replay", "check_router_controls", "updates_per_batch"]


def updates_per_batch(cfg: Config) -> int:
    """Optimizer steps the actor takes on one rollout batch: ppo_epochs x mini-batches per batch."""
    actor = cfg.actor_rollout_ref.actor
    return actor.ppo_epochs * math.ceil(cfg.data.train_batch_size / actor.ppo_mini_batch_size)


def auto_replay(cfg: Config, caps: Any, is_moe: bool, device: str) -> tuple[str, str]:
    """The replay mode `router_replay.mode=auto` runs (disabled, R2 or R3) and why, in words."""
    v1, actor = cfg.trainer.v1, cfg.actor_rollout_ref.actor
    k = updates_per_batch(cfg)
    s = v1.sampler.max_off_policy_threshold if v1.is_async else 0
    shape = (
        f"{k} optimizer step(s) per rollout batch (ppo_epochs={actor.ppo_epochs}, "
        f"train_batch_size={cfg.data.train_batch_size} / ppo_mini_batch_size={actor.ppo_mini_batch_size}), "
        f"staleness {s}"
    )
    if not is_moe:
        return "disabled", "router_replay.mode=auto: disabled (the model is dense)"
    if k == 1 and s == 0:
        mode, rule = "disabled", "on-policy: one update against the sampling policy needs no replay"
    elif s > 0 or k >= 4:
        mode, rule = "R3", "off-policy by 4 or more updates, or stale samples: the rollout's routing is held"
    else:
        mode, rule = "R2", "2-3 updates per batch: the old-log-prob forward's routing is held"
    bypass = cfg.algorithm.rollout_correction.bypass_mode is True
    if bypass and (mode == "R2" or not caps.returns_routing) and mode != "disabled":
        if mode == "R2" and caps.returns_routing:
            mode, rule = "R3", rule + "; R3 instead, since bypass_mode=true skips the forward R2 records in"
        else:
            mode = "disabled"
            rule += (
                f"; disabled instead: the {cfg.actor_rollout_ref.rollout.name} rollout returns no routing on "
                f"{device} and bypass_mode=true skips the forward R2 records in"
            )
    return mode, f"router_replay.mode=auto: {mode} ({shape}; {rule})"


def check_router_controls(cfg: Config, caps: Any, device: str, is_moe: bool) -> str | None:
    """Refuse a router control on a dense model, or a bias the engine cannot serve; the plan's line, or None."""
    router = cfg.actor_rollout_ref.actor.router
    rate = router.bias_update_rate
    if not is_moe:
        for key, on, off in (
            ("freeze", router.freeze, "false"),
            ("aux_loss_coef", router.aux_loss_coef > 0, "0"),
            ("bias_update_rate", rate > 0, "0"),
        ):
            if on:
                raise ConfigError(
                    f"actor_rollout_ref.actor.router.{key}: the model is dense (it has no MoE router); set it to {off}"
                )
    if rate <= 0:
        return None
    name = cfg.actor_rollout_ref.rollout.name
    if not caps.selection_bias:
        raise ConfigError(
            f"actor_rollout_ref.actor.router.bias_update_rate={rate:g}: the {name} rollout cannot route with the "
            f"loss-free balancing bias on {device} (its model has no place for a per-expert selection bias, so "
            "it would sample from routing the trainer does not use); set it to 0 or use "
            "actor_rollout_ref.rollout.name=hf"
        )
    routes = (
        "the replayed samples were drawn with the recorded run's bias"
        if cfg.trainer.replay_rollouts_from
        else f"the {name} rollout routes with it"
    )
    return (
        f"loss-free balancing: each router's selection bias moves by {rate:g} per optimizer step against its "
        f"expert's excess load (global over the actor's ranks); {routes}"
    )
