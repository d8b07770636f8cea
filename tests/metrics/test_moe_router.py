"""Router health metrics against values worked out by hand on small tensors."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from conveyor.data_plane.memory import MemoryDataPlane
from conveyor.metrics.moe_router import (
    RouterMarginAccumulator,
    dead_expert_metrics,
    expert_grad_norm_metrics,
    expert_grad_norms,
    expert_load,
    flip_counts,
    gate_load_tv,
    margin_counts,
    near_tie_metrics,
    response_margins,
    rollout_router_metrics,
    summarise_layers,
)
from conveyor.models.moe_routing import RouterStatsRecorder, moe_layers, router_margin
from conveyor.models.tiny import tiny_config

NAN = math.nan


def _tiny_moe(num_experts: int = 4) -> torch.nn.Module:
    """A tiny Qwen3-MoE with a seeded init (2 MoE layers, top-2)."""
    config = tiny_config("qwen3_moe", vocab_size=50, num_experts=num_experts, top_k=2, num_layers=2)
    config.initializer_range = 0.2
    with torch.random.fork_rng():
        torch.manual_seed(3)
        return AutoModelForCausalLM.from_config(config)


def test_router_margin_is_the_gap_between_the_kth_and_the_next_logit() -> None:
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.5], [1.0, 1.0, 1.0, -2.0]])
    # top-2: row 0 keeps 3 and 2, the next is 1 -> gap 1; row 1 keeps two of three equal logits -> a tie.
    assert router_margin(logits, 2).tolist() == [1.0, 0.0]
    assert router_margin(logits, 1).tolist() == [1.0, 0.0]
    assert router_margin(logits, 4).tolist() == [math.inf, math.inf]  # every expert chosen: nothing to flip to


def test_margin_counts_and_near_tie_metrics_by_hand() -> None:
    # 3 tokens x 2 layers; layer 1 has one unknown pair.
    margins = torch.tensor([[0.0, 0.005], [0.02, NAN], [0.5, 2.0]])
    known, near, hist = margin_counts(margins, eps=0.01)
    assert known.tolist() == [3, 2] and near.tolist() == [1, 1]
    # bins [0,1e-4) [1e-4,1e-3) [1e-3,1e-2) [1e-2,1e-1) [1e-1,1) [1,inf)
    assert hist.tolist() == [[1, 0, 0, 1, 1, 0], [0, 0, 1, 0, 0, 1]]
    out = near_tie_metrics(known, near, hist, "rollout/moe")
    assert out["rollout/moe/near_tie/layer_0"] == pytest.approx(1 / 3)
    assert out["rollout/moe/near_tie/layer_1"] == pytest.approx(1 / 2)
    assert out["rollout/moe/near_tie/max"] == pytest.approx(1 / 2)
    assert out["rollout/moe/near_tie/avg"] == pytest.approx(5 / 12)
    assert out["rollout/moe/margin_hist/0_1e-04"] == pytest.approx(1 / 5)
    assert out["rollout/moe/margin_hist/1e-03_1e-02"] == pytest.approx(1 / 5)
    assert out["rollout/moe/margin_hist/1e+00_inf"] == pytest.approx(1 / 5)
    assert sum(v for k, v in out.items() if "margin_hist" in k) == pytest.approx(1.0)
    # A margin on an edge falls in the bin above it, and eps is strict.
    _, near_edge, hist_edge = margin_counts(torch.tensor([[0.01]]), eps=0.01)
    assert near_edge.tolist() == [0] and hist_edge.tolist() == [[0, 0, 0, 1, 0, 0]]


def test_margins_accumulate_over_response_positions_only() -> None:
    # batch 2, prompt 1 + response 2, one layer; the prompt's margin (0.0) never counts.
    margins = torch.tensor([[[0.0], [0.001], [0.5]], [[0.0], [0.002], [NAN]]])
    mask = torch.tensor([[True, True], [True, False]])
    assert response_margins(margins, mask).flatten().tolist() == pytest.approx([0.001, 0.5, 0.002])
    acc = RouterMarginAccumulator(eps=0.01)
    assert acc.update(margins, mask)
    assert acc.update(margins, mask)
    out = acc.pop_metrics("rollout/moe")
    assert out["rollout/moe/near_tie/layer_0"] == pytest.approx(4 / 6)
    assert acc.pop_metrics("rollout/moe") == {}  # popped
    with pytest.raises(ValueError, match="eps"):
        RouterMarginAccumulator(eps=0.0)


def test_dead_experts_by_hand() -> None:
    counts = torch.tensor([[3, 0, 1, 0], [2, 2, 2, 2]])
    out = dead_expert_metrics(counts, "rollout/moe")
    assert out == {
        "rollout/moe/dead_experts/layer_0": 2.0,
        "rollout/moe/dead_experts/layer_1": 0.0,
        "rollout/moe/dead_experts/max": 2.0,
        "rollout/moe/dead_experts/sum": 2.0,
    }
    assert dead_expert_metrics(None, "x") == {}


def test_flip_counts_by_hand() -> None:
    # batch 1, 3 positions, 2 layers, top-2.
    rollout = torch.tensor([[[[0, 1], [2, 3]], [[0, 1], [2, 3]], [[-1, -1], [1, 0]]]])
    train = torch.tensor([[[[1, 0], [2, 4]], [[0, 2], [3, 2]], [[0, 1], [1, 0]]]])
    valid = torch.tensor([[True, True, True]])
    flipped, counted = flip_counts(train, rollout, valid)
    # layer 0: position 0 same set, position 1 differs, position 2 unknown -> 1 of 2.
    # layer 1: position 0 differs, position 1 same set, position 2 same set -> 1 of 3.
    assert flipped.tolist() == [1, 1] and counted.tolist() == [2, 3]
    flipped, counted = flip_counts(train, rollout, torch.tensor([[False, True, True]]))
    assert flipped.tolist() == [1, 0] and counted.tolist() == [1, 2]


def test_gate_mass_against_assigned_load_by_hand() -> None:
    ids = torch.tensor([[[0]], [[0]], [[1]], [[2]]])  # 4 tokens, 1 layer, top-1
    load = expert_load(ids, torch.tensor([True, True, True, False]), num_experts=3)
    assert load.tolist() == [[2.0, 1.0, 0.0]]
    # The router's mass is even: TV = 0.5 * (|1/3 - 2/3| + |1/3 - 1/3| + |1/3 - 0|) = 1/3.
    tv = gate_load_tv(torch.tensor([[1.0, 1.0, 1.0]]), load)
    assert tv.tolist() == pytest.approx([1 / 3])
    assert gate_load_tv(torch.tensor([[2.0, 1.0, 0.0]]), load).tolist() == pytest.approx([0.0])


def test_router_stats_recorder_reads_margin_entropy_and_mass_of_each_layer() -> None:
    model = _tiny_moe()
    ids = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(0))
    valid = torch.tensor([[True] * 5, [False, False, True, True, True]])
    seen = []
    handles = [
        layer.router.register_forward_hook(lambda m, a, out: seen.append(out[0].detach()))
        for layer in moe_layers(model)
    ]
    with torch.no_grad(), RouterStatsRecorder(model, valid.flatten()) as rec:
        model(input_ids=ids)
    for h in handles:
        h.remove()
    stats = rec.result()
    assert stats.ids.shape == (10, 2, 2) and stats.margin.shape == stats.entropy.shape == (10, 2)
    for layer, logits in enumerate(seen):
        p = torch.softmax(logits.float(), dim=-1)
        top = logits.float().sort(dim=-1, descending=True).values
        assert torch.allclose(stats.margin[:, layer], top[:, 1] - top[:, 2])
        assert torch.allclose(stats.entropy[:, layer], -(p * p.log()).sum(-1), atol=1e-6)
        assert torch.allclose(stats.gate_mass[layer].float(), p[valid.flatten()].sum(0), atol=1e-6)


def test_expert_grad_norms_by_hand() -> None:
    model = _tiny_moe()
    assert expert_grad_norms(model) is None  # no gradient yet
    for layer in moe_layers(model):
        for param in layer.block.experts.parameters():
            param.grad = torch.zeros_like(param)
    first = next(iter(moe_layers(model)[0].block.experts.parameters()))
    first.grad[1].view(-1)[:2] = torch.tensor([3.0, 4.0])  # expert 1 of layer 0: norm 5
    norms = expert_grad_norms(model)
    assert norms.tolist() == [[0.0, 5.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
    out = expert_grad_norm_metrics(norms, "actor/moe")
    assert out["actor/moe/expert_grad_norm_max/layer_0"] == 5.0
    assert out["actor/moe/expert_grad_norm_min/layer_0"] == 0.0
    assert out["actor/moe/expert_grad_norm_max/max"] == 5.0 and out["actor/moe/expert_grad_norm_min/min"] == 0.0


def test_summarise_layers_adds_max_and_mean_of_each_family() -> None:
    metrics = {"actor/moe/flip_rate/layer_0": 0.1, "actor/moe/flip_rate/layer_1": 0.3, "actor/moe/other": 5.0}
    out = summarise_layers(metrics, "actor/moe", ["flip_rate", "near_tie"])
    assert out == {"actor/moe/flip_rate/max": 0.3, "actor/moe/flip_rate/avg": pytest.approx(0.2)}


def test_rollout_router_metrics_read_margins_from_the_data_plane_and_tolerate_their_absence() -> None:
    plane = MemoryDataPlane()
    keys = ["a", "b"]
    margins = torch.tensor([[[0.0], [0.001], [0.5]], [[0.0], [0.002], [NAN]]], dtype=torch.float16)
    mask = torch.tensor([[True, True], [True, False]])
    plane.kv_batch_put(keys=keys, partition_id="p", fields={"router_margins": margins, "response_mask": mask})
    plane.kv_batch_put(keys=keys, partition_id="q", fields={"response_mask": mask})
    acc = RouterMarginAccumulator(eps=0.01)
    counts = torch.tensor([[1, 0]])
    assert rollout_router_metrics(acc, plane.kv_batch_get, keys, "p", mask, False, counts) == {}
    # A partition without margins (an engine that cannot return them) adds nothing and raises nothing.
    out = rollout_router_metrics(acc, plane.kv_batch_get, keys, "q", mask, True, counts)
    assert out["rollout/moe/near_tie/layer_0"] == pytest.approx(2 / 3)
    assert out["rollout/moe/dead_experts/layer_0"] == 1.0


def test_a_router_of_zeros_is_uniform_by_hand() -> None:
    # Zero router weights: every logit 0, so each token's entropy is ln E, every margin a tie (0), and each
    # expert's gate mass is (valid tokens) / E.
    model = _tiny_moe(num_experts=4)
    with torch.no_grad():
        for layer in moe_layers(model):
            layer.router.weight.zero_()
    valid = torch.tensor([True, True, False, True, True, True])
    with torch.no_grad(), RouterStatsRecorder(model, valid) as rec:
        model(input_ids=torch.arange(6).view(2, 3))
    stats = rec.result()
    torch.testing.assert_close(stats.entropy, torch.full((6, 2), math.log(4)))
    assert bool((stats.margin == 0).all())
    torch.testing.assert_close(stats.gate_mass, torch.full((2, 4), 5 / 4, dtype=torch.float64))
