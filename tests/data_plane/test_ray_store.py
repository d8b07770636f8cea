"""Tests of the `ray` data plane: exact round trips, row order, errors, clearing, sharding, use from other actors."""

from __future__ import annotations

import pickle
import time

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

ray = pytest.importorskip("ray")

from data_plane_tensors import assert_same_tensor, random_tensor  # noqa: E402

from conveyor.data_plane import DataPlane, FieldNotFoundError, make_data_plane  # noqa: E402
from conveyor.data_plane.ray_store import RayDataPlane, shard_of  # noqa: E402

DTYPES = [torch.bool, torch.int8, torch.int16, torch.int64, torch.float16, torch.bfloat16, torch.float32]


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    """One local Ray for the module; logical CPUs so the 0.05-CPU storage actors always fit."""
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


@pytest.fixture(scope="module", params=[1, 3], ids=["one_shard", "three_shards"])
def plane(request, ray_session):
    """A ray data plane with one or three storage actors, shared by the module (each test uses its own partition)."""
    dp = make_data_plane("ray", num_storage_actors=request.param, actor_cpus=0.05)
    try:
        yield dp
    finally:
        dp.close()


@pytest.fixture
def pid(request) -> str:
    """A partition name of this test's own."""
    return request.node.name


def test_make_data_plane_ray_and_sharding(plane: DataPlane) -> None:
    assert isinstance(plane, RayDataPlane) and plane.backend == "ray"
    assert plane.kv_list("nothing") == []
    # The hash is stable (CRC32), not Python's per-process salted hash().
    # CRC-32 of "a" is 0xE8B7BE43 (the standard check value), 3904355907 % 3 == 0.
    assert shard_of("a", 2**32) == 0xE8B7BE43 and shard_of("a", 3) == 0
    assert {shard_of(f"s{i}", 3) for i in range(7)} == {0, 1, 2}  # the keys the tests below use reach every shard


# --------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("dtype", DTYPES)
def test_dense_roundtrip_is_exact_in_any_order(plane: DataPlane, dtype: torch.dtype, pid: str) -> None:
    gen = torch.Generator().manual_seed(0)
    value = random_tensor((7, 3, 2), dtype, gen)
    keys = [f"s{i}" for i in range(7)]
    meta = plane.kv_batch_put(keys, pid, {"f": value})
    assert meta.fields == ["f"] and meta.keys == keys
    order = [4, 0, 6, 2, 2, 1, 5, 3]  # shuffled, with a repeat
    got = plane.kv_batch_get([keys[i] for i in order], pid, ["f"])
    assert got.batch_size == torch.Size([8])
    assert_same_tensor(got["f"], value[order])
    assert_same_tensor(plane.kv_batch_get(keys, pid, ["f"])["f"], value)


def test_rows_from_several_puts_and_a_non_contiguous_input(plane: DataPlane, pid: str) -> None:
    a = torch.arange(12).reshape(3, 4).t()  # (4, 3), transposed strides
    b = torch.arange(100, 106).reshape(2, 3)
    plane.kv_batch_put(["a0", "a1", "a2", "a3"], pid, {"x": a})
    plane.kv_batch_put(["b0", "b1"], pid, {"x": b})
    got = plane.kv_batch_get(["b1", "a2", "b0", "a0"], pid, ["x"])["x"]
    assert got.is_contiguous()
    assert_same_tensor(got, torch.stack([b[1], a[2], b[0], a[0]]))
    assert plane.kv_list(pid) == ["a0", "a1", "a2", "a3", "b0", "b1"]


def test_get_is_a_writable_copy(plane: DataPlane, pid: str) -> None:
    value = torch.arange(6, dtype=torch.float32).reshape(3, 2)
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)
    plane.kv_batch_put(["a", "b", "c"], pid, {"x": value})
    plane.kv_batch_put(["a", "b"], pid + "-q", {"r": nested})
    got = plane.kv_batch_get(["a", "b", "c"], pid, ["x"])["x"]
    got.add_(100)  # a reader scribbling on its batch must not change the store
    assert_same_tensor(plane.kv_batch_get(["a", "b", "c"], pid, ["x"])["x"], value)
    r = plane.kv_batch_get(["a", "b"], pid + "-q", ["r"])["r"]
    r.values().mul_(0)
    assert float(plane.kv_batch_get(["a", "b"], pid + "-q", ["r"])["r"].values().sum()) == 5.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int16])
def test_jagged_nested_roundtrip(plane: DataPlane, dtype: torch.dtype, pid: str) -> None:
    gen = torch.Generator().manual_seed(1)
    rows = [random_tensor((n, 3), dtype, gen) for n in (2, 5, 1, 4)]
    plane.kv_batch_put(["a", "b", "c", "d"], pid, {"r": torch.nested.nested_tensor(rows, layout=torch.jagged)})
    got = plane.kv_batch_get(["d", "a", "c", "b", "a"], pid, ["r"])["r"]
    assert got.is_nested and got.layout == torch.jagged and got.dtype == dtype
    want = [rows[3], rows[0], rows[2], rows[1], rows[0]]
    out_rows = list(got.unbind(0))
    assert len(out_rows) == len(want)
    for o, w in zip(out_rows, want):
        assert_same_tensor(o, w)


