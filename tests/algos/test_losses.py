"""Loss aggregation, the clipped policy loss (with dual clip), the value loss and entropy."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from conveyor.algos.losses import (
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    agg_loss,
    compute_entropy_loss,
    compute_policy_loss,
    compute_value_loss,
    get_policy_loss,
    register_policy_loss,
)

# --------------------------------------------------------------------------- aggregation

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])


def test_agg_modes_by_hand() -> None:
    # Valid entries: row 0 -> 1, 2; row 1 -> 4.
    # token-mean: (1 + 2 + 4) / 3 tokens.
    assert agg_loss(LOSS, MASK, "token-mean").item() == pytest.approx(7 / 3)
    # seq-mean-token-sum: (3 + 4) / 2 sequences.
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum").item() == pytest.approx(3.5)
    # seq-mean-token-mean: (1.5 + 4) / 2 sequences.
    assert agg_loss(LOSS, MASK, "seq-mean-token-mean").item() == pytest.approx(2.75)
    # token-sum: 1 + 2 + 4, no normaliser.
    assert agg_loss(LOSS, MASK, "token-sum").item() == pytest.approx(7.0)
    # seq-mean-token-sum-norm: (3 + 4) / 2 sequences / 3 (the padded width by default).
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum-norm").item() == pytest.approx(3.5 / 3)


def test_agg_uses_given_normalisers() -> None:
    assert agg_loss(LOSS, MASK, "token-mean", num_tokens=7).item() == pytest.approx(1.0)
    assert agg_loss(LOSS, MASK, "token-mean", num_tokens=torch.tensor(14)).item() == pytest.approx(0.5)
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum", num_seqs=7).item() == pytest.approx(1.0)
    assert agg_loss(LOSS, MASK, "seq-mean-token-mean", num_seqs=11).item() == pytest.approx(0.5)
    # num_tokens does not affect the sequence modes, num_seqs not the token mode.
    assert agg_loss(LOSS, MASK, "token-mean", num_seqs=100).item() == pytest.approx(7 / 3)
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum", num_tokens=100).item() == pytest.approx(3.5)
    # token-sum takes no normaliser; seq-mean-token-sum-norm takes num_seqs and loss_scale_factor.
    assert agg_loss(LOSS, MASK, "token-sum", num_tokens=100, num_seqs=100).item() == pytest.approx(7.0)
    norm = agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", num_seqs=7, loss_scale_factor=10)
    assert norm.item() == pytest.approx(7 / 7 / 10)
    # loss_scale_factor only matters to seq-mean-token-sum-norm.
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum", loss_scale_factor=10).item() == pytest.approx(3.5)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_zero_denominators_give_zero_not_nan(mode: str) -> None:
    empty = torch.zeros(2, 3)
    assert agg_loss(LOSS, empty, mode).item() == 0.0
    assert agg_loss(LOSS, empty, mode, num_tokens=0, num_seqs=0).item() == 0.0
    assert agg_loss(torch.zeros(0, 3), torch.zeros(0, 3), mode).item() == 0.0


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_ignores_values_under_the_mask(mode: str) -> None:
    noisy = torch.where(MASK.bool(), LOSS, torch.tensor(float("nan")))
    loss = noisy.clone().requires_grad_(True)
    out = agg_loss(loss, MASK, mode)
    assert out.item() == pytest.approx(agg_loss(LOSS, MASK, mode).item())
    out.backward()
    assert (loss.grad[~MASK.bool()] == 0).all()


def test_agg_unknown_mode_and_shape_errors() -> None:
    with pytest.raises(ValueError) as info:
        agg_loss(LOSS, MASK, "token-median")
    for mode in LOSS_AGG_MODES:
        assert mode in str(info.value)
    with pytest.raises(ValueError, match="loss_mask"):
        agg_loss(LOSS, MASK[:, :2], "token-mean")


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_data_parallel_shards_sum_to_the_whole_batch(mode: str) -> None:
    gen = torch.Generator().manual_seed(3)
    batch, length = 7, 6
    loss_mat = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    mask = torch.rand(batch, length, generator=gen) > 0.4
    mask[2] = False  # an empty sequence on one shard
    num_tokens, num_seqs = mask.sum(), batch

    whole_in = loss_mat.clone().requires_grad_(True)
    whole = agg_loss(whole_in, mask, mode, num_tokens=num_tokens, num_seqs=num_seqs)
    whole.backward()
    assert whole.item() == pytest.approx(agg_loss(loss_mat, mask, mode).item())

    total = torch.zeros((), dtype=torch.float64)
    grads = []
    for rows in (slice(0, 3), slice(3, 7)):
        shard_in = loss_mat[rows].clone().requires_grad_(True)
        shard = agg_loss(shard_in, mask[rows], mode, num_tokens=num_tokens, num_seqs=num_seqs)
        shard.backward()
        total = total + shard.detach()
        grads.append(shard_in.grad)
    torch.testing.assert_close(total, whole.detach())
    torch.testing.assert_close(torch.cat(grads), whole_in.grad)


# --------------------------------------------------------------------------- policy loss


def _policy_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Five tokens, each hitting one branch of the clipped surrogate (clip 0.2, dual clip 3)."""
    ratios = torch.tensor([[1.5, 0.5, 0.5, 5.0, 1.5]])
    advantages = torch.tensor([[1.0, 1.0, -1.0, -1.0, -1.0]])
    old_log_prob = torch.tensor([[-1.0, -2.0, -0.5, -3.0, -1.2]])
    log_prob = old_log_prob + ratios.log()
    return old_log_prob, log_prob, advantages, torch.ones(1, 5)


