"""The actor objective: policy loss + entropy bonus + KL loss + rollout-correction weights, and its metrics."""

from __future__ import annotations

import math

import pytest
import torch

from conveyor.algos.correction import compute_rollout_is_weights
from conveyor.algos.kl import kl_penalty
from conveyor.algos.losses import POLICY_LOSSES, agg_loss, compute_policy_loss, loss_params
from conveyor.algos.objective import compute_policy_objective, merge_objective_metrics
from conveyor.metrics.reduce import reduce_rank_metrics

MASK = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
ADV = torch.tensor([[1.0, 1.0, 5.0], [-1.0, 5.0, 5.0]])
OLD = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]])
# Ratios on the valid tokens: 1 (unclipped), 1.5 (clipped above), 0.5 with A < 0 (clipped below).
LOG_PROB = OLD + torch.tensor([[0.0, math.log(1.5), 7.0], [math.log(0.5), 7.0, 7.0]])
# Per-token PPO losses: -1, -1.2 and 0.8 (the dual-clip cap 3 does not bind); padding must not count.
PG_TOKENS = (-1.0, -1.2, 0.8)
VANILLA_KEYS = {
    "pg_loss@sum",
    "pg_clipfrac@sum",
    "pg_clipfrac@count",
    "pg_clipfrac_lower@sum",
    "pg_clipfrac_lower@count",
    "ppo_kl@sum",
    "ppo_kl@count",
}
IS_KEYS = {
    "rollout_corr/is_mean@sum",
    "rollout_corr/is_mean@count",
    "rollout_corr/clipped_frac@sum",
    "rollout_corr/clipped_frac@count",
    "rollout_corr/is_truncated_mean@sum",
    "rollout_corr/is_truncated_mean@count",
    "rollout_corr/probs_diff_mean@sum",
    "rollout_corr/probs_diff_mean@count",
    "rollout_corr/is_max",
    "rollout_corr/probs_diff_max",
}


def _objective(**kwargs):
    log_prob = kwargs.pop("log_prob", LOG_PROB)
    return compute_policy_objective(OLD, log_prob, ADV, MASK, **kwargs)


def test_vanilla_by_hand() -> None:
    loss, metrics = _objective()
    assert loss.item() == pytest.approx(sum(PG_TOKENS) / 3)
    assert set(metrics) == VANILLA_KEYS
    assert metrics["pg_loss@sum"] == pytest.approx(sum(PG_TOKENS) / 3)
    # Means come back as sums over the micro-batch's 3 tokens.
    assert metrics["pg_clipfrac@sum"] == pytest.approx(2.0) and metrics["pg_clipfrac@count"] == 3.0
    assert metrics["pg_clipfrac_lower@sum"] == 0.0
    assert metrics["ppo_kl@sum"] == pytest.approx(-(math.log(1.5) + math.log(0.5)))


def test_vanilla_equals_the_registered_loss_and_uses_global_normalisers() -> None:
    kwargs = dict(
        clip_ratio_low=0.1,
        clip_ratio_high=0.3,
        clip_ratio_c=2.0,
        loss_agg_mode="seq-mean-token-sum",
        num_tokens=12,
        num_seqs=8,
    )
    loss, _ = _objective(**kwargs)
    want, _ = compute_policy_loss(OLD, LOG_PROB, ADV, MASK, **kwargs)
    assert loss.item() == pytest.approx(want.item())
    token_mean, _ = _objective(num_tokens=6)
    assert token_mean.item() == pytest.approx(sum(PG_TOKENS) / 6)


def test_loss_mode_picks_from_the_registry(monkeypatch) -> None:
    calls = []

    def constant_loss(old_log_prob, log_prob, advantages, response_mask, **kwargs):
        calls.append(kwargs)
        return log_prob.sum() * 0 + 7.0, {"my_metric": torch.tensor(0.5)}

    monkeypatch.setitem(POLICY_LOSSES, "constant-for-test", constant_loss)
    loss, metrics = _objective(loss_mode="constant-for-test", num_tokens=9)
    assert loss.item() == 7.0
    assert calls[0]["num_tokens"] == 9 and calls[0]["is_weights"] is None
    assert metrics == {"pg_loss@sum": 7.0, "my_metric@sum": 1.5, "my_metric@count": 3.0}
    with pytest.raises(ValueError, match="policy_loss.loss_mode: unknown"):
        _objective(loss_mode="no-such-loss")


