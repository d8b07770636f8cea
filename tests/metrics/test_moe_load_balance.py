"""Tests for MoE rollout load-balance metrics: counting, metrics, accumulation, config, data-plane fallback."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf
from tensordict import TensorDict

from conveyor.data_plane.base import FieldNotFoundError
from conveyor.metrics.moe_load_balance import (
    RolloutMoELoadBalanceMetricsAccumulator,
    compute_moe_lb_metrics,
    compute_rollout_moe_load_balance_metrics,
    count_expert_assignments,
    get_metric_data_with_optional_routed_experts,
    infer_moe_num_experts,
    load_balance_metrics_from_counts,
)

LOGGER = "conveyor.metrics.moe_load_balance"
P = "rollout/moe"


def worked_example(dtype: torch.dtype = torch.int16) -> tuple[torch.Tensor, torch.Tensor]:
    """SPEC §4 example: E=4, B=1, S=6, L=2, K=2, response = positions 2..5, all valid."""
    # Prompt positions hold an out-of-range id on purpose: they must never be read.
    routed = torch.full((1, 6, 2, 2), 9, dtype=dtype)
    routed[0, 2:, 0] = torch.tensor([[0, 1], [2, 3], [0, 1], [2, 3]], dtype=dtype)
    routed[0, 2:, 1] = 2
    return routed, torch.ones(1, 4, dtype=torch.bool)


WORKED_EXAMPLE_METRICS = {
    f"{P}/max_vio/layer_0": 0.0,
    f"{P}/min_vio/layer_0": 0.0,
    f"{P}/avg_vio/layer_0": 0.0,
    f"{P}/max_vio/layer_1": 3.0,
    f"{P}/min_vio/layer_1": -1.0,
    f"{P}/avg_vio/layer_1": 1.5,
    f"{P}/max_vio/max": 3.0,
    f"{P}/max_vio/avg": 1.5,
    f"{P}/min_vio/max": 0.0,
    f"{P}/min_vio/avg": -0.5,
    f"{P}/avg_vio/max": 1.5,
    f"{P}/avg_vio/avg": 0.75,
}


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


# --------------------------------------------------------------------------- the metric


def test_worked_example_exact() -> None:
    routed, mask = worked_example()
    assert count_expert_assignments(routed, mask, 4).tolist() == [[2, 2, 2, 2], [0, 0, 8, 0]]
    assert compute_rollout_moe_load_balance_metrics(routed, mask, 4) == WORKED_EXAMPLE_METRICS


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int32, torch.int64])
def test_worked_example_other_integer_dtypes(dtype: torch.dtype) -> None:
    routed, mask = worked_example(dtype)
    assert compute_rollout_moe_load_balance_metrics(routed, mask, 4) == WORKED_EXAMPLE_METRICS


def test_prefix_and_counts_are_cpu_int64() -> None:
    routed, mask = worked_example()
    metrics = compute_rollout_moe_load_balance_metrics(routed, mask, 4, prefix="val/moe")
    assert metrics["val/moe/avg_vio/avg"] == 0.75 and all(k.startswith("val/moe/") for k in metrics)
    counts = count_expert_assignments(routed, mask, 4)
    assert counts.dtype == torch.int64 and counts.device.type == "cpu" and counts.is_contiguous()


def test_minus_one_slots_are_not_counted() -> None:
    routed, mask = worked_example()
    routed[0, 3, 0, 0] = -1  # layer 0, position 3: {2,3} -> {-1,3}
    counts = count_expert_assignments(routed, mask, 4)
    assert counts.tolist() == [[2, 2, 1, 2], [0, 0, 8, 0]]
    metrics = compute_rollout_moe_load_balance_metrics(routed, mask, 4)
    # Layer 0: T=7, mean 7/4: vio = 1/7 for three experts, -3/7 for expert 2.
    assert metrics[f"{P}/max_vio/layer_0"] == pytest.approx(1 / 7)
    assert metrics[f"{P}/min_vio/layer_0"] == pytest.approx(-3 / 7)
    assert metrics[f"{P}/avg_vio/layer_0"] == pytest.approx(3 / 14)
    assert metrics[f"{P}/avg_vio/avg"] == pytest.approx((3 / 14 + 1.5) / 2)


def test_ids_below_minus_one_do_not_leak_into_other_layers() -> None:
    routed, mask = worked_example()
    routed[0, 2, 1, 0] = -2  # in a flat layer*(E+1) layout this would hit layer 0's last expert
    routed[0, 4, 1, 1] = -1
    assert count_expert_assignments(routed, mask, 4).tolist() == [[2, 2, 2, 2], [0, 0, 6, 0]]


def test_masked_positions_and_prompt_are_ignored_even_out_of_range() -> None:
    routed, _ = worked_example()
    mask = torch.tensor([[True, True, False, False]])
    routed[0, 4:] = 99  # masked-out response positions with ids >= num_experts
    assert count_expert_assignments(routed, mask, 4).tolist() == [[1, 1, 1, 1], [0, 0, 4, 0]]


def test_a_layer_with_no_known_slot_gets_no_keys() -> None:
    routed, mask = worked_example()
    routed[0, 2:, 1] = -1  # layer 1 routing unknown everywhere
    metrics = compute_rollout_moe_load_balance_metrics(routed, mask, 4)
    assert not any("layer_1" in k for k in metrics)
    assert metrics[f"{P}/max_vio/avg"] == 0.0 and metrics[f"{P}/avg_vio/max"] == 0.0


def test_non_contiguous_routed_experts() -> None:
    routed, _ = worked_example()
    # Batch and seq_len not mergeable into one view: exercises the boolean-index path.
    expanded = torch.cat([routed, routed]).transpose(0, 1).contiguous().transpose(0, 1)
    assert not expanded.is_contiguous()
    counts = count_expert_assignments(expanded, torch.ones(2, 4, dtype=torch.bool), 4)
    assert counts.tolist() == [[4, 4, 4, 4], [0, 0, 16, 0]]


def test_float_mask_is_accepted() -> None:
    routed, _ = worked_example()
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0]])
    assert count_expert_assignments(routed, mask, 4).tolist() == [[1, 1, 2, 2], [0, 0, 6, 0]]


@pytest.mark.parametrize(
    "case",
    [
        "routed_none",
        "mask_none",
        "num_experts_none",
        "num_experts_zero",
        "num_experts_negative",
        "nothing_selected",
        "all_unknown",
        "empty_response",
    ],
)
def test_silent_empty_cases(case: str, caplog: pytest.LogCaptureFixture) -> None:
    routed, mask = worked_example()
    num_experts: Any = 4
    if case == "routed_none":
        routed = None
    elif case == "mask_none":
        mask = None
    elif case == "num_experts_none":
        num_experts = None
    elif case == "num_experts_zero":
        num_experts = 0
    elif case == "num_experts_negative":
        num_experts = -3
    elif case == "nothing_selected":
        mask = torch.zeros(1, 4, dtype=torch.bool)
    elif case == "all_unknown":
        routed[0, 2:] = -1
    elif case == "empty_response":
        mask = torch.ones(1, 0, dtype=torch.bool)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert compute_rollout_moe_load_balance_metrics(routed, mask, num_experts) == {}
        assert count_expert_assignments(routed, mask, num_experts) is None
    assert warnings_of(caplog) == []


@pytest.mark.parametrize(
    "case, expected_in_message",
    [
        ("three_d", "routed_experts must be a dense"),
        ("five_d", "routed_experts must be a dense"),
        ("mask_three_d", "response_mask of shape"),
        ("mask_one_d", "response_mask of shape"),
        ("mask_batch_differs", "response_mask of shape"),
        ("seq_shorter_than_response", "shorter than the response length"),
        ("id_out_of_range", "expert id 4 but num_experts is 4"),
        ("float_ids", "integer ids"),
    ],
)
def test_invalid_inputs_warn_and_return_empty(
    case: str, expected_in_message: str, caplog: pytest.LogCaptureFixture
) -> None:
    routed, mask = worked_example()
    if case == "three_d":
        routed = routed[:, :, 0]
    elif case == "five_d":
        routed = routed.unsqueeze(-1)
    elif case == "mask_three_d":
        mask = mask.unsqueeze(-1)
    elif case == "mask_one_d":
        mask = mask[0]
    elif case == "mask_batch_differs":
        mask = torch.ones(2, 4, dtype=torch.bool)
    elif case == "seq_shorter_than_response":
        mask = torch.ones(1, 7, dtype=torch.bool)
    elif case == "id_out_of_range":
        routed[0, 5, 1, 1] = 4
    elif case == "float_ids":
        routed = routed.float()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert compute_rollout_moe_load_balance_metrics(routed, mask, 4) == {}
    messages = warnings_of(caplog)
    assert len(messages) == 1 and expected_in_message in messages[0], messages


def test_metrics_from_counts_edge_cases() -> None:
    assert load_balance_metrics_from_counts(None) == {}
    assert load_balance_metrics_from_counts(torch.zeros(3, 4, dtype=torch.int64)) == {}
    metrics = load_balance_metrics_from_counts(torch.tensor([[5, 0, 0, 0]]))
    assert metrics[f"{P}/max_vio/layer_0"] == 3.0 and metrics[f"{P}/min_vio/layer_0"] == -1.0


# --------------------------------------------------------------------------- property test against a naive loop


def naive_counts(routed: torch.Tensor, mask: torch.Tensor, num_experts: int) -> list[list[int]] | None:
    """Per-position Python loop; None where the real function returns None on valid-shaped inputs."""
    batch, seq_len, layers, top_k = routed.shape
    response_len = mask.shape[1]
    counts = [[0] * num_experts for _ in range(layers)]
    seen_any = False
    for b in range(batch):
        for r in range(response_len):
            if not bool(mask[b, r]):
                continue
            for layer in range(layers):
                for k in range(top_k):
                    expert = int(routed[b, seq_len - response_len + r, layer, k])
                    if expert >= num_experts:
                        return None
                    if expert >= 0:
                        counts[layer][expert] += 1
                        seen_any = True
    return counts if seen_any else None


def naive_metrics(counts: list[list[int]], prefix: str = P) -> dict[str, float]:
    out: dict[str, float] = {}
    per_kind: dict[str, list[float]] = {"max_vio": [], "min_vio": [], "avg_vio": []}
    for layer, row in enumerate(counts):
        total = sum(row)
        if total == 0:
            continue
        mean = total / len(row)
        vio = [(c - mean) / mean for c in row]
        avg = sum(abs(v) for v in vio) / len(vio)
        for kind, value in (("max_vio", max(vio)), ("min_vio", min(vio)), ("avg_vio", avg)):
            out[f"{prefix}/{kind}/layer_{layer}"] = value
            per_kind[kind].append(value)
    for kind, values in per_kind.items():
        out[f"{prefix}/{kind}/max"] = max(values)
        out[f"{prefix}/{kind}/avg"] = sum(values) / len(values)
    return out


@st.composite
def routing_inputs(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, int]:
    batch = draw(st.integers(1, 3))
    seq_len = draw(st.integers(1, 6))
    response_len = draw(st.integers(0, seq_len))
    layers = draw(st.integers(1, 3))
    top_k = draw(st.integers(1, 3))
    num_experts = draw(st.integers(1, 5))
    dtype = draw(st.sampled_from([torch.int16, torch.int8, torch.int32, torch.int64]))
    # Mostly valid ids, some -1, rarely -2 or an out-of-range id.
    id_strategy = st.one_of(
        st.integers(0, num_experts - 1),
        st.just(-1),
        st.just(-1),
        st.integers(-3, num_experts).filter(lambda v: v != -1),
    )
    n = batch * seq_len * layers * top_k
    ids = draw(st.lists(id_strategy, min_size=n, max_size=n))
    routed = torch.tensor(ids, dtype=dtype).view(batch, seq_len, layers, top_k)
    if draw(st.booleans()):  # same values, batch dim not mergeable with seq_len: the other gather path
        routed = routed.transpose(0, 1).contiguous().transpose(0, 1)
    bits = draw(st.lists(st.booleans(), min_size=batch * response_len, max_size=batch * response_len))
    mask = torch.tensor(bits, dtype=torch.bool).view(batch, response_len)
    return routed, mask, num_experts


@settings(max_examples=150, deadline=None)
@given(routing_inputs())
def test_matches_naive_loop(inputs: tuple[torch.Tensor, torch.Tensor, int]) -> None:
    routed, mask, num_experts = inputs
    expected = naive_counts(routed, mask, num_experts)
    counts = count_expert_assignments(routed, mask, num_experts)
    if expected is None:
        assert counts is None
        assert compute_rollout_moe_load_balance_metrics(routed, mask, num_experts) == {}
        return
    assert counts.tolist() == expected
    metrics = compute_rollout_moe_load_balance_metrics(routed, mask, num_experts)
    reference = naive_metrics(expected)
    assert metrics.keys() == reference.keys()
    for key, value in reference.items():
        assert metrics[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key


# --------------------------------------------------------------------------- accumulator


def batch_with(layer0: list[list[int]], layer1: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, no prompt, response positions routed as given (two layers, top-2)."""
    routed = torch.tensor([[a, b] for a, b in zip(layer0, layer1)], dtype=torch.int16).unsqueeze(0)
    return routed, torch.ones(1, routed.shape[1], dtype=torch.bool)


