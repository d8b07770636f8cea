"""Each stage of a step reads only the fields it needs and writes only its outputs, observed through `step()`.

The tests run the public `PPOTrainer.step()` on the real memory data plane,
which records every get and put. A stage is `get(fields) -> compute ->
put(fields)`, so the log of the step's partition falls into one segment per
writing stage (the fields read since the previous write, and the fields
written); the updates and the metrics only read. Segments are compared as
sets: the tests pin what each stage reads and writes, not the order of the
calls, and check that every field is written before anything reads it.
"""

from __future__ import annotations

import pytest
import torch

from conveyor.config import load_config
from conveyor.data_plane.memory import MemoryDataPlane
from conveyor.models.loading import load_model_config, load_tokenizer
from conveyor.protocol import KVBatchMeta
from conveyor.trainer.plan import build_run_plan
from conveyor.trainer.ppo import PPOTrainer
from conveyor.trainer.setup import load_prompt_records, prepare_default_model
from conveyor.workers.placement.roles import build_worker_groups

PROMPT = frozenset(
    {"prompts", "prompt_mask", "uid", "data_source", "ground_truth", "raw_prompt", "prompt_messages", "extra_info"}
)
MODEL_INPUT = frozenset({"prompts", "prompt_mask", "responses", "response_mask"})
GENERATED = frozenset({"responses", "response_mask", "rollout_log_probs"})
SCORED = frozenset({"rm_scores", "acc"})
ADVANTAGES = frozenset({"token_level_rewards", "advantages", "returns"})
METRICS_READ = frozenset(
    {"rm_scores", "acc", "token_level_rewards", "advantages", "returns", "response_mask", "prompt_mask"}
)


class RecordingDataPlane(MemoryDataPlane):
    """The real memory store, noting which fields each get/put touched (per partition), and keeping what a clear
    drops."""

    def __init__(self):
        super().__init__()
        self.log: list[tuple[str, str, frozenset[str]]] = []  # (op, partition, fields)
        self.cleared: dict[str, dict] = {}  # partition -> {field: values} as it was when cleared

    def kv_batch_get(self, keys, partition_id, select_fields):
        self.log.append(("get", partition_id, frozenset(select_fields)))
        return super().kv_batch_get(keys, partition_id, select_fields)

    def kv_batch_put(self, keys, partition_id, fields, tags=None):
        self.log.append(("put", partition_id, frozenset(fields.keys())))
        return super().kv_batch_put(keys, partition_id, fields, tags)

    def kv_clear(self, partition_id, keys=None):
        stored = self.kv_list(partition_id)
        if keys is None and stored:
            written = set().union(*(f for op, p, f in self.log if op == "put" and p == partition_id))
            td = super().kv_batch_get(stored, partition_id, sorted(written))
            self.cleared[partition_id] = {name: td[name] for name in written}
        return super().kv_clear(partition_id, keys)

    def ops(self, partition_id):
        return [(op, f) for op, p, f in self.log if p == partition_id]

    def stages(self, partition_id):
        """The partition's writing stages as a set of (fields read since the previous write, fields written),
        and the field sets read after the last write (the updates' and the metrics')."""
        segments, reads = set(), set()
        for op, fields in self.ops(partition_id):
            if op == "get":
                reads.add(fields)
            else:
                segments.add((frozenset().union(*reads), fields))
                reads = set()
        return segments, reads


class NullTracking:
    def log(self, metrics, step):
        pass

    def close(self, failed=False):
        pass


def build_trainer(overrides, *, with_model_config: bool = False):
    """A synchronous trainer on a recording memory data plane: (trainer, data plane, config, plan, model path)."""
    cfg = load_config(None, overrides)
    path = prepare_default_model(cfg)
    tok = load_tokenizer(path)
    train, val = load_prompt_records(cfg)
    dp = RecordingDataPlane()
    plan = build_run_plan(cfg, "cpu")
    workers = build_worker_groups(cfg, plan, path, dp, tok)
    extra = {"model_config": load_model_config(path)} if with_model_config else {}
    trainer = PPOTrainer(
        cfg,
        plan=plan,
        data_plane=dp,
        workers=workers,
        tokenizer=tok,
        train_records=train,
        val_records=val,
        tracking=NullTracking(),
        run_dir=cfg.run_dir,
        **extra,
    )
    return trainer, dp, cfg, plan, path