def test_policy_loss_kwargs_and_loss_scale_factor_reach_the_terms(monkeypatch) -> None:
    calls = []

    def spy_loss(old_log_prob, log_prob, advantages, response_mask, *, tau_pos=1.0, **kwargs):
        calls.append({**kwargs, "tau_pos": tau_pos})
        return log_prob.sum() * 0, {}

    monkeypatch.setitem(POLICY_LOSSES, "spy-for-test", spy_loss)
    entropy = torch.tensor([[0.5, 1.0, 0.0], [2.0, 0.0, 0.0]])
    loss, _ = _objective(
        loss_mode="spy-for-test",
        policy_loss_kwargs={"tau_pos": 0.5},
        loss_agg_mode="seq-mean-token-sum-norm",
        loss_scale_factor=10,
        num_seqs=2,
        entropy=entropy,
        entropy_coeff=1.0,
    )
    assert calls[0]["tau_pos"] == 0.5 and calls[0]["loss_scale_factor"] == 10
    # Entropy per sequence 1.5 and 2.0 -> (3.5 / 2 sequences) / 10.
    assert loss.item() == pytest.approx(-3.5 / 2 / 10)
    # Without one, the keyword is not passed at all (losses registered before it keep working).
    _objective(loss_mode="spy-for-test")
    assert "loss_scale_factor" not in calls[1]


def test_each_loss_takes_the_hyperparameters_it_declares() -> None:
    # The caller passes every configured hyperparameter; each loss picks its own.
    every = {"tau_pos": 2.0, "tau_neg": 3.0, "clip_cov_ratio": 0.5, "kl_cov_ratio": 0.5, "ppo_kl_coef": 1.0}
    loss, _ = _objective(loss_mode="sapo", policy_loss_kwargs=every)
    want, _ = POLICY_LOSSES["sapo"](OLD, LOG_PROB, ADV, MASK, tau_pos=2.0, tau_neg=3.0)
    assert loss.item() == pytest.approx(want.item())
    default, _ = _objective(loss_mode="sapo")
    assert default.item() != pytest.approx(want.item())
    vanilla, _ = _objective(policy_loss_kwargs=every)
    assert vanilla.item() == pytest.approx(sum(PG_TOKENS) / 3)
    assert loss_params(POLICY_LOSSES["kl_cov"], every) == {"kl_cov_ratio": 0.5, "ppo_kl_coef": 1.0}

    # A plugin loss that forwards **kwargs to another loss gets none of them (that loss would refuse them);
    # one that names a hyperparameter gets it.
    def forwarding(*args, **kwargs):
        return compute_policy_loss(*args, **kwargs)

    def naming(*args, tau_pos=1.0, **kwargs):
        return compute_policy_loss(*args, **kwargs)

    assert loss_params(forwarding, every) == {}
    assert loss_params(naming, every) == {"tau_pos": 2.0}
    # Called directly, a loss still refuses a keyword it does not know (a typo is not silently dropped).
    with pytest.raises(TypeError, match="tau_pso"):
        POLICY_LOSSES["sapo"](OLD, LOG_PROB, ADV, MASK, tau_pso=2.0)


def test_entropy_bonus_by_hand() -> None:
    entropy = torch.tensor([[0.5, 1.0, float("nan")], [2.0, 9.0, 9.0]])
    loss, metrics = _objective(entropy=entropy, entropy_coeff=0.1)
    assert loss.item() == pytest.approx(sum(PG_TOKENS) / 3 - 0.1 * 3.5 / 3)
    assert set(metrics) == VANILLA_KEYS | {"entropy@sum", "entropy@count", "entropy_loss@sum"}
    assert metrics["entropy@sum"] == pytest.approx(3.5) and metrics["entropy@count"] == 3.0
    assert metrics["entropy_loss@sum"] == pytest.approx(3.5 / 3)
    # Without a coefficient the entropy is only reported, not part of the loss.
    plain, plain_metrics = _objective(entropy=entropy)
    assert plain.item() == pytest.approx(sum(PG_TOKENS) / 3)
    assert set(plain_metrics) == VANILLA_KEYS | {"entropy@sum", "entropy@count"}
    with pytest.raises(ValueError, match="entropy"):
        _objective(entropy_coeff=0.1)


