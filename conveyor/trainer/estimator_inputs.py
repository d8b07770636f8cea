"""What the advantage stage reads for an estimator beyond rewards, group ids and values, and the keywords it makes.

Two families read more:

- the optimal token baselines (`EstimatorNeeds.sum_pi_squared`) read `old_log_probs` and `sum_pi_squared`
  (B, T) from the old-log-prob forward, and with importance weights on (the run plan's `rollout_is_level`)
  the truncated weights of those log-probs against `rollout_log_probs`, as verl passes them;
- `algorithm.gdpo_reward_keys` names per-sample fields (B,) that the reward stage wrote (`acc`, or an entry of
  the dict a reward function returns): they are stacked into `reward_components` (B, K), with
  `algorithm.gdpo_reward_weights` as `reward_weights`.

What it deliberately does not do: compute advantages (`conveyor.algos.advantages` does) or write anything.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict

from conveyor.algos.advantages import EstimatorNeeds
from conveyor.algos.correction import compute_rollout_is_weights
from conveyor.config import Config
from conveyor.config.plan import RunPlan
from conveyor.data_plane.base import DataPlane, FieldNotFoundError
from conveyor.protocol import KVBatchMeta

__all__ = ["estimator_fields", "estimator_inputs"]


def _reads_is_weights(plan: RunPlan) -> bool:
    """Whether importance weights apply and the old log-probs differ from the rollout's (not bypass)."""
    return plan.rollout_is_level is not None and not plan.bypass


def estimator_fields(plan: RunPlan, needs: EstimatorNeeds) -> list[str]:
    """The data-plane fields the estimator's extra inputs are made from (besides GDPO's components)."""
    if not needs.sum_pi_squared:
        return []
    return ["old_log_probs", "sum_pi_squared"] + (["rollout_log_probs"] if _reads_is_weights(plan) else [])


def estimator_inputs(
    td: TensorDict, meta: KVBatchMeta, data_plane: DataPlane, cfg: Config, plan: RunPlan, needs: EstimatorNeeds
) -> dict[str, Any]:
    """The keywords of `compute_advantage` beyond the usual ones, from `td` (holding `estimator_fields`)."""
    out: dict[str, Any] = {}
    mask = td["response_mask"].bool()
    if needs.sum_pi_squared:
        out["old_log_probs"] = td["old_log_probs"]
        out["sum_pi_squared"] = td["sum_pi_squared"]
        if _reads_is_weights(plan):
            upper, lower = cfg.algorithm.rollout_correction.is_thresholds()
            out["rollout_is_weights"], _ = compute_rollout_is_weights(
                td["old_log_probs"],
                td["rollout_log_probs"],
                mask,
                level=plan.rollout_is_level,
                threshold=upper,
                lower=lower,
            )
    keys = cfg.algorithm.gdpo_reward_keys
    if keys:
        out["reward_components"] = _reward_components(meta, data_plane, list(keys))
        if cfg.algorithm.gdpo_reward_weights is not None:
            out["reward_weights"] = [float(w) for w in cfg.algorithm.gdpo_reward_weights]
    return out


def _reward_components(meta: KVBatchMeta, data_plane: DataPlane, keys: list[str]) -> torch.Tensor:
    """The fields `keys` (one number per sample each) as a float32 (B, K) tensor; a ValueError naming the key."""
    try:
        td = data_plane.get(meta, keys)
    except FieldNotFoundError as err:
        raise ValueError(
            f"algorithm.gdpo_reward_keys: {err.fields} not written by the reward stage; it writes acc, and each "
            "entry of the dict a reward function returns (e.g. {'score': ..., 'format_reward': ...})"
        ) from None
    columns = []
    for key in keys:
        value = td[key]
        column = value if isinstance(value, torch.Tensor) else torch.tensor([float(v) for v in value])
        if column.dim() != 1:
            raise ValueError(
                f"algorithm.gdpo_reward_keys: field {key!r} holds {tuple(column.shape)} per batch, not one number "
                "per sample"
            )
        columns.append(column.to(torch.float32))
    return torch.stack(columns, dim=-1)