def test_accumulator_sums_updates_and_pops() -> None:
    acc = RolloutMoELoadBalanceMetricsAccumulator()
    assert acc.counts is None and acc.total_assignments() == 0 and acc.compute() == {}
    assert acc.update(*batch_with([[0, 1], [2, 3]], [[2, 2], [2, 2]]), num_experts=4)
    first = acc.counts
    assert first.tolist() == [[1, 1, 1, 1], [0, 0, 4, 0]]
    assert acc.update(*batch_with([[0, 1]], [[0, 1]]), num_experts=4)
    assert acc.update(*worked_example(), num_experts=4)
    assert first.tolist() == [[1, 1, 1, 1], [0, 0, 4, 0]]  # a held snapshot is not changed by later updates
    expected = torch.tensor([[4, 4, 3, 3], [1, 1, 12, 0]])
    assert acc.counts.tolist() == expected.tolist()
    assert acc.counts.dtype == torch.int64 and acc.counts.device.type == "cpu"
    assert acc.total_assignments() == 28
    assert acc.compute() == load_balance_metrics_from_counts(expected)
    # compute() does not consume
    assert acc.compute() == load_balance_metrics_from_counts(expected)
    popped = acc.pop_metrics()
    assert popped == load_balance_metrics_from_counts(expected)
    assert popped[f"{P}/max_vio/layer_1"] == pytest.approx((12 - 3.5) / 3.5)
    assert acc.counts is None and acc.total_assignments() == 0 and acc.pop_metrics() == {}


