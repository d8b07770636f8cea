"""Training with actor_rollout_ref.rollout.name=vllm: the config's checks, and a short run on the real CPU engine."""

from __future__ import annotations

import json

import pytest

from conveyor.config import ConfigError, load_config
from conveyor.metrics.trackers import read_metrics_jsonl
from conveyor.tools import CallFormat, ToolCall, register_call_format
from conveyor.trainer.plan import build_run_plan
from conveyor.trainer.run import run_training

# The tiny model with heads vLLM's CPU attention accepts (head_dim 32).
VLLM_MODEL = [
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.model.tiny.num_heads=2",
    "actor_rollout_ref.model.tiny.num_kv_heads=2",
]


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["actor_rollout_ref.rollout.name=vllm"], "actor_rollout_ref.model.tiny.num_heads"),  # head_dim 16
        (VLLM_MODEL + ["actor_rollout_ref.rollout.max_model_len=32"], "actor_rollout_ref.rollout.max_model_len"),
        (["actor_rollout_ref.rollout.name=sglang"], "actor_rollout_ref.rollout.name"),
        (
            VLLM_MODEL + ["trainer.num_cpu_workers=2", "actor_rollout_ref.rollout.tensor_model_parallel_size=3"],
            "actor_rollout_ref.rollout.tensor_model_parallel_size",
        ),
        (VLLM_MODEL + ["actor_rollout_ref.rollout.gpu_memory_utilization=0"], "rollout.gpu_memory_utilization"),
    ],
)
def test_config_errors_name_the_key_to_change(overrides, key) -> None:
    # The config's own checks at load, the engine's (its module's validate_config) where the run plan is made.
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        build_run_plan(load_config(None, overrides), "cpu")


def test_vllm_never_bypasses_the_old_log_prob_forward() -> None:
    # The engine's log-probs come from other kernels: the trainer recomputes them, and the gap is measured.
    assert build_run_plan(load_config(None, []), "cpu").old_log_probs == "rollout"
    plan = build_run_plan(load_config(None, VLLM_MODEL), "cpu")
    assert plan.old_log_probs == "forward" and plan.engine_max_model_len == 64 + 6


def test_r3_runs_as_r2_where_the_engine_cannot_return_routing() -> None:
    cfg = load_config(None, VLLM_MODEL + ["actor_rollout_ref.actor.router_replay.mode=R3"])
    plan = build_run_plan(cfg, "cpu")
    assert plan.replay_mode == "R2" and "uses R2" in plan.replay_reason
    assert cfg.actor_rollout_ref.actor.router_replay.mode == "R3"  # the plan decides; the config stays as given
    assert build_run_plan(cfg, "cuda").replay_mode == "R3"
    hf = load_config(None, ["actor_rollout_ref.actor.router_replay.mode=R3"])
    assert build_run_plan(hf, "cpu").replay_mode == "R3"


# Untrained, the tiny model never answers right: this reward (one point per "1" written) gives
# GRPO advantages to learn from.
ONES_REWARD = (
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    return float(solution_str.count('1'))\n"
)


def test_a_vllm_run_syncs_every_step_and_measures_the_gap(tiny_run, tmp_path) -> None:
    # A high learning rate moves the policy visibly each step: were the engine a step behind, the
    # trainer's recomputed log-probs would differ from the engine's by far more than kernel noise.
    reward = tmp_path / "ones.py"
    reward.write_text(ONES_REWARD)
    cfg = load_config(
        None,
        tiny_run
        + VLLM_MODEL
        + [
            "trainer.total_training_steps=4",
            "actor_rollout_ref.actor.optim.lr=3e-2",
            f"reward.custom_reward_function.path={reward}",
            "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.rollout.moe_load_balance_metrics_interval=1",
        ],
    )
    run_training(cfg)
    import torch.distributed

    assert not torch.distributed.is_initialized()  # the engine was closed with the run
    rows = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r.get("step", 0) >= 1 and "actor/pg_loss" in r]
    assert len(steps) == 4
    for r in steps:
        # verl's mismatch metrics, every step, and the engine serving the weights the trainer scores with.
        for k in (
            "training_ppl",
            "rollout_ppl",
            "ppl_ratio",
            "log_ppl_diff",
            "log_ppl_abs_diff",
            "kl",
            "k3_kl",
            "chi2_token",
            "chi2_seq",
            "extreme_frac",
        ):
            assert f"rollout_corr/{k}" in r, k
        assert r["rollout_corr/log_prob_abs_diff/max"] < 1e-3 and r["rollout_corr/extreme_frac"] == 0
        assert abs(r["rollout_corr/ppl_ratio"] - 1) < 1e-4
        # New weights reach the engine before each rollout (step 1's were synced for the step-0 validation).
        assert r["step"] == 1 or r["rollout/weight_sync_s"] >= 0
        # The CPU engine returns no routing: the load-balance metrics describe the old-log-prob forward's.
        assert r["rollout/moe/routing_from_trainer_forward"] == 1.0 and r["rollout/moe/routed_experts_found"] == 1.0
    # The policy moved on every step (so a stale engine would have shown above).
    assert all(r["actor/grad_norm"] > 0.1 for r in steps)


