"""Smoke test: the router-control benchmark runs both parts end to end at a tiny size and reports its figures."""

from __future__ import annotations

import math

import pytest
from benchmark_scripts import load_script

TINY = [
    "--seeds",
    "0",
    "--steps",
    "2",
    "--set",
    "data.train_batch_size=4",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "data.synthetic.num_train=64",
    "data.synthetic.num_val=8",
    "actor_rollout_ref.model.tiny.warmstart_steps=0",
    "actor_rollout_ref.rollout.moe_load_balance_metrics_interval=1",
]


def test_main_tiny(capsys: pytest.CaptureFixture[str]) -> None:
    out = load_script("router_control").main(TINY)
    printed = capsys.readouterr().out
    (balance,) = out["balance"]
    for arm in ("off", "bias"):
        for key in ("vio_first", "vio_last", "acc"):
            assert math.isfinite(balance[arm][key]), (arm, key)
    # The skew put one expert into nearly every token's top-2 of 8: max_vio near 3 before any balancing.
    assert balance["off"]["vio_first"] > 2.0
    assert 0.0 <= balance["bias"]["flip"] <= 1.0  # every step is a load-balance step here
    (replay,) = out["replay"]
    assert replay["auto"]["step_s"] > 0 and replay["R3"]["step_s"] > 0
    assert replay["auto"]["cpu_step_s"] > 0 and replay["R3"]["cpu_step_s"] > 0
    assert "skewed router: expert 0 in the top-k of" in printed
    assert "balanced warm start: 0 steps with load-balancing loss" in printed  # --base balanced, the default
    assert "over answer tokens" in printed and "answer tokens: assignments per expert" in printed
    assert "router_replay.mode=auto: disabled" in printed  # one mini-batch per batch, one epoch: on-policy


def test_balance_from_the_unskewed_base_with_a_chosen_rule(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--part", "balance", "--no-skew", "--update", "proportional", "--dead-band", "0.3", "--rate", "0.1"]
    (balance,) = load_script("router_control").main(TINY + args)["balance"]
    printed = capsys.readouterr().out
    assert "no skew: both arms start from the base model" in printed and "skewed router" not in printed
    # No skew: the run without balancing starts from the base's own routing, far below the skewed max_vio of 3.
    assert balance["off"]["vio_first"] < 2.0
    assert math.isfinite(balance["bias"]["acc"]) and 0.0 <= balance["bias"]["flip"] <= 1.0


def test_the_balancing_arm_can_be_the_load_balancing_loss(capsys: pytest.CaptureFixture[str]) -> None:
    (balance,) = load_script("router_control").main(
        TINY + ["--part", "balance", "--no-skew", "--aux-loss-coef", "1.0"]
    )["balance"]
    printed = capsys.readouterr().out
    assert "balancing arm ('bias' below): actor_rollout_ref.actor.router.aux_loss_coef=1.0" in printed
    assert math.isfinite(balance["bias"]["vio_last"]) and math.isfinite(balance["bias"]["acc"])


@pytest.mark.parametrize("argv", [["--steps", "1"], ["--update", "signum"]])
def test_bad_flags_are_rejected(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        load_script("router_control").main(argv)


def test_a_stronger_skew_over_a_base_balanced_on_every_token(capsys: pytest.CaptureFixture[str]) -> None:
    import re

    args = ["--part", "balance", "--skew-lead", "2", "--warmstart-aux-tokens", "all", "--val", "8"]
    (balance,) = load_script("router_control").main(TINY + args)["balance"]
    printed = capsys.readouterr().out
    assert "over all tokens" in printed
    leads = re.search(r"its logit ahead of the k-th other's by a median ([0-9., ]+)", printed).group(1)
    assert all(float(v) >= 2.0 for v in leads.split(", ")), leads  # the refit went on past the share
    assert balance["off"]["vio_first"] > 2.0