def make_trainer(overrides):
    """A synchronous trainer on a recording memory data plane, at step 1 (the data plane is returned too)."""
    trainer, dp, *_ = build_trainer(overrides)
    trainer.global_step = 1
    return trainer, dp


def step_partition(partition_id):
    """The (empty) handle of a step's partition: what the sampling stage is given."""
    return KVBatchMeta(keys=[], partition_id=partition_id)


def count_actor_calls(trainer):
    """Record the name of every endpoint the actor's ranks run."""
    calls = []
    ranks = trainer.workers.actor.ranks
    original = ranks.call
    ranks.call = lambda endpoint, m: calls.append(endpoint.__name__) or original(endpoint, m)
    return calls


def assert_written_before_read(dp, partition_id):
    written: set[str] = set()
    for op, fields in dp.ops(partition_id):
        if op == "get":
            assert fields <= written, f"read before written: {sorted(fields - written)}"
        else:
            written |= fields


def run_step(trainer, dp):
    metrics = trainer.step()
    assert dp.list_partitions() == [], "the step clears its partition"
    assert_written_before_read(dp, "train-1")
    assert metrics["training/global_step"] == 1.0
    assert {
        "timing_s/step",
        "timing_s/prompts",
        "timing_s/gen",
        "timing_s/reward",
        "timing_s/adv",
        "timing_s/update_actor",
        "timing_s/metrics",
        "perf/throughput",
        "perf/total_num_tokens",
    } <= set(metrics)
    assert metrics["perf/total_num_tokens"] > 0
    # Every timed stage also has its thread's CPU seconds: never more than the thread could spend in its wall time.
    cpu = {k.removeprefix("timing_cpu_s/"): v for k, v in metrics.items() if k.startswith("timing_cpu_s/")}
    wall = {k.removeprefix("timing_s/"): v for k, v in metrics.items() if k.startswith("timing_s/")}
    assert set(cpu) == set(wall) and cpu["step"] > 0
    assert all(0.0 <= cpu[k] <= wall[k] + 1e-3 for k in cpu), {k: (cpu[k], wall[k]) for k in cpu}
    assert all(isinstance(v, float) for v in metrics.values()), {k: type(v) for k, v in metrics.items()}
    return metrics


def test_stage_fields_grpo(tiny_run):
    trainer, dp = make_trainer(tiny_run + ["algorithm.rollout_correction.bypass_mode=false"])
    calls = count_actor_calls(trainer)
    metrics = run_step(trainer, dp)
    segments, update_reads = dp.stages("train-1")
    assert segments == {
        (frozenset(), PROMPT),  # prompts
        (frozenset({"prompts", "prompt_mask"}), GENERATED),  # rollout
        (frozenset({"responses", "response_mask", "data_source", "ground_truth"}), SCORED),  # reward
        (MODEL_INPUT, frozenset({"old_log_probs", "entropy"})),  # old log-probs, by an actor forward
        (frozenset({"rm_scores", "response_mask", "uid"}), ADVANTAGES),  # advantages
    }
    # The update reads its inputs (and writes nothing back); the metrics compare sampler and trainer log-probs.
    assert update_reads == {
        MODEL_INPUT | {"old_log_probs", "advantages"},
        METRICS_READ | {"rollout_log_probs", "old_log_probs"},
    }
    assert "compute_log_prob" in calls and "update_actor" in calls
    assert metrics["actor/entropy"] > 0
    assert "actor/pg_loss" in metrics and "critic/vf_loss" not in metrics
    assert "timing_s/old_log_prob" in metrics and "timing_s/ref" not in metrics and "timing_s/values" not in metrics
    assert "actor/reward_kl_penalty" not in metrics


