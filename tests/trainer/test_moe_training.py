"""MoE observability wired through a real training run: load-balance metrics, expert load file, replay (R3)."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch

from conveyor.config import load_config
from conveyor.data_plane.memory import MemoryDataPlane
from conveyor.metrics.trackers import read_metrics_jsonl
from conveyor.trainer.plan import build_run_plan
from conveyor.trainer.run import run_training
from conveyor.trainer.setup import prepare_default_model
from conveyor.workers.ranks.actor import PolicyWorker
from conveyor.workers.ranks.calls import LogProbCall, UpdateCall
from conveyor.workers.ranks.settings import actor_settings

LAYER_KEYS = ("max_vio", "min_vio", "avg_vio")


def test_interval_two_logs_every_moe_key_on_even_steps(tiny_run, tmp_path):
    cfg = load_config(
        None,
        tiny_run
        + [
            "trainer.total_training_steps=4",
            "actor_rollout_ref.rollout.moe_load_balance_metrics_interval=2",
            # A loss with a gradient whatever the rewards, so that every expert's gradient norm is measured,
            # and steps too small to move the router (the agreement is measured after the update).
            "actor_rollout_ref.actor.entropy_coeff=0.01",
            "actor_rollout_ref.actor.optim.lr=1e-7",
        ],
    )
    run_training(cfg)
    rows = {r["step"]: r for r in read_metrics_jsonl(tmp_path / "metrics.jsonl")}
    for step in (1, 3):
        assert not [k for k in rows[step] if k.startswith(("rollout/moe/", "actor/moe/"))]
    for step in (2, 4):
        row = rows[step]
        assert row["rollout/moe/routed_experts_found"] == 1.0
        assert row["rollout/moe/routed_expert_assignments"] > 0
        for name in LAYER_KEYS:
            for layer in (0, 1):
                assert f"rollout/moe/{name}/layer_{layer}" in row
            assert f"rollout/moe/{name}/max" in row and f"rollout/moe/{name}/avg" in row
        # The training forward agrees with the rollout's routing on (nearly) every token.
        assert row["actor/moe/routing_agreement"] > 0.9
        _check_router_health(row)
    loads = [json.loads(line) for line in (tmp_path / "moe_expert_load.jsonl").read_text().splitlines()]
    assert [r["step"] for r in loads] == [2, 4]
    assert len(loads[0]["counts"]) == 2 and len(loads[0]["counts"][0]) == loads[0]["num_experts"] == 8
    # Two steps of counts: every response token, each layer, top-2 slots.
    assert sum(loads[0]["counts"][0]) == rows[2]["rollout/moe/routed_expert_assignments"] / 2


def _check_router_health(row: dict) -> None:
    """The router-health keys of a logging step of the tiny 2-layer, 8-expert, top-2 run, and their ranges."""
    for layer in (0, 1):
        for side in ("rollout", "actor"):
            assert 0.0 <= row[f"{side}/moe/near_tie/layer_{layer}"] <= 1.0
        assert 0.0 <= row[f"rollout/moe/dead_experts/layer_{layer}"] <= 8
        assert 0.0 <= row[f"actor/moe/flip_rate/layer_{layer}"] <= 1.0
        assert 0.0 < row[f"actor/moe/router_entropy/layer_{layer}"] <= math.log(8) + 1e-9
        assert 0.0 <= row[f"actor/moe/gate_load_tv/layer_{layer}"] <= 1.0
        assert 0.0 <= row[f"actor/moe/expert_grad_norm_min/layer_{layer}"]
        assert (
            row[f"actor/moe/expert_grad_norm_min/layer_{layer}"] <= row[f"actor/moe/expert_grad_norm_max/layer_{layer}"]
        )
    assert row["actor/moe/expert_grad_norm_max/max"] > 0.0
    hist = [v for k, v in row.items() if k.startswith("rollout/moe/margin_hist/")]
    assert len(hist) == 6 and sum(hist) == pytest.approx(1.0)
    # Every layer is known at the same tokens, so the mean flip rate over layers is 1 - agreement.
    assert row["actor/moe/flip_rate/avg"] == pytest.approx(1.0 - row["actor/moe/routing_agreement"])
    assert row["rollout/moe/dead_experts/sum"] <= 2 * row["rollout/moe/dead_experts/max"]


def test_dense_model_with_interval_warns_once_and_logs_no_layer_keys(tiny_run, tmp_path, caplog):
    cfg = load_config(
        None,
        tiny_run
        + [
            "trainer.total_training_steps=4",
            "actor_rollout_ref.model.tiny.arch=qwen3",
            "actor_rollout_ref.rollout.moe_load_balance_metrics_interval=2",
        ],
    )
    with caplog.at_level(logging.WARNING):
        run_training(cfg)
    rows = {r["step"]: r for r in read_metrics_jsonl(tmp_path / "metrics.jsonl")}
    for step in (2, 4):
        moe = {k: v for k, v in rows[step].items() if k.startswith("rollout/moe/")}
        assert moe == {"rollout/moe/routed_experts_found": 0.0, "rollout/moe/routed_expert_assignments": 0.0}
    warnings = [r for r in caplog.records if "routed_experts" in r.getMessage() and r.levelno == logging.WARNING]
    assert len(warnings) == 1


def _replay_batch():
    """Keys, left-padded prompts, their mask, right-padded responses and theirs: four samples of uneven lengths."""
    keys = [f"k{i}" for i in range(4)]
    prompts = torch.tensor([[0, 5, 6, 7], [5, 6, 7, 8], [9, 10, 11, 12], [0, 0, 13, 14]])
    responses = torch.tensor([[5, 6, 1], [7, 1, 0], [8, 9, 10], [11, 1, 0]])
    rmask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    return keys, prompts, prompts != 0, responses, rmask


@pytest.mark.parametrize("impl", ["lean", "hf"])
def test_r3_replay_uses_recorded_experts_and_router_gets_gradient(tiny_run, impl):
    cfg = load_config(
        None,
        tiny_run + ["actor_rollout_ref.actor.router_replay.mode=R3", f"actor_rollout_ref.model.forward_impl={impl}"],
    )
    path = prepare_default_model(cfg)
    dp = MemoryDataPlane()
    worker = PolicyWorker(actor_settings(cfg, build_run_plan(cfg, "cpu")), model_path=path, data_plane=dp)
    keys, prompts, pmask, responses, rmask = _replay_batch()
    # A routing the model would not choose itself: experts (e, e+1) rotated by position.
    seq = prompts.shape[1] + responses.shape[1]
    base = (torch.arange(seq).view(1, seq, 1, 1) + torch.tensor([0, 3]).view(1, 1, 1, 2)) % 8
    routed = base.expand(4, seq, 2, 2).clone().to(torch.int8)
    dp.kv_batch_put(
        keys,
        "p",
        {
            "prompts": prompts,
            "prompt_mask": pmask,
            "responses": responses,
            "response_mask": rmask,
            "old_log_probs": torch.full((4, 3), -2.0),
            "advantages": torch.tensor([[1.0] * 3, [-1.0] * 3, [0.5] * 3, [2.0] * 3]),
            "routed_experts": routed,
        },
    )
    from conveyor.protocol import KVBatchMeta

    meta = KVBatchMeta(keys, "p")
    td = dp.kv_batch_get(keys, "p", ["prompts", "prompt_mask", "responses", "response_mask"])
    seen = worker._forward(td, 1.0, False, routed.long(), record_routing=True)[2].long()
    # Every token fed through the model (-1 marks the lean forward's pads and last response tokens).
    fed = torch.cat([pmask, rmask[:, 1:], torch.zeros(4, 1, dtype=torch.bool)], dim=1)
    assert (seen[fed] >= 0).all()
    known = seen >= 0
    assert torch.equal(seen[known], routed.long()[known]), "the training forward must route exactly as recorded"

    gate = [m for n, m in worker.model.named_modules() if n.endswith("mlp.gate")][0]
    before = gate.weight.detach().clone()
    out = worker.update_actor(
        meta.with_extra_info(**UpdateCall(temperature=1.0, calculate_entropy=False).to_extra_info())
    )
    assert out.extra_info["actor/grad_norm"] > 0
    assert not torch.equal(before, gate.weight.detach()), "the router must be trained under replay"


@pytest.mark.parametrize("impl", ["lean", "hf"])
def test_r2_records_the_old_log_prob_forwards_routing_and_the_update_replays_it(tiny_run, impl):
    cfg = load_config(
        None,
        tiny_run + ["actor_rollout_ref.actor.router_replay.mode=R2", f"actor_rollout_ref.model.forward_impl={impl}"],
    )
    plan = build_run_plan(cfg, "cpu")
    assert plan.old_log_probs == "forward" and plan.forward_records_routing  # R2 needs the forward that records
    path = prepare_default_model(cfg)
    dp = MemoryDataPlane()
    worker = PolicyWorker(actor_settings(cfg, plan), model_path=path, data_plane=dp)
    keys, prompts, pmask, responses, rmask = _replay_batch()
    dp.kv_batch_put(
        keys,
        "p",
        {
            "prompts": prompts,
            "prompt_mask": pmask,
            "responses": responses,
            "response_mask": rmask,
            "advantages": torch.tensor([[1.0] * 3, [-1.0] * 3, [0.5] * 3, [2.0] * 3]),
        },
    )
    from conveyor.protocol import KVBatchMeta

    meta = KVBatchMeta(keys, "p")
    out = worker.compute_log_prob(
        meta.with_extra_info(**LogProbCall(temperature=1.0, calculate_entropy=False).to_extra_info())
    )
    assert "routed_experts" in out.fields
    td = dp.kv_batch_get(keys, "p", ["prompts", "prompt_mask", "responses", "response_mask", "routed_experts"])
    recorded = td["routed_experts"].long()
    own = worker._forward(td, 1.0, False, None, record_routing=True)[2].long()
    fed = torch.cat([pmask, rmask], dim=1)
    assert (recorded[~fed] == -1).all(), "pads carry no routing"
    both = (recorded >= 0) & (own >= 0)
    assert both[fed].any() and torch.equal(recorded[both], own[both])

    # Move the router: its own choices change, but the update must route as recorded.
    gate = [m for n, m in worker.model.named_modules() if n.endswith("mlp.gate")][0]
    with torch.no_grad():
        gate.weight.add_(torch.randn_like(gate.weight))
    moved = worker._forward(td, 1.0, False, None, record_routing=True)[2].long()
    assert not torch.equal(moved[both], recorded[both])
    seen = worker._forward(td, 1.0, False, recorded, record_routing=True)[2].long()
    known = (seen >= 0) & (recorded >= 0)
    assert torch.equal(seen[known], recorded[known])
    fields_read = []
    original_get = dp.kv_batch_get

    def spy(keys, partition_id, select_fields):
        fields_read.append(tuple(select_fields))
        return original_get(keys, partition_id, select_fields)

    dp.kv_batch_get = spy
    worker.update_actor(meta.with_extra_info(**UpdateCall(temperature=1.0, calculate_entropy=False).to_extra_info()))
    assert any("routed_experts" in f for f in fields_read), "the update reads the recorded routing to replay it"


def test_r2_in_a_run_logs_load_balance_from_the_trainers_forward(tiny_run):
    cfg = load_config(
        None,
        tiny_run
        + [
            "actor_rollout_ref.actor.router_replay.mode=R2",
            "actor_rollout_ref.rollout.moe_load_balance_metrics_interval=1",
        ],
    )
    last = run_training(cfg)
    assert last["rollout/moe/routed_experts_found"] == 1.0
    assert "actor/moe/routing_agreement" in last
    with pytest.raises(ValueError, match="R2 records the routing"):
        load_config(
            None, ["actor_rollout_ref.actor.router_replay.mode=R2", "algorithm.rollout_correction.bypass_mode=true"]
        )


PHASE_KEYS = (
    "actor/perf/rollout/max_memory_gb",
    "actor/perf/old_log_prob/max_memory_gb",
    "ref/perf/ref/max_memory_gb",
    "critic/perf/values/max_memory_gb",
    "critic/perf/update_critic/max_memory_gb",
    "actor/perf/update_actor/max_memory_gb",
    "actor/perf/routing_agreement/max_memory_gb",
)


def test_r3_with_gradient_checkpointing_trains_and_every_phase_reports_its_memory(tiny_run, tmp_path):
    """R3 replay under activation checkpointing completes a run (the recompute replays too); with every phase on
    (old log-probs, reference, critic, routing agreement), each logs its own peak per rank."""
    cfg = load_config(
        None,
        tiny_run
        + [
            "actor_rollout_ref.actor.router_replay.mode=R3",
            "actor_rollout_ref.model.enable_gradient_checkpointing=true",
            "algorithm.adv_estimator=gae",
            "actor_rollout_ref.actor.use_kl_loss=true",
            "algorithm.rollout_correction.bypass_mode=false",
            "actor_rollout_ref.rollout.moe_load_balance_metrics_interval=1",
        ],
    )
    run_training(cfg)
    rows = {r["step"]: r for r in read_metrics_jsonl(tmp_path / "metrics.jsonl")}
    for step in (1, 2):
        missing = [k for k in PHASE_KEYS if k not in rows[step]]
        assert not missing, f"step {step} lacks {missing}"
        assert all(rows[step][k] > 0 for k in PHASE_KEYS)
        assert torch.isfinite(torch.tensor(rows[step]["actor/pg_loss"]))