def test_policy_loss_by_hand_with_dual_clip() -> None:
    # Per token loss = max(-A r, -A clip(r, 0.8, 1.2)), capped at 3 * -A when A < 0:
    #   A=+1, r=1.5: max(-1.5, -1.2) = -1.2   (clipped)
    #   A=+1, r=0.5: max(-0.5, -0.8) = -0.5
    #   A=-1, r=0.5: max( 0.5,  0.8) =  0.8   (clipped)
    #   A=-1, r=5.0: max( 5.0,  1.2) =  5.0 -> dual clip cap 3.0
    #   A=-1, r=1.5: max( 1.5,  1.2) =  1.5   (below the cap)
    # token-mean = (-1.2 - 0.5 + 0.8 + 3.0 + 1.5) / 5 = 0.72.
    old, new, adv, mask = _policy_case()
    new = new.clone().requires_grad_(True)
    loss, metrics = compute_policy_loss(old, new, adv, mask)
    assert loss.item() == pytest.approx(0.72, abs=1e-6)
    assert metrics["pg_clipfrac"].item() == pytest.approx(2 / 5)
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(1 / 5)
    expected_kl = -sum(math.log(r) for r in (1.5, 0.5, 0.5, 5.0, 1.5)) / 5
    assert metrics["ppo_kl"].item() == pytest.approx(expected_kl, abs=1e-6)
    for value in metrics.values():
        assert value.dim() == 0 and not value.requires_grad

    loss.backward()
    # d(-A r)/d log_prob = -A r / 5 on unclipped tokens; clipped and capped tokens get 0.
    torch.testing.assert_close(new.grad, torch.tensor([[0.0, -0.5 / 5, 0.0, 0.0, 1.5 / 5]]))


def test_dual_clip_bounds_negative_advantage_loss() -> None:
    # However large the ratio, a token with A < 0 costs at most clip_ratio_c * |A|.
    old = torch.zeros(1, 4)
    new = torch.tensor([[2.0, 5.0, 10.0, 50.0]])
    adv = torch.full((1, 4), -2.0)
    loss, metrics = compute_policy_loss(
        old, new, adv, torch.ones(1, 4), clip_ratio_c=3.0, loss_agg_mode="seq-mean-token-sum"
    )
    assert loss.item() == pytest.approx(4 * 6.0)
    assert metrics["pg_clipfrac_lower"].item() == 1.0
    # Positive advantages are not capped by the dual clip (only by the PPO clip).
    loss_pos, _ = compute_policy_loss(old, new, -adv, torch.ones(1, 4))
    assert loss_pos.item() == pytest.approx(-2.0 * 1.2)


