"""Tests of the `transferqueue` data plane against the real TransferQueue package (skipped without it).

One plane (controller + two SimpleStorage units, so rows are spread over
units) serves the module; each test works in its own partition, and the last
test closes it. Starting Ray and the actors dominates the run time (tens of
seconds on a 2-core machine), so no test starts a second TransferQueue.
"""

from __future__ import annotations

import pickle
import uuid

import pytest

pytest.importorskip("transfer_queue")

import ray  # noqa: E402  (the package needs Ray; importorskip first)
import torch  # noqa: E402
from data_plane_tensors import random_tensor  # noqa: E402
from tensordict import NonTensorStack, TensorDict  # noqa: E402

from conveyor.data_plane import FieldNotFoundError, make_data_plane  # noqa: E402
from conveyor.data_plane.prometheus import DataPlaneMetrics  # noqa: E402
from conveyor.data_plane.transferqueue import NAMESPACE, SCHEMA_PREFIX, TransferQueueDataPlane  # noqa: E402

DTYPES = [torch.bool, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32]


@pytest.fixture(scope="module")
def plane():
    """One transferqueue plane for the module (two storage units), closed at the end."""
    dp = make_data_plane("transferqueue", tq_config={"backend": {"SimpleStorage": {"num_data_storage_units": 2}}})
    try:
        yield dp
    finally:
        dp.close()


@pytest.fixture
def part(plane):
    """A fresh partition name, cleared after the test."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    yield name
    if not plane.closed:
        plane.kv_clear(name)


def values_of(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Values that use the dtype's range, so a lossy cast would change them."""
    return random_tensor(shape, dtype, torch.Generator().manual_seed(seed))


def test_dense_round_trip_keeps_dtype_shape_and_layout(plane, part) -> None:
    keys = [f"k{i}" for i in range(5)]
    fields = {}
    for i, dtype in enumerate(DTYPES):
        for shape in [(5,), (5, 3), (5, 2, 4)]:
            fields[f"{str(dtype)[6:]}_{len(shape)}d"] = values_of(dtype, shape, seed=i * 10 + len(shape))
    meta = plane.kv_batch_put(keys, part, fields)
    assert meta.keys == keys and meta.partition_id == part and meta.fields == list(fields)
    got = plane.kv_batch_get(keys, part, list(fields))
    assert got.batch_size == torch.Size([5])
    for name, want in fields.items():
        value = got[name]
        assert not value.is_nested, name  # the package alone returns these as jagged nested tensors
        assert value.dtype == want.dtype and value.shape == want.shape, name
        assert torch.equal(value, want), name


def test_ragged_round_trip_stays_ragged_even_when_rows_are_equal(plane, part) -> None:
    rows = [torch.arange(n, dtype=torch.int64) for n in (3, 1, 4, 2)]
    same = [torch.full((2, 3), float(i), dtype=torch.bfloat16) for i in range(4)]
    flags = [torch.tensor([True] * n + [False]) for n in (0, 2, 1, 3)]
    keys = ["a", "b", "c", "d"]
    plane.kv_batch_put(
        keys,
        part,
        {
            "ragged": torch.nested.as_nested_tensor(rows, layout=torch.jagged),
            "equal_rows": torch.nested.as_nested_tensor(same, layout=torch.jagged),
            "flags": torch.nested.as_nested_tensor(flags, layout=torch.jagged),
        },
    )
    got = plane.kv_batch_get(["c", "a"], part, ["ragged", "equal_rows", "flags"])
    for name, want in (("ragged", rows), ("equal_rows", same), ("flags", flags)):
        value = got.get(name)
        assert value.is_nested and value.layout == torch.jagged, name
        assert value.dtype == want[0].dtype, name
        out = value.unbind(0)
        assert len(out) == 2 and torch.equal(out[0], want[2]) and torch.equal(out[1], want[0]), name


