"""Advantage estimators against hand-worked numbers, mask handling and the registry."""

from __future__ import annotations

import math

import pytest
import torch

from conveyor.algos.advantages import (
    ADV_ESTIMATORS,
    NEEDS_CRITIC,
    compute_advantage,
    get_adv_estimator,
    masked_mean,
    masked_var,
    masked_whiten,
    register_adv_estimator,
)


def _py_whiten(xs: list[float]) -> list[float]:
    """Reference whitening in plain Python: unbiased variance, the 1e-8 guard the library uses."""
    mean = sum(xs) / len(xs)
    var = sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)
    return [(x - mean) / math.sqrt(var + 1e-8) for x in xs]


# --------------------------------------------------------------------------- helpers


def test_masked_mean_var_whiten_by_hand() -> None:
    values = torch.tensor([[1.0, 2.0, 100.0], [3.0, float("nan"), 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    # Selected: 1, 2, 3, 6 -> mean 3, squared deviations 4+1+0+9 = 14, unbiased var 14/3.
    assert masked_mean(values, mask).item() == pytest.approx(3.0)
    assert masked_var(values, mask).item() == pytest.approx(14.0 / 3.0)
    assert masked_var(values, mask, unbiased=False).item() == pytest.approx(14.0 / 4.0)
    # Per-row mean along dim -1: row 0 -> 1.5, row 1 -> 4.5.
    torch.testing.assert_close(masked_mean(values, mask, dim=-1), torch.tensor([1.5, 4.5]))

    whitened = masked_whiten(values, mask)
    expected = _py_whiten([1.0, 2.0, 3.0, 6.0])
    torch.testing.assert_close(
        whitened, torch.tensor([[expected[0], expected[1], 0.0], [expected[2], 0.0, expected[3]]])
    )
    # shift_mean=False keeps the mean (3) and only rescales the spread.
    kept = masked_whiten(values, mask, shift_mean=False)
    assert masked_mean(kept, mask).item() == pytest.approx(3.0)


def test_masked_helpers_empty_and_single() -> None:
    values = torch.tensor([[5.0, 7.0]])
    assert masked_mean(values, torch.zeros(1, 2)).item() == 0.0
    # A single selected item has no unbiased variance; 0 keeps whitening finite.
    assert masked_var(values, torch.tensor([[1, 0]])).item() == 0.0
    assert torch.isfinite(masked_whiten(values, torch.tensor([[1, 0]]))).all()


# --------------------------------------------------------------------------- GRPO


def _outcome_rewards(scores: list[float], lengths: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rewards with each score on the sequence's last valid token, and the matching mask."""
    rewards = torch.zeros(len(scores), length)
    mask = torch.zeros(len(scores), length, dtype=torch.bool)
    for i, (s, n) in enumerate(zip(scores, lengths)):
        mask[i, :n] = True
        rewards[i, n - 1] = s
    return rewards, mask


def test_grpo_by_hand() -> None:
    # Group 0: scores 1, 3 -> mean 2, unbiased std sqrt(2) -> advantages -1/sqrt2, +1/sqrt2.
    # Group 1: scores 0, 0 -> std 0 -> advantages 0 (epsilon keeps it finite).
    # Group 2: a lone sample with score 5 -> mean 0, std 1 -> advantage 5 / (1 + eps).
    rewards, mask = _outcome_rewards([1, 3, 0, 0, 5], [3, 1, 2, 3, 2], 3)
    group = torch.tensor([7, 7, 2, 2, 9])
    eps = 1e-6
    adv, ret = compute_advantage("grpo", rewards, mask, group_index=group, epsilon=eps)
    per_seq = torch.tensor([-1 / (math.sqrt(2) + eps), 1 / (math.sqrt(2) + eps), 0.0, 0.0, 5 / (1 + eps)])
    expected = per_seq[:, None] * mask
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, expected)

    # Without std normalisation: plain mean-centring (lone sample keeps its raw score).
    adv, _ = compute_advantage("grpo", rewards, mask, group_index=group, norm_adv_by_std=False)
    torch.testing.assert_close(adv, torch.tensor([-1.0, 1.0, 0.0, 0.0, 5.0])[:, None] * mask)


def test_grpo_std_is_unbiased_like_torch_std_and_accepts_uid_lists() -> None:
    rewards, mask = _outcome_rewards([1.0, 2.0, 4.0], [2, 2, 2], 2)
    scores = torch.tensor([1.0, 2.0, 4.0])
    expected = (scores - scores.mean()) / (scores.std() + 1e-6)
    adv, _ = compute_advantage("grpo", rewards, mask, group_index=["uid-a", "uid-a", "uid-a"])
    torch.testing.assert_close(adv[:, 0], expected)
    torch.testing.assert_close(adv[:, 1], expected)


def test_grpo_score_is_sum_of_token_rewards() -> None:
    # Rewards spread over tokens add up: row scores 3 and 1 -> mean 2, std sqrt2.
    rewards = torch.tensor([[1.0, 2.0], [0.5, 0.5]])
    mask = torch.ones(2, 2)
    adv, _ = compute_advantage("grpo", rewards, mask, group_index=torch.tensor([0, 0]), epsilon=0.0)
    torch.testing.assert_close(adv, torch.tensor([[1.0, 1.0], [-1.0, -1.0]]) / math.sqrt(2))


def test_group_estimators_need_group_index() -> None:
    rewards, mask = _outcome_rewards([1.0, 2.0], [1, 1], 1)
    for name in ("grpo", "rloo"):
        with pytest.raises(ValueError, match="group_index"):
            compute_advantage(name, rewards, mask)
    with pytest.raises(ValueError, match="group_index"):
        compute_advantage("grpo", rewards, mask, group_index=torch.tensor([0, 0, 1]))


# --------------------------------------------------------------------------- RLOO


def test_rloo_by_hand() -> None:
    # Group scores 1, 3, 5: baselines are the mean of the other two -> 4, 3, 2,
    # so advantages -3, 0, 3. The lone sample (score 7) gets 0.
    rewards, mask = _outcome_rewards([1, 3, 5, 7], [2, 3, 1, 2], 3)
    adv, ret = compute_advantage("rloo", rewards, mask, group_index=torch.tensor([0, 0, 0, 1]))
    expected = torch.tensor([-3.0, 0.0, 3.0, 0.0])[:, None] * mask
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, expected)


# --------------------------------------------------------------------------- GAE


def test_gae_by_hand() -> None:
    # gamma = lam = 0.5, rewards (0, 0, 1), values (0.5, 1, 2):
    # deltas: t2 = 1 - 2 = -1; t1 = 0.5*2 - 1 = 0; t0 = 0.5*1 - 0.5 = 0.
    # advantages: t2 = -1; t1 = 0 + 0.25*(-1) = -0.25; t0 = 0 + 0.25*(-0.25) = -0.0625.
    # returns = advantages + values = (0.4375, 0.75, 1.0); advantages then whitened.
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 1.0, 2.0]])
    mask = torch.ones(1, 3)
    adv, ret = compute_advantage("gae", rewards, mask, values=values, gamma=0.5, lam=0.5)
    torch.testing.assert_close(ret, torch.tensor([[0.4375, 0.75, 1.0]]))
    torch.testing.assert_close(adv, torch.tensor([_py_whiten([-0.0625, -0.25, -1.0])]))


