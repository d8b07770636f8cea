"""Tests of the embedded `memory` data plane: exact round trips, row order, errors, clearing and threads."""

from __future__ import annotations

import concurrent.futures
import gc
import random
import threading
import time
import weakref

import pytest
import torch
from data_plane_tensors import assert_same_tensor, random_tensor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import NonTensorStack, TensorDict

from conveyor.data_plane import BACKENDS, DataPlane, FieldNotFoundError, make_data_plane
from conveyor.data_plane.memory import MemoryDataPlane
from conveyor.protocol import KVBatchMeta

DTYPES = [torch.bool, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32]


@pytest.fixture
def plane():
    """A fresh memory data plane, closed after the test."""
    dp = make_data_plane("memory")
    try:
        yield dp
    finally:
        dp.close()


# --------------------------------------------------------------------------- creation
def test_make_data_plane_memory(plane: DataPlane) -> None:
    assert isinstance(plane, MemoryDataPlane) and isinstance(plane, DataPlane)
    assert plane.backend == "memory"
    assert plane.metrics_server is None and not plane.closed
    assert plane.kv_list("anything") == []


def test_unknown_backend_names_the_valid_ones() -> None:
    with pytest.raises(ValueError) as info:
        make_data_plane("redis")
    msg = str(info.value)
    assert "redis" in msg
    for name in ("memory", "ray", "transferqueue"):
        assert name in msg
    assert tuple(BACKENDS) == ("memory", "ray", "transferqueue")


def test_memory_backend_rejects_options() -> None:
    with pytest.raises(ValueError, match="num_storage_actors"):
        make_data_plane("memory", num_storage_actors=2)


def test_planes_are_independent() -> None:
    # Creation is timed in benchmarks/data_plane.py; here only that each call gives a fresh store.
    planes = [make_data_plane("memory") for _ in range(5)]
    planes[0].kv_batch_put(["a"], "p", {"x": torch.tensor([1])})
    assert planes[0].kv_list("p") == ["a"]
    assert all(p.kv_list("p") == [] for p in planes[1:])
    for p in planes:
        p.close()


# --------------------------------------------------------------------------- round trips
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    batch=st.integers(min_value=1, max_value=6),
    trailing=st.lists(st.integers(min_value=0, max_value=4), min_size=0, max_size=3),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(min_value=0, max_value=2**16),
    data=st.data(),
)
def test_dense_roundtrip_is_exact(batch: int, trailing: list[int], dtype: torch.dtype, seed: int, data) -> None:
    gen = torch.Generator().manual_seed(seed)
    value = random_tensor((batch, *trailing), dtype, gen)
    keys = [f"s{i}" for i in range(batch)]
    order = data.draw(st.permutations(range(batch)))
    with make_data_plane("memory") as dp:
        meta = dp.kv_batch_put(keys, "p", {"f": value})
        assert meta.fields == ["f"] and meta.keys == keys
        got = dp.kv_batch_get([keys[i] for i in order], "p", ["f"])
        assert got.batch_size == torch.Size([batch])
        assert_same_tensor(got["f"], value[list(order)])


def test_dense_get_is_a_copy(plane: DataPlane) -> None:
    value = torch.arange(6).reshape(3, 2)
    plane.kv_batch_put(["a", "b", "c"], "p", {"x": value})
    got = plane.kv_batch_get(["a", "b", "c"], "p", ["x"])["x"]
    got.add_(100)  # a reader scribbling on its batch must not change the store
    assert torch.equal(plane.kv_batch_get(["a", "b", "c"], "p", ["x"])["x"], torch.arange(6).reshape(3, 2))


def test_non_contiguous_put_reads_back_contiguous(plane: DataPlane) -> None:
    x = torch.arange(12).reshape(3, 4).t()  # (4, 3), transposed strides
    plane.kv_batch_put(["a", "b", "c", "d"], "p", {"x": x})
    for order in (["a", "b", "c", "d"], ["d", "b", "a", "c"]):
        got = plane.kv_batch_get(order, "p", ["x"])["x"]
        assert got.is_contiguous()  # callers may .view() what they read
        assert_same_tensor(got, x[["abcd".index(k) for k in order]])