def test_list_of_tensors_and_python_values(plane: DataPlane, pid: str) -> None:
    tensors = [torch.zeros(2, 3), torch.arange(4, dtype=torch.int8), torch.ones(1, 1, 1, dtype=torch.bfloat16)]
    strings = ["2+2=", "héllo", ""]
    dicts = [{"ground_truth": "4", "n": [1, 2]}, {}, {"nested": {"a": None}}]
    plane.kv_batch_put(["a", "b", "c"], pid, {"t": tensors, "s": strings, "d": dicts, "n": [1, 2.5, None]})
    got = plane.kv_batch_get(["b", "c", "a", "b"], pid, ["t", "s", "d", "n"])
    assert isinstance(got["t"], list) and len(got["t"]) == 4
    for o, w in zip(got["t"], [tensors[1], tensors[2], tensors[0], tensors[1]]):
        assert_same_tensor(o, w)
    assert list(got["s"]) == ["héllo", "", "2+2=", "héllo"] and all(type(s) is str for s in got["s"])
    assert list(got["d"]) == [dicts[1], dicts[2], dicts[0], dicts[1]] and all(type(d) is dict for d in got["d"])
    assert list(got["n"]) == [2.5, None, 1, 2.5]


def test_tensordict_input_and_tags(plane: DataPlane, pid: str) -> None:
    td = TensorDict({"scores": torch.tensor([0.25, -1.0, 3.5]), "ids": torch.arange(12).reshape(3, 4)}, batch_size=[3])
    td["names"] = NonTensorStack("x", "y", "z")
    meta = plane.kv_batch_put(["a", "b", "c"], pid, td, tags=[{"seq_len": 3}, {"seq_len": 1}, {}])
    assert set(meta.fields) == {"scores", "ids", "names"}
    assert meta.tags == [{"seq_len": 3}, {"seq_len": 1}, {}]
    # A later put without tags keeps them and reports every field each key has.
    meta2 = plane.kv_batch_put(["a", "c"], pid, {"extra": torch.ones(2)})
    assert meta2.tags == [{"seq_len": 3}, {}]
    assert set(meta2.fields) == {"scores", "ids", "names", "extra"}
    got = plane.kv_batch_get(["c", "a"], pid, ["scores", "ids", "names", "extra"])
    assert_same_tensor(got["scores"], torch.tensor([3.5, 0.25]))
    assert_same_tensor(got["ids"], torch.tensor([[8, 9, 10, 11], [0, 1, 2, 3]]))
    assert list(got["names"]) == ["z", "x"]
    assert_same_tensor(got["extra"], torch.ones(2))


def test_empty_get_keeps_each_kind(plane: DataPlane, pid: str) -> None:
    plane.kv_batch_put(
        ["a", "b"],
        pid,
        {
            "x": torch.ones(2, 3, dtype=torch.int16),
            "r": torch.nested.nested_tensor([torch.ones(2, 4), torch.ones(1, 4)], layout=torch.jagged),
            "s": ["u", "v"],
        },
    )
    got = plane.kv_batch_get([], pid, ["x", "r", "s"])
    assert got.batch_size == torch.Size([0])
    assert_same_tensor(got["x"], torch.ones(0, 3, dtype=torch.int16))
    assert got["r"].is_nested and got["r"].dtype == torch.float32 and got["r"].size(0) == 0
    assert list(got["s"]) == []


# --------------------------------------------------------------------------- errors
def test_missing_things_raise_field_not_found(plane: DataPlane, pid: str) -> None:
    plane.kv_batch_put(["a", "b", "c"], pid, {"x": torch.zeros(3)})
    plane.kv_batch_put(["a"], pid, {"y": torch.zeros(1)})
    with pytest.raises(FieldNotFoundError) as info:
        plane.kv_batch_get(["a", "zz", "b", "yy"], pid, ["x"])
    assert info.value.keys == ["zz", "yy"] and f"'{pid}'" in str(info.value)
    with pytest.raises(FieldNotFoundError) as info:
        plane.kv_batch_get(["a", "b"], pid, ["x", "nope", "nada"])
    assert info.value.fields == ["nope", "nada"] and "nope" in str(info.value)
    with pytest.raises(FieldNotFoundError) as info:  # y exists, but not for b and c
        plane.kv_batch_get(["c", "a", "b"], pid, ["y"])
    assert info.value.fields == ["y"] and info.value.keys == ["c", "b"]
    with pytest.raises(FieldNotFoundError) as info:
        plane.kv_batch_get(["a"], pid + "-other", ["x"])
    assert info.value.partition_id == pid + "-other" and f"'{pid}-other'" in str(info.value)
    assert isinstance(info.value, KeyError)