def test_accumulator_reset_and_rejected_updates() -> None:
    acc = RolloutMoELoadBalanceMetricsAccumulator()
    routed, mask = worked_example()
    assert acc.update(routed, mask, num_experts=4)
    acc.reset()
    assert acc.counts is None and acc.compute() == {}
    assert not acc.update(None, mask, num_experts=4)
    assert not acc.update(routed, None, num_experts=4)
    assert not acc.update(routed, torch.zeros_like(mask), num_experts=4)
    bad = routed.clone()
    bad[0, 5, 0, 0] = 7
    assert not acc.update(bad, mask, num_experts=4)
    assert acc.counts is None


def test_accumulator_shape_change_warns_and_restarts(caplog: pytest.LogCaptureFixture) -> None:
    acc = RolloutMoELoadBalanceMetricsAccumulator()
    routed, mask = worked_example()
    acc.update(routed, mask, num_experts=4)
    three_layers = torch.cat([routed, routed[:, :, :1]], dim=2)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert acc.update(three_layers, mask, num_experts=4)
    messages = warnings_of(caplog)
    assert len(messages) == 1 and "changed shape from (2, 4) to (3, 4)" in messages[0]
    assert acc.counts.tolist() == [[2, 2, 2, 2], [0, 0, 8, 0], [2, 2, 2, 2]]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert acc.update(routed, mask, num_experts=5)  # more experts: shape changes again
    assert acc.counts.tolist() == [[2, 2, 2, 2, 0], [0, 0, 8, 0, 0]]