def test_stage_fields_gae_with_critic_and_kl(tiny_run):
    trainer, dp = make_trainer(
        tiny_run
        + [
            "algorithm.adv_estimator=gae",
            "actor_rollout_ref.actor.use_kl_loss=true",
            "algorithm.use_kl_in_reward=true",
            "algorithm.rollout_correction.bypass_mode=false",
        ]
    )
    metrics = run_step(trainer, dp)
    segments, update_reads = dp.stages("train-1")
    assert (MODEL_INPUT, frozenset({"ref_log_prob"})) in segments  # the reference
    assert (MODEL_INPUT, frozenset({"values"})) in segments  # the critic's values
    assert (
        frozenset({"rm_scores", "response_mask", "uid", "old_log_probs", "ref_log_prob", "values"}),
        ADVANTAGES,
    ) in segments  # advantages, after the in-reward KL penalty
    assert len(segments) == 7
    assert update_reads == {
        MODEL_INPUT | {"values", "returns"},  # the critic update
        MODEL_INPUT | {"old_log_probs", "advantages", "ref_log_prob"},  # the actor update, with its KL loss
        METRICS_READ | {"rollout_log_probs", "old_log_probs", "values"},
    }
    assert {
        "critic/vf_loss",
        "critic/grad_norm",
        "actor/kl_loss",
        "actor/reward_kl_penalty",
        "actor/reward_kl_penalty_coeff",
        "timing_s/ref",
        "timing_s/values",
        "timing_s/update_critic",
    } <= set(metrics)


def test_bypass_mode_copies_rollout_log_probs_without_a_forward(tiny_run):
    trainer, dp = make_trainer(tiny_run + ["algorithm.rollout_correction.bypass_mode=true"])
    calls = count_actor_calls(trainer)
    metrics = run_step(trainer, dp)
    assert "compute_log_prob" not in calls, "bypass mode must not run the actor's forward"
    segments, update_reads = dp.stages("train-1")
    assert (frozenset({"rollout_log_probs"}), frozenset({"old_log_probs"})) in segments
    assert not any("entropy" in written for _, written in segments)
    # In bypass mode sampler and trainer log-probs are the same numbers: the metrics do not compare them.
    assert METRICS_READ in update_reads
    td = dp.cleared["train-1"]
    assert torch.equal(td["old_log_probs"], td["rollout_log_probs"].float())
    assert metrics["actor/entropy"] > 0  # from the update's own forward


def test_greedy_baseline_is_written_before_the_advantage_reads_it(tiny_run):
    trainer, dp = make_trainer(tiny_run + ["algorithm.adv_estimator=remax"])
    run_step(trainer, dp)
    segments, _ = dp.stages("train-1")
    assert (frozenset(), frozenset({"reward_baselines"})) in segments  # computed in a partition of its own
    assert (frozenset({"rm_scores", "response_mask", "uid", "reward_baselines"}), ADVANTAGES) in segments
    assert ("put", PROMPT) in dp.ops("train-1-greedy")


