"""What the advantage stage hands the newer estimators: sum_pi_squared from the old-log-prob forward, GDPO's fields."""

from __future__ import annotations

import pytest
import torch
from test_stages import make_trainer, step_partition  # tests/trainer is on sys.path (rootdir import mode)

from conveyor.algos.advantages import compute_advantage
from conveyor.algos.correction import compute_rollout_is_weights
from conveyor.config import ConfigError, load_config
from conveyor.trainer.plan import build_run_plan

OTB = ["algorithm.adv_estimator=optimal_token_baseline"]


def test_the_plan_runs_the_forward_that_writes_sum_pi_squared() -> None:
    plan = build_run_plan(load_config(None, OTB), "cpu")
    assert plan.old_log_probs == "forward" and plan.forward_sum_pi_squared
    assert any("sum_pi_squared" in d for d in plan.decisions)
    plan = build_run_plan(load_config(None, []), "cpu")
    assert plan.old_log_probs == "rollout" and not plan.forward_sum_pi_squared
    plan = build_run_plan(load_config(None, ["actor_rollout_ref.actor.calculate_sum_pi_squared=true"]), "cpu")
    assert plan.old_log_probs == "forward" and plan.forward_sum_pi_squared
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref.actor.calculate_sum_pi_squared: .*true or null"):
        load_config(None, [*OTB, "actor_rollout_ref.actor.calculate_sum_pi_squared=false"])
    with pytest.raises(ConfigError, match=r"^algorithm.rollout_correction.bypass_mode: .*null or false"):
        load_config(None, [*OTB, "algorithm.rollout_correction.bypass_mode=true"])


def test_the_forward_writes_sum_pi_squared_and_the_advantages_read_it(tiny_run) -> None:
    trainer, dp = make_trainer(tiny_run + ["algorithm.adv_estimator=tir_optimal_token_baseline"] + IS_TOKEN)
    meta, _ = trainer.sample(step_partition("train-1"))
    meta, _ = trainer.compute_old_log_prob(meta)
    meta, _ = trainer.compute_advantage(meta)
    td = dp.get(
        meta,
        ["sum_pi_squared", "old_log_probs", "rollout_log_probs", "response_mask", "rm_scores", "uid", "advantages"],
    )
    mask = td["response_mask"].bool()
    spp, pi = td["sum_pi_squared"], td["old_log_probs"].exp()
    # The squared mass of a distribution: at least the sampled token's share squared, at most 1; 0 off the mask.
    assert mask.any() and (spp[mask] >= pi[mask] ** 2 - 1e-6).all() and (spp[mask] <= 1 + 1e-6).all()
    assert spp[~mask].eq(0).all()
    weights, _ = compute_rollout_is_weights(td["old_log_probs"], td["rollout_log_probs"], mask, level="token")
    want, _ = compute_advantage(
        "tir_optimal_token_baseline",
        td["rm_scores"],
        mask,
        group_index=list(td["uid"]),
        old_log_probs=td["old_log_probs"],
        sum_pi_squared=spp,
        rollout_is_weights=weights,
    )
    torch.testing.assert_close(td["advantages"], want)


IS_TOKEN = ["algorithm.rollout_correction.rollout_is=token"]


def test_gdpo_normalises_the_named_reward_fields(tiny_run) -> None:
    trainer, dp = make_trainer(tiny_run + ["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[acc]"])
    meta, _ = trainer.sample(step_partition("train-1"))
    meta, _ = trainer.compute_old_log_prob(meta)
    meta, _ = trainer.compute_advantage(meta)
    td = dp.get(meta, ["acc", "response_mask", "rm_scores", "uid", "advantages"])
    want, _ = compute_advantage(
        "gdpo",
        td["rm_scores"],
        td["response_mask"].bool(),
        group_index=list(td["uid"]),
        reward_components=td["acc"].unsqueeze(-1),
    )
    torch.testing.assert_close(td["advantages"], want)

    trainer, _ = make_trainer(tiny_run + ["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[format_reward]"])
    meta, _ = trainer.sample(step_partition("train-1"))
    meta, _ = trainer.compute_old_log_prob(meta)
    with pytest.raises(ValueError, match=r"algorithm.gdpo_reward_keys: \['format_reward'\] not written"):
        trainer.compute_advantage(meta)


def test_gdpo_keys_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"^algorithm.gdpo_reward_weights: must be 2 finite number"):
        load_config(None, ["algorithm.gdpo_reward_keys=[acc,format]", "algorithm.gdpo_reward_weights=[1.0]"])
    with pytest.raises(ConfigError, match=r"^algorithm.gdpo_reward_weights: .*gdpo_reward_keys"):
        load_config(None, ["algorithm.gdpo_reward_weights=[1.0]"])
    with pytest.raises(ConfigError, match=r"^algorithm.gdpo_reward_keys: must be a non-empty list of distinct"):
        load_config(None, ["algorithm.gdpo_reward_keys=[acc,acc]"])
    cfg = load_config(None, ["algorithm.gdpo_reward_keys=[acc,fmt]", "algorithm.gdpo_reward_weights=[1,0.5]"])
    assert cfg.algorithm.gdpo_reward_weights == [1, 0.5]