def test_accumulator_infers_num_experts_once() -> None:
    model_config = {"path": "/models/tiny", "hf_config": {"model_type": "qwen3_moe", "num_experts": 4}}
    acc = RolloutMoELoadBalanceMetricsAccumulator(model_config=model_config)
    routed, mask = worked_example()
    assert acc.update(routed, mask)
    assert acc.counts.shape == (2, 4) and acc.num_experts == 4
    model_config["hf_config"]["num_experts"] = 8  # not read again
    assert acc.update(routed, mask)
    assert acc.counts.tolist() == [[4, 4, 4, 4], [0, 0, 16, 0]]
    assert acc.update(routed, mask, num_experts=6)  # an explicit count wins
    assert acc.counts.shape == (2, 6)


def test_accumulator_without_num_experts_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    acc = RolloutMoELoadBalanceMetricsAccumulator(model_config={"hf_config": {"model_type": "llama"}})
    routed, mask = worked_example()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert not acc.update(routed, mask)
        assert not acc.update(routed, mask)
    messages = warnings_of(caplog)
    assert len(messages) == 1 and "number of experts" in messages[0]


def test_accumulator_with_invalid_expert_count_warns(caplog: pytest.LogCaptureFixture) -> None:
    acc = RolloutMoELoadBalanceMetricsAccumulator(model_config={"num_experts": [4, 4]})
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert not acc.update(*worked_example())
    assert any("'num_experts'" in m for m in warnings_of(caplog))


