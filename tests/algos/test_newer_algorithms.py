"""gdpo, optimal_token_baseline, tir_optimal_token_baseline, dppo_tv, dppo_kl and dro: verl's values, and edge cases.

The expected numbers below were computed once by verl 0.9.1's own functions
(``verl.trainer.ppo.core_algos``, through ``verl_reference.py``) on these
inputs and written down, so this file needs no verl; ``test_verl_parity.py``
compares the same six with verl itself on random inputs when verl is installed.
"""

from __future__ import annotations

import pytest
import torch

from conveyor.algos.advantages import compute_advantage, estimator_needs
from conveyor.algos.logprob import sum_pi_squared_from_logits
from conveyor.algos.losses import get_policy_loss

TOL = {"atol": 1e-5, "rtol": 1e-5}


def _advantage_inputs() -> dict[str, torch.Tensor]:
    """Two groups of three: ragged lengths (a unique longest in group 0), an empty response, a hole (tool output)."""
    gen = torch.Generator().manual_seed(2026)
    mask = torch.tensor(
        [[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 0, 1], [1, 1, 1, 0]], dtype=torch.bool
    )
    rewards = torch.zeros(6, 4)
    last = torch.where(mask, torch.arange(4), -1).max(-1).values
    rewards[torch.arange(6), last] = torch.tensor([1.0, 0.75, 0.5, 1.0, 0.25, 0.0])
    # Row 3 has no token to carry its reward (verl would count one left off the mask; here it is skipped).
    rewards = rewards * mask
    old = (-2.0 * torch.rand(6, 4, generator=gen)).round(decimals=3)
    pi = old.exp()
    spp = (pi**2 + (1 - pi**2) * torch.rand(6, 4, generator=gen)).round(decimals=3)
    components = torch.tensor([[1.0, 0.2], [0.0, 0.9], [1.0, 0.4], [0.0, 0.1], [1.0, 0.3], [1.0, 0.8]])
    return {"rewards": rewards, "mask": mask, "old": old, "spp": spp, "components": components}


GROUPS = [0, 0, 0, 1, 1, 1]

# verl 0.9.1, compute_optimal_token_baseline_advantage / compute_multi_turn_optimal_token_baseline_advantage.
VERL_OTB = [
    [0.380194, 0.318657, 0.119426, 0.0],
    [0.130194, 0.068657, -0.130574, 0.750000],  # its last token: past every other sample (the zero tail)
    [-0.119806, -0.181343, 0.0, 0.0],
    [0.0, 0.0, 0.0, 0.0],
    [0.074259, 0.086333, 0.0, 0.0],
    [-0.175741, -0.163667, 0.0, 0.0],
]
VERL_TIR_OTB = [
    [0.380194, 0.318657, 0.119426, 0.0],
    [0.130194, 0.068657, -0.130574, 0.750000],
    [-0.119806, -0.181343, 0.0, 0.0],
    [0.0, 0.0, 0.0, 0.0],
    [0.074259, 0.086333, 0.0, 0.100258],  # counted in model tokens, its third is aligned with the others' third
    [-0.175741, -0.163667, -0.149742, 0.0],
]
# verl 0.9.1, compute_gdpo_outcome_advantage: with two components weighted 1 and 0.5, and with none (rm_scores).
VERL_GDPO_COMPONENTS = [
    [-0.134254, -0.134254, -0.134254, 0.0],
    [-1.357252, -1.357252, -1.357252, -1.357252],
    [0.311282, 0.311282, 0.0, 0.0],
    [0.0, 0.0, 0.0, 0.0],
    [0.311282, 0.311282, 0.0, 0.311282],
    [1.425121, 1.425121, 1.425121, 0.0],
]
VERL_GDPO = [
    [0.992725, 0.992725, 0.992725, 0.0],
    [-0.221078, -0.221078, -0.221078, -0.221078],
    [-1.434880, -1.434880, 0.0, 0.0],
    [0.0, 0.0, 0.0, 0.0],
    [1.180497, 1.180497, 0.0, 1.180497],
    [-0.921865, -0.921865, -0.921865, 0.0],
]


@pytest.mark.parametrize(
    "name, expected", [("optimal_token_baseline", VERL_OTB), ("tir_optimal_token_baseline", VERL_TIR_OTB)]
)
def test_optimal_token_baselines_match_verls_values(name: str, expected: list) -> None:
    x = _advantage_inputs()
    adv, returns = compute_advantage(
        name, x["rewards"], x["mask"], group_index=GROUPS, old_log_probs=x["old"], sum_pi_squared=x["spp"]
    )
    torch.testing.assert_close(adv, torch.tensor(expected), **TOL)
    # Returns: the reward-to-go over the valid tokens.
    assert returns[1].tolist() == [0.75] * 4 and returns[4].tolist() == [0.25, 0.25, 0.0, 0.25]
    assert estimator_needs(name).sum_pi_squared