def test_python_values_and_mixed_tensors_come_back_exactly(plane, part) -> None:
    values = ["text", (1, 2), {"score": 0.5, "pair": (3, 4)}, None, 7, 2.5, {1, 2}]
    tensors = [
        torch.ones(2),
        torch.zeros(1, 3, dtype=torch.float64),
        torch.tensor([9], dtype=torch.int8),
        torch.tensor(5),
        torch.ones(3, dtype=torch.bool),
        torch.arange(4),
        torch.empty(0),
    ]
    keys = [f"k{i}" for i in range(7)]
    plane.kv_batch_put(
        keys, part, {"values": values, "tensors": NonTensorStack(*tensors, batch_size=[7]), "same": ["x"] * 7}
    )
    order = [6, 0, 3, 1]
    got = plane.kv_batch_get([keys[i] for i in order], part, ["values", "tensors"])
    assert isinstance(got.get("values"), NonTensorStack)
    out = list(got["values"])
    assert out == [values[i] for i in order]
    assert type(out[3]) is tuple and type(out[0]) is set  # msgpack alone would give lists
    for t, i in zip(got["tensors"], order):
        want = tensors[i]
        # The package alone packs these into one nested tensor of a single dtype.
        assert t.dtype == want.dtype and t.shape == want.shape and torch.equal(t, want)
    one = plane.kv_batch_get(["k2"], part, ["values", "same"])
    assert one["values"] == [values[2]] and one["same"] == ["x"]


def test_rows_follow_the_order_of_the_keys_asked_for(plane, part) -> None:
    plane.kv_batch_put(["a", "b", "c"], part, {"x": torch.tensor([[1, 10], [2, 20], [3, 30]])})
    plane.kv_batch_put(["d", "e"], part, {"x": torch.tensor([[4, 40], [5, 50]])})
    got = plane.kv_batch_get(["e", "a", "d", "a", "c"], part, ["x"])
    assert torch.equal(got["x"], torch.tensor([[5, 50], [1, 10], [4, 40], [1, 10], [3, 30]]))
    assert plane.kv_list(part) == ["a", "b", "c", "d", "e"]


def test_missing_keys_fields_and_partitions_name_what_is_missing(plane, part) -> None:
    plane.kv_batch_put(["a", "b", "c"], part, {"x": torch.zeros(3, 2)})
    plane.kv_batch_put(["b"], part, {"y": torch.ones(1)})

    with pytest.raises(FieldNotFoundError) as err:
        plane.kv_batch_get(["a", "zz", "b", "yy"], part, ["x"])
    assert isinstance(err.value, KeyError)
    assert err.value.keys == ["zz", "yy"] and err.value.fields == [] and err.value.partition_id == part
    assert str(err.value) == f"key(s) ['zz', 'yy'] not found in partition {part!r}"

    with pytest.raises(FieldNotFoundError) as err:
        plane.kv_batch_get(["a"], part, ["x", "nope", "never"])
    assert err.value.fields == ["nope", "never"] and err.value.keys == []

    with pytest.raises(FieldNotFoundError) as err:  # y exists, but only for b
        plane.kv_batch_get(["a", "b", "c"], part, ["x", "y"])
    assert err.value.fields == ["y"] and err.value.keys == ["a", "c"]
    assert str(err.value) == f"field(s) ['y'] and key(s) ['a', 'c'] not found in partition {part!r}"

    with pytest.raises(FieldNotFoundError) as err:
        plane.kv_batch_get(["a"], "no-such-partition", ["x"])
    assert err.value.fields == ["x"] and err.value.keys == ["a"] and err.value.partition_id == "no-such-partition"

    # Nothing was filled in: the partial field still reads for the key that has it.
    assert torch.equal(plane.kv_batch_get(["b"], part, ["y"])["y"], torch.ones(1))


def test_incompatible_put_is_refused_and_writes_nothing(plane, part) -> None:
    plane.kv_batch_put(["a", "b"], part, {"x": torch.zeros(2, 3), "names": ["p", "q"]})
    with pytest.raises(
        ValueError,
        match=r"field 'x' in partition .* holds rows of shape \(3,\) and dtype float32; "
        r"this put gives \(4,\) float32",
    ):
        plane.kv_batch_put(["c"], part, {"x": torch.zeros(1, 4)})
    with pytest.raises(ValueError, match="dtype float32; this put gives \\(3,\\) int64"):
        plane.kv_batch_put(["c"], part, {"x": torch.zeros(1, 3, dtype=torch.int64)})
    with pytest.raises(ValueError, match="field 'names' .* was stored as list; this put gives dense"):
        plane.kv_batch_put(["c"], part, {"ok": torch.ones(1), "names": torch.ones(1, 2)})
    with pytest.raises(ValueError, match="field 'x' has 1 rows for 2 keys"):
        plane.kv_batch_put(["c", "d"], part, {"x": torch.zeros(1, 3)})
    with pytest.raises(ValueError, match="duplicate keys"):
        plane.kv_batch_put(["c", "c"], part, {"x": torch.zeros(2, 3)})
    assert plane.kv_list(part) == ["a", "b"]
    with pytest.raises(FieldNotFoundError):  # the refused put registered no field either
        plane.kv_batch_get(["a"], part, ["ok"])