def test_entropy_bonus_gradient_reaches_the_entropy() -> None:
    entropy = torch.tensor([[0.5, 1.0, 0.0], [2.0, 0.0, 0.0]], requires_grad=True)
    loss, _ = _objective(entropy=entropy, entropy_coeff=0.3, num_tokens=6)
    loss.backward()
    torch.testing.assert_close(entropy.grad, -0.3 / 6 * MASK.float())


@pytest.mark.parametrize("kind", ["k1", "k2", "low_var_kl", "abs"])
def test_kl_loss_equals_its_parts(kind: str) -> None:
    ref = LOG_PROB + torch.tensor([[0.1, -0.2, 0.0], [0.3, 0.0, 0.0]])
    log_prob = LOG_PROB.clone().requires_grad_(True)
    loss, metrics = _objective(log_prob=log_prob, ref_log_prob=ref, kl_loss_type=kind, kl_loss_coef=0.5, num_tokens=6)
    kl_loss = agg_loss(kl_penalty(LOG_PROB, ref, kind), MASK, "token-mean", num_tokens=6)
    assert loss.item() == pytest.approx(sum(PG_TOKENS) / 6 + 0.5 * kl_loss.item())
    assert set(metrics) == VANILLA_KEYS | {"kl_loss@sum"}
    assert metrics["kl_loss@sum"] == pytest.approx(kl_loss.item())
    loss.backward()  # the KL term is differentiable in log_prob
    assert torch.isfinite(log_prob.grad).all()


def test_k2_kl_loss_by_hand() -> None:
    ref = LOG_PROB - torch.tensor([[0.1, 0.2, 0.0], [-0.3, 0.0, 0.0]])
    loss, metrics = _objective(ref_log_prob=ref, kl_loss_type="k2", kl_loss_coef=2.0)
    kl = 0.5 * (0.01 + 0.04 + 0.09) / 3
    assert metrics["kl_loss@sum"] == pytest.approx(kl)
    assert loss.item() == pytest.approx(sum(PG_TOKENS) / 3 + 2.0 * kl)


def _rollout_log_probs() -> torch.Tensor:
    """Rollout log-probs whose token ratios old / rollout are 0.5, 4 and 1 on the valid tokens."""
    return OLD - torch.tensor([[math.log(0.5), math.log(4.0), 0.0], [0.0, 0.0, 0.0]])


def test_token_is_weights_by_hand() -> None:
    rollout = _rollout_log_probs()
    loss, metrics = _objective(rollout_log_probs=rollout, rollout_is="token", rollout_is_threshold=2.0)
    # Weights min(ratio, 2) = 0.5, 2, 1 multiply the per-token losses -1, -1.2, 0.8.
    assert loss.item() == pytest.approx((-0.5 - 2.4 + 0.8) / 3)
    assert set(metrics) == VANILLA_KEYS | IS_KEYS
    assert metrics["rollout_corr/is_mean@sum"] == pytest.approx(5.5)
    assert metrics["rollout_corr/is_mean@count"] == 3.0
    assert metrics["rollout_corr/is_max"] == pytest.approx(4.0)
    assert metrics["rollout_corr/clipped_frac@sum"] == pytest.approx(1.0)
    assert metrics["rollout_corr/is_truncated_mean@sum"] == pytest.approx(3.5)
    probs = (OLD.exp() - rollout.exp()).abs()[MASK]
    assert metrics["rollout_corr/probs_diff_mean@sum"] == pytest.approx(float(probs.sum()))
    assert metrics["rollout_corr/probs_diff_max"] == pytest.approx(float(probs.max()))


