"""The synthetic code task: its records, its reward through the sandbox, and a short run that learns it."""

from __future__ import annotations

import json

import pytest

from conveyor.models.tokenizer import DEFAULT_ALPHABET
from conveyor.tasks import SYNTHETIC_TASKS, get_reward_fn
from conveyor.tasks.code import CODE_DATA_SOURCE, code_split, code_tests_score, make_code_records
from conveyor.tasks.sandbox import OUTCOMES, Sandbox, namespaces_available


def test_records_are_seeded_split_and_encodable():
    train = make_code_records(50, seed=3, max_operand=19, ops=["+", "*"])
    assert train == make_code_records(50, seed=3, max_operand=19, ops=["+", "*"])
    test = make_code_records(20, seed=3, max_operand=19, ops=["+", "*"], split="test")
    key = lambda r: (r["extra_info"]["op"], r["extra_info"]["c"], r["prompt"][0]["content"])  # noqa: E731
    assert not {key(r) for r in train} & {key(r) for r in test}
    for rec in train + test:
        text = rec["prompt"][0]["content"] + rec["extra_info"]["warmstart_target"]
        assert set(text) <= set(DEFAULT_ALPHABET), "the tiny model's characters spell every prompt and answer"
        assert rec["data_source"] == CODE_DATA_SOURCE
        x1, x2 = (int(t.split(")")[0][2:]) for t in rec["prompt"][0]["content"].split("\n")[0].split())
        info = rec["extra_info"]
        assert code_split(info["op"], info["c"], x1, x2) == info["split"]
    assert SYNTHETIC_TASKS["code"] is make_code_records
    assert get_reward_fn("synthetic/code/hard") is code_tests_score
    with pytest.raises(ValueError, match="max_operand"):
        make_code_records(10_000, seed=0, max_operand=9)


def test_the_reference_programs_pass_every_test_and_a_constant_earns_partial_credit():
    sandbox = Sandbox(isolation="namespaces" if namespaces_available() else "auto")
    for rec in make_code_records(3, seed=0, max_operand=9, ops=["+", "-", "*"]):
        truth = rec["reward_model"]["ground_truth"]
        assert code_tests_score(rec["extra_info"]["warmstart_target"], truth, sandbox=sandbox) == 1.0
        shown_value = rec["prompt"][0]["content"].split()[0].split("=")[1]
        assert code_tests_score(shown_value, truth, sandbox=sandbox) == 0.25  # right on one shown value of four
        assert len(json.loads(truth)["tests"]) == 4


def test_a_few_steps_train_through_the_sandbox_above_chance(tiny_run, tmp_path):
    """Rules x+c with c in 0..9: a program of the right shape with a guessed c passes all four tests one time in
    ten, so chance is 0.1; the run must reach twice that in its three steps."""
    from conveyor.config import load_config
    from conveyor.metrics.trackers import read_metrics_jsonl
    from conveyor.trainer.run import run_training

    overrides = tiny_run + [
        "data.synthetic.task=code",
        "data.synthetic.max_operand=9",
        "data.synthetic.num_train=100",
        "data.train_batch_size=8",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.model.tiny.warmstart_steps=200",
        "actor_rollout_ref.model.tiny.warmstart_until_accuracy=0.3",
        "trainer.total_training_steps=3",
        "reward.sandbox.max_concurrent=4",
    ]
    run_training(load_config(None, overrides))
    rows = [r for r in read_metrics_jsonl(tmp_path / "metrics.jsonl") if r["step"] >= 1]
    assert len(rows) == 3
    for row in rows:  # every response ran once, each counted under one outcome
        assert row["reward/sandbox/executions"] == 32
        assert sum(row[f"reward/sandbox/{outcome}"] for outcome in OUTCOMES) == 32
    chance = 0.1
    mean_reward = sum(r["reward/mean"] for r in rows) / len(rows)
    assert mean_reward > 2 * chance, f"reward {mean_reward:.3f} is not clearly above chance ({chance})"