def test_gae_skips_masked_tokens_inside_and_after_the_response() -> None:
    # A masked token in the middle (tool output) and right padding must behave
    # as if those positions were not there at all.
    rewards_c = torch.tensor([[0.3, -0.2, 1.0], [0.0, 0.5, 2.0]])
    values_c = torch.tensor([[0.1, 0.4, 0.9], [1.0, -1.0, 0.2]])
    adv_c, ret_c = compute_advantage("gae", rewards_c, torch.ones(2, 3), values=values_c, gamma=0.9, lam=0.8)

    nan = float("nan")
    rewards = torch.tensor([[0.3, nan, -0.2, 1.0, 7.0], [0.0, 0.5, 9.0, 2.0, nan]])
    values = torch.tensor([[0.1, nan, 0.4, 0.9, 3.0], [1.0, -1.0, nan, 0.2, 5.0]])
    mask = torch.tensor([[1, 0, 1, 1, 0], [1, 1, 0, 1, 0]], dtype=torch.bool)
    adv, ret = compute_advantage("gae", rewards, mask, values=values, gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv[mask].view(2, 3), adv_c)
    torch.testing.assert_close(ret[mask].view(2, 3), ret_c)
    assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()


def test_gae_needs_values_and_is_the_critic_estimator() -> None:
    assert NEEDS_CRITIC == {"gae"}
    with pytest.raises(ValueError, match="values"):
        compute_advantage("gae", torch.zeros(1, 2), torch.ones(1, 2))
    with pytest.raises(ValueError, match="values"):
        compute_advantage("gae", torch.zeros(1, 2), torch.ones(1, 2), values=torch.zeros(1, 3))


# --------------------------------------------------------------------------- REINFORCE++