def test_sequence_is_weights_equal_the_parts() -> None:
    rollout = _rollout_log_probs()
    loss, metrics = _objective(rollout_log_probs=rollout, rollout_is="sequence", rollout_is_threshold=3.0)
    weights, is_metrics = compute_rollout_is_weights(OLD, rollout, MASK, level="sequence", threshold=3.0)
    want, _ = compute_policy_loss(OLD, LOG_PROB, ADV, MASK, is_weights=weights)
    assert loss.item() == pytest.approx(want.item())
    # Sequence 0's ratio is 0.5 * 4 = 2 (under the threshold), sequence 1's is 1.
    assert loss.item() == pytest.approx((2 * -1.0 + 2 * -1.2 + 0.8) / 3)
    # Sequence-level means are weighted by sequences, token-level ones by tokens.
    assert metrics["rollout_corr/is_mean@count"] == 2.0
    assert metrics["rollout_corr/is_mean@sum"] == pytest.approx(2 * is_metrics["rollout_corr/is_mean"])
    assert metrics["rollout_corr/is_truncated_mean@count"] == 3.0
    assert metrics["rollout_corr/clipped_frac@sum"] == 0.0


def test_is_weights_need_rollout_log_probs() -> None:
    with pytest.raises(ValueError, match="rollout_log_probs"):
        _objective(rollout_is="token")
    with pytest.raises(ValueError, match="level"):
        _objective(rollout_is="batch", rollout_log_probs=OLD)


def test_every_term_together_is_the_sum_of_the_terms() -> None:
    entropy = torch.tensor([[0.5, 1.0, 0.0], [2.0, 0.0, 0.0]])
    ref = LOG_PROB + 0.1
    rollout = _rollout_log_probs()
    loss, metrics = _objective(
        entropy=entropy,
        entropy_coeff=0.01,
        ref_log_prob=ref,
        kl_loss_coef=0.2,
        rollout_log_probs=rollout,
        rollout_is="token",
    )
    pg, _ = _objective(rollout_log_probs=rollout, rollout_is="token")
    want = (
        pg
        - 0.01 * agg_loss(entropy, MASK, "token-mean")
        + 0.2 * agg_loss(kl_penalty(LOG_PROB, ref, "low_var_kl"), MASK, "token-mean")
    )
    assert loss.item() == pytest.approx(want.item())
    assert set(metrics) == VANILLA_KEYS | IS_KEYS | {"entropy@sum", "entropy@count", "entropy_loss@sum", "kl_loss@sum"}


def test_micro_batches_merge_into_the_whole_batch() -> None:
    """Losses over global normalisers add up, and merged metrics reduce to the whole batch's values."""
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 5, generator=gen) * 3
    log_prob = old + torch.randn(4, 5, generator=gen) * 0.3
    adv = torch.randn(4, 5, generator=gen)
    rollout = old + torch.randn(4, 5, generator=gen) * 0.5
    entropy = torch.rand(4, 5, generator=gen)
    ref = log_prob + torch.randn(4, 5, generator=gen) * 0.1
    mask = torch.rand(4, 5, generator=gen) > 0.3
    kwargs = dict(entropy_coeff=0.01, kl_loss_coef=0.1, rollout_is="token", num_tokens=float(mask.sum()), num_seqs=4.0)

    def run(rows: slice):
        return compute_policy_objective(
            old[rows],
            log_prob[rows],
            adv[rows],
            mask[rows],
            entropy=entropy[rows],
            ref_log_prob=ref[rows],
            rollout_log_probs=rollout[rows],
            **kwargs,
        )

    whole_loss, whole = run(slice(0, 4))
    (loss_a, a), (loss_b, b) = run(slice(0, 1)), run(slice(1, 4))
    assert (loss_a + loss_b).item() == pytest.approx(whole_loss.item())
    merged = merge_objective_metrics(merge_objective_metrics({}, a), b)
    assert set(merged) == set(whole)
    reduced, want = reduce_rank_metrics(merged), reduce_rank_metrics(whole)
    assert reduced.keys() == want.keys()
    for key in want:
        assert reduced[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
