"""What an advantage estimator needs is declared where it is registered, and asked for by name."""

from __future__ import annotations

import pytest

from conveyor.algos.advantages import (
    ADV_ESTIMATORS,
    NEEDS_CRITIC,
    EstimatorNeeds,
    estimator_needs,
    register_adv_estimator,
)


def test_builtin_declarations():
    assert estimator_needs("gae") == EstimatorNeeds(needs_critic=True)
    assert estimator_needs("remax") == EstimatorNeeds(greedy_baseline=True)
    assert estimator_needs("grpo_passk") == EstimatorNeeds(min_group_size=2, group_baseline=True)
    assert estimator_needs("grpo") == EstimatorNeeds(group_baseline=True)
    assert estimator_needs("reinforce_plus_plus") == EstimatorNeeds()
    # The old set stays, as a view of the declarations.
    assert NEEDS_CRITIC == {name for name in ADV_ESTIMATORS if estimator_needs(name).needs_critic}


def test_unknown_name_is_the_registry_error():
    with pytest.raises(ValueError, match="algorithm.adv_estimator: unknown 'nope'; valid names are .*grpo"):
        estimator_needs("nope")


def test_plugins_registering_the_old_way_get_defaults():
    def mine(token_level_rewards, response_mask, **_):
        return token_level_rewards, token_level_rewards

    try:
        register_adv_estimator("test_old_style")(mine)
        assert estimator_needs("test_old_style") == EstimatorNeeds()
        register_adv_estimator("test_old_style_critic", needs_critic=True)(mine)
        assert estimator_needs("test_old_style_critic").needs_critic and "test_old_style_critic" in NEEDS_CRITIC
        # Put into the table by hand, without the decorator: still answered, with the defaults.
        ADV_ESTIMATORS["test_by_hand"] = mine
        assert estimator_needs("test_by_hand") == EstimatorNeeds()
    finally:
        for name in ("test_old_style", "test_old_style_critic", "test_by_hand"):
            ADV_ESTIMATORS.pop(name, None)
            NEEDS_CRITIC.discard(name)
        from conveyor.algos.advantages import ADV_ESTIMATOR_NEEDS

        for name in ("test_old_style", "test_old_style_critic"):
            ADV_ESTIMATOR_NEEDS.pop(name, None)


def test_min_group_size_must_be_positive():
    with pytest.raises(ValueError, match="min_group_size must be >= 1"):
        register_adv_estimator("test_bad", min_group_size=0)