def test_gdpo_matches_verls_values() -> None:
    x = _advantage_inputs()
    adv, returns = compute_advantage(
        "gdpo", x["rewards"], x["mask"], group_index=GROUPS, reward_components=x["components"], reward_weights=[1, 0.5]
    )
    torch.testing.assert_close(adv, torch.tensor(VERL_GDPO_COMPONENTS), **TOL)
    torch.testing.assert_close(returns, adv)
    adv, _ = compute_advantage("gdpo", x["rewards"], x["mask"], group_index=GROUPS)
    torch.testing.assert_close(adv, torch.tensor(VERL_GDPO), **TOL)


def _loss_inputs() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]], dtype=torch.bool)
    old = (-2.0 * torch.rand(3, 4, generator=gen)).round(decimals=3)
    new = (old + 0.15 * torch.randn(3, 4, generator=gen)).clamp(max=-0.01).round(decimals=3)
    adv = torch.randn(3, 4, generator=gen).round(decimals=3)
    return {"old": old, "new": new, "adv": adv, "mask": mask}


# verl 0.9.1's losses under token-mean: (clip_ratio_low, clip_ratio_high, clip_ratio_c, own keywords), loss,
# d loss / d log_prob, metrics.
VERL_LOSSES = {
    "dppo_tv": (
        (0.03, 0.05, 1.1, {}),
        0.350799,
        [[-0.258276, 0.0, -0.201862, 0.0], [0.053391, 0.082070, 0.0, 0.0], [0.0, 0.073700, 0.0, 0.0]],
        {"pg_clipfrac": 4 / 9, "pg_clipfrac_lower": 1 / 9, "ppo_kl": -0.0828889},
    ),
    "dppo_kl": (
        (0.002, 0.004, 1.1, {}),
        0.350799,
        [[-0.258276, 0.0, -0.201862, 0.0], [0.053391, 0.082070, 0.0, 0.0], [0.0, 0.073700, 0.0, 0.0]],
        {"pg_clipfrac": 4 / 9, "pg_clipfrac_lower": 1 / 9, "ppo_kl": -0.0828889},
    ),
    "dro": (
        (0.2, 0.2, 3.0, {"dro_beta": 0.5}),
        0.617204,
        [
            [-0.275278, -0.214833, -0.196500, 0.088000],
            [0.053556, 0.081556, 0.0, 0.0],
            [-0.190056, 0.078222, -0.159111, 0.0],
        ],
        {"ppo_kl": -0.0828889},
    ),
}


@pytest.mark.parametrize("name", list(VERL_LOSSES))
def test_policy_losses_match_verls_values(name: str) -> None:
    (low, high, c, own), loss_value, grad, metrics = VERL_LOSSES[name]
    x = _loss_inputs()
    log_prob = x["new"].clone().requires_grad_(True)
    loss, ours = get_policy_loss(name)(
        x["old"], log_prob, x["adv"], x["mask"], clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=c, **own
    )
    loss.backward()
    assert loss.item() == pytest.approx(loss_value, abs=1e-5)
    torch.testing.assert_close(log_prob.grad, torch.tensor(grad), **TOL)
    for key, value in metrics.items():
        assert ours[key].item() == pytest.approx(value, abs=1e-5), key


def test_dppo_drops_exactly_the_tokens_past_the_divergence_threshold() -> None:
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5]]))
    new = torch.log(torch.tensor([[0.6, 0.8, 0.4, 0.1]]))
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    # TV: a rise of 0.1 is within 0.15, of 0.3 not; a fall of 0.1 is within 0.15, of 0.4 not.
    _, m = get_policy_loss("dppo_tv")(old, new, adv, mask, clip_ratio_low=0.15, clip_ratio_high=0.15)
    assert m["pg_clipfrac"].item() == pytest.approx(0.5)
    # A token moving against its advantage's direction is never dropped, however far.
    _, m = get_policy_loss("dppo_kl")(old, new, -adv, mask, clip_ratio_low=1e-6, clip_ratio_high=1e-6)
    assert m["pg_clipfrac"].item() == 0.0
    _, m = get_policy_loss("dppo_kl")(old, new, adv, mask, clip_ratio_low=1e-6, clip_ratio_high=1e-6)
    assert m["pg_clipfrac"].item() == 1.0
    with pytest.raises(ValueError, match="clip_ratio_c"):
        get_policy_loss("dppo_tv")(old, new, adv, mask, clip_ratio_c=0.0)


def test_dro_needs_its_beta_and_is_reinforce_on_policy() -> None:
    x = _loss_inputs()
    with pytest.raises(ValueError, match="policy_loss.dro_beta"):
        get_policy_loss("dro")(x["old"], x["new"], x["adv"], x["mask"])
    # At log r = 0 the penalty and its gradient vanish: -A log π, as the gpg loss.
    for name, own in (("dro", {"dro_beta": 3.0}), ("gpg", {})):
        log_prob = x["old"].clone().requires_grad_(True)
        loss, _ = get_policy_loss(name)(x["old"], log_prob, x["adv"], x["mask"], **own)
        loss.backward()
        if name == "dro":
            dro_grad = log_prob.grad
    torch.testing.assert_close(dro_grad, log_prob.grad)