def test_handle_lists_common_fields_and_tags_replace(plane, part) -> None:
    meta = plane.kv_batch_put(["a", "b"], part, {"x": torch.zeros(2, 1)}, tags=[{"len": 3}, {"len": 5}])
    assert meta.fields == ["x"] and meta.tags == [{"len": 3}, {"len": 5}]
    meta = plane.kv_batch_put(["b", "c"], part, {"y": torch.ones(2)})
    assert meta.fields == ["y"]  # c has no x
    assert meta.tags == [{"len": 5}, {}]  # no tags given: b keeps its own
    meta = plane.kv_batch_put(["b"], part, {"z": torch.ones(1)}, tags=[{"done": True}])
    assert meta.fields == ["x", "y", "z"] and meta.tags == [{"done": True}]
    with pytest.raises(ValueError, match="2 tags for 1 keys"):
        plane.kv_batch_put(["b"], part, {"z": torch.ones(1)}, tags=[{}, {}])


def test_get_of_no_keys_keeps_each_kind(plane, part) -> None:
    plane.kv_batch_put(
        ["a", "b"],
        part,
        {
            "dense": torch.zeros(2, 3, dtype=torch.float16),
            "ragged": torch.nested.as_nested_tensor([torch.ones(2, 4), torch.ones(1, 4)], layout=torch.jagged),
            "names": ["u", "v"],
        },
    )
    got = plane.kv_batch_get([], part, ["dense", "ragged", "names"])
    assert got.batch_size == torch.Size([0])
    assert got["dense"].shape == (0, 3) and got["dense"].dtype == torch.float16 and not got["dense"].is_nested
    assert got.get("ragged").is_nested and got.get("ragged").dtype == torch.float32
    assert isinstance(got.get("names"), NonTensorStack) and len(got.get("names")) == 0
    with pytest.raises(FieldNotFoundError) as err:
        plane.kv_batch_get([], part, ["nope"])
    assert err.value.fields == ["nope"]


def test_clear_keys_then_partition(plane, part) -> None:
    plane.kv_batch_put(["a", "b", "c"], part, {"x": torch.arange(6).reshape(3, 2)})
    plane.kv_clear(part, ["b", "not-there"])
    assert plane.kv_list(part) == ["a", "c"]
    with pytest.raises(FieldNotFoundError) as err:
        plane.kv_batch_get(["b"], part, ["x"])
    assert err.value.keys == ["b"]
    assert torch.equal(plane.kv_batch_get(["c", "a"], part, ["x"])["x"], torch.tensor([[4, 5], [0, 1]]))
    assert part in plane.list_partitions()
    assert not any(p.startswith(SCHEMA_PREFIX) for p in plane.list_partitions())

    plane.kv_clear(part)
    assert plane.kv_list(part) == [] and part not in plane.list_partitions()
    assert plane._run(plane._keys(SCHEMA_PREFIX + part), "list") is None  # the field record is gone too
    with pytest.raises(FieldNotFoundError):
        plane.kv_batch_get(["a"], part, ["x"])
    # The field record went with the partition: x may now have another shape.
    plane.kv_batch_put(["a"], part, {"x": torch.ones(1, 5)})
    assert plane.kv_batch_get(["a"], part, ["x"])["x"].shape == (1, 5)
    plane.kv_clear(part, ["a"])  # clearing the last key drops the partition too
    assert part not in plane.list_partitions()
    plane.kv_clear("never-written")  # unknown partitions are ignored


def test_reserved_partition_names_are_refused(plane) -> None:
    with pytest.raises(ValueError, match="reserved prefix"):
        plane.kv_batch_put(["a"], SCHEMA_PREFIX + "x", {"x": torch.ones(1)})