def test_warn_skip_once_is_per_key_and_per_instance(caplog: pytest.LogCaptureFixture) -> None:
    a = RolloutMoELoadBalanceMetricsAccumulator()
    b = RolloutMoELoadBalanceMetricsAccumulator()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        a.warn_skip_once("k1", "first")
        a.warn_skip_once("k1", "first again")
        a.warn_skip_once("k2", "second")
        b.warn_skip_once("k1", "other instance")
    assert warnings_of(caplog) == ["first", "second", "other instance"]


# --------------------------------------------------------------------------- compute_moe_lb_metrics


def test_compute_moe_lb_metrics_off_does_nothing() -> None:
    acc = RolloutMoELoadBalanceMetricsAccumulator()
    routed, mask = worked_example()
    for interval in (0, -1):
        assert compute_moe_lb_metrics({"routed_experts": routed, "response_mask": mask}, interval, 1, acc) == {}
    assert acc.counts is None


def test_compute_moe_lb_metrics_interval() -> None:
    acc = RolloutMoELoadBalanceMetricsAccumulator(model_config={"num_experts": 4})
    routed, mask = worked_example()
    td = TensorDict({"routed_experts": routed, "response_mask": mask}, batch_size=[1])
    assert compute_moe_lb_metrics(td, 2, 1, acc) == {}
    assert acc.total_assignments() == 16  # counted even though nothing is logged at this step
    metrics = compute_moe_lb_metrics({"routed_experts": routed, "response_mask": mask}, 2, 2, acc)
    assert metrics == {
        **WORKED_EXAMPLE_METRICS,
        f"{P}/routed_experts_found": 1.0,
        f"{P}/routed_expert_assignments": 32.0,
    }
    assert acc.counts is None
    assert compute_moe_lb_metrics(td, 2, 3, acc) == {}
    assert compute_moe_lb_metrics(td, 2, 4, acc)[f"{P}/routed_expert_assignments"] == 32.0  # steps 3 and 4


def test_compute_moe_lb_metrics_without_routed_experts(caplog: pytest.LogCaptureFixture) -> None:
    acc = RolloutMoELoadBalanceMetricsAccumulator(model_config={"num_experts": 4})
    _, mask = worked_example()
    batch = TensorDict({"response_mask": mask}, batch_size=[1])
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert compute_moe_lb_metrics(batch, 1, 1, acc) == {
            f"{P}/routed_experts_found": 0.0,
            f"{P}/routed_expert_assignments": 0.0,
        }
        compute_moe_lb_metrics(batch, 1, 2, acc)
    messages = warnings_of(caplog)
    assert len(messages) == 1 and "no routed expert assignments" in messages[0]


def test_compute_moe_lb_metrics_rejects_non_mapping() -> None:
    with pytest.raises(ValueError, match="metrics_batch"):
        compute_moe_lb_metrics([1, 2], 1, 1, RolloutMoELoadBalanceMetricsAccumulator())


# --------------------------------------------------------------------------- optional routed_experts fetch