def test_asymmetric_clip_range() -> None:
    # clip_ratio_high = 0.28: A=+1 at r=1.5 is clipped at 1.28, not 1.2.
    old = torch.zeros(1, 1)
    new = torch.tensor([[math.log(1.5)]])
    loss, _ = compute_policy_loss(old, new, torch.ones(1, 1), torch.ones(1, 1), clip_ratio_high=0.28)
    assert loss.item() == pytest.approx(-1.28)
    # clip_ratio_low = 0.1: A=-1 at r=0.5 is clipped at 0.9.
    new = torch.tensor([[math.log(0.5)]])
    loss, _ = compute_policy_loss(old, new, -torch.ones(1, 1), torch.ones(1, 1), clip_ratio_low=0.1)
    assert loss.item() == pytest.approx(0.9)


def test_policy_loss_importance_weights_multiply_each_token() -> None:
    old, new, adv, mask = _policy_case()
    weights = torch.tensor([[2.0, 1.0, 0.5, 1.0, 0.0]])
    loss, _ = compute_policy_loss(old, new, adv, mask, is_weights=weights)
    # (2 * -1.2 - 0.5 + 0.5 * 0.8 + 3.0 + 0) / 5
    assert loss.item() == pytest.approx((-2.4 - 0.5 + 0.4 + 3.0) / 5, abs=1e-6)
    with pytest.raises(ValueError, match="is_weights"):
        compute_policy_loss(old, new, adv, mask, is_weights=torch.ones(1, 4))


def _seeded(name: str) -> dict[str, Any]:
    """A loss's own keywords for a repeatable call: clip_cov's seeded generator (two calls pick the same tokens),
    dro's coefficient."""
    if name == "dro":  # no default coefficient, as in verl
        return {"dro_beta": 0.5}
    return {"generator": torch.Generator().manual_seed(0)} if name == "clip_cov" else {}


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_policy_loss_ignores_values_under_the_mask(name: str) -> None:
    old, new, adv, _ = _policy_case()
    mask = torch.tensor([[1, 1, 0, 1, 0]], dtype=torch.bool)
    loss_fn = get_policy_loss(name)
    clean_new = new.clone().requires_grad_(True)
    clean, clean_metrics = loss_fn(old, clean_new, adv, mask, **_seeded(name))
    clean.backward()

    nan = torch.tensor(float("nan"))
    noisy_new = torch.where(mask, new, nan).requires_grad_(True)
    noisy, noisy_metrics = loss_fn(
        torch.where(mask, old, nan), noisy_new, torch.where(mask, adv, nan), mask, **_seeded(name)
    )
    noisy.backward()
    assert noisy.item() == pytest.approx(clean.item())
    for key in clean_metrics:
        assert noisy_metrics[key].item() == pytest.approx(clean_metrics[key].item())
    torch.testing.assert_close(noisy_new.grad, clean_new.grad)


def test_policy_loss_argument_errors() -> None:
    old, new, adv, mask = _policy_case()
    with pytest.raises(ValueError, match="clip_ratio_c"):
        compute_policy_loss(old, new, adv, mask, clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="advantages"):
        compute_policy_loss(old, new, adv[:, :3], mask)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        compute_policy_loss(old, new, adv, mask, loss_agg_mode="sum")


def test_gspo_uses_the_sequence_ratio_with_per_token_gradients() -> None:
    # Token log-ratios 0.1, 0.3 -> sequence ratio exp(0.2) = 1.22 on both tokens, inside the clip range 1.28.
    old = torch.zeros(1, 2)
    new = torch.tensor([[0.1, 0.3]], requires_grad=True)
    adv = torch.tensor([[1.0, -2.0]])
    loss, metrics = get_policy_loss("gspo")(old, new, adv, torch.ones(1, 2), clip_ratio_high=0.28)
    s = math.exp(0.2)
    assert loss.item() == pytest.approx((-1.0 * s + 2.0 * s) / 2)
    loss.backward()
    # Straight-through: d/d log_prob_t of s * (p_t / sg p_t) is s, so each token gets -A_t s / 2.
    torch.testing.assert_close(new.grad, torch.tensor([[-s / 2, 2 * s / 2]]))
    assert metrics["pg_clipfrac"].item() == 0.0


