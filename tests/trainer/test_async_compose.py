"""Asynchronous training composes with the rest: dynamic sampling, ReMax's greedy baseline and multi-turn rollouts.

Each runs the asynchronous source (k = 1) over the rollout worker group and checks what the feature
itself promises, plus the staleness bound. The vllm engine in async mode is tests/rollout/test_vllm_training.py's.
"""

from __future__ import annotations

import json

import torch

from conveyor.config import load_config
from conveyor.metrics.trackers import read_metrics_jsonl
from conveyor.tools import CallFormat, ToolCall, register_call_format
from conveyor.trainer.run import run_training

ASYNC = ["trainer.v1.trainer_mode=separate_async", "trainer.v1.sampler.max_off_policy_threshold=1"]

# Odd ground truths score 0 or 1 by the sample's first character, even ones always 1: half the groups are constant.
HALF_CONSTANT = (
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    if int(ground_truth) % 2 == 0:\n"
    "        return 1.0\n"
    "    return float(solution_str[:1] in '13579')\n"
)

# An untrained model calls the calculator whenever a turn ends at a digit (frequent): tool turns without a warm start.
register_call_format(
    CallFormat(
        "test_async_digit_calls",
        stop_texts=tuple("0123456789"),
        parser=lambda turn: ToolCall("calc", text=turn) if turn[-1:].isdigit() else None,
    ),
    overwrite=True,
)


def _versions(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "async_versions.jsonl").read_text().splitlines()]


def test_dynamic_sampling_in_async_mode_trains_full_batches_of_varied_groups(tiny_run, tmp_path):
    reward = tmp_path / "half.py"
    reward.write_text(HALF_CONSTANT)
    run_training(
        load_config(
            None,
            tiny_run
            + ASYNC
            + [
                f"reward.custom_reward_function.path={reward}",
                "algorithm.filter_groups.enable=true",
                "actor_rollout_ref.rollout.n=4",
                "trainer.total_training_steps=3",
                "trainer.dump_freq=1",
                "trainer.dump_num=16",
            ],
        )
    )
    rows = [r for r in read_metrics_jsonl(tmp_path / "metrics.jsonl") if "actor/pg_loss" in r]
    assert len(rows) == 3
    for r in rows:
        assert r["train/num_gen_batches"] >= 1 and 0 < r["train/filter_groups/kept_frac"] <= 1
    assert sum(r["train/num_gen_batches"] for r in rows) > 3  # constant groups were dropped and replaced
    for step in (1, 2, 3):
        dumped = [
            json.loads(line) for line in (tmp_path / "generations" / f"step_{step:06d}.jsonl").read_text().splitlines()
        ]
        assert len(dumped) == 16  # a full batch: 4 varied groups of 4
        assert all(int(d["ground_truth"]) % 2 == 1 for d in dumped)  # every constant (even) group was dropped
    log = _versions(tmp_path)
    # Several generation batches a step, each within the bound, and each trained no later than scheduled.
    assert len(log) > 3 and all(r["trained_at"] - min(r["sample_versions"]) <= 1 for r in log)


def test_remax_in_async_mode_takes_its_greedy_baseline_from_the_generating_weights(tiny_run, tmp_path, monkeypatch):
    import threading

    from conveyor.trainer import async_source, sources

    seen: list[str] = []
    baseline = sources.GreedyBaseline.__call__

    def record(self, *args, **kwargs):
        seen.append(threading.current_thread().name)
        return baseline(self, *args, **kwargs)

    monkeypatch.setattr(sources.GreedyBaseline, "__call__", record)
    run_training(
        load_config(None, tiny_run + ASYNC + ["algorithm.adv_estimator=remax", "trainer.total_training_steps=3"])
    )
    rows = [r for r in read_metrics_jsonl(tmp_path / "metrics.jsonl") if "actor/pg_loss" in r]
    assert len(rows) == 3
    for r in rows:
        assert "timing_s/async/rollout_gen_baseline" in r and r["off_policy/staleness_max"] <= 1
        assert torch.isfinite(torch.tensor(r["actor/pg_loss"]))
    # Every batch's baseline was decoded on the rollout's thread, right after its samples, with their weights.
    assert len(seen) == 3 and all(name.startswith(async_source.ROLLOUT_THREAD) for name in seen)


def test_multi_turn_with_tools_in_async_mode(tiny_run, tmp_path):
    tools = tmp_path / "tools.yaml"
    tools.write_text("tools:\n  - name: calc\n    path: conveyor.tools.calculator:calculate\n")
    mt = "actor_rollout_ref.rollout.multi_turn"
    run_training(
        load_config(
            None,
            tiny_run
            + ASYNC
            + [
                "data.synthetic.task=arithmetic_tool",
                "data.synthetic.ops=['*']",
                "data.synthetic.max_operand=99",
                "data.max_response_length=24",
                f"{mt}.enable=true",
                f"{mt}.format=test_async_digit_calls",
                f"{mt}.tool_config_path={tools}",
                f"{mt}.max_user_turns=3",
                "trainer.total_training_steps=3",
                "actor_rollout_ref.actor.router_replay.mode=R3",
                "actor_rollout_ref.rollout.moe_load_balance_metrics_interval=1",
            ],
        )
    )
    rows = [r for r in read_metrics_jsonl(tmp_path / "metrics.jsonl") if "actor/pg_loss" in r]
    assert len(rows) == 3
    assert sum(r["rollout/multi_turn/tool_calls"] for r in rows) > 0
    for r in rows:
        assert 0 < r["rollout/multi_turn/model_token_frac"] <= 1 and r["off_policy/staleness_max"] <= 1
        # R3 replays, in the update, the routing the rollout recorded around the tool turns.
        assert r["rollout/moe/routed_experts_found"] == 1.0 and r["actor/moe/routing_agreement"] > 0.5
    assert [r["trained_at"] for r in _versions(tmp_path)] == [0, 1, 2]
