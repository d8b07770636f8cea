"""Tests of the batch protocol: KVBatchMeta handles, BatchData.concat and the metric reduction rules."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from conveyor.protocol import BatchData, KVBatchMeta, reduce_metric, reduce_metrics


def make_meta(n: int, partition: str = "step-0", prefix: str = "k", **extra) -> KVBatchMeta:
    """A handle over `n` keys with a distinct tag per key."""
    return KVBatchMeta(
        keys=[f"{prefix}{i}" for i in range(n)],
        partition_id=partition,
        fields=["prompts", "responses"],
        tags=[{"uid": f"{prefix}{i // 2}", "row": i} for i in range(n)],
        extra_info=dict(extra),
    )


# --------------------------------------------------------------------------- KVBatchMeta
def test_len_is_number_of_keys() -> None:
    assert len(make_meta(0)) == 0
    assert len(make_meta(7)) == 7


def test_default_tags_are_one_empty_dict_per_key() -> None:
    meta = KVBatchMeta(keys=["a", "b", "c"], partition_id="p")
    assert meta.tags == [{}, {}, {}]
    meta.tags[0]["x"] = 1  # each key gets its own dict, not one shared object
    assert meta.tags[1] == {}


def test_tags_must_match_keys() -> None:
    with pytest.raises(ValueError, match="2 tags for 3 keys"):
        KVBatchMeta(keys=["a", "b", "c"], partition_id="p", tags=[{}, {}])


def test_chunk_rejects_non_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        make_meta(4).chunk(0)


def test_chunk_hand_computed_sizes() -> None:
    chunks = make_meta(10).chunk(4)
    assert [len(c) for c in chunks] == [3, 3, 2, 2]
    assert chunks[2].keys == ["k6", "k7"]
    # more ranks than samples: the last ranks get empty handles
    assert [len(c) for c in make_meta(2).chunk(3)] == [1, 1, 0]


@settings(max_examples=150, deadline=None)
@given(length=st.integers(min_value=0, max_value=64), n=st.integers(min_value=1, max_value=17))
def test_chunk_sizes_order_and_concat_roundtrip(length: int, n: int) -> None:
    meta = make_meta(length, temperature=0.7)
    chunks = meta.chunk(n)
    assert len(chunks) == n
    sizes = [len(c) for c in chunks]
    assert sum(sizes) == length
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # the larger chunks come first
    flat_keys = [k for c in chunks for k in c.keys]
    assert flat_keys == meta.keys
    assert [t for c in chunks for t in c.tags] == meta.tags
    assert all(c.partition_id == meta.partition_id and c.fields == meta.fields for c in chunks)

    back = BatchData(chunks).concat()
    assert isinstance(back, KVBatchMeta)
    assert back.keys == meta.keys
    assert back.tags == meta.tags
    assert back.partition_id == meta.partition_id
    assert back.fields == meta.fields
    # every chunk carried the same call parameter; the merge keeps one entry per chunk
    assert back.extra_info == {"temperature": [0.7] * n}


def test_chunk_does_not_share_tags_with_the_parent() -> None:
    meta = make_meta(4)
    chunks = meta.chunk(2)
    chunks[0].tags[0]["row"] = 99
    assert meta.tags[0]["row"] == 0


# --------------------------------------------------------------------------- BatchData.concat
def test_concat_empty_list_message() -> None:
    with pytest.raises(ValueError) as info:
        BatchData([]).concat()
    assert str(info.value) == "Cannot concatenate an empty list of data items."


def test_concat_tensordicts_along_batch() -> None:
    a = TensorDict({"x": torch.arange(8).reshape(2, 4), "y": torch.tensor([0.5, 1.5])}, batch_size=[2])
    b = TensorDict({"x": torch.arange(8, 20).reshape(3, 4), "y": torch.tensor([2.5, 3.5, 4.5])}, batch_size=[3])
    out = BatchData([a, b]).concat()
    assert isinstance(out, TensorDict)
    assert out.batch_size == torch.Size([5])
    assert torch.equal(out["x"], torch.arange(20).reshape(5, 4))
    assert torch.equal(out["y"], torch.tensor([0.5, 1.5, 2.5, 3.5, 4.5]))


def test_concat_metas_merges_extra_info_without_mutating_inputs() -> None:
    rank0 = KVBatchMeta(
        keys=["a", "b"],
        partition_id="p",
        fields=["x"],
        tags=[{"uid": "u0"}, {"uid": "u0"}],
        extra_info={"perf/max_memory_allocated_gb": 1.5, "temperature": 0.7, "shared": {"nested": [1]}},
    )
    rank1 = KVBatchMeta(
        keys=["c"],
        partition_id="p",
        fields=["x", "y"],
        tags=[{"uid": "u1"}],
        extra_info={"perf/max_memory_allocated_gb": 2.25, "only_rank1": "yes", "shared": {"nested": [2]}},
    )
    rank2 = KVBatchMeta(keys=["d", "e"], partition_id="p", fields=["y"])
    before = copy.deepcopy([rank0, rank1, rank2])

    out = BatchData([rank0, rank1, rank2]).concat()

    assert out.keys == ["a", "b", "c", "d", "e"]
    assert out.partition_id == "p"
    assert out.fields == ["x", "y"]
    assert out.tags == [{"uid": "u0"}, {"uid": "u0"}, {"uid": "u1"}, {}, {}]
    assert out.extra_info == {
        "perf/max_memory_allocated_gb": [1.5, 2.25, None],  # differing values kept, not rejected
        "temperature": [0.7, None, None],
        "shared": [{"nested": [1]}, {"nested": [2]}, None],
        "only_rank1": [None, "yes", None],
    }
    assert list(out.extra_info) == ["perf/max_memory_allocated_gb", "temperature", "shared", "only_rank1"]
    assert [rank0, rank1, rank2] == before  # dataclass equality compares every field deeply
    # the merged handle owns its tags: editing them leaves the inputs alone
    out.tags[0]["uid"] = "changed"
    assert rank0.tags[0] == {"uid": "u0"}


def test_concat_metas_reduces_to_the_documented_values() -> None:
    ranks = [
        KVBatchMeta(
            keys=[f"k{r}"], partition_id="p", extra_info={"perf/max_memory_allocated_gb": v, "actor/loss": loss}
        )
        for r, (v, loss) in enumerate([(1.0, 0.5), (3.0, 1.5), (2.0, 1.0)])
    ]
    merged = BatchData(ranks).concat()
    assert reduce_metrics(merged.extra_info) == {"perf/max_memory_allocated_gb": 3.0, "actor/loss": 1.0}


def test_concat_metas_of_different_partitions_is_an_error() -> None:
    with pytest.raises(ValueError, match="different partitions") as info:
        BatchData([make_meta(2, partition="step-1"), make_meta(2, partition="step-2")]).concat()
    assert "step-1" in str(info.value) and "step-2" in str(info.value)


def test_kvbatchmeta_concat_staticmethod_matches_batchdata() -> None:
    chunks = make_meta(5, lr=0.1).chunk(2)
    assert KVBatchMeta.concat(chunks) == BatchData(chunks).concat()


class Segment:
    """A user type that knows how to concatenate itself."""

    calls: list = []

    def __init__(self, values: list[int]):
        self.values = values

    @classmethod
    def concat(cls, items: list[Segment]) -> Segment:
        """One segment holding the items' values in order (and remember the call)."""
        cls.calls.append(list(items))
        return cls([v for item in items for v in item.values])


