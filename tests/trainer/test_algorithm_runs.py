"""DAPO's dynamic sampling and overlong shaping, ReMax's greedy baseline, and every algorithm training without NaN."""

from __future__ import annotations

import json
import math

import pytest
import torch
from test_stages import make_trainer, step_partition  # tests/trainer is on sys.path (rootdir import mode)

from conveyor.config import ConfigError, load_config
from conveyor.trainer.plan import build_run_plan
from conveyor.trainer.run import run_training
from conveyor.workers.ranks.reward import overlong_penalty

# Half the prompts (even answers) score the same whatever is generated: their groups
# carry no signal. The others score the response's length parity, which varies.
HALF_CONSTANT = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if int(ground_truth) % 2 == 0:
        return 0.3
    return float(len(solution_str) % 2)
"""


@pytest.fixture
def half_constant_reward(tmp_path):
    path = tmp_path / "half_constant.py"
    path.write_text(HALF_CONSTANT)
    return [f"reward.custom_reward_function.path={path}"]


def test_dynamic_sampling_trains_a_full_batch_of_varied_groups(tiny_run, half_constant_reward):
    overrides = (
        tiny_run
        + half_constant_reward
        + [
            "algorithm.filter_groups.enable=true",
            "actor_rollout_ref.rollout.n=4",
            "data.train_batch_size=4",
        ]
    )
    trainer, dp = make_trainer(overrides)
    meta, metrics = trainer.sample(step_partition("train-1"))
    assert len(meta) == 4 * 4  # full: train_batch_size groups of n samples
    td = dp.get(meta, ["acc", "uid", "ground_truth", "prompts", "responses"])
    groups: dict[str, list[float]] = {}
    for uid, score in zip(td["uid"], td["acc"].tolist()):
        groups.setdefault(uid, []).append(score)
    assert len(groups) == 4 and all(len(v) == 4 for v in groups.values())
    assert all(max(v) > min(v) for v in groups.values()), groups
    assert all(int(gt) % 2 == 1 for gt in td["ground_truth"])  # every constant group was dropped
    assert metrics["train/num_gen_batches"] >= 2
    assert 0 < metrics["train/filter_groups/kept_frac"] < 1
    # Batches of one partition share widths: prompts padded to the longest training prompt.
    assert td["prompts"].shape[1] == trainer.stages.train_prompt_width()
    assert td["responses"].shape[1] == trainer.cfg.data.max_response_length


def test_dynamic_sampling_gives_up_after_max_num_gen_batches(tiny_run, tmp_path):
    path = tmp_path / "constant.py"
    path.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    trainer, _ = make_trainer(
        tiny_run
        + [
            f"reward.custom_reward_function.path={path}",
            "algorithm.filter_groups.enable=true",
            "algorithm.filter_groups.max_num_gen_batches=2",
        ]
    )
    with pytest.raises(ValueError, match="after 2 generation batches only 0 of the 4"):
        trainer.sample(step_partition("train-1"))


def test_dynamic_sampling_without_a_limit_stops_after_an_epoch_of_constant_groups(tiny_run, tmp_path):
    path = tmp_path / "constant.py"
    path.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    trainer, _ = make_trainer(
        tiny_run
        + [
            f"reward.custom_reward_function.path={path}",
            "data.synthetic.num_train=16",
            "algorithm.filter_groups.enable=true",
        ]
    )
    with pytest.raises(ValueError, match="a whole epoch of prompts"):
        trainer.sample(step_partition("train-1"))


def test_dynamic_sampling_logs_the_generation_batches_of_every_step(tiny_run, half_constant_reward):
    cfg = load_config(None, tiny_run + half_constant_reward + ["algorithm.filter_groups.enable=true"])
    run_training(cfg)
    records = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("step", 0) >= 1 and "train/num_gen_batches" in r]
    assert len(steps) == 2 and all(r["train/num_gen_batches"] >= 1 for r in steps)


def test_dynamic_sampling_needs_groups():
    with pytest.raises(ConfigError, match="actor_rollout_ref.rollout.n"):
        load_config(None, ["algorithm.filter_groups.enable=true", "actor_rollout_ref.rollout.n=1"])


def test_remax_baseline_is_the_greedy_response_reward(tiny_run):
    trainer, dp = make_trainer(tiny_run + ["algorithm.adv_estimator=remax"])
    meta, _ = trainer.sample(step_partition("train-1"))
    base = dp.get(meta, ["reward_baselines", "uid"])
    # The baseline is one number per prompt, shared by its samples ...
    by_uid: dict[str, set] = {}
    for uid, b in zip(base["uid"], base["reward_baselines"].tolist()):
        by_uid.setdefault(uid, set()).add(b)
    assert all(len(v) == 1 for v in by_uid.values())
    # ... the score of a greedy decode of that prompt, made again here.
    records = trainer.stages.train_data  # the batch above consumed the first 4 prompts of the order
    records.load_state_dict({**records.state_dict(), "position": 0})
    again = trainer.stages.put_prompts(records.next_batch(4), "check", n=1)
    again, _ = trainer.stages.generate(again, seed=0, greedy=True, generate=trainer.source.generate)
    again, _ = trainer.stages.compute_reward(again)
    expected = dp.get(again, ["rm_scores"])["rm_scores"].sum(-1)
    torch.testing.assert_close(base["reward_baselines"][::2], expected)


def test_overlong_shaping_moves_the_reward_not_the_accuracy(tiny_run):
    trainer, dp = make_trainer(
        tiny_run
        + [
            "reward_model.overlong_buffer.enable=true",
            "reward_model.overlong_buffer.len=3",
            "reward_model.overlong_buffer.penalty_factor=2.0",
        ]
    )
    meta, metrics = trainer.sample(step_partition("train-1"))
    td = dp.get(meta, ["rm_scores", "acc", "response_mask"])
    lengths = td["response_mask"].sum(-1)
    penalty = overlong_penalty(lengths, trainer.cfg.data.max_response_length, 3, 2.0)
    torch.testing.assert_close(td["rm_scores"].sum(-1), td["acc"] + penalty)
    assert metrics["reward/overlong_frac"] == pytest.approx(float((penalty < 0).float().mean()))
    with pytest.raises(ConfigError, match="reward_model.overlong_buffer.len"):
        load_config(None, ["reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=7"])


# Each algorithm users ask for by name, as its recipe sets it up (verl's keys). To
# keep the suite short, each run pairs an advantage estimator with a policy loss
# (and an aggregation or KL variant), so every name is trained in one of them.
ALGORITHMS = {
    "gae+vanilla": ["algorithm.adv_estimator=gae"],
    "grpo+gspo": [
        "actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
        "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
        "actor_rollout_ref.actor.clip_ratio_low=0.0003",
        "actor_rollout_ref.actor.clip_ratio_high=0.0004",
    ],
    # DAPO: clip-higher, token-mean, dynamic sampling, overlong shaping (a buffer
    # over every length, so groups of 4 whose lengths differ differ in reward).
    "dapo": [
        "algorithm.filter_groups.enable=true",
        "reward_model.overlong_buffer.enable=true",
        "reward_model.overlong_buffer.len=6",
        "actor_rollout_ref.actor.clip_ratio_high=0.28",
        "actor_rollout_ref.actor.loss_agg_mode=token-mean",
        "actor_rollout_ref.rollout.n=4",
        "data.synthetic.num_train=256",
    ],
    "dr_grpo+cispo": [
        "algorithm.norm_adv_by_std_in_grpo=false",
        "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm",
        "actor_rollout_ref.actor.policy_loss.loss_mode=cispo",
    ],
    "rloo+sapo": ["algorithm.adv_estimator=rloo", "actor_rollout_ref.actor.policy_loss.loss_mode=sapo"],
    "reinforce_plus_plus+clip_cov": [
        "algorithm.adv_estimator=reinforce_plus_plus",
        "actor_rollout_ref.actor.policy_loss.loss_mode=clip_cov",
        "actor_rollout_ref.actor.policy_loss.clip_cov_ratio=0.05",
    ],
    "reinforce_plus_plus_baseline+kl_cov": [
        "algorithm.adv_estimator=reinforce_plus_plus_baseline",
        "actor_rollout_ref.actor.policy_loss.loss_mode=kl_cov",
        "actor_rollout_ref.actor.policy_loss.kl_cov_ratio=0.05",
    ],
    "remax+geo_mean": ["algorithm.adv_estimator=remax", "actor_rollout_ref.actor.policy_loss.loss_mode=geo_mean"],
    "opo+token_sum+k3plus": [
        "algorithm.adv_estimator=opo",
        "actor_rollout_ref.actor.loss_agg_mode=token-sum",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.kl_loss_type=k3+",
    ],
    "gpg+abs_plus_in_reward": [
        "algorithm.adv_estimator=gpg",
        "actor_rollout_ref.actor.policy_loss.loss_mode=gpg",
        "algorithm.use_kl_in_reward=true",
        "algorithm.kl_penalty=abs+",
    ],
    "grpo_passk+k1plus": [
        "algorithm.adv_estimator=grpo_passk",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.kl_loss_type=k1+",
    ],
    "gdpo+dro": [
        "algorithm.adv_estimator=gdpo",
        "actor_rollout_ref.actor.policy_loss.loss_mode=dro",
        "actor_rollout_ref.actor.policy_loss.dro_beta=0.1",
    ],
    # The optimal token baselines read sum_pi_squared, which turns the old-log-prob forward on.
    "optimal_token_baseline+dppo_tv": [
        "algorithm.adv_estimator=optimal_token_baseline",
        "actor_rollout_ref.actor.policy_loss.loss_mode=dppo_tv",
    ],
    "tir_optimal_token_baseline+dppo_kl+is": [
        "algorithm.adv_estimator=tir_optimal_token_baseline",
        "actor_rollout_ref.actor.policy_loss.loss_mode=dppo_kl",
        "algorithm.rollout_correction.rollout_is=token",
    ],
}

# The default task at the smallest batch that still has groups: each algorithm's every update, advantage and
# metric must stay finite all the way. From a random init the task's reward is 0 for every sample: over 200
# steps the 10 runs other than DAPO's scored 0 on every step, 9 had advantages of exactly 0 and 6 a gradient
# norm of exactly 0 (measured), so they checked next to nothing. They start from a 40-step supervised warm start
# instead: rewards of ~0.1 and gradient norms of ~1-20 from the first step, and in 100 steps each policy's entropy
# falls from ~1.5 to ~1.0 (measured), so 100 such steps check far more than 200 steps of zeros did.
# DAPO's signal is its overlong shaping, which needs the random init's varied lengths (a warm-started model
# answers at one length: every group is constant and dynamic sampling gives up), so it keeps the random init and
# 200 steps, over which its entropy collapses from 4.0 to 0.7: the regime where a NaN would show.
SMOKE = [
    "data.train_batch_size=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "critic.ppo_mini_batch_size=2",
    "actor_rollout_ref.rollout.n=2",
    "trainer.save_freq=0",
]
WARM_START = ["actor_rollout_ref.model.tiny.warmstart_steps=40"]
SMOKE_STEPS = {"dapo": 200}
DEFAULT_SMOKE_STEPS = 100


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_algorithm_trains_without_nan(name, tiny_run):
    steps = SMOKE_STEPS.get(name, DEFAULT_SMOKE_STEPS)
    start = [] if name == "dapo" else WARM_START
    cfg = load_config(None, tiny_run + SMOKE + start + [f"trainer.total_training_steps={steps}"] + ALGORITHMS[name])
    last = run_training(cfg)  # a non-finite reward, advantage or loss raises NonFiniteError
    assert last["training/global_step"] == steps
    records = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    for rec in records:
        bad = [k for k, v in rec.items() if isinstance(v, float) and not math.isfinite(v)]
        assert not bad, (rec.get("step"), bad)
    # The policy was really updated: finite zeros would prove nothing.
    assert any(rec.get("actor/grad_norm", 0.0) > 0 for rec in records), name


def test_a_run_with_rollout_correction_logs_the_gap_icepop_weights_and_rejections(tiny_run):
    cfg = load_config(
        None,
        tiny_run
        + [
            "algorithm.rollout_correction.rollout_is=token",
            "algorithm.rollout_correction.rollout_is_threshold=0.5_5.0",
            "algorithm.rollout_correction.rollout_rs=token_k1,seq_mean_k3",
            "algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0,0.01",
        ],
    )
    # Asking for a correction turns the old-log-prob forward on.
    assert build_run_plan(cfg, "cpu").old_log_probs == "forward"
    last = run_training(cfg)
    assert last["rollout_corr/rollout_rs_masked_fraction"] == 0.0
    # The hf rollout samples with the trainer's own numerics: the gap is (numerically) none.
    assert abs(last["rollout_corr/kl"]) < 1e-4 and last["rollout_corr/ppl_ratio"] == pytest.approx(1.0, abs=1e-4)
    assert last["rollout_corr/extreme_frac"] == 0.0
    assert last["rollout_corr/rollout_is_oob_ratio"] == 0.0
    assert last["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(1.0, abs=1e-3)