def test_reinforce_plus_plus_by_hand() -> None:
    # gamma 0.5, rewards (0, 0, 1) then one padded token:
    # return-to-go = (0.25, 0.5, 1.0); advantages = its whitening over the 3 tokens.
    rewards = torch.tensor([[0.0, 0.0, 1.0, 42.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    adv, ret = compute_advantage("reinforce_plus_plus", rewards, mask, gamma=0.5)
    torch.testing.assert_close(ret, torch.tensor([[0.25, 0.5, 1.0, 0.0]]))
    torch.testing.assert_close(adv, torch.tensor([_py_whiten([0.25, 0.5, 1.0]) + [0.0]]))


def test_reinforce_plus_plus_discounts_over_valid_tokens_only() -> None:
    # Masked middle token: t2 return = 1, t0 return = 1 + 0.5 * 1 = 1.5 (one valid step, not two).
    rewards = torch.tensor([[1.0, 100.0, 1.0], [0.0, 0.0, 2.0]])
    mask = torch.tensor([[1, 0, 1], [1, 1, 1]])
    _, ret = compute_advantage("reinforce_plus_plus", rewards, mask, gamma=0.5)
    torch.testing.assert_close(ret, torch.tensor([[1.5, 0.0, 1.0], [0.5, 1.0, 2.0]]))


# --------------------------------------------------------------------------- REINFORCE++-baseline, ReMax, OPO, GPG,
# pass@k


def test_reinforce_plus_plus_baseline_by_hand() -> None:
    # Group scores 1, 3 -> centred -1, +1; the lone sample keeps its score 2.
    # Tokens: -1 (x2), +1 (x1), 2 (x1) -> whitened over those 4 tokens.
    rewards, mask = _outcome_rewards([1, 3, 2], [2, 1, 1], 2)
    adv, ret = compute_advantage("reinforce_plus_plus_baseline", rewards, mask, group_index=torch.tensor([0, 0, 1]))
    w = _py_whiten([-1.0, -1.0, 1.0, 2.0])
    torch.testing.assert_close(adv, torch.tensor([[w[0], w[1]], [w[2], 0.0], [w[3], 0.0]]))
    torch.testing.assert_close(ret, adv)


def test_remax_by_hand_and_needs_the_greedy_baseline() -> None:
    # Reward-to-go over valid tokens (0.5, 1.5, 1.0 | 2.0) minus the greedy rewards 1 and 3.
    rewards = torch.tensor([[-1.0, 0.5, 1.0], [2.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    adv, ret = compute_advantage("remax", rewards, mask, reward_baselines=torch.tensor([1.0, 3.0]))
    torch.testing.assert_close(ret, torch.tensor([[0.5, 1.5, 1.0], [2.0, 0.0, 0.0]]))
    torch.testing.assert_close(adv, torch.tensor([[-0.5, 0.5, 0.0], [-1.0, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="reward_baselines"):
        compute_advantage("remax", rewards, mask)
    with pytest.raises(ValueError, match="reward_baselines"):
        compute_advantage("remax", rewards, mask, reward_baselines=torch.zeros(3))


def test_opo_by_hand() -> None:
    # Scores 1 (length 3) and 4 (length 1): baseline (3*1 + 1*4) / 4 = 1.75. Lone sample keeps its score.
    rewards, mask = _outcome_rewards([1, 4, 5], [3, 1, 2], 3)
    adv, _ = compute_advantage("opo", rewards, mask, group_index=["a", "a", "b"])
    torch.testing.assert_close(adv, torch.tensor([-0.75, 2.25, 5.0])[:, None] * mask)


def test_gpg_by_hand() -> None:
    # Scores 0, 2 | 0, 0: alpha = 4 samples / 1 non-zero = 4; centred -1, +1 | flat group -> 0.
    rewards, mask = _outcome_rewards([0, 2, 0, 0], [1, 2, 2, 1], 2)
    adv, _ = compute_advantage("gpg", rewards, mask, group_index=torch.tensor([0, 0, 1, 1]))
    torch.testing.assert_close(adv, torch.tensor([-4.0, 4.0, 0.0, 0.0])[:, None] * mask)


def test_grpo_passk_by_hand() -> None:
    # Group 0 scores 1, 5, 3: only the best (5) gets 5 - 3 = 2, over std 2 -> 1.
    # Group 1 ties at the top (2, 2): best - second = 0 for everyone.
    rewards, mask = _outcome_rewards([1, 5, 3, 2, 2], [1, 2, 1, 2, 2], 2)
    group = torch.tensor([0, 0, 0, 1, 1])
    adv, _ = compute_advantage("grpo_passk", rewards, mask, group_index=group, epsilon=0.0)
    torch.testing.assert_close(adv, torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0])[:, None] * mask)
    adv, _ = compute_advantage("grpo_passk", rewards, mask, group_index=group, norm_adv_by_std=False)
    torch.testing.assert_close(adv, torch.tensor([0.0, 2.0, 0.0, 0.0, 0.0])[:, None] * mask)
    with pytest.raises(ValueError, match="at least 2 samples"):
        compute_advantage("grpo_passk", rewards, mask, group_index=torch.tensor([0, 0, 0, 1, 2]))


# --------------------------------------------------------------------------- flat groups

GROUP_ESTIMATORS = ("grpo", "rloo", "opo", "gpg", "grpo_passk", "reinforce_plus_plus_baseline")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", GROUP_ESTIMATORS)
def test_groups_with_equal_rewards_get_exactly_zero(name: str, dtype: torch.dtype) -> None:
    # In float32, mean(8 x 0.3) is a rounding step off 0.3 and std comes out ~3e-8,
    # so (score - mean) / (std + 1e-6) used to give ~0.03 on every token.
    scores, lengths, group = [], [], []
    for value in (0.1, 0.3, 0.7):
        for size in range(2, 9):
            scores += [value] * size
            lengths += [1 + (i % 4) for i in range(size)]
            group += [len(set(group))] * size
    rewards, mask = _outcome_rewards(scores, lengths, 4)
    adv, ret = compute_advantage(name, rewards.to(dtype), mask, group_index=torch.tensor(group))
    assert (adv == 0).all() and (ret == 0).all()


@pytest.mark.parametrize("name", [n for n in GROUP_ESTIMATORS if n != "reinforce_plus_plus_baseline"])
def test_a_flat_group_stays_zero_next_to_others(name: str) -> None:
    # Per-group estimators: a flat group's zeros do not depend on the rest of the batch.
    rewards, mask = _outcome_rewards([0.3] * 8 + [0.0, 1.0, 0.5], [3] * 8 + [1, 2, 3], 3)
    adv, _ = compute_advantage(name, rewards, mask, group_index=torch.tensor([0] * 8 + [1, 1, 1]))
    assert (adv[:8] == 0).all() and (adv[8:] != 0).any()


# --------------------------------------------------------------------------- shared properties


@pytest.mark.parametrize("name", sorted(ADV_ESTIMATORS))
def test_values_under_the_mask_change_nothing(name: str) -> None:
    gen = torch.Generator().manual_seed(0)
    rewards = torch.randn(6, 5, generator=gen)
    values = torch.randn(6, 5, generator=gen)
    mask = torch.rand(6, 5, generator=gen) > 0.3
    mask[:, 0] = True
    # A lone sample in group 2, except for pass@k, which needs two per group.
    group = torch.tensor([0, 0, 0, 1, 1, 1 if name == "grpo_passk" else 2])
    old_log_probs = -torch.rand(6, 5, generator=gen)
    sum_pi_squared = torch.exp(old_log_probs) ** 2 + 0.1
    kwargs = dict(
        values=values,
        group_index=group,
        gamma=0.9,
        lam=0.95,
        reward_baselines=torch.randn(6, generator=gen),
        old_log_probs=old_log_probs,
        sum_pi_squared=sum_pi_squared,
    )
    adv1, ret1 = compute_advantage(name, rewards, mask, **kwargs)

    nan = torch.tensor(float("nan"))
    noisy_rewards = torch.where(mask, rewards, torch.full_like(rewards, 1e6))
    for key in ("values", "old_log_probs", "sum_pi_squared"):
        kwargs[key] = torch.where(mask, kwargs[key], nan)
    adv2, ret2 = compute_advantage(name, noisy_rewards, mask, **kwargs)
    torch.testing.assert_close(adv1, adv2)
    torch.testing.assert_close(ret1, ret2)
    assert (adv1[~mask] == 0).all() and (ret1[~mask] == 0).all()
    assert adv1.shape == ret1.shape == rewards.shape


def test_shape_mismatch_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="token_level_rewards"):
        compute_advantage("reinforce_plus_plus", torch.zeros(2, 3), torch.ones(2, 4))


# --------------------------------------------------------------------------- registry


def test_unknown_estimator_lists_valid_names() -> None:
    with pytest.raises(ValueError) as info:
        get_adv_estimator("ppo2")
    message = str(info.value)
    assert "ppo2" in message
    for name in ("gae", "grpo", "rloo", "reinforce_plus_plus"):
        assert name in message
    with pytest.raises(ValueError, match="ppo2"):
        compute_advantage("ppo2", torch.zeros(1, 1), torch.ones(1, 1))


def test_register_a_new_estimator_and_dispatch_to_it() -> None:
    @register_adv_estimator("test_constant")
    def constant(token_level_rewards, response_mask, *, values, group_index, gamma, lam, norm_adv_by_std, epsilon):
        out = torch.full_like(token_level_rewards, gamma) * response_mask
        return out, out

    try:
        adv, _ = compute_advantage("test_constant", torch.zeros(1, 2), torch.tensor([[1.0, 0.0]]), gamma=0.7)
        torch.testing.assert_close(adv, torch.tensor([[0.7, 0.0]]))
        with pytest.raises(ValueError, match="already registered"):
            register_adv_estimator("test_constant")(lambda *a, **k: None)
    finally:
        ADV_ESTIMATORS.pop("test_constant", None)