def test_adaptive_kl_in_reward_counts_sequences_as_verl_does(tiny_run):
    """verl's apply_kl_penalty updates the controller with the batch's number of sequences (prompts x n)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    trainer, dp = make_trainer(
        tiny_run
        + [
            "algorithm.use_kl_in_reward=true",
            "algorithm.kl_ctrl.type=adaptive",
            "algorithm.kl_ctrl.kl_coef=0.05",
            "algorithm.kl_ctrl.target_kl=0.01",
            "algorithm.kl_ctrl.horizon=100",
            "actor_rollout_ref.rollout.n=4",
        ]
    )
    metrics = run_step(trainer, dp)
    current_kl = metrics["actor/reward_kl_penalty"]
    n_seqs = trainer.cfg.data.train_batch_size * trainer.cfg.actor_rollout_ref.rollout.n
    assert n_seqs == 16
    # verl's own controller, in a subprocess (importing verl here would leak its logging set-up).
    script = (
        "import json, sys\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "from verl_reference import _load_core_algos\n"
        "ca = _load_core_algos()\n"
        "out = []\n"
        "for n in sys.argv[3:]:\n"
        "    ctrl = ca.AdaptiveKLController(init_kl_coef=0.05, target_kl=0.01, horizon=100)\n"
        "    ctrl.update(float(sys.argv[2]), int(n))\n"
        "    out.append(float(ctrl.value))\n"
        "print(json.dumps(out))\n"
    )
    algos = Path(__file__).resolve().parents[1] / "algos"
    n_prompts = trainer.cfg.data.train_batch_size
    proc = subprocess.run(
        [sys.executable, "-c", script, str(algos), repr(current_kl), str(n_seqs), str(n_prompts)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected, per_prompt = json.loads(proc.stdout.strip().splitlines()[-1])
    assert expected != pytest.approx(per_prompt)  # the case tells the two counts apart
    assert trainer.kl_ctrl.value == pytest.approx(expected, rel=1e-12)
    assert metrics["actor/reward_kl_penalty_coeff"] == pytest.approx(expected, rel=1e-12)


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
    from conveyor.trainer.run import run_training

    run_training(load_config(None, tiny_run + ["trainer.total_training_steps=1"]))
    (row,) = [r for r in read_metrics_jsonl(tmp_path / "metrics.jsonl") if r["step"] == 1]
    assert row["actor/entropy"] > 0
    assert "timing_s/old_log_prob" in row


def test_prompts_render_once_per_distinct_message_list(tiny_run, monkeypatch):
    import conveyor.tasks.prompts as prompts_module
    from conveyor.tasks.dataset import render_prompt

    trainer, dp = make_trainer(tiny_run)
    rendered: list[str] = []

    def counting(rec, tokenizer=None):
        rendered.append(rec["prompt"][-1]["content"])
        return render_prompt(rec, tokenizer)

    monkeypatch.setattr(prompts_module, "render_prompt", counting)
    records = [
        {"prompt": [{"role": "user", "content": c}], "data_source": "arith", "reward_model": {"ground_truth": "1"}}
        for c in ("1+1=", "2+2=", "1+1=")
    ]
    first = trainer.stages.put_prompts(records, "a", n=2)
    again = trainer.stages.put_prompts([dict(r) for r in records], "b", n=1)
    assert rendered == ["1+1=", "2+2="]  # a message list seen before is not rendered again
    raw = dp.kv_batch_get(keys=first.keys, partition_id="a", select_fields=["raw_prompt"])["raw_prompt"]
    assert list(raw) == [render_prompt(r, trainer.tokenizer) for r in records for _ in range(2)]
    raw = dp.kv_batch_get(keys=again.keys, partition_id="b", select_fields=["raw_prompt"])["raw_prompt"]
    assert list(raw) == [render_prompt(r, trainer.tokenizer) for r in records]
    # A different message list under the same content is a different prompt.
    trainer.stages.put_prompts(
        [{**records[0], "prompt": [{"role": "system", "content": "x"}, *records[0]["prompt"]]}], "c", n=1
    )
    assert rendered == ["1+1=", "2+2=", "1+1="]


def test_the_heap_is_frozen_while_the_run_trains_and_collectable_after(tiny_run, monkeypatch):
    # Garbage collections skip what start-up built (torch's, transformers' and the model's objects) while the steps
    # run; after the run they are collectable again, so a process that trains twice does not keep the first run.
    import gc

    from conveyor.trainer.run import run_training

    frozen: list[int] = []
    step = PPOTrainer.step

    def counting(self):
        frozen.append(gc.get_freeze_count())
        return step(self)

    monkeypatch.setattr(PPOTrainer, "step", counting)
    assert gc.get_freeze_count() == 0
    run_training(load_config(None, tiny_run + ["trainer.total_training_steps=2"]))
    assert len(frozen) == 2 and min(frozen) > 10_000  # every module, class and the model's parameters
    assert gc.get_freeze_count() == 0
