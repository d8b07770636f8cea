"""Run verl 0.9.1's core_algos on saved cases: `python verl_reference.py CASES.pt OUT.pt`.

Run as a subprocess by test_verl_parity.py, never imported by the tests:
importing verl sets up the root logger and environment variables, which would
leak into the tests that follow. Each case is a dict with a "kind"
(advantage, policy_loss, agg, kl) and its inputs; the output maps each case id
to verl's tensors.

verl's own config classes (``verl.workers.config``) pull in profiler and
tracking packages that verl's no-deps install lacks, so a stand-in module
providing ``ActorConfig`` (attribute access over a dict, which is all the
losses read) is put in its place before core_algos is imported.
"""

from __future__ import annotations

import sys
import types

import numpy as np
import torch


class _Config(dict):
    """A dict read by attribute too, with ``.get``: what core_algos reads from verl's config dataclasses."""

    __getattr__ = dict.__getitem__


class ActorConfig(_Config):
    """Stand-in for verl.workers.config.ActorConfig (the losses check isinstance against it)."""


def _load_core_algos() -> types.ModuleType:
    """verl.trainer.ppo.core_algos with ``verl.workers.config`` replaced by the stand-in."""
    stub = types.ModuleType("verl.workers.config")
    stub.ActorConfig = ActorConfig
    sys.modules["verl.workers.config"] = stub
    from verl.trainer.ppo import core_algos

    return core_algos


def _advantage(ca: types.ModuleType, case: dict) -> dict[str, torch.Tensor]:
    """verl's estimator ``case["name"]`` -> advantages and returns."""
    kwargs = {
        "token_level_rewards": case["rewards"].clone(),
        "response_mask": case["mask"].float(),
        "index": np.array(case["index"]),
        "config": _Config(norm_adv_by_std_in_grpo=case["norm_adv_by_std"]),
    }
    if case["name"] in ("grpo", "gdpo"):
        kwargs["norm_adv_by_std_in_grpo"] = case["norm_adv_by_std"]
    if "reward_baselines" in case:
        kwargs["reward_baselines"] = case["reward_baselines"]
    for name in ("old_log_probs", "sum_pi_squared", "rollout_is_weights"):
        if name in case:
            kwargs[name] = case[name]
    if "reward_components" in case:
        # verl reads GDPO's components from the batch's non-tensor fields, named by algorithm.gdpo_reward_keys,
        # and places each on the last response token counted by the attention mask.
        components = case["reward_components"]
        keys = [f"component{j}" for j in range(components.shape[1])]
        kwargs["config"] = _Config(
            norm_adv_by_std_in_grpo=case["norm_adv_by_std"],
            gdpo_reward_keys=keys,
            gdpo_reward_weights=case.get("reward_weights"),
        )
        kwargs["non_tensor_batch"] = {k: components[:, j].numpy() for j, k in enumerate(keys)}
        prompts = torch.ones(components.shape[0], 2, dtype=torch.long)
        kwargs["batch"] = {
            "prompts": prompts,
            "attention_mask": torch.cat([torch.ones_like(prompts), case["mask"].long()], dim=1),
        }
    adv, ret = ca.get_adv_estimator_fn(case["name"])(**kwargs)
    return {"advantages": adv, "returns": ret}


def _policy_loss(ca: types.ModuleType, case: dict) -> dict[str, torch.Tensor]:
    """verl's policy loss ``case["name"]`` -> loss, d loss / d log_prob and its metrics (``metric/<name>``)."""
    log_prob = case["log_prob"].clone().requires_grad_(True)
    params = case["params"]  # the loss's own hyperparameters; verl's defaults otherwise
    config = ActorConfig(
        clip_ratio=case["clip_ratio_low"],
        clip_ratio_low=case["clip_ratio_low"],
        clip_ratio_high=case["clip_ratio_high"],
        clip_ratio_c=case["clip_ratio_c"],
        tau_pos=params.get("tau_pos", 1.0),
        tau_neg=params.get("tau_neg", 1.05),
        policy_loss=_Config(
            clip_cov_ratio=params.get("clip_cov_ratio", 0.0002),
            clip_cov_lb=params.get("clip_cov_lb", 1.0),
            clip_cov_ub=params.get("clip_cov_ub", 5.0),
            kl_cov_ratio=params.get("kl_cov_ratio", 0.0002),
            ppo_kl_coef=params.get("ppo_kl_coef", 0.1),
            dro_beta=params.get("dro_beta"),
        ),
        global_batch_info={
            "dp_size": 1,
            "batch_num_tokens": case["num_tokens"],
            "global_batch_size": case["num_seqs"],
            "loss_scale_factor": case["loss_scale_factor"],
        },
    )
    torch.manual_seed(case["seed"])  # clip_cov picks its tokens with the global generator
    loss, metrics = ca.get_policy_loss_fn(case["name"])(
        case["old_log_prob"],
        log_prob,
        case["advantages"],
        case["mask"].float(),
        loss_agg_mode=case["loss_agg_mode"],
        config=config,
        rollout_is_weights=case.get("is_weights"),
    )
    loss.backward()
    out = {"loss": loss.detach(), "grad": log_prob.grad}
    out.update({"metric/" + k.removeprefix("actor/"): torch.tensor(float(v)) for k, v in metrics.items()})
    return out


