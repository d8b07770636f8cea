"""Balanced partitions by tokens: against brute force, the ranks' split of a handle, and its imbalance metric."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from conveyor.protocol import KVBatchMeta
from conveyor.workers.placement.group import split_for_ranks, split_metrics
from conveyor.workers.training.balance import balanced_partition, imbalance, sequence_lengths, with_seq_lens


def _best_max(weights: list[int], k: int, equal_size: bool) -> int:
    """The smallest possible heaviest part, by trying every assignment."""
    best = None
    for assign in itertools.product(range(k), repeat=len(weights)):
        counts = [assign.count(j) for j in range(k)]
        if equal_size and max(counts) - min(counts) > 1:
            continue
        sums = [0] * k
        for w, part in zip(weights, assign):
            sums[part] += w
        best = max(sums) if best is None else min(best, max(sums))
    return best


@pytest.mark.parametrize("equal_size", [True, False])
@pytest.mark.parametrize("k", [2, 3])
def test_partition_is_close_to_the_best_by_brute_force(k: int, equal_size: bool) -> None:
    rng = random.Random(k + 10 * equal_size)
    ratios = []
    for _ in range(60):
        n = rng.randint(k, 8)
        weights = [rng.randint(1, 100) for _ in range(n)]
        parts = balanced_partition(weights, k, equal_size=equal_size)
        assert len(parts) == k
        assert sorted(i for p in parts for i in p) == list(range(n))
        if equal_size:
            assert max(map(len, parts)) - min(map(len, parts)) <= 1
        ratios.append(max(sum(weights[i] for i in p) for p in parts) / _best_max(weights, k, equal_size))
    # Measured: mean 1.000-1.003, worst 1.02-1.15 (a few items per part leave a heuristic little room).
    assert sum(ratios) / len(ratios) <= 1.01, ratios
    assert max(ratios) <= 1.2, ratios


def test_partition_edge_cases() -> None:
    assert balanced_partition([], 2, equal_size=True) == [[], []]
    assert balanced_partition([5], 3) in ([[0], [], []], [[], [0], []], [[], [], [0]])
    # One long sequence and many short ones: the long one alone, the short ones spread.
    parts = balanced_partition([100] + [10] * 9, 2, equal_size=True)
    assert sorted(len(p) for p in parts) == [5, 5]
    parts = balanced_partition([100] + [10] * 10, 2)
    assert [0] in parts
    with pytest.raises(ValueError, match="positive number"):
        balanced_partition([1, 2], 0)


def _meta(lengths: list[int]) -> KVBatchMeta:
    keys = [f"k{i}" for i in range(len(lengths))]
    return KVBatchMeta(
        keys, "p", ["prompts"], [{"seq_len": v, "other": i} for i, v in enumerate(lengths)], {"temperature": 1.0}
    )


def test_split_for_ranks_balances_tokens_with_counts_within_one() -> None:
    rng = random.Random(0)
    lengths = [rng.randint(10, 2000) for _ in range(37)]
    meta = _meta(lengths)
    chunks = split_for_ranks(meta, 4)
    assert sorted(k for c in chunks for k in c.keys) == sorted(meta.keys)
    assert max(len(c) for c in chunks) - min(len(c) for c in chunks) <= 1
    sums = [sum(t["seq_len"] for t in c.tags) for c in chunks]
    # In-order chunks for comparison: what an untagged handle gets.
    plain = [sum(lengths[i] for i in range(len(lengths)) if f"k{i}" in c.keys) for c in meta.chunk(4)]
    assert imbalance(sums) < 1.01 < imbalance(plain)
    for c in chunks:  # each rank's share keeps the handle's order, tags and extra_info
        assert c.keys == sorted(c.keys, key=meta.keys.index)
        assert all(t["seq_len"] == lengths[int(k[1:])] and t["other"] == int(k[1:]) for k, t in zip(c.keys, c.tags))
        assert c.extra_info == {"temperature": 1.0}
    metric = split_metrics(chunks, "update_actor")
    assert metric == {"perf/update_actor/rank_token_imbalance": [pytest.approx(imbalance(sums))] * 4}


def test_split_without_seq_len_is_in_order_and_reports_nothing() -> None:
    meta = KVBatchMeta([f"k{i}" for i in range(5)], "p")
    chunks = split_for_ranks(meta, 2)
    assert [c.keys for c in chunks] == [["k0", "k1", "k2"], ["k3", "k4"]]
    assert split_metrics(chunks, "compute_log_prob") == {}
    assert split_metrics(split_for_ranks(_meta([3, 4]), 1), "compute_log_prob") == {}


def test_sequence_lengths_count_prompt_and_response_span() -> None:
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1]], dtype=torch.bool)
    # Row 1: a multi-turn response whose tool tokens (mask 0) are fed too, up to the last model token.
    response_mask = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0]], dtype=torch.bool)
    assert sequence_lengths(prompt_mask, response_mask).tolist() == [4, 6]
    meta = with_seq_lens(_meta([1, 1]), torch.tensor([4, 6]))
    assert [t["seq_len"] for t in meta.tags] == [4, 6] and [t["other"] for t in meta.tags] == [0, 1]


def test_tags_travel_through_the_merge_of_rank_results() -> None:
    """BatchData.concat (the worker groups' merge) keeps every rank's tags with its keys."""
    from conveyor.protocol import BatchData

    chunks = split_for_ranks(_meta([5, 50, 7, 40]), 2)
    merged = BatchData([with_seq_lens(c, [t["seq_len"] * 2 for t in c.tags]) for c in chunks]).concat()
    assert {k: t["seq_len"] for k, t in zip(merged.keys, merged.tags)} == {"k0": 10, "k1": 100, "k2": 14, "k3": 80}


def test_the_trainer_logs_the_imbalance_per_role_and_endpoint() -> None:
    from conveyor.trainer.ppo import _phase_memory

    info = {
        "perf/compute_log_prob/rank_token_imbalance": [1.25, 1.25],
        "perf/old_log_prob/max_memory_gb": [1.0, 2.0],
        "perf/cpu_memory_used_gb": [1.0, 1.0],
    }
    assert _phase_memory(info, "ref") == {
        "ref/perf/compute_log_prob/rank_token_imbalance": 1.25,
        "ref/perf/old_log_prob/max_memory_gb": 2.0,
    }


def test_generation_tags_each_sample_with_its_prompt_and_response_tokens() -> None:
    """The rollout's handle carries seq_len = prompt + response tokens (it held the prompt's length before)."""
    from conveyor.config import load_config
    from conveyor.data_plane import make_data_plane
    from conveyor.trainer.plan import build_run_plan
    from conveyor.trainer.setup import prepare_default_model
    from conveyor.workers.ranks.actor import PolicyWorker
    from conveyor.workers.ranks.calls import GenerateCall
    from conveyor.workers.ranks.settings import actor_settings

    cfg = load_config(
        None,
        ["data.synthetic.num_train=64", "data.synthetic.num_val=8", "actor_rollout_ref.model.tiny.warmstart_steps=0"],
    )
    plane = make_data_plane("memory")
    worker = PolicyWorker(
        actor_settings(cfg, build_run_plan(cfg, "cpu")), model_path=prepare_default_model(cfg), data_plane=plane
    )
    prompt_mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1], [0, 1, 1, 1]], dtype=torch.bool)
    prompts = torch.randint(4, 40, (3, 4), generator=torch.Generator().manual_seed(0)) * prompt_mask
    keys = ["a", "b", "c"]
    meta = plane.kv_batch_put(
        keys,
        "p",
        {"prompts": prompts, "prompt_mask": prompt_mask},
        tags=[{"seq_len": 2, "uid": "x"}, {"seq_len": 4, "uid": "y"}, {"seq_len": 3, "uid": "z"}],
    )
    call = GenerateCall(
        max_new_tokens=5,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        do_sample=True,
        seed=0,
        capture_routing=False,
        pad_to_max_new_tokens=False,
    )
    out = worker.generate_sequences(meta.with_extra_info(**call.to_extra_info()))
    response_mask = plane.kv_batch_get(keys, "p", ["response_mask"])["response_mask"]
    want = (prompt_mask.sum(-1) + sequence_lengths(torch.zeros(3, 0), response_mask)).tolist()
    assert [t["seq_len"] for t in out.tags] == want and [t["uid"] for t in out.tags] == ["x", "y", "z"]
    assert all(w > p for w, p in zip(want, [2, 4, 3]))