# --------------------------------------------------------------------------- edge cases


def _otb(name: str, rewards: torch.Tensor, mask: torch.Tensor, groups: list, **kw) -> torch.Tensor:
    old = torch.full(mask.shape, -0.7)
    return compute_advantage(
        name, rewards, mask, group_index=groups, old_log_probs=old, sum_pi_squared=torch.full(mask.shape, 0.4), **kw
    )[0]


@pytest.mark.parametrize("name", ["optimal_token_baseline", "tir_optimal_token_baseline"])
def test_optimal_token_baseline_edge_cases(name: str) -> None:
    mask = torch.ones(4, 3, dtype=torch.bool)
    rewards = torch.zeros(4, 3)
    rewards[:, -1] = torch.tensor([1.0, 1.0, 1.0, 0.5])
    # A flat group of equal lengths: every sample is its baseline (to the 1e-8 in the denominator).
    adv = _otb(name, rewards, mask, [0, 0, 0, 1])
    assert adv[:3].abs().max() < 1e-6
    # A lone sample keeps its reward-to-go.
    assert adv[3].tolist() == [0.5, 0.5, 0.5]
    # A group of equal samples gives each the same weight: the baseline is the group mean of G_t.
    rewards[:, -1] = torch.tensor([1.0, 0.0, 0.5, 0.5])
    adv = _otb(name, rewards, mask, [0, 0, 1, 1])
    torch.testing.assert_close(adv[:2], torch.tensor([[0.5] * 3, [-0.5] * 3]), **TOL)
    # Importance weights of 0 on a sample take it out of the baseline: its partner keeps its own G_t.
    weights = torch.ones(4, 3)
    weights[1] = 0.0
    adv = _otb(name, rewards, mask, [0, 0, 1, 1], rollout_is_weights=weights)
    torch.testing.assert_close(adv[0], torch.zeros(3), **TOL)
    # Every response empty: all zeros, nothing NaN.
    empty = torch.zeros(4, 3, dtype=torch.bool)
    adv = _otb(name, rewards, empty, [0, 0, 1, 1])
    assert adv.eq(0).all()
    with pytest.raises(ValueError, match="sum_pi_squared"):
        compute_advantage(name, rewards, mask, group_index=[0, 0, 1, 1], old_log_probs=torch.zeros(4, 3))


def test_gdpo_edge_cases() -> None:
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    rewards = torch.zeros(4, 3)
    # Components flat within each group: no signal, advantages exactly 0 (the batch whitening keeps 0 at 0).
    flat = torch.tensor([[1.0, 0.3], [1.0, 0.3], [0.0, 0.7], [0.0, 0.7]])
    adv, _ = compute_advantage("gdpo", rewards, mask, group_index=[0, 0, 1, 1], reward_components=flat)
    assert adv.eq(0).all()
    # A component's scale does not matter, each is normalised in its group first: one 1000 times larger
    # does not drown the other (in a plain sum it would decide every sign).
    comps = torch.tensor([[3.0, 0.0], [1.0, 0.0], [2.0, 1.0], [0.0, 0.0]])
    adv, _ = compute_advantage("gdpo", rewards, mask, group_index=[0, 0, 1, 1], reward_components=comps)
    scaled = comps * torch.tensor([1000.0, 1.0])
    adv_scaled, _ = compute_advantage("gdpo", rewards, mask, group_index=[0, 0, 1, 1], reward_components=scaled)
    torch.testing.assert_close(adv_scaled, adv, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="reward_weights"):
        compute_advantage(
            "gdpo", rewards, mask, group_index=[0, 0, 1, 1], reward_components=comps, reward_weights=[1.0]
        )
    # Garbage under the mask changes nothing; the advantage is 0 there.
    noisy = torch.where(mask, rewards, torch.tensor(float("nan")))
    adv1, _ = compute_advantage("gdpo", noisy, mask, group_index=[0, 0, 1, 1], reward_components=comps * 0.5 + 1)
    assert torch.isfinite(adv1).all() and adv1[~mask].eq(0).all()


def test_sum_pi_squared_from_logits_is_the_softmax_squared_mass() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = 3.0 * torch.randn(2, 5, 11, generator=gen)
    for temperature in (1.0, 0.7):
        want = torch.softmax(logits / temperature, dim=-1).pow(2).sum(-1)
        got = sum_pi_squared_from_logits(logits, temperature=temperature, chunk_elements=13)
        torch.testing.assert_close(got, want)
    bf16 = sum_pi_squared_from_logits(logits.bfloat16())
    assert bf16.dtype == torch.float32
    with pytest.raises(ValueError, match="temperature"):
        sum_pi_squared_from_logits(logits, temperature=0.0)
