"""Rollout correction: bypass copy and truncated importance-sampling weights."""

from __future__ import annotations

import math

import pytest
import torch

from conveyor.algos.correction import (
    bypass_old_log_prob,
    compute_mismatch_metrics,
    compute_rollout_is_weights,
    parse_is_threshold,
    parse_rejection,
)


def test_bypass_is_a_detached_float32_copy() -> None:
    rollout = torch.tensor([[-0.5, -1.25, -3.0]], dtype=torch.bfloat16, requires_grad=True)
    old = bypass_old_log_prob(rollout)
    assert old.dtype == torch.float32
    assert not old.requires_grad
    torch.testing.assert_close(old, torch.tensor([[-0.5, -1.25, -3.0]]))
    # Writing into the result must not touch the rollout's tensor (also for float32 input).
    rollout32 = torch.tensor([[-1.0, -2.0]])
    copy = bypass_old_log_prob(rollout32)
    copy.add_(1.0)
    torch.testing.assert_close(rollout32, torch.tensor([[-1.0, -2.0]]))


def _case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row 0: probabilities old (0.5, 0.6, 0.8) vs rollout (1.0, 0.4, 0.2) -> ratios 0.5, 1.5, 4.

    Row 1: one valid token with equal probabilities (ratio 1), then padding holding garbage.
    """
    old = torch.tensor([[0.5, 0.6, 0.8], [0.3, 0.0, 0.0]]).log()
    rollout = torch.tensor([[1.0, 0.4, 0.2], [0.3, 0.0, 0.0]]).log()
    old[1, 1:] = float("nan")
    rollout[1, 1:] = 123.0
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    return old, rollout, mask


def test_token_level_weights_and_metrics_by_hand() -> None:
    old, rollout, mask = _case()
    weights, metrics = compute_rollout_is_weights(old, rollout, mask, level="token", threshold=2.0)
    # Ratios 0.5, 1.5, 4 -> 4 truncated to 2; row 1: 1, then 0 off the mask.
    torch.testing.assert_close(weights, torch.tensor([[0.5, 1.5, 2.0], [1.0, 0.0, 0.0]]))
    assert not weights.requires_grad
    assert all(isinstance(v, float) for v in metrics.values())
    # Raw ratios over the 4 valid tokens: 0.5, 1.5, 4, 1.
    assert metrics["rollout_corr/is_mean"] == pytest.approx(7.0 / 4)
    assert metrics["rollout_corr/is_max"] == pytest.approx(4.0)
    assert metrics["rollout_corr/is_truncated_mean"] == pytest.approx(5.0 / 4)
    assert metrics["rollout_corr/clipped_frac"] == pytest.approx(1.0 / 4)
    # The trainer-vs-sampler gap of the same batch, in verl's sign: log(training ppl / rollout ppl)
    # = mean(rollout) - mean(old) per sequence; row 0: -ln(0.5 * 1.5 * 4) / 3 = -ln 3 / 3, row 1: 0.
    gap = compute_mismatch_metrics(old, rollout, mask)
    assert gap["rollout_corr/log_ppl_diff"] == pytest.approx(-math.log(3.0) / 6, abs=1e-6)
    assert gap["rollout_corr/extreme_frac"] == pytest.approx(2.0 / 4)  # ratios 0.5 and 4 are beyond 2x
    # |p_old - p_rollout|: 0.5, 0.2, 0.6, 0.
    assert metrics["rollout_corr/probs_diff_max"] == pytest.approx(0.6, abs=1e-6)
    assert metrics["rollout_corr/probs_diff_mean"] == pytest.approx(1.3 / 4, abs=1e-6)


def test_sequence_level_weights_by_hand() -> None:
    old, rollout, mask = _case()
    weights, metrics = compute_rollout_is_weights(old, rollout, mask, level="sequence", threshold=2.0)
    # Row 0: 0.5 * 1.5 * 4 = 3 -> truncated to 2 on every valid token; row 1: ratio 1.
    torch.testing.assert_close(weights, torch.tensor([[2.0, 2.0, 2.0], [1.0, 0.0, 0.0]]))
    assert metrics["rollout_corr/is_mean"] == pytest.approx(2.0)
    assert metrics["rollout_corr/is_max"] == pytest.approx(3.0)
    assert metrics["rollout_corr/clipped_frac"] == pytest.approx(0.5)


def test_weights_ignore_values_under_the_mask() -> None:
    old, rollout, mask = _case()
    w1, m1 = compute_rollout_is_weights(old, rollout, mask)
    old2, rollout2 = old.clone(), rollout.clone()
    old2[~mask] = -7.0
    rollout2[~mask] = float("inf")
    w2, m2 = compute_rollout_is_weights(old2, rollout2, mask)
    torch.testing.assert_close(w1, w2)
    assert m1 == pytest.approx(m2)


def test_long_sequences_do_not_overflow() -> None:
    # 2000 tokens each with log-ratio +1: the product is e^2000, far beyond float32.
    old = torch.zeros(1, 2000)
    rollout = -torch.ones(1, 2000)
    weights, metrics = compute_rollout_is_weights(old, rollout, torch.ones(1, 2000), level="sequence", threshold=5.0)
    torch.testing.assert_close(weights, torch.full((1, 2000), 5.0))
    assert all(math.isfinite(v) for v in metrics.values())
    assert metrics["rollout_corr/clipped_frac"] == 1.0


def test_empty_mask_gives_zero_metrics() -> None:
    weights, metrics = compute_rollout_is_weights(torch.zeros(2, 2), torch.zeros(2, 2), torch.zeros(2, 2))
    assert (weights == 0).all()
    assert metrics and all(v == 0.0 for v in metrics.values())


def test_argument_errors() -> None:
    old, rollout, mask = _case()
    with pytest.raises(ValueError, match="level"):
        compute_rollout_is_weights(old, rollout, mask, level="geometric")
    with pytest.raises(ValueError, match="threshold"):
        compute_rollout_is_weights(old, rollout, mask, threshold=0.0)
    with pytest.raises(ValueError, match="rollout_log_prob"):
        compute_rollout_is_weights(old, rollout[:, :2], mask)


def test_icepop_keeps_weights_inside_the_band_and_zeroes_the_rest() -> None:
    old, rollout, mask = _case()  # row 0 ratios 0.5, 1.5, 4; row 1 ratio 1
    weights, metrics = compute_rollout_is_weights(old, rollout, mask, threshold=2.0, lower=0.6)
    torch.testing.assert_close(weights, torch.tensor([[0.0, 1.5, 0.0], [1.0, 0.0, 0.0]]))
    assert metrics["rollout_corr/clipped_frac"] == pytest.approx(2.0 / 4)


@pytest.mark.parametrize("spec, expected", [(2.0, (2.0, None)), ("3", (3.0, None)), ("0.5_5.0", (5.0, 0.5))])
def test_is_threshold_is_a_number_or_lower_upper(spec, expected) -> None:
    assert parse_is_threshold(spec) == expected


@pytest.mark.parametrize("spec", ["5_0.5", "0_2", "x", "-1", "nan", True])
def test_bad_is_thresholds_say_what_is_wrong(spec) -> None:
    with pytest.raises(ValueError, match="lower|number"):
        parse_is_threshold(spec)


def test_rejection_options_parse_like_verl() -> None:
    assert parse_rejection("token_k1", 2.0) == [("token_k1", 0.5, 2.0)]
    assert parse_rejection("token_k1, seq_max_k3,token_k1", "0.6_1.5,0.2") == [
        ("token_k1", 0.6, 1.5),
        ("seq_max_k3", None, 0.2),
    ]
    for options, threshold, match in [
        ("seq_max_k1", 2.0, "unknown"),
        ("token_k2", None, "needs"),
        ("token_k2", "0.1_0.2", "one positive"),
        ("token_k1", "2_1", "lower <= upper"),
        ("token_k1,token_k2", "1,2,3", "3 values for 2"),
    ]:
        with pytest.raises(ValueError, match=match):
            parse_rejection(options, threshold)


def test_rejected_tokens_leave_the_update(tiny_run) -> None:
    """Advantages only on tokens the rejection drops: with rollout_rs the update has nothing to learn from."""
    from conveyor.config import load_config
    from conveyor.data_plane.memory import MemoryDataPlane
    from conveyor.protocol import KVBatchMeta
    from conveyor.trainer.plan import build_run_plan
    from conveyor.trainer.setup import prepare_default_model
    from conveyor.workers.ranks.actor import PolicyWorker
    from conveyor.workers.ranks.calls import LogProbCall, UpdateCall
    from conveyor.workers.ranks.settings import actor_settings

    prompts = torch.tensor([[5, 6, 7], [8, 9, 10]])
    responses = torch.tensor([[5, 6, 1], [7, 8, 1]])
    mask = torch.ones(2, 3, dtype=torch.bool)
    grads = {}
    for rs in (None, "token_k1"):
        extra = ["algorithm.rollout_correction.bypass_mode=false"]
        if rs:
            extra += [
                f"algorithm.rollout_correction.rollout_rs={rs}",
                "algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0",
            ]
        cfg = load_config(None, tiny_run + extra)
        dp = MemoryDataPlane()
        worker = PolicyWorker(
            actor_settings(cfg, build_run_plan(cfg, "cpu")), model_path=prepare_default_model(cfg), data_plane=dp
        )
        keys = ["a", "b"]
        dp.kv_batch_put(
            keys,
            "p",
            {
                "prompts": prompts,
                "prompt_mask": torch.ones(2, 3, dtype=torch.bool),
                "responses": responses,
                "response_mask": mask,
            },
        )
        call = LogProbCall(temperature=1.0, calculate_entropy=False)
        worker.compute_log_prob(KVBatchMeta(keys, "p").with_extra_info(**call.to_extra_info()))
        old = dp.kv_batch_get(keys, "p", ["old_log_probs"])["old_log_probs"]
        # The sampler saw tokens (0, 1) and (1, 2) as 3x likelier than the trainer does: beyond 0.5_2.0.
        rollout = old.clone()
        rollout[0, 1] += math.log(3.0)
        rollout[1, 2] += math.log(3.0)
        advantages = torch.zeros(2, 3)
        advantages[0, 1], advantages[1, 2] = 1.0, -1.0
        dp.kv_batch_put(keys, "p", {"rollout_log_probs": rollout, "advantages": advantages})
        update = UpdateCall(temperature=1.0, calculate_entropy=False)
        out = worker.update_actor(KVBatchMeta(keys, "p").with_extra_info(**update.to_extra_info()))
        grads[rs] = out.extra_info["actor/grad_norm"]
    assert grads[None] > 0
    assert grads["token_k1"] == 0.0