# An untrained model ends turns at these often: a turn that ends at "3" or at the two tokens "12" calls the
# calculator. "12" is no single stop token for vLLM: the engine stops at "2" and goes on where "1" is missing.
register_call_format(
    CallFormat(
        "test_vllm_calls",
        stop_texts=("3", "12"),
        parser=lambda turn: ToolCall("calc", text=turn[-2:]) if turn.endswith(("3", "12")) else None,
    ),
    overwrite=True,
)


def test_multi_turn_with_tools_trains_on_vllm(tiny_run, tmp_path) -> None:
    tools = tmp_path / "tools.yaml"
    tools.write_text("tools:\n  - name: calc\n    path: conveyor.tools.calculator:calculate\n")
    mt = "actor_rollout_ref.rollout.multi_turn"
    cfg = load_config(
        None,
        tiny_run
        + VLLM_MODEL
        + [
            "data.synthetic.task=arithmetic_tool",
            "data.synthetic.ops=['*']",
            "data.synthetic.max_operand=99",
            "data.max_response_length=24",
            f"{mt}.enable=true",
            f"{mt}.format=test_vllm_calls",
            f"{mt}.tool_config_path={tools}",
            f"{mt}.max_user_turns=3",
            "trainer.total_training_steps=3",
        ],
    )
    run_training(cfg)
    rows = [r for r in read_metrics_jsonl(tmp_path / "metrics.jsonl") if "actor/pg_loss" in r]
    assert len(rows) == 3
    assert sum(r["rollout/multi_turn/tool_calls"] for r in rows) > 0
    for r in rows:
        assert 0 < r["rollout/multi_turn/model_token_frac"] <= 1 and "rollout/multi_turn/assistant_turns" in r
        # The engine scored the model's tokens as the trainer does: the tool tokens are out of the comparison.
        assert r["rollout_corr/log_prob_abs_diff/max"] < 1e-3


@pytest.mark.parametrize("process", ["trainer", "own"])
def test_vllm_in_async_mode_generates_a_version_ahead(tiny_run, tmp_path, process) -> None:
    # The rollout worker group's vllm engine generates while the actor trains: on the rollout's thread, or in a Ray
    # actor of its own that takes the weights over the channel beside its generation.
    cfg = load_config(
        None,
        tiny_run
        + VLLM_MODEL
        + [
            "trainer.v1.trainer_mode=separate_async",
            "trainer.v1.sampler.max_off_policy_threshold=1",
            "trainer.total_training_steps=4",
            "actor_rollout_ref.rollout.n=4",
            f"trainer.v1.separate_async.rollout_process={process}",
            "ray.num_cpus=4",
        ],
    )
    run_training(cfg)
    rows = [r for r in read_metrics_jsonl(tmp_path / "metrics.jsonl") if "actor/pg_loss" in r]
    assert len(rows) == 4
    versions = [json.loads(line) for line in (tmp_path / "async_versions.jsonl").read_text().splitlines()]
    assert [v["trained_at"] for v in versions] == [0, 1, 2, 3]
    for r, v in zip(rows, versions):
        assert r["off_policy/staleness_max"] <= 1 and v["trained_at"] - min(v["sample_versions"]) <= 1
        assert "rollout_corr/log_prob_abs_diff/max" in r  # the engine's log-probs against the trainer's
    # Weights reached the engine while it ran ahead: later batches were generated by newer versions.
    assert max(min(v["sample_versions"]) for v in versions) >= 1
    assert any("rollout/weight_sync_s" in r for r in rows)