def test_bad_puts_are_refused_whole(plane: DataPlane, pid: str) -> None:
    with pytest.raises(ValueError, match="duplicate"):
        plane.kv_batch_put(["a", "a"], pid, {"x": torch.zeros(2)})
    with pytest.raises(ValueError, match="'x'"):
        plane.kv_batch_put(["a", "b"], pid, {"x": torch.zeros(3)})
    keys = ["a", "b", "c", "d", "e"]
    plane.kv_batch_put(keys, pid, {"x": torch.zeros(5, 2)})
    with pytest.raises(ValueError, match="shape"):
        plane.kv_batch_put(keys, pid, {"x": torch.ones(5, 3), "y": torch.ones(5)})
    # Nothing of the refused put was written, on any shard.
    assert_same_tensor(plane.kv_batch_get(keys, pid, ["x"])["x"], torch.zeros(5, 2))
    with pytest.raises(FieldNotFoundError):
        plane.kv_batch_get(["a"], pid, ["y"])


# --------------------------------------------------------------------------- clearing and closing
def test_clear_keys_and_partitions(plane: DataPlane, pid: str) -> None:
    plane.kv_batch_put(["a", "b", "c"], pid, {"x": torch.arange(3)})
    plane.kv_batch_put(["a"], pid + "-q", {"x": torch.arange(1)})
    plane.kv_clear(pid, ["b"])
    assert plane.kv_list(pid) == ["a", "c"]
    assert_same_tensor(plane.kv_batch_get(["c", "a"], pid, ["x"])["x"], torch.tensor([2, 0]))
    with pytest.raises(FieldNotFoundError):
        plane.kv_batch_get(["b"], pid, ["x"])
    plane.kv_clear(pid)
    assert plane.kv_list(pid) == [] and pid + "-q" in plane.list_partitions() and pid not in plane.list_partitions()
    plane.kv_clear("unknown")  # a no-op


def test_close_kills_storage_actors_and_copies_do_not(pid: str) -> None:
    dp = make_data_plane("ray", num_storage_actors=2)
    dp.kv_batch_put(["a"], pid, {"x": torch.tensor([7])})
    copy = pickle.loads(pickle.dumps(dp))
    copy.close()  # a worker's copy closing must not take the store down
    assert_same_tensor(dp.kv_batch_get(["a"], pid, ["x"])["x"], torch.tensor([7]))
    shards = list(dp._shards)
    dp.close()
    dp.close()  # twice is fine
    with pytest.raises(RuntimeError, match="closed"):
        dp.kv_batch_get(["a"], pid, ["x"])
    # ray.kill is asynchronous: a call can still slip in just after it, so allow the kill a moment to land.
    deadline = time.monotonic() + 30
    alive = list(shards)
    while alive and time.monotonic() < deadline:
        still = []
        for shard in alive:
            try:
                ray.get(shard.ready.remote(), timeout=30)
                still.append(shard)
            except ray.exceptions.RayActorError:
                pass
        alive = still
        time.sleep(0.1)
    assert not alive


# --------------------------------------------------------------------------- across processes
@ray.remote(num_cpus=0.05)
class _Stage:
    """A stand-in for a worker: reads a field, computes, writes a field back through the same plane."""

    def __init__(self, data_plane):
        self.dp = data_plane

    def double(self, keys, partition_id):
        import os

        td = self.dp.kv_batch_get(keys, partition_id, ["x", "names"])
        names = [n.upper() for n in td["names"]]
        self.dp.kv_batch_put(keys, partition_id, {"y": td["x"] * 2, "upper": names})
        return os.getpid()


def test_use_from_another_ray_actor(plane: DataPlane, pid: str) -> None:
    import os

    keys = [f"k{i}" for i in range(6)]
    x = torch.arange(12, dtype=torch.bfloat16).reshape(6, 2)
    plane.kv_batch_put(keys, pid, {"x": x, "names": list("abcdef")})
    stage = _Stage.remote(plane)
    try:
        worker_pid = ray.get(stage.double.remote(keys[::-1], pid), timeout=60)
    finally:
        ray.kill(stage)
    assert worker_pid != os.getpid()
    got = plane.kv_batch_get(keys, pid, ["y", "upper"])
    assert_same_tensor(got["y"], x * 2)
    assert list(got["upper"]) == list("ABCDEF")
    # The actor's rows keep the driver's first-written order for kv_list.
    assert plane.kv_list(pid) == keys


def test_metrics_count_traffic(pid: str) -> None:
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    dp = make_data_plane("ray", registry=registry, num_storage_actors=2)
    try:
        dp.kv_batch_put(["a", "b", "c"], pid, {"x": torch.zeros(3, 4)})  # 48 bytes
        dp.kv_batch_get(["a", "b"], pid, ["x"])  # 32 bytes
        value = registry.get_sample_value
        assert value("conveyor_dataplane_put_bytes_total", {"backend": "ray"}) == 48
        assert value("conveyor_dataplane_get_bytes_total", {"backend": "ray"}) == 32
        assert value("conveyor_dataplane_live_samples", {"backend": "ray", "partition": pid}) == 3
        dp.kv_clear(pid, ["a"])
        assert value("conveyor_dataplane_live_samples", {"backend": "ray", "partition": pid}) == 2
    finally:
        dp.close()