def test_metrics_count_samples_bytes_and_live_keys(plane, part) -> None:
    metrics = DataPlaneMetrics("transferqueue")
    plane.metrics = metrics
    try:
        plane.kv_batch_put(
            ["a", "b", "c"],
            part,
            {
                "x": torch.zeros(3, 4),
                "r": [torch.ones(2, dtype=torch.int16), "s", 1],
            },
        )
        plane.kv_batch_get(["a", "c"], part, ["x"])
        plane.kv_clear(part, ["a"])
    finally:
        plane.metrics = None
    reg = metrics.registry
    assert reg.get_sample_value("conveyor_dataplane_put_samples_total", {"backend": "transferqueue"}) == 3
    assert reg.get_sample_value("conveyor_dataplane_put_bytes_total", {"backend": "transferqueue"}) == 3 * 4 * 4 + 2 * 2
    assert reg.get_sample_value("conveyor_dataplane_get_samples_total", {"backend": "transferqueue"}) == 2
    assert reg.get_sample_value("conveyor_dataplane_get_bytes_total", {"backend": "transferqueue"}) == 2 * 4 * 4
    assert reg.get_sample_value("conveyor_dataplane_live_samples", {"backend": "transferqueue", "partition": part}) == 2
    latency = {"backend": "transferqueue", "op": "put"}
    assert reg.get_sample_value("conveyor_dataplane_op_latency_seconds_count", latency) == 1


def test_pickled_copy_and_named_attach_share_the_store_and_own_nothing(plane, part) -> None:
    copy = pickle.loads(pickle.dumps(plane))
    copy.kv_batch_put(["w"], part, {"from_copy": torch.tensor([[7, 8]])})
    assert torch.equal(plane.kv_batch_get(["w"], part, ["from_copy"])["from_copy"], torch.tensor([[7, 8]]))
    copy.close()

    attached = TransferQueueDataPlane(controller_name=plane.controller_name)
    assert attached.kv_list(part) == ["w"]
    attached.close()
    # Closing the copies stopped nothing: the owner still reads and writes.
    plane.kv_batch_put(["v"], part, {"from_copy": torch.tensor([[1, 2]])})
    assert plane.kv_list(part) == ["w", "v"]

    with pytest.raises(ValueError, match="no TransferQueue controller named 'nobody'"):
        TransferQueueDataPlane(controller_name="nobody")


def test_config_mistakes_fail_fast_with_the_key_named(plane) -> None:
    with pytest.raises(
        ValueError,
        match=r"transferqueue\.backend\.SimpleStorag is not a TransferQueue setting; "
        r"did you mean transfer_queue\.transferqueue\.backend\.SimpleStorage\?",
    ):
        TransferQueueDataPlane(tq_config={"backend": {"SimpleStorag": {}}})
    with pytest.raises(ValueError, match="storage_backend='Redis' is not a TransferQueue storage backend"):
        make_data_plane("transferqueue", tq_config={"backend": {"storage_backend": "Redis"}})
    # More logical CPUs than Ray has: refused before any actor is started, not left pending.
    with pytest.raises(RuntimeError, match="needs 3000 logical Ray CPUs"):
        TransferQueueDataPlane(actor_cpus=1000)


def test_whole_batch_as_tensordict(plane, part) -> None:
    ids = torch.randint(0, 100, (4, 6))
    td = TensorDict({"input_ids": ids, "mask": torch.ones(4, 6, dtype=torch.bool)}, batch_size=[4])
    meta = plane.kv_batch_put([f"s{i}" for i in range(4)], part, td)
    got = plane.get(meta, ["input_ids", "mask"])
    assert torch.equal(got["input_ids"], td["input_ids"]) and torch.equal(got["mask"], td["mask"])


def test_close_stops_what_it_started(plane) -> None:
    """Runs last: it closes the module's plane."""
    started_ray = plane._started_ray
    name = plane.controller_name
    units = list(plane._storage["SimpleStorage"].values())
    assert len(units) == 2 and ray.get_actor(name, namespace=NAMESPACE) is not None
    plane.close()
    plane.close()  # twice is fine
    assert plane.closed
    if started_ray:
        assert not ray.is_initialized()  # it started Ray, so it stopped it (and every actor with it)
    else:
        with pytest.raises(ValueError):
            ray.get_actor(name, namespace=NAMESPACE)
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(units[0].get_zmq_server_info.remote(), timeout=30)
    with pytest.raises(RuntimeError, match="the data plane is closed"):
        plane.kv_batch_put(["b"], "p", {"x": torch.ones(1, 2)})
    with pytest.raises(RuntimeError, match="the data plane is closed"):
        plane.kv_batch_get(["a"], "p", ["x"])
    with pytest.raises(RuntimeError, match="cannot pickle a closed"):
        pickle.dumps(plane)
    assert plane.kv_list("p") == []