def _agg(ca: types.ModuleType, case: dict) -> dict[str, torch.Tensor]:
    """verl's agg_loss on one rank with the global normalisers given."""
    loss = ca.agg_loss(
        case["loss_mat"],
        case["mask"].float(),
        case["loss_agg_mode"],
        dp_size=1,
        batch_num_tokens=case["num_tokens"],
        global_batch_size=case["num_seqs"],
        loss_scale_factor=case["loss_scale_factor"],
    )
    return {"loss": loss}


def _kl(ca: types.ModuleType, case: dict) -> dict[str, torch.Tensor]:
    """verl's kl_penalty -> the per-token value and d (weights * kl).sum() / d log_prob."""
    log_prob = case["log_prob"].clone().requires_grad_(True)
    kl = ca.kl_penalty(log_prob, case["ref_log_prob"], case["name"])
    (kl * case["weights"]).sum().backward()
    return {"value": kl.detach(), "grad": log_prob.grad}


class _NoTextTokenizer:
    """What DAPORewardManager reads of a tokenizer; the overlong case's score ignores the text."""

    eos_token = "</s>"

    def decode(self, ids, skip_special_tokens=True) -> str:
        return ""


def _overlong(ca: types.ModuleType, case: dict) -> dict[str, torch.Tensor]:
    """verl's DAPORewardManager with the overlong buffer on -> each response's reward (score + penalty)."""
    from verl import DataProto
    from verl.workers.reward_manager.dapo import DAPORewardManager

    lengths, width = case["lengths"], case["max_resp_len"]
    batch = len(lengths)
    prompt = torch.ones(batch, 2, dtype=torch.long)
    response_mask = (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).long()
    data = DataProto.from_dict(
        tensors={
            "prompts": prompt,
            "responses": torch.ones(batch, width, dtype=torch.long),
            "attention_mask": torch.cat([torch.ones_like(prompt), response_mask], dim=1),
        },
        non_tensors={
            "data_source": np.array(["synthetic"] * batch, dtype=object),
            "reward_model": np.array([{"ground_truth": "0"}] * batch, dtype=object),
        },
    )
    scores = iter(case["scores"].tolist())
    manager = DAPORewardManager(
        tokenizer=_NoTextTokenizer(),
        num_examine=0,
        compute_score=lambda **_: next(scores),
        max_resp_len=width,
        overlong_buffer_cfg=_Config(enable=True, len=case["len"], penalty_factor=case["penalty_factor"], log=True),
    )
    return {"reward": manager(data).sum(-1)}


def _offpolicy_stub() -> None:
    """rollout_corr_helper imports verl.workers.config.actor (for annotations only): a stand-in module."""
    stub = types.ModuleType("verl.workers.config.actor")
    stub.PolicyLossConfig = _Config
    sys.modules["verl.workers.config.actor"] = stub


def _offpolicy(ca: types.ModuleType, case: dict) -> dict[str, torch.Tensor]:
    """verl's compute_rollout_corr_metrics_from_logprobs -> each rollout_corr/ metric as a 0-d tensor."""
    _offpolicy_stub()
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_corr_metrics_from_logprobs

    metrics = compute_rollout_corr_metrics_from_logprobs(
        case["old_log_prob"], case["rollout_log_prob"], case["mask"].float()
    )
    return {k: torch.tensor(float(v), dtype=torch.float64) for k, v in metrics.items()}


def _rollout_is(ca: types.ModuleType, case: dict) -> dict[str, torch.Tensor]:
    """verl's compute_rollout_correction_weights -> the weights and each metric (as 0-d tensors, prefixed)."""
    _offpolicy_stub()
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights

    weights, metrics = compute_rollout_correction_weights(
        case["old_log_prob"] - case["rollout_log_prob"],
        case["mask"].float(),
        rollout_is=case["level"],
        rollout_is_threshold=case["threshold"],
    )
    out = {f"metric/rollout_corr/{k}": torch.tensor(float(v), dtype=torch.float64) for k, v in metrics.items()}
    return {"weights": weights, **out}


def _rejection(ca: types.ModuleType, case: dict) -> dict[str, torch.Tensor]:
    """verl's compute_rollout_rejection_mask -> the mask it keeps and each metric (as 0-d tensors)."""
    _offpolicy_stub()
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_rejection_mask

    mask, metrics = compute_rollout_rejection_mask(
        case["old_log_prob"] - case["rollout_log_prob"],
        case["mask"].float(),
        rollout_rs=case["options"],
        rollout_rs_threshold=case["threshold"],
    )
    out = {f"metric/{k}": torch.tensor(float(v), dtype=torch.float64) for k, v in metrics.items()}
    return {"mask": mask, **out}


def main(argv: list[str]) -> int:
    """Read the cases file, write verl's outputs per case id."""
    cases_path, out_path = argv
    ca = _load_core_algos()
    run = {
        "advantage": _advantage,
        "policy_loss": _policy_loss,
        "agg": _agg,
        "kl": _kl,
        "overlong": _overlong,
        "offpolicy": _offpolicy,
        "rollout_is": _rollout_is,
        "rejection": _rejection,
    }
    cases = torch.load(cases_path, weights_only=True)
    torch.save({case_id: run[case["kind"]](ca, case) for case_id, case in cases.items()}, out_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
