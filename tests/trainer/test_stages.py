"""Each stage of a step reads only the fields it needs and writes only its outputs."""

from __future__ import annotations

import torch

from conveyor.config import load_config
from conveyor.data_plane.memory import MemoryDataPlane
from conveyor.models.loading import load_tokenizer
from conveyor.trainer.plan import build_run_plan
from conveyor.trainer.ppo import PPOTrainer
from conveyor.trainer.setup import load_prompt_records, prepare_default_model
from conveyor.workers.roles import build_worker_groups


class RecordingDataPlane(MemoryDataPlane):
    """The real memory store, noting which fields each get/put touched."""

    def __init__(self):
        super().__init__()
        self.log: list[tuple[str, tuple[str, ...]]] = []

    def kv_batch_get(self, keys, partition_id, select_fields):
        self.log.append(("get", tuple(select_fields)))
        return super().kv_batch_get(keys, partition_id, select_fields)

    def kv_batch_put(self, keys, partition_id, fields, tags=None):
        names = tuple(fields.keys())
        self.log.append(("put", names))
        return super().kv_batch_put(keys, partition_id, fields, tags)


class NullTracking:
    def log(self, metrics, step):
        pass

    def close(self, failed=False):
        pass


def make_trainer(overrides):
    cfg = load_config(None, overrides)
    path = prepare_default_model(cfg)
    tok = load_tokenizer(path)
    train, val = load_prompt_records(cfg)
    dp = RecordingDataPlane()
    plan = build_run_plan(cfg, "cpu")
    workers = build_worker_groups(cfg, plan, path, dp, tok)
    trainer = PPOTrainer(cfg, plan=plan, data_plane=dp, workers=workers, tokenizer=tok, train_records=train,
                         val_records=val, tracking=NullTracking(), run_dir=cfg.run_dir)
    trainer.global_step = 1
    return trainer, dp


def run_until_advantage(trainer):
    meta = trainer._put_prompts(trainer.train_data.next_batch(trainer.cfg.data.train_batch_size), "p", n=2)
    meta, _ = trainer._generate(meta, seed=1)
    meta, _ = trainer._compute_reward(meta)
    return meta


def test_stage_fields_grpo(tiny_run):
    trainer, dp = make_trainer(tiny_run + ["algorithm.rollout_correction.bypass_mode=false"])
    meta = run_until_advantage(trainer)
    assert dp.log[0] == ("put", ("prompts", "prompt_mask", "uid", "data_source", "ground_truth", "raw_prompt"))
    assert dp.log[1] == ("get", ("prompts", "prompt_mask"))
    assert dp.log[2] == ("put", ("responses", "response_mask", "rollout_log_probs"))
    assert dp.log[3] == ("get", ("responses", "response_mask", "data_source", "ground_truth"))
    assert dp.log[4] == ("put", ("rm_scores", "acc"))

    dp.log.clear()
    metrics: dict = {}
    meta = trainer._compute_old_log_prob(meta, metrics)
    assert dp.log == [("get", ("prompts", "prompt_mask", "responses", "response_mask")),
                      ("put", ("old_log_probs", "entropy"))]
    assert "actor/entropy" in metrics and metrics["actor/entropy"] > 0
    assert {"old_log_probs", "entropy"} <= set(meta.fields)

    dp.log.clear()
    meta = trainer._compute_advantage(meta, metrics)
    assert dp.log == [("get", ("rm_scores", "response_mask", "uid")),
                      ("put", ("token_level_rewards", "advantages", "returns"))]

    dp.log.clear()
    trainer._update_actor(meta)
    gets = [f for op, f in dp.log if op == "get"]
    assert all(set(f) == {"prompts", "prompt_mask", "responses", "response_mask", "old_log_probs", "advantages"}
               for f in gets)
    assert not [f for op, f in dp.log if op == "put"], "the update writes nothing back"


def test_stage_fields_gae_with_critic_and_kl(tiny_run):
    trainer, dp = make_trainer(tiny_run + ["algorithm.adv_estimator=gae", "actor_rollout_ref.actor.use_kl_loss=true",
                                           "algorithm.use_kl_in_reward=true",
                                           "algorithm.rollout_correction.bypass_mode=false"])
    meta = run_until_advantage(trainer)
    meta = trainer._compute_old_log_prob(meta, {})
    dp.log.clear()
    meta = trainer._compute_ref_log_prob(meta)
    assert dp.log == [("get", ("prompts", "prompt_mask", "responses", "response_mask")), ("put", ("ref_log_prob",))]
    dp.log.clear()
    meta = trainer._compute_values(meta)
    assert dp.log == [("get", ("prompts", "prompt_mask", "responses", "response_mask")), ("put", ("values",))]
    dp.log.clear()
    metrics: dict = {}
    meta = trainer._compute_advantage(meta, metrics)
    assert dp.log[0] == ("get", ("rm_scores", "response_mask", "uid", "old_log_probs", "ref_log_prob", "values"))
    assert "actor/reward_kl_penalty" in metrics
    dp.log.clear()
    out = trainer._update_critic(meta)
    assert {"critic/vf_loss", "critic/grad_norm"} <= set(out)
    assert set(dp.log[0][1]) == {"prompts", "prompt_mask", "responses", "response_mask", "values", "returns"}
    dp.log.clear()
    out = trainer._update_actor(meta)
    assert "ref_log_prob" in dp.log[0][1] and "actor/kl_loss" in out


def test_bypass_mode_copies_rollout_log_probs_without_a_forward(tiny_run):
    trainer, dp = make_trainer(tiny_run + ["algorithm.rollout_correction.bypass_mode=true"])
    meta = run_until_advantage(trainer)
    calls = []
    ranks = trainer.workers.actor.ranks
    original = ranks.call
    ranks.call = lambda endpoint, m: calls.append(endpoint.__name__) or original(endpoint, m)
    dp.log.clear()
    out = trainer._compute_old_log_prob(meta, {})
    assert calls == [], "bypass mode must not run the actor"
    assert dp.log == [("get", ("rollout_log_probs",)), ("put", ("old_log_probs",))]
    assert out.keys == meta.keys and "old_log_probs" in out.fields
    td = dp.kv_batch_get(out.keys, out.partition_id, ["old_log_probs", "rollout_log_probs"])
    assert torch.equal(td["old_log_probs"], td["rollout_log_probs"].float())


def test_bypass_resolves_automatically():
    from conveyor.config import load_config

    def old(overrides):
        return build_run_plan(load_config(None, overrides), "cpu").old_log_probs

    # The hf rollout samples from the actor's own weights: its log-probs are the old ones.
    assert old([]) == "rollout"
    assert old(["actor_rollout_ref.rollout.moe_load_balance_metrics_interval=5"]) == "rollout"
    assert old(["actor_rollout_ref.actor.router_replay.mode=R3"]) == "rollout"
    assert old(["algorithm.rollout_correction.bypass_mode=false"]) == "forward"


def test_bypass_run_reports_entropy_from_the_update(tiny_run, tmp_path):
    from conveyor.config import load_config
    from conveyor.metrics.trackers import read_metrics_jsonl
    from conveyor.trainer.ppo import run_training

    run_training(load_config(None, tiny_run + ["trainer.total_training_steps=1"]))
    (row,) = [r for r in read_metrics_jsonl(tmp_path / "metrics.jsonl") if r["step"] == 1]
    assert row["actor/entropy"] > 0
    assert "timing_s/old_log_prob" in row