def test_concat_anything_else_uses_the_type_concat() -> None:
    a, b, c = Segment([1, 2]), Segment([]), Segment([3])
    out = BatchData([a, b, c]).concat()
    assert isinstance(out, Segment)
    assert out.values == [1, 2, 3]
    assert Segment.calls[-1] == [a, b, c]


def test_concat_anything_else_without_concat_fails_loudly() -> None:
    with pytest.raises(AttributeError):
        BatchData([1, 2]).concat()


# --------------------------------------------------------------------------- Ray ObjectRefs
@pytest.fixture(scope="module")
def ray_session():
    """A one-CPU local Ray for this module (skips when Ray is not installed)."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def test_concat_resolves_object_refs(ray_session) -> None:
    ray = ray_session
    metas = [
        KVBatchMeta(keys=["a", "b"], partition_id="p", fields=["x"], extra_info={"perf/cpu_memory_used_gb": 1.0}),
        KVBatchMeta(keys=["c"], partition_id="p", fields=["x"], extra_info={"perf/cpu_memory_used_gb": 2.0}),
    ]
    refs = [ray.put(m) for m in metas]
    assert all(isinstance(r, ray.ObjectRef) for r in refs)
    out = BatchData(refs).concat()
    assert out.keys == ["a", "b", "c"]
    assert out.extra_info == {"perf/cpu_memory_used_gb": [1.0, 2.0]}


# --------------------------------------------------------------------------- reduce_metrics
def test_reduce_metric_rules() -> None:
    assert reduce_metric("perf/max_memory_allocated_gb", [1.0, 5.0, None, 3.0]) == 5.0
    assert reduce_metric("response_length/min", [4, 2, None]) == 2.0
    assert math.isclose(reduce_metric("actor/pg_loss", [1.0, None, 2.0, 4.0]), 7.0 / 3.0)
    assert reduce_metric("actor/pg_loss", [None, None]) is None
    assert reduce_metric("actor/lr", 0.25) == 0.25  # a scalar is already reduced
    # "max" is checked before "min", so a key with both reduces by max
    assert reduce_metric("max_min_gap", [1.0, 2.0]) == 2.0


def test_reduce_metrics_drops_all_none_and_keeps_scalars() -> None:
    out = reduce_metrics(
        {
            "perf/max_memory_reserved_gb": [2.0, None, 8.0],
            "timing/min_step_s": (3.0, 1.0),
            "critic/vf_loss": [0.5, 1.5],
            "missing": [None, None],
            "step": 3,
        }
    )
    assert out == {"perf/max_memory_reserved_gb": 8.0, "timing/min_step_s": 1.0, "critic/vf_loss": 1.0, "step": 3}
