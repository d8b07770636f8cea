"""KL estimators, the in-reward KL penalty and both KL controllers."""

from __future__ import annotations

import math

import pytest
import torch

from conveyor.algos.kl import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_penalty,
    make_kl_controller,
)

LOGP = torch.tensor([[-1.0, -2.0]])
REF = torch.tensor([[-1.5, -1.0]])
# logp - ref = (0.5, -1.0); ref - logp = (-0.5, 1.0).


def test_kl_kinds_by_hand() -> None:
    torch.testing.assert_close(kl_penalty(LOGP, REF, "k1"), torch.tensor([[0.5, -1.0]]))
    torch.testing.assert_close(kl_penalty(LOGP, REF, "abs"), torch.tensor([[0.5, 1.0]]))
    # k2 = 0.5 * diff^2 = (0.125, 0.5)
    torch.testing.assert_close(kl_penalty(LOGP, REF, "k2"), torch.tensor([[0.125, 0.5]]))
    # k3 = exp(x) - x - 1 with x = ref - logp: exp(-0.5) + 0.5 - 1, exp(1) - 1 - 1
    k3 = torch.tensor([[math.exp(-0.5) - 0.5, math.e - 2.0]])
    torch.testing.assert_close(kl_penalty(LOGP, REF, "k3"), k3)


@pytest.mark.parametrize(("alias", "kind"), [("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3")])
def test_kl_aliases(alias: str, kind: str) -> None:
    torch.testing.assert_close(kl_penalty(LOGP, REF, alias), kl_penalty(LOGP, REF, kind))


def test_k3_is_clamped_and_keeps_finite_gradients() -> None:
    # x = +30 -> e^30 - 31 (huge) -> 10; x = -30 -> e^-30 + 29 -> 10; x = 2 -> e^2 - 3 (not clamped).
    logp = torch.tensor([[0.0, 0.0, 0.0]], requires_grad=True)
    ref = torch.tensor([[30.0, -30.0, 2.0]])
    out = kl_penalty(logp, ref, "k3")
    torch.testing.assert_close(out, torch.tensor([[10.0, 10.0, math.exp(2.0) - 3.0]]))
    out.sum().backward()
    assert torch.isfinite(logp.grad).all()
    # d/dlogp [e^x - x - 1] with x = ref - logp is 1 - e^x; clamped entries get 0.
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.0, 1.0 - math.exp(2.0)]]))


@pytest.mark.parametrize(
    ("kind", "base"),
    [
        ("k1+", "k1"),
        ("kl+", "k1"),
        ("abs+", "abs"),
        ("k3+", "k3"),
        ("low_var_kl+", "k3"),
        ("k2+", "k2"),
        ("mse+", "k2"),
    ],
)
def test_straight_through_kinds_have_their_value_and_k2s_gradient(kind: str, base: str) -> None:
    logp = LOGP.clone().requires_grad_(True)
    out = kl_penalty(logp, REF, kind)
    torch.testing.assert_close(out, kl_penalty(LOGP, REF, base))
    out.sum().backward()
    # d/dlogp 0.5 (logp - ref)^2 = logp - ref = (0.5, -1.0), the true KL's expected gradient.
    torch.testing.assert_close(logp.grad, torch.tensor([[0.5, -1.0]]))


def test_unknown_kl_kind_names_valid_kinds() -> None:
    with pytest.raises(ValueError) as info:
        kl_penalty(LOGP, REF, "full")
    message = str(info.value)
    assert "full" in message
    for kind in ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl", "k1+", "abs+", "k3+", "low_var_kl+"):
        assert kind in message


# --------------------------------------------------------------------------- controllers


def test_fixed_controller_never_moves() -> None:
    ctl = FixedKLController(0.05)
    ctl.update(current_kl=100.0, n_steps=1000)
    assert ctl.value == 0.05


def test_adaptive_controller_by_hand() -> None:
    ctl = AdaptiveKLController(init_kl_coef=0.2, target_kl=6.0, horizon=10000)
    # KL 9 vs target 6: error 0.5, clipped to 0.2 -> 0.2 * (1 + 0.2 * 256 / 10000) = 0.201024.
    ctl.update(current_kl=9.0, n_steps=256)
    assert ctl.value == pytest.approx(0.201024)
    # KL 5.4: error -0.1 (inside the clip) -> times (1 - 0.1 * 256 / 10000) = 0.99744.
    ctl.update(current_kl=5.4, n_steps=256)
    assert ctl.value == pytest.approx(0.201024 * 0.99744)
    # KL 0: error -1 clipped to -0.2 -> times (1 - 0.2 * 5000 / 10000) = 0.9.
    before = ctl.value
    ctl.update(current_kl=0.0, n_steps=5000)
    assert ctl.value == pytest.approx(before * 0.9)


def test_make_kl_controller() -> None:
    fixed = make_kl_controller("fixed", 0.1)
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.1
    adaptive = make_kl_controller("adaptive", 0.1, target_kl=1.0, horizon=100)
    assert isinstance(adaptive, AdaptiveKLController) and adaptive.value == 0.1
    with pytest.raises(ValueError, match="target_kl"):
        make_kl_controller("adaptive", 0.1)
    with pytest.raises(ValueError, match="pid"):
        make_kl_controller("pid", 0.1)
    with pytest.raises(ValueError, match="horizon"):
        AdaptiveKLController(0.1, target_kl=1.0, horizon=0)
    with pytest.raises(ValueError, match="target_kl"):
        AdaptiveKLController(0.1, target_kl=0.0, horizon=10)


# --------------------------------------------------------------------------- in-reward penalty


def test_apply_kl_penalty_by_hand() -> None:
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 3.0]], dtype=torch.float64)
    ref = torch.zeros(2, 3, dtype=torch.float64)
    # k1 = old - ref, so old is the per-token KL: row 0 (0.1, 0.2, 0.3), row 1 (0.4, 0.5, masked).
    old = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 99.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    rewards, current_kl = apply_kl_penalty(scores, old, ref, mask, kl_coef=0.5, kind="k1")
    # rewards = scores - 0.5 * kl on valid tokens; the masked score is left as is.
    expected = torch.tensor([[-0.05, -0.1, 0.85], [-0.2, 1.75, 3.0]], dtype=torch.float64)
    torch.testing.assert_close(rewards, expected)
    # Per-sequence means 0.2 and 0.45 -> batch mean 0.325.
    assert isinstance(current_kl, float)
    assert current_kl == pytest.approx(0.325)


def test_apply_kl_penalty_skips_empty_sequences_and_uses_kind() -> None:
    scores = torch.zeros(2, 2)
    old = torch.tensor([[-1.0, -2.0], [5.0, 5.0]])
    ref = torch.tensor([[-1.5, -1.0], [0.0, 0.0]])
    mask = torch.tensor([[1, 1], [0, 0]])
    rewards, current_kl = apply_kl_penalty(scores, old, ref, mask, kl_coef=1.0, kind="mse")
    # Only row 0 counts: k2 = (0.125, 0.5), mean 0.3125.
    assert current_kl == pytest.approx(0.3125)
    torch.testing.assert_close(rewards, torch.tensor([[-0.125, -0.5], [0.0, 0.0]]))
    _, none_kl = apply_kl_penalty(scores, old, ref, torch.zeros(2, 2), kl_coef=1.0)
    assert none_kl == 0.0