def test_cispo_keeps_the_gradient_of_clipped_tokens() -> None:
    # Ratio 1.5 with A = 1: PPO would give this token no gradient; CISPO weighs -A log_prob by clip(r) = 1.2.
    old = torch.zeros(1, 1)
    new = torch.tensor([[math.log(1.5)]], requires_grad=True)
    loss, metrics = get_policy_loss("cispo")(old, new, torch.ones(1, 1), torch.ones(1, 1))
    assert loss.item() == pytest.approx(-1.2 * math.log(1.5))
    loss.backward()
    torch.testing.assert_close(new.grad, torch.tensor([[-1.2]]))
    assert metrics["pg_clipfrac"].item() == 1.0


def test_sapo_gate_by_hand() -> None:
    # At r = 1 the gate is (4 / tau) * sigmoid(0) = 2 / tau and its slope in r is 1, like PPO's.
    old = torch.zeros(1, 2)
    new = torch.zeros(1, 2, requires_grad=True)
    adv = torch.tensor([[1.0, -1.0]])
    loss, _ = get_policy_loss("sapo")(old, new, adv, torch.ones(1, 2), tau_pos=2.0, tau_neg=4.0)
    assert loss.item() == pytest.approx((-1.0 * 2 / 2.0 + 1.0 * 2 / 4.0) / 2)
    loss.backward()
    torch.testing.assert_close(new.grad, torch.tensor([[-0.5, 0.5]]))
    with pytest.raises(ValueError, match="tau"):
        get_policy_loss("sapo")(old, new, adv, torch.ones(1, 2), tau_neg=0.0)


def test_gpg_is_plain_policy_gradient() -> None:
    new = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, _ = get_policy_loss("gpg")(torch.zeros(1, 2), new, torch.tensor([[2.0, 1.0]]), torch.ones(1, 2))
    assert loss.item() == pytest.approx((2.0 + 2.0) / 2)
    loss.backward()
    torch.testing.assert_close(new.grad, torch.tensor([[-1.0, -0.5]]))


def test_geo_mean_by_hand() -> None:
    # One sequence, A = 1 on both tokens, log-ratios 0.1 and 0.5: the second is clipped at 0.28
    # (A > 0 clips from above), so the ratio is exp((0.1 + 0.28) / 2) and the loss its negative.
    old = torch.zeros(1, 2)
    new = torch.tensor([[0.1, 0.5]])
    loss, metrics = get_policy_loss("geo_mean")(old, new, torch.ones(1, 2), torch.ones(1, 2), clip_ratio_high=0.28)
    assert loss.item() == pytest.approx(-math.exp(0.19))
    assert metrics["pg_clipfrac"].item() == 0.5 and metrics["pg_clipfrac_lower"].item() == 0.0
    # A per-sequence loss: summed over sequences / num_seqs, whatever loss_agg_mode says.
    halved, _ = get_policy_loss("geo_mean")(
        old, new, torch.ones(1, 2), torch.ones(1, 2), clip_ratio_high=0.28, num_seqs=2, loss_agg_mode="token-sum"
    )
    assert halved.item() == pytest.approx(-math.exp(0.19) / 2)


def test_cov_losses_pick_the_highest_covariance_tokens() -> None:
    # Four tokens, ratio 1 everywhere. Centred A = (1.5, -0.5, -0.5, -0.5), centred log_prob = (1.5, -0.5, -0.5,
    # -0.5): token 0 has covariance 2.25, the others 0.25.
    old = torch.tensor([[0.0, -2.0, -2.0, -2.0]])
    adv = torch.tensor([[2.0, 0.0, 0.0, 0.0]])
    mask = torch.ones(1, 4)
    # kl_cov penalises token 0 by coef * |log r| = 0 at r = 1, so the loss is plain -A r.
    loss, _ = get_policy_loss("kl_cov")(old, old.clone(), adv, mask, kl_cov_ratio=0.25, ppo_kl_coef=1.0)
    assert loss.item() == pytest.approx(-2.0 / 4)
    # clip_cov with bounds around 2.25 switches token 0 off, so nothing is left.
    loss, metrics = get_policy_loss("clip_cov")(old, old.clone(), adv, mask, clip_cov_lb=2.0, clip_cov_ub=3.0)
    assert loss.item() == 0.0 and metrics["pg_clipfrac"].item() == 0.25
    # Bounds that exclude it leave the PPO loss.
    loss, metrics = get_policy_loss("clip_cov")(old, old.clone(), adv, mask, clip_cov_lb=3.0, clip_cov_ub=5.0)
    assert loss.item() == pytest.approx(-2.0 / 4) and metrics["pg_clipfrac"].item() == 0.0
    for name, key in (("clip_cov", "clip_cov_ratio"), ("kl_cov", "kl_cov_ratio")):
        with pytest.raises(ValueError, match=key):
            get_policy_loss(name)(old, old, adv, mask, **{key: 0.0})