class RecordingStore:
    """A kv_batch_get that records its calls and serves a fixed set of columns, raising like the data plane."""

    def __init__(self, columns: dict[str, Any], error: Exception | None = None) -> None:
        self.columns = columns
        self.error = error
        self.calls: list[dict[str, Any]] = []

    def kv_batch_get(self, keys: list[str], partition_id: str, select_fields: list[str]) -> dict[str, Any]:
        self.calls.append({"keys": list(keys), "partition_id": partition_id, "select_fields": list(select_fields)})
        if self.error is not None:
            raise self.error
        missing = [f for f in select_fields if f not in self.columns]
        if missing:
            raise FieldNotFoundError(partition_id, fields=missing)
        return {f: self.columns[f] for f in select_fields}


KEYS = ["k0", "k1"]
FIELDS = ["responses", "response_mask"]


def fetch(store: RecordingStore, step: int, acc: RolloutMoELoadBalanceMetricsAccumulator, interval: int = 2) -> Any:
    return get_metric_data_with_optional_routed_experts(
        keys=KEYS,
        partition_id="step-1",
        fields=FIELDS,
        moe_lb_metrics_interval=interval,
        global_steps=step,
        accumulator=acc,
        kv_batch_get=store.kv_batch_get,
    )


def selects(store: RecordingStore) -> list[list[str]]:
    return [c["select_fields"] for c in store.calls]


def test_fetch_includes_routed_experts_when_present() -> None:
    store = RecordingStore({"responses": 1, "response_mask": 2, "routed_experts": 3})
    acc = RolloutMoELoadBalanceMetricsAccumulator()
    assert fetch(store, 1, acc) == {"responses": 1, "response_mask": 2, "routed_experts": 3}
    assert store.calls == [{"keys": KEYS, "partition_id": "step-1", "select_fields": FIELDS + ["routed_experts"]}]


def test_fetch_with_metrics_off_asks_for_fields_only() -> None:
    store = RecordingStore({"responses": 1, "response_mask": 2, "routed_experts": 3})
    out = fetch(store, 1, RolloutMoELoadBalanceMetricsAccumulator(), interval=0)
    assert out == {"responses": 1, "response_mask": 2}
    assert selects(store) == [FIELDS]


def test_fetch_falls_back_warns_once_and_defers(caplog: pytest.LogCaptureFixture) -> None:
    store = RecordingStore({"responses": 1, "response_mask": 2})
    acc = RolloutMoELoadBalanceMetricsAccumulator()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert fetch(store, 1, acc, interval=3) == {"responses": 1, "response_mask": 2}
        assert selects(store) == [FIELDS + ["routed_experts"], FIELDS]
        # Deferred until step 1 + 3: steps 2 and 3 ask for the fields alone.
        fetch(store, 2, acc, interval=3)
        fetch(store, 3, acc, interval=3)
        assert selects(store)[2:] == [FIELDS, FIELDS]
        # Step 4 tries again, fails again (no second warning), defers to 7.
        fetch(store, 4, acc, interval=3)
        assert selects(store)[4:] == [FIELDS + ["routed_experts"], FIELDS]
        fetch(store, 6, acc, interval=3)
        assert selects(store)[6:] == [FIELDS]
        store.columns["routed_experts"] = 3  # the rollout starts recording it
        assert fetch(store, 7, acc, interval=3) == {"responses": 1, "response_mask": 2, "routed_experts": 3}
    assert selects(store)[7:] == [FIELDS + ["routed_experts"]]
    messages = warnings_of(caplog)
    assert len(messages) == 1 and "routed_experts" in messages[0] and "step 4" in messages[0]
    assert all(c["keys"] == KEYS and c["partition_id"] == "step-1" for c in store.calls)


@pytest.mark.parametrize(
    "error",
    [
        FieldNotFoundError("step-1", fields=["responses"]),
        FieldNotFoundError("step-1", keys=["k1"]),
        RuntimeError("routed_experts: storage unreachable"),
        KeyError("responses"),
    ],
    ids=["other-field", "missing-key", "runtime-error", "foreign-key-error"],
)
def test_fetch_other_errors_propagate(error: Exception) -> None:
    store = RecordingStore({}, error=error)
    acc = RolloutMoELoadBalanceMetricsAccumulator()
    with pytest.raises(type(error)):
        fetch(store, 1, acc)
    assert selects(store) == [FIELDS + ["routed_experts"]]
    assert acc.should_request_routed_experts(2)  # nothing deferred


