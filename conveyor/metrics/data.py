"""Per-step statistics of the batch: rewards, response lengths, advantages, returns, values.

Pure functions of the fields the metrics stage fetched; no state, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from conveyor.algos.correction import compute_mismatch_metrics

__all__ = ["compute_data_metrics"]


def _stats(prefix: str, x: torch.Tensor) -> dict[str, float]:
    if x.numel() == 0:
        return {}
    x = x.float()
    return {f"{prefix}/mean": float(x.mean()), f"{prefix}/max": float(x.max()), f"{prefix}/min": float(x.min())}


def compute_data_metrics(batch: Mapping[str, Any], *, use_critic: bool, max_response_length: int) -> dict[str, float]:
    """reward/*, response_length/*, prompt_length/*, advantages/*, returns/*, values/* of one step's batch."""
    mask = batch["response_mask"].bool()
    resp_len = mask.sum(-1).float()
    prompt_len = batch["prompt_mask"].sum(-1).float()
    scores = batch["rm_scores"].sum(-1)
    out: dict[str, float] = {}
    out.update(_stats("reward", scores))
    out["reward/accuracy"] = float((batch["acc"].float() >= 1.0).float().mean())
    out.update(_stats("reward/token_level", batch["token_level_rewards"].sum(-1)))
    out.update(_stats("response_length", resp_len))
    out["response_length/clip_ratio"] = float((resp_len >= max_response_length).float().mean())
    out.update(_stats("prompt_length", prompt_len))
    out.update(_stats("advantages", batch["advantages"][mask]))
    out.update(_stats("returns", batch["returns"][mask]))
    if use_critic and "values" in batch.keys():
        values = batch["values"][mask]
        out.update(_stats("values", values))
        returns = batch["returns"][mask]
        var = returns.var(unbiased=False)
        if var > 0:
            out["critic/vf_explained_var"] = float(1 - (returns - values).var(unbiased=False) / var)
    if "rollout_log_probs" in batch.keys() and "old_log_probs" in batch.keys():
        # How far the sampler's log-probs are from the trainer's: 0 when both run the same numerics.
        diff = (batch["rollout_log_probs"] - batch["old_log_probs"])[mask].abs()
        if diff.numel():
            out["rollout_corr/log_prob_abs_diff/mean"] = float(diff.mean())
            out["rollout_corr/log_prob_abs_diff/max"] = float(diff.max())
        out.update(compute_mismatch_metrics(batch["old_log_probs"], batch["rollout_log_probs"], batch["response_mask"]))
    out["_tokens"] = float(resp_len.sum() + prompt_len.sum())
    return out