def test_policy_loss_registry() -> None:
    assert get_policy_loss("vanilla") is compute_policy_loss
    # verl's names for the losses users ask for.
    assert {"gspo", "sapo", "cispo", "gpg", "clip_cov", "kl_cov", "geo_mean"} <= set(POLICY_LOSSES)
    with pytest.raises(ValueError) as info:
        get_policy_loss("gpo")
    assert "gpo" in str(info.value) and "vanilla" in str(info.value)

    @register_policy_loss("test_zero")
    def zero(old_log_prob, log_prob, advantages, response_mask, **kwargs):
        return (log_prob * 0).sum(), {}

    try:
        assert get_policy_loss("test_zero") is zero
        with pytest.raises(ValueError, match="already registered"):
            register_policy_loss("vanilla")(zero)
    finally:
        POLICY_LOSSES.pop("test_zero", None)


# --------------------------------------------------------------------------- value and entropy


def test_value_loss_by_hand() -> None:
    # old values 1, clip range 0.5:
    #   v=2.0, R=2: unclipped 0, clipped v=1.5 -> 0.25 -> 0.25 (clipped branch wins)
    #   v=1.2, R=0: unclipped 1.44, clipped v=1.2 -> 1.44 -> 1.44
    #   v=0.0, R=1: unclipped 1, clipped v=0.5 -> 0.25 -> 1
    # loss = 0.5 * (0.25 + 1.44 + 1) / 3; clipfrac = 1/3.
    vpreds = torch.tensor([[2.0, 1.2, 0.0]], requires_grad=True)
    returns = torch.tensor([[2.0, 0.0, 1.0]])
    values = torch.ones(1, 3)
    loss, clipfrac = compute_value_loss(vpreds, returns, values, torch.ones(1, 3), cliprange_value=0.5)
    assert loss.item() == pytest.approx(0.5 * 2.69 / 3)
    assert clipfrac.item() == pytest.approx(1 / 3)
    loss.backward()
    # The clipped branch is flat in vpreds; the others give 0.5 * 2 (v - R) / 3.
    torch.testing.assert_close(vpreds.grad, torch.tensor([[0.0, 1.2 / 3, -1.0 / 3]]))


def test_value_loss_modes_and_mask() -> None:
    vpreds = torch.tensor([[1.0, 2.0], [3.0, 7.0]])
    returns = torch.zeros(2, 2)
    mask = torch.tensor([[1, 1], [1, 0]])
    # Huge clip range: plain 0.5 * v^2 -> per token 0.5, 2, 4.5 (7 is masked).
    loss, _ = compute_value_loss(
        vpreds, returns, vpreds, mask, cliprange_value=100.0, loss_agg_mode="seq-mean-token-sum", num_seqs=4
    )
    assert loss.item() == pytest.approx((0.5 + 2.0 + 4.5) / 4)
    with pytest.raises(ValueError, match="cliprange_value"):
        compute_value_loss(vpreds, returns, vpreds, mask, cliprange_value=-1.0)


def test_entropy_loss_is_aggregated_entropy() -> None:
    entropy = torch.tensor([[0.5, 1.5, 9.0]])
    mask = torch.tensor([[1, 1, 0]])
    assert compute_entropy_loss(entropy, mask, "token-mean").item() == pytest.approx(1.0)
    assert compute_entropy_loss(entropy, mask, "seq-mean-token-sum", num_seqs=4).item() == pytest.approx(0.5)