@pytest.mark.parametrize(
    "error",
    [
        ValueError("column 'routed_experts' is not in the batch"),
        KeyError("routed_experts"),
        FieldNotFoundError("step-1", fields=["routed_experts"], keys=["k1"]),  # some samples lack it
    ],
    ids=["foreign-value-error", "foreign-key-error", "field-missing-for-some-keys"],
)
def test_fetch_falls_back_on_errors_about_routed_experts(error: Exception) -> None:
    store = RecordingStore({"responses": 1, "response_mask": 2})
    first_error = error

    def kv_batch_get(keys: list[str], partition_id: str, select_fields: list[str]) -> Any:
        if "routed_experts" in select_fields:
            store.calls.append({"keys": keys, "partition_id": partition_id, "select_fields": list(select_fields)})
            raise first_error
        return store.kv_batch_get(keys=keys, partition_id=partition_id, select_fields=select_fields)

    acc = RolloutMoELoadBalanceMetricsAccumulator()
    out = get_metric_data_with_optional_routed_experts(KEYS, "step-1", FIELDS, 2, 5, acc, kv_batch_get)
    assert out == {"responses": 1, "response_mask": 2}
    assert selects(store) == [FIELDS + ["routed_experts"], FIELDS]
    assert not acc.should_request_routed_experts(6) and acc.should_request_routed_experts(7)


def test_fetch_when_the_fallback_also_fails_propagates_without_deferring() -> None:
    acc = RolloutMoELoadBalanceMetricsAccumulator()
    store = RecordingStore({"response_mask": 2})  # "responses" is missing too
    with pytest.raises(FieldNotFoundError) as info:
        fetch(store, 1, acc)
    assert info.value.fields == ["responses"]
    assert acc.should_request_routed_experts(2)


def test_fetch_against_the_memory_data_plane(caplog: pytest.LogCaptureFixture) -> None:
    from conveyor.data_plane import make_data_plane

    plane = make_data_plane("memory")
    try:
        plane.kv_batch_put(
            keys=KEYS,
            partition_id="step-1",
            fields={"responses": torch.tensor([[1, 2], [3, 4]]), "response_mask": torch.ones(2, 2, dtype=torch.bool)},
        )
        calls: list[list[str]] = []

        def recording_get(**kwargs: Any) -> Any:
            calls.append(list(kwargs["select_fields"]))
            return plane.kv_batch_get(**kwargs)

        acc = RolloutMoELoadBalanceMetricsAccumulator()
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            out = get_metric_data_with_optional_routed_experts(KEYS, "step-1", FIELDS, 2, 1, acc, recording_get)
        assert sorted(out.keys()) == sorted(FIELDS) and torch.equal(out["responses"], torch.tensor([[1, 2], [3, 4]]))
        assert calls == [FIELDS + ["routed_experts"], FIELDS]
        assert len(warnings_of(caplog)) == 1
    finally:
        plane.close()


# --------------------------------------------------------------------------- infer_moe_num_experts


def tiny(config_cls: type, **kwargs: Any) -> Any:
    base = dict(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=32,
    )
    base.update(kwargs)
    return config_cls(**base)


@pytest.mark.parametrize(
    "config, expected",
    [
        (None, None),
        ({}, None),
        ({"num_experts": 8}, 8),
        ({"n_routed_experts": 64}, 64),
        ({"num_experts": 8, "n_routed_experts": 64}, 8),
        ({"hf_config": {"n_routed_experts": 64}}, 64),
        ({"num_experts": 2, "hf_config": {"num_experts": 64}}, 2),
        ({"hf_config": {"text_config": {"num_experts": 16}}}, 16),
        ({"hf_config": {"num_experts": 4, "text_config": {"num_experts": 16}}}, 4),
        ({"hf_config": {"text_config": {"num_experts": 16}}, "text_config": {"num_experts": 32}}, 16),
        ({"text_config": {"num_experts": 32}, "override_config": {"num_experts": 3}}, 32),
        ({"override_config": {"num_experts": 3, "model_config": {"num_experts": 5}}}, 3),
        ({"override_config": {"model_config": {"n_routed_experts": 5}}}, 5),
        ({"override_config": {"model_config": {"x": 1}, "text_config": {"num_experts": 7}}}, 7),
        # a container's own num_experts beats a num_local_experts hit earlier in the same container
        ({"model_type": "mixtral", "num_local_experts": 8, "num_experts": 2}, 2),
        # num_local_experts only counts for mixtral and gpt_oss
        ({"model_type": "mixtral", "num_local_experts": 8}, 8),
        ({"model_type": "gpt_oss", "num_local_experts": 32}, 32),
        ({"model_type": "llama4_text", "num_local_experts": 16}, None),
        ({"num_local_experts": 16}, None),
        ({"hf_config": {"model_type": "mixtral", "num_local_experts": 8}, "override_config": {"num_experts": 4}}, 8),
        ({"model_type": "mixtral", "hf_config": {"model_type": "granitemoe", "num_local_experts": 8}}, None),
    ],
)
def test_infer_from_dicts(config: Any, expected: int | None) -> None:
    assert infer_moe_num_experts(config) == expected


