"""Training runs whose rollout is an agent through the gateway: the trainer's stages over its rows, sessions cut into
several samples, rewards from each source, validation, R3 and the MoE metrics."""

from __future__ import annotations

import sys

import pytest

from conveyor.config import ConfigError, load_config
from conveyor.metrics.trackers import read_metrics_jsonl
from conveyor.trainer.run import run_training

AG = "actor_rollout_ref.rollout.agent"
TASK = [
    "data.synthetic.task=arithmetic_tool",
    "data.synthetic.ops=['*']",
    "data.synthetic.max_operand=99",
    "data.max_response_length=24",
    "actor_rollout_ref.rollout.multi_turn.format=test_digit_calls",
    "trainer.plugins=[tests/agent/digit_format.py]",
]


def _rows(path):
    return {r["step"]: r for r in read_metrics_jsonl(path / "metrics.jsonl")}


def test_training_through_the_gateway_with_r3_metrics_and_validation(tiny_run, tmp_path) -> None:
    run_training(
        load_config(
            None,
            tiny_run
            + TASK
            + [
                f"{AG}.callable=tests/agent/gateway_agents.py:digits",
                "actor_rollout_ref.actor.router_replay.mode=R3",
                "actor_rollout_ref.rollout.moe_load_balance_metrics_interval=1",
                "trainer.test_freq=2",
            ],
        )
    )
    last = _rows(tmp_path)[2]
    assert last["rollout/agent/ok"] == 8 and last["rollout/agent/reward_source_rule"] == 8
    assert last["rollout/agent/calls_per_session"] > 1  # tool turns happened
    assert last["rollout/agent/samples_per_session"] == 1  # every call extended the one before
    assert last["rollout/moe/routed_experts_found"] == 1.0 and "rollout/moe/max_vio/max" in last
    assert "val/accuracy" in last and "actor/pg_loss" in last


def test_sessions_cut_into_samples_train_with_one_advantage_per_session(tiny_run, tmp_path) -> None:
    run_training(load_config(None, tiny_run + TASK + [f"{AG}.callable=tests/agent/gateway_agents.py:forgetful"]))
    last = _rows(tmp_path)[2]
    assert last["rollout/agent/samples_per_session"] == 3  # three calls, none extending the one before
    assert last["rollout/agent/cut_sessions"] == 16  # 8 sessions x 2 extra samples
    assert last["rollout/agent/reward_source_return"] == 8 and last["reward/mean"] == pytest.approx(0.5)
    # Every session scores the same: GRPO's advantages are 0 for each session, whatever its number of samples.
    assert last["actor/pg_loss"] == pytest.approx(0.0, abs=1e-6)


def test_agent_commands_report_rewards_on_stdout(tiny_run, tmp_path) -> None:
    run_training(
        load_config(
            None,
            tiny_run
            + TASK
            + [
                "trainer.total_training_steps=1",
                f"{AG}.command={sys.executable} tests/agent/gateway_agents.py stdout_reward",
            ],
        )
    )
    last = _rows(tmp_path)[1]
    assert last["rollout/agent/reward_source_stdout"] == 8 and last["reward/mean"] == pytest.approx(0.75)


def test_agent_keys_are_checked_at_start(tiny_run) -> None:
    with pytest.raises(ConfigError, match="give one of actor_rollout_ref.rollout.agent.command and"):
        load_config(None, tiny_run + [f"{AG}.command=x", f"{AG}.callable=a.py:f"])
    with pytest.raises(ConfigError, match="multi_turn.enable"):
        load_config(
            None,
            tiny_run
            + [
                f"{AG}.command=x",
                "actor_rollout_ref.rollout.multi_turn.enable=true",
                "actor_rollout_ref.rollout.multi_turn.tool_config_path=examples/tools/calculator.yaml",
            ],
        )
    with pytest.raises(ConfigError, match="cannot split"):
        load_config(None, tiny_run + [f'{AG}.command="a \'b"'])
    with pytest.raises(ConfigError, match="module:function or file.py:function"):
        load_config(None, tiny_run + [f"{AG}.callable=nofunction"])


def test_training_through_the_gateway_on_vllm(tiny_run, tmp_path) -> None:
    # vLLM's CPU build behind the gateway: agents' calls become its requests, with their stop texts; the engine's
    # log-probs of the model's tokens agree with the trainer's as on the built-in loop.
    vllm = [
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.model.tiny.num_heads=2",
        "actor_rollout_ref.model.tiny.num_kv_heads=2",
    ]
    run_training(load_config(None, tiny_run + TASK + vllm + [f"{AG}.callable=tests/agent/gateway_agents.py:digits"]))
    rows = [r for r in read_metrics_jsonl(tmp_path / "metrics.jsonl") if "actor/pg_loss" in r]
    assert len(rows) == 2
    for r in rows:
        assert r["rollout/agent/ok"] == 8 and r["rollout/agent/calls_per_session"] > 1
        assert r["rollout_corr/log_prob_abs_diff/max"] < 1e-3


def test_an_agent_on_the_openai_agents_sdk_trains(tiny_run, tmp_path) -> None:
    run_training(load_config(None, tiny_run + TASK + [f"{AG}.callable=tests/agent/gateway_agents.py:sdk"]))
    rows = [r for r in read_metrics_jsonl(tmp_path / "metrics.jsonl") if "actor/pg_loss" in r]
    assert len(rows) == 2
    for r in rows:
        # Refused requests only where a history outgrew its sample (the SDK keeps every turn)
        assert r["rollout/agent/ok"] == 8 and r["rollout/agent/bad_requests"] == r["rollout/agent/context_exceeded"]
        assert r["rollout/agent/calls_per_session"] > 1  # the SDK ran tool turns


def test_the_run_plan_says_the_rollout_is_an_agent() -> None:
    from conveyor.trainer.plan import build_run_plan

    plan = build_run_plan(load_config("examples/agent_gateway.yaml"), "cpu")
    said = [d for d in plan.decisions if d.startswith("rollout: agents through the OpenAI-compatible gateway")]
    assert len(said) == 1 and "examples/agents/arithmetic_agent.py:run" in said[0] and "hash" in said[0]


def test_asynchronous_training_through_the_gateway_records_each_tokens_policy_version(tiny_run, tmp_path) -> None:
    import json

    # A separate replica serves the agents k = 1 version ahead; the gateway's rows carry each token's version (the
    # call's weights), which the staleness bound and its log read as they read the built-in rollout's.
    run_training(
        load_config(
            None,
            tiny_run
            + TASK
            + [
                f"{AG}.callable=tests/agent/gateway_agents.py:digits",
                "trainer.v1.trainer_mode=separate_async",
                "trainer.total_training_steps=3",
                "trainer.v1.sampler.max_off_policy_threshold=1",
            ],
        )
    )
    log = [json.loads(line) for line in (tmp_path / "async_versions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3]
    for r in log:
        assert len(r["sample_versions"]) == 8
        for v, (oldest, newest) in zip(r["sample_versions"], r["token_version_range"]):
            assert v == oldest == newest and r["trained_at"] - 1 <= v <= r["trained_at"]
    rows = _rows(tmp_path)
    assert max(v for r in log for v in r["sample_versions"]) >= 1  # weights reached the replica between rollouts
    assert rows[3]["off_policy/token_staleness_mean"] <= 1.0 and rows[3]["rollout/agent/ok"] == 8
