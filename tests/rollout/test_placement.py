"""Rollout placement: engines colocated with the actor's ranks, or a rollout worker group of their own.

On the real engines: the hf engine separate equals the hf engine colocated, bit for bit (the rollout worker's
copy gets the actor's weights before every rollout); vLLM separate from 2 fsdp2 actor ranks on Ray gets the
weights over the weight channel and trains, and an engine that misses a sync fails the run's gap check.
"""

from __future__ import annotations

import json

import pytest

from conveyor.config import ConfigError, load_config
from conveyor.trainer.run import run_training

VLLM = [
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.model.tiny.num_heads=2",
    "actor_rollout_ref.model.tiny.num_kv_heads=2",
]
SEPARATE = ["actor_rollout_ref.rollout.placement=separate"]
# Untrained, the tiny model never answers right: one point per "1" written gives GRPO advantages to learn from.
ONES_REWARD = (
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    return float(solution_str.count('1'))\n"
)


def _rows(cfg) -> list[dict]:
    return [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]


def _train_rows(cfg) -> list[dict]:
    return [r for r in _rows(cfg) if "actor/pg_loss" in r]


def test_a_separate_hf_rollout_trains_exactly_as_a_colocated_one(tiny_run, tmp_path) -> None:
    reward = tmp_path / "ones.py"
    reward.write_text(ONES_REWARD)
    common = tiny_run + [
        "trainer.total_training_steps=3",
        "actor_rollout_ref.actor.optim.lr=3e-2",
        f"reward.custom_reward_function.path={reward}",
        "actor_rollout_ref.rollout.n=4",
    ]
    colocated = load_config(None, common)
    separate = load_config(None, common + SEPARATE + [f"trainer.default_local_dir={tmp_path / 'separate'}"])
    run_training(colocated)
    run_training(separate)
    a, b = _train_rows(colocated), _train_rows(separate)
    assert len(a) == len(b) == 3
    for x, y in zip(a, b):
        # The replica samples from its own copy, synced before each rollout: the same tokens, the same update.
        for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "response_length/mean"):
            assert x[key] == y[key], key
    # The copy took the new weights before steps 2 and 3 (step 1's were synced for the step-0 validation).
    assert all("rollout/weight_sync_s" in r for r in b[1:])


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["actor_rollout_ref.rollout.placement=apart"], "actor_rollout_ref.rollout.placement"),
        (SEPARATE + ["actor_rollout_ref.rollout.replicas=0"], "actor_rollout_ref.rollout.replicas"),
    ],
)
def test_placement_errors_name_the_key(overrides, key) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, overrides)


@pytest.fixture(scope="module")
def hf_step0_validation(tiny_run_base, tmp_path_factory) -> dict:
    """Greedy validation of the untrained vllm-shaped tiny model by the hf rollout on one rank (what vLLM must
    match)."""
    root = tmp_path_factory.mktemp("hf")
    (root / "ones.py").write_text(ONES_REWARD)
    cfg = load_config(
        None,
        tiny_run_base
        + VLLM[1:]
        + [
            f"trainer.default_local_dir={root}",
            "trainer.total_training_steps=1",
            "actor_rollout_ref.rollout.n=4",
            f"reward.custom_reward_function.path={root / 'ones.py'}",
        ],
    )
    run_training(cfg)
    return next(r for r in _rows(cfg) if r["step"] == 0)


def test_several_replicas_in_one_process_are_refused_with_what_to_change(tiny_run) -> None:
    cfg = load_config(None, tiny_run + SEPARATE + ["actor_rollout_ref.rollout.replicas=2"])
    with pytest.raises(ValueError, match="rollout.replicas=2: a run in one process holds one replica"):
        run_training(cfg)


@pytest.mark.parametrize("placement, tp", [("separate", 1), ("colocated", 1), ("colocated", 2)])
def test_vllm_with_two_fsdp2_ranks_on_ray_gets_every_update(
    placement, tp, tiny_run, tmp_path, hf_step0_validation
) -> None:
    """colocated with tp 2: one replica over both ranks, which gather their prompts and generate together."""
    # A high learning rate moves the policy visibly each step: were the engine a step behind, the
    # trainer's recomputed log-probs would differ from the engine's by far more than kernel noise.
    reward = tmp_path / "ones.py"
    reward.write_text(ONES_REWARD)
    cfg = load_config(
        None,
        tiny_run
        + VLLM
        + [
            f"actor_rollout_ref.rollout.placement={placement}",
            "trainer.num_cpu_workers=2",
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}",
            "ray.num_cpus=4",
            "actor_rollout_ref.actor.strategy=fsdp2",
            "trainer.total_training_steps=4",
            "actor_rollout_ref.actor.optim.lr=3e-2",
            f"reward.custom_reward_function.path={reward}",
            "actor_rollout_ref.rollout.n=4",
        ],
    )
    run_training(cfg)
    # Greedy on the same (untrained) weights, the engines on two ranks write the hf rollout's tokens: the
    # held-out rewards (one point per "1") and response lengths of step 0 are the same.
    step0 = next(r for r in _rows(cfg) if r["step"] == 0)
    for key in ("val/reward", "val/response_length"):
        assert step0[key] == pytest.approx(hf_step0_validation[key], abs=1e-9), key
    steps = _train_rows(cfg)
    assert len(steps) == 4
    for r in steps:
        assert r["rollout_corr/log_prob_abs_diff/max"] < 1e-3 and r["rollout_corr/extreme_frac"] == 0
    for r in steps[1:]:
        if placement == "separate":
            # New weights before each rollout, over the channel from actor rank 0 (the tiny model fits one
            # bucket; tests/rollout/test_weight_channel.py streams many).
            assert r["rollout/weight_send_buckets"] >= 1
            assert r["rollout/weight_sync_gb"] == r["rollout/weight_send_gb"] > 0
        else:  # every rank's own engine, in its process, from the rank's stream of gathered tensors
            assert r["rollout/weight_sync_s"] > 0
    # The policy moved before most rollouts, so the gap above compares a changed policy with what the engine serves.
    assert sum(r["actor/grad_norm"] > 0.1 for r in steps[:3]) >= 2


def test_a_separate_engine_that_misses_a_sync_fails_the_gap_check(tiny_run, tmp_path, monkeypatch) -> None:
    """What the Ray test above relies on: an engine left on the first weights is far off the trainer's log-probs."""
    from conveyor.workers.placement.roles import ReplicaGroup

    synced = ReplicaGroup.sync

    def first_only(self):
        return synced(self) if self.served is None else {}

    monkeypatch.setattr(ReplicaGroup, "sync", first_only)
    reward = tmp_path / "ones.py"
    reward.write_text(ONES_REWARD)
    cfg = load_config(
        None,
        tiny_run
        + VLLM
        + SEPARATE
        + [
            "trainer.total_training_steps=3",
            "actor_rollout_ref.actor.optim.lr=3e-2",
            f"reward.custom_reward_function.path={reward}",
            "actor_rollout_ref.rollout.n=4",
        ],
    )
    run_training(cfg)
    steps = _train_rows(cfg)
    assert steps[0]["rollout_corr/log_prob_abs_diff/max"] < 1e-3  # the one sync it had
    assert max(r["rollout_corr/log_prob_abs_diff/max"] for r in steps[1:]) > 1e-2