def test_infer_from_omegaconf() -> None:
    cfg = OmegaConf.create(
        {"path": "/models/x", "hf_config": {"text_config": {"n_routed_experts": 12}}, "override_config": {}}
    )
    OmegaConf.set_struct(cfg, True)  # missing keys must read as absent, not raise
    assert infer_moe_num_experts(cfg) == 12
    interpolated = OmegaConf.create({"override_config": {"model_config": {"num_experts": "${n}"}}, "n": 6})
    assert infer_moe_num_experts(interpolated) == 6
    assert infer_moe_num_experts(OmegaConf.create({"model_type": "gpt_oss", "num_local_experts": 4})) == 4
    assert infer_moe_num_experts(OmegaConf.create({"model_type": "phimoe", "num_local_experts": 4})) is None


@dataclasses.dataclass
class ModelSection:
    path: str = "/models/x"
    hf_config: Any = None
    text_config: Any = None
    override_config: dict = dataclasses.field(default_factory=dict)


def test_infer_from_dataclass_and_hf_configs() -> None:
    from transformers import MixtralConfig, OlmoeConfig, PhimoeConfig, Qwen3MoeConfig

    assert infer_moe_num_experts(ModelSection()) is None
    assert infer_moe_num_experts(ModelSection(override_config={"num_experts": 5})) == 5
    qwen = tiny(Qwen3MoeConfig, num_experts=6)
    assert infer_moe_num_experts(qwen) == 6
    assert infer_moe_num_experts(ModelSection(hf_config=qwen)) == 6
    assert infer_moe_num_experts(ModelSection(hf_config=qwen, override_config={"num_experts": 9})) == 6
    mixtral = tiny(MixtralConfig, num_local_experts=4)
    assert infer_moe_num_experts(mixtral) == 4
    assert infer_moe_num_experts(ModelSection(hf_config=mixtral)) == 4
    # Serialised, a Mixtral config only says num_local_experts: the model_type rule finds it.
    serialised = mixtral.to_dict()
    assert "num_experts" not in serialised and serialised["model_type"] == "mixtral"
    assert infer_moe_num_experts({"hf_config": serialised}) == 4
    assert infer_moe_num_experts(tiny(OlmoeConfig, num_experts=10)) == 10
    # Phi-MoE names its experts num_local_experts but is not on the list.
    assert infer_moe_num_experts(tiny(PhimoeConfig, num_local_experts=4)) is None
    assert infer_moe_num_experts(ModelSection(text_config=tiny(OlmoeConfig, num_experts=3))) == 3


def test_infer_rejects_non_integer_counts() -> None:
    with pytest.raises(ValueError, match="'num_experts'"):
        infer_moe_num_experts({"num_experts": 2.5})
    with pytest.raises(ValueError, match="'n_routed_experts'"):
        infer_moe_num_experts({"hf_config": {"n_routed_experts": True}})
    assert infer_moe_num_experts({"num_experts": "8"}) == 8


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_give_the_cpu_counts() -> None:
    routed, mask = worked_example()
    routed[0, 3, 0, 0] = -1
    routed[0, 2, 1, 0] = -2
    cpu = count_expert_assignments(routed, mask, 4)
    cuda = count_expert_assignments(routed.cuda(), mask.cuda(), 4)
    assert cuda.device.type == "cpu" and cuda.tolist() == cpu.tolist()
    assert compute_rollout_moe_load_balance_metrics(routed.cuda(), mask, 4) == compute_rollout_moe_load_balance_metrics(
        routed, mask, 4
    )