def test_one_dimensional_and_tensordict_input(plane: DataPlane) -> None:
    td = TensorDict({"scores": torch.tensor([0.25, -1.0, 3.5]), "ids": torch.arange(12).reshape(3, 4)}, batch_size=[3])
    td["names"] = NonTensorStack("x", "y", "z")
    meta = plane.kv_batch_put(["a", "b", "c"], "p", td)
    assert set(meta.fields) == {"scores", "ids", "names"}
    got = plane.kv_batch_get(["c", "a"], "p", ["scores", "ids", "names"])
    assert_same_tensor(got["scores"], torch.tensor([3.5, 0.25]))
    assert_same_tensor(got["ids"], torch.tensor([[8, 9, 10, 11], [0, 1, 2, 3]]))
    assert list(got["names"]) == ["z", "x"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int16])
def test_jagged_nested_roundtrip(plane: DataPlane, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    rows = [random_tensor((n, 3), dtype, gen) for n in (2, 5, 1, 4)]
    nested = torch.nested.nested_tensor(rows, layout=torch.jagged)
    keys = ["a", "b", "c", "d"]
    plane.kv_batch_put(keys, "p", {"r": nested})
    got = plane.kv_batch_get(["d", "a", "c", "b", "a"], "p", ["r"])["r"]
    assert got.is_nested and got.layout == torch.jagged and got.dtype == dtype
    want = [rows[3], rows[0], rows[2], rows[1], rows[0]]
    out_rows = list(got.unbind(0))
    assert len(out_rows) == len(want)
    for o, w in zip(out_rows, want):
        assert_same_tensor(o, w)


def test_jagged_nested_one_dimensional_rows_across_puts(plane: DataPlane) -> None:
    first = [torch.arange(3), torch.arange(10, 11)]
    second = [torch.arange(20, 25)]
    plane.kv_batch_put(["a", "b"], "p", {"r": torch.nested.nested_tensor(first, layout=torch.jagged)})
    plane.kv_batch_put(["c"], "p", {"r": torch.nested.nested_tensor(second, layout=torch.jagged)})
    got = plane.kv_batch_get(["c", "b", "a"], "p", ["r"])["r"]
    assert got.is_nested
    for o, w in zip(got.unbind(0), [second[0], first[1], first[0]]):
        assert_same_tensor(o, w)


def test_empty_get_keeps_each_kind(plane: DataPlane) -> None:
    # A data-parallel rank can be handed zero keys (more ranks than samples).
    plane.kv_batch_put(
        ["a", "b"],
        "p",
        {
            "x": torch.ones(2, 3, dtype=torch.int16),
            "r": torch.nested.nested_tensor([torch.ones(2, 4), torch.ones(1, 4)], layout=torch.jagged),
            "s": ["u", "v"],
        },
    )
    got = plane.kv_batch_get([], "p", ["x", "r", "s"])
    assert got.batch_size == torch.Size([0])
    assert_same_tensor(got["x"], torch.ones(0, 3, dtype=torch.int16))
    assert got["r"].is_nested and got["r"].dtype == torch.float32 and got["r"].size(0) == 0
    assert list(got["s"]) == []


def test_list_of_differently_shaped_tensors_stays_a_list(plane: DataPlane) -> None:
    rows = [torch.zeros(2, 3), torch.arange(4, dtype=torch.int8), torch.ones(1, 1, 1, dtype=torch.float16)]
    plane.kv_batch_put(["a", "b", "c"], "p", {"t": rows})
    got = plane.kv_batch_get(["b", "c", "a"], "p", ["t"])["t"]
    assert isinstance(got, list)
    assert len(got) == 3
    for o, w in zip(got, [rows[1], rows[2], rows[0]]):
        assert_same_tensor(o, w)


def test_python_values_stay_python_values(plane: DataPlane) -> None:
    strings = ["2+2=", "héllo", ""]
    dicts = [{"ground_truth": "4", "n": [1, 2]}, {}, {"nested": {"a": None}}]
    plane.kv_batch_put(["a", "b", "c"], "p", {"prompt": strings, "reward_model": dicts, "n": [1, 2.5, None]})
    got = plane.kv_batch_get(["c", "a", "b", "a"], "p", ["prompt", "reward_model", "n"])
    assert isinstance(got["prompt"], list) and list(got["prompt"]) == ["", "2+2=", "héllo", "2+2="]
    assert all(type(s) is str for s in got["prompt"])
    assert list(got["reward_model"]) == [dicts[2], dicts[0], dicts[1], dicts[0]]
    assert all(type(d) is dict for d in got["reward_model"])
    assert list(got["n"]) == [None, 1, 2.5, 1]


# --------------------------------------------------------------------------- order
@settings(max_examples=40, deadline=None)
@given(
    put_sizes=st.lists(st.integers(min_value=1, max_value=6), min_size=1, max_size=4),
    seed=st.integers(min_value=0, max_value=2**16),
    data=st.data(),
)
def test_get_returns_rows_in_the_order_asked(put_sizes: list[int], seed: int, data) -> None:
    gen = torch.Generator().manual_seed(seed)
    expected_dense: dict[str, torch.Tensor] = {}
    expected_ragged: dict[str, torch.Tensor] = {}
    with make_data_plane("memory") as dp:
        start = 0
        for size in put_sizes:  # each put is its own block: the get spans blocks
            keys = [f"k{start + i}" for i in range(size)]
            dense = random_tensor((size, 3), torch.int64, gen)
            ragged = [random_tensor((start + i + 1,), torch.float32, gen) for i in range(size)]
            dp.kv_batch_put(
                keys,
                "p",
                {
                    "d": dense,
                    "r": torch.nested.nested_tensor(ragged, layout=torch.jagged),
                    "name": [k.upper() for k in keys],
                },
            )
            expected_dense.update(zip(keys, dense))
            expected_ragged.update(zip(keys, ragged))
            start += size
        all_keys = list(expected_dense)
        order = data.draw(st.permutations(all_keys))
        extra = data.draw(st.lists(st.sampled_from(all_keys), max_size=4))  # duplicates in one get
        ask = list(order) + extra
        got = dp.kv_batch_get(ask, "p", ["d", "r", "name"])
        assert_same_tensor(got["d"], torch.stack([expected_dense[k] for k in ask]))
        for o, k in zip(got["r"].unbind(0), ask):
            assert_same_tensor(o, expected_ragged[k])
        assert list(got["name"]) == [k.upper() for k in ask]
        assert dp.kv_list("p") == all_keys


def test_rewriting_a_key_returns_the_latest_value(plane: DataPlane) -> None:
    plane.kv_batch_put(["a", "b"], "p", {"x": torch.tensor([[1], [2]])})
    plane.kv_batch_put(["b"], "p", {"x": torch.tensor([[20]])})
    assert_same_tensor(plane.kv_batch_get(["a", "b"], "p", ["x"])["x"], torch.tensor([[1], [20]]))
    assert plane.kv_list("p") == ["a", "b"]


def test_put_returns_handle_with_fields_every_key_has_and_tags(plane: DataPlane) -> None:
    plane.kv_batch_put(["a", "b"], "p", {"prompts": torch.zeros(2, 1)}, tags=[{"uid": "0"}, {"uid": "1"}])
    meta = plane.kv_batch_put(["a", "c"], "p", {"responses": torch.zeros(2, 1)})
    assert isinstance(meta, KVBatchMeta)
    # "c" has no prompts, so only "responses" is complete for this handle
    assert meta.fields == ["responses"] and meta.partition_id == "p" and meta.keys == ["a", "c"]
    assert meta.tags == [{"uid": "0"}, {}]
    again = plane.kv_batch_put(["a", "b"], "p", {"responses": torch.ones(2, 1)})
    assert again.fields == ["prompts", "responses"]


def test_handle_helpers_read_and_write(plane: DataPlane) -> None:
    meta = plane.kv_batch_put(["a", "b"], "p", {"x": torch.tensor([1, 2])})
    meta = plane.put(meta, {"y": torch.tensor([10, 20])})
    assert meta.fields == ["x", "y"]
    got = plane.get(meta.select([1, 0]), ["y", "x"])
    assert_same_tensor(got["y"], torch.tensor([20, 10]))
    assert_same_tensor(got["x"], torch.tensor([2, 1]))


# --------------------------------------------------------------------------- errors
def test_missing_field_names_field_and_partition(plane: DataPlane) -> None:
    plane.kv_batch_put(["a", "b"], "step-3", {"x": torch.zeros(2)})
    with pytest.raises(FieldNotFoundError) as info:
        plane.kv_batch_get(["a", "b"], "step-3", ["x", "old_log_probs", "values"])
    err = info.value
    assert isinstance(err, KeyError)
    assert err.fields == ["old_log_probs", "values"] and err.partition_id == "step-3"
    msg = str(err)
    assert "old_log_probs" in msg and "values" in msg and "'step-3'" in msg
    assert "'x'" not in msg  # only what is missing is named


def test_missing_key_names_key_and_partition(plane: DataPlane) -> None:
    plane.kv_batch_put(["a", "b"], "p", {"x": torch.zeros(2)})
    with pytest.raises(FieldNotFoundError) as info:
        plane.kv_batch_get(["a", "zz", "b", "yy"], "p", ["x"])
    assert info.value.keys == ["zz", "yy"]
    assert "zz" in str(info.value) and "yy" in str(info.value) and "'p'" in str(info.value)


def test_unknown_partition(plane: DataPlane) -> None:
    plane.kv_batch_put(["a"], "p", {"x": torch.zeros(1)})
    with pytest.raises(FieldNotFoundError) as info:
        plane.kv_batch_get(["a"], "other", ["x"])
    assert info.value.partition_id == "other" and "'other'" in str(info.value)
    assert plane.kv_list("other") == []  # a failed get creates nothing


def test_cleared_partition(plane: DataPlane) -> None:
    plane.kv_batch_put(["a"], "p", {"x": torch.zeros(1)})
    plane.kv_clear("p")
    with pytest.raises(FieldNotFoundError, match="'p'"):
        plane.kv_batch_get(["a"], "p", ["x"])


def test_field_only_some_keys_have(plane: DataPlane) -> None:
    plane.kv_batch_put(["a", "b"], "p", {"x": torch.zeros(2, 2)})
    plane.kv_batch_put(["c"], "p", {"y": torch.zeros(1, 2)})
    with pytest.raises(FieldNotFoundError) as info:
        plane.kv_batch_get(["a", "c", "b"], "p", ["x"])
    err = info.value
    assert err.fields == ["x"] and err.keys == ["c"]
    assert "'x'" in str(err) and "'c'" in str(err) and "'p'" in str(err)


def test_many_missing_keys_are_summarised() -> None:
    err = FieldNotFoundError("p", keys=[f"k{i}" for i in range(8)])
    assert "k4" in str(err) and "k5" not in str(err) and "3 more" in str(err)


def test_shape_or_dtype_change_of_a_field_is_an_error(plane: DataPlane) -> None:
    plane.kv_batch_put(["a", "b"], "p", {"x": torch.zeros(2, 3)})
    with pytest.raises(ValueError, match="'x'.*\\(3,\\)"):
        plane.kv_batch_put(["c"], "p", {"x": torch.zeros(1, 4)})
    with pytest.raises(ValueError, match="'x'.*int64"):
        plane.kv_batch_put(["c"], "p", {"x": torch.zeros(1, 3, dtype=torch.int64)})
    with pytest.raises(ValueError, match="'x'.*dense"):
        plane.kv_batch_put(["c"], "p", {"x": ["not", "a tensor"][:1]})
    # the same field in another partition may have another shape
    plane.kv_batch_put(["c"], "q", {"x": torch.zeros(1, 4)})


def test_refused_put_writes_nothing(plane: DataPlane) -> None:
    plane.kv_batch_put(["a"], "p", {"x": torch.zeros(1, 3)})
    with pytest.raises(ValueError, match="'x'"):
        # "y" comes first and is fine on its own; the whole put is still refused
        plane.kv_batch_put(["c"], "p", {"y": torch.ones(1), "x": torch.zeros(1, 4)}, tags=[{"uid": "c"}])
    assert plane.kv_list("p") == ["a"]
    with pytest.raises(FieldNotFoundError, match="'y'"):
        plane.kv_batch_get(["a"], "p", ["y"])
    # the field "y" was never created, so it may now take any shape
    meta = plane.kv_batch_put(["c"], "p", {"y": torch.ones(1, 2)})
    assert meta.tags == [{}] and meta.fields == ["y"]


def test_bad_puts_are_errors(plane: DataPlane) -> None:
    with pytest.raises(ValueError, match="'x' has 3 rows for 2 keys"):
        plane.kv_batch_put(["a", "b"], "p", {"x": torch.zeros(3)})
    with pytest.raises(ValueError, match="duplicate"):
        plane.kv_batch_put(["a", "a"], "p", {"x": torch.zeros(2)})
    with pytest.raises(ValueError, match="1 tags for 2 keys"):
        plane.kv_batch_put(["a", "b"], "p", {"x": torch.zeros(2)}, tags=[{}])
    with pytest.raises(ValueError, match="0-d"):
        plane.kv_batch_put(["a"], "p", {"x": torch.tensor(1.0)})
    with pytest.raises(ValueError, match="'x' has type int"):
        plane.kv_batch_put(["a"], "p", {"x": 5})
    assert plane.kv_list("p") == []


def test_closed_plane_refuses_put_and_get() -> None:
    dp = make_data_plane("memory")
    dp.kv_batch_put(["a"], "p", {"x": torch.zeros(1)})
    dp.close()
    assert dp.closed
    with pytest.raises(RuntimeError, match="closed"):
        dp.kv_batch_put(["b"], "p", {"x": torch.zeros(1)})
    with pytest.raises(RuntimeError, match="closed"):
        dp.kv_batch_get(["a"], "p", ["x"])
    dp.close()  # a second close is harmless


def test_context_manager_closes() -> None:
    with make_data_plane("memory") as dp:
        dp.kv_batch_put(["a"], "p", {"x": torch.zeros(1)})
    assert dp.closed


# --------------------------------------------------------------------------- list and clear
def test_kv_list_is_first_written_order(plane: DataPlane) -> None:
    plane.kv_batch_put(["c", "a", "b"], "p", {"x": torch.zeros(3)})
    plane.kv_batch_put(["d", "a"], "p", {"y": torch.zeros(2)})
    plane.kv_batch_put(["z"], "other", {"x": torch.zeros(1)})
    assert plane.kv_list("p") == ["c", "a", "b", "d"]
    assert plane.kv_list("other") == ["z"]


def test_kv_clear_some_keys(plane: DataPlane) -> None:
    plane.kv_batch_put(["a", "b", "c"], "p", {"x": torch.tensor([1, 2, 3]), "s": ["A", "B", "C"]})
    plane.kv_batch_put(["d"], "p", {"x": torch.tensor([4]), "s": ["D"]})
    plane.kv_clear("p", keys=["b", "d"])
    assert plane.kv_list("p") == ["a", "c"]
    got = plane.kv_batch_get(["c", "a"], "p", ["x", "s"])
    assert_same_tensor(got["x"], torch.tensor([3, 1]))
    assert list(got["s"]) == ["C", "A"]
    with pytest.raises(FieldNotFoundError) as info:
        plane.kv_batch_get(["a", "d"], "p", ["x"])
    assert info.value.keys == ["d"]
    plane.kv_clear("p", keys=["not-there"])  # clearing an absent key is a no-op
    plane.kv_clear("no-such-partition")
    assert plane.kv_list("p") == ["a", "c"]


def test_kv_clear_all(plane: DataPlane) -> None:
    plane.kv_batch_put(["a", "b"], "p", {"x": torch.zeros(2)})
    plane.kv_batch_put(["a"], "q", {"x": torch.ones(1)})
    plane.kv_clear("p")
    assert plane.kv_list("p") == []
    assert_same_tensor(plane.kv_batch_get(["a"], "q", ["x"])["x"], torch.ones(1))
    # a cleared partition can be written afresh, with a new shape
    plane.kv_batch_put(["a"], "p", {"x": torch.zeros(1, 5)})
    assert plane.kv_batch_get(["a"], "p", ["x"])["x"].shape == (1, 5)


def test_clearing_every_key_of_a_put_frees_its_tensor(plane: DataPlane) -> None:
    first, second = torch.zeros(2, 4), torch.ones(1, 4)
    ref = weakref.ref(first)
    plane.kv_batch_put(["a", "b"], "p", {"x": first})
    plane.kv_batch_put(["c"], "p", {"x": second})
    del first
    gc.collect()
    assert ref() is not None  # the store holds it
    plane.kv_clear("p", keys=["a"])
    gc.collect()
    assert ref() is not None  # "b" still points into it
    plane.kv_clear("p", keys=["b"])
    gc.collect()
    assert ref() is None
    assert_same_tensor(plane.kv_batch_get(["c"], "p", ["x"])["x"], torch.ones(1, 4))


# --------------------------------------------------------------------------- threads
def test_concurrent_writers_and_readers_lose_nothing(plane: DataPlane) -> None:
    writers, puts_per_writer, rows_per_put = 4, 30, 4
    done = threading.Event()

    def expected_row(key: str) -> torch.Tensor:
        w, i, j = (int(p) for p in key[1:].split("-"))
        return torch.tensor([w, i, j, w * 10_000 + i * 10 + j])

    def write(w: int) -> int:
        for i in range(puts_per_writer):
            keys = [f"w{w}-{i}-{j}" for j in range(rows_per_put)]
            plane.kv_batch_put(keys, "p", {"x": torch.stack([expected_row(k) for k in keys]), "name": list(keys)})
            if i % 5 == 0:
                time.sleep(0)  # let the other threads in
        return puts_per_writer * rows_per_put

    def read(seed: int) -> int:
        rng = random.Random(seed)
        checked = 0
        while not done.is_set() or checked == 0:
            keys = plane.kv_list("p")
            if not keys:
                continue
            ask = rng.sample(keys, min(8, len(keys)))
            got = plane.kv_batch_get(ask, "p", ["x", "name"])
            assert torch.equal(got["x"], torch.stack([expected_row(k) for k in ask]))
            assert list(got["name"]) == ask
            checked += len(ask)
        return checked

    with concurrent.futures.ThreadPoolExecutor(max_workers=writers + 3) as pool:
        readers = [pool.submit(read, s) for s in range(3)]
        written = [pool.submit(write, w) for w in range(writers)]
        total = sum(f.result(timeout=60) for f in written)
        done.set()
        assert all(f.result(timeout=60) > 0 for f in readers)

    all_keys = plane.kv_list("p")
    assert total == len(all_keys) == writers * puts_per_writer * rows_per_put
    got = plane.kv_batch_get(all_keys, "p", ["x", "name"])
    assert torch.equal(got["x"], torch.stack([expected_row(k) for k in all_keys]))
    assert list(got["name"]) == all_keys


def test_plain_columns_are_the_get_taken_apart():
    # What the served plane sends another process: the same rows as kv_batch_get, a list column as a list
    # (built without the TensorDict form, and the base class's default from that form agrees).
    dp = make_data_plane("memory")
    keys = [f"k{i}" for i in range(5)]
    dp.kv_batch_put(
        keys,
        "p",
        {"x": torch.arange(10).reshape(5, 2), "uid": list("aabbc"), "ragged": [torch.arange(i + 1) for i in range(5)]},
    )
    order = keys[::-1]
    td = dp.kv_batch_get(order, "p", ["x", "uid", "ragged"])
    for columns in (
        dp.kv_batch_get_columns(order, "p", ["x", "uid", "ragged"]),
        DataPlane._get_columns(dp, order, "p", ["x", "uid", "ragged"]),
    ):
        assert list(columns) == ["x", "uid", "ragged"]
        assert torch.equal(columns["x"], td["x"])
        assert columns["uid"] == list("cbbaa") == td["uid"].tolist()
        assert [t.tolist() for t in columns["ragged"]] == [list(range(n)) for n in (5, 4, 3, 2, 1)]
    empty = dp.kv_batch_get_columns([], "p", ["uid", "x"])
    assert empty["uid"] == [] and empty["x"].shape == (0, 2)
    assert len(dp.kv_batch_get([], "p", ["uid"])["uid"]) == 0
    with pytest.raises(FieldNotFoundError, match="nope"):
        dp.kv_batch_get_columns(keys, "p", ["nope"])
