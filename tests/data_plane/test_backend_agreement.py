"""The three backends agree: one sequence of puts, gets, listings and clears gives the same outcome on each.

The sequence covers dense, ragged and list columns, overwrites, puts of some
keys only, puts that change a field's dtype, row shape or kind (refused, see
`DataPlane.kv_batch_put`), gets of missing fields, keys and partitions, gets
and puts of no keys, and clearing keys and partitions. Every step's outcome
(the handle, the batch, the listing, or the exception with its message) is
recorded on `memory`, the reference, and compared on `ray` and `transferqueue`
(each skipped without its package) and on `memory` served over its socket to
another process's client (`conveyor.data_plane.served`). A few reference outcomes are pinned too,
so the backends cannot agree on the wrong rule.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from tensordict import TensorDict

from conveyor.data_plane import DataPlane, FieldNotFoundError, make_data_plane
from conveyor.protocol import KVBatchMeta

Outcome = tuple[str, Any]


# --------------------------------------------------------------------------- recording outcomes
def _value(v: Any) -> Any:
    """A per-sample value of a list column, tensors tagged so the comparison checks dtype and shape."""
    return ("tensor", v) if isinstance(v, torch.Tensor) else ("value", type(v).__name__, v)


def _column(value: Any) -> tuple:
    if isinstance(value, torch.Tensor) and value.is_nested:
        return "nested", value.layout, value.dtype, list(value.unbind(0))
    if isinstance(value, torch.Tensor):
        return "dense", value
    return "list", [_value(v) for v in value.tolist()]


def _normalise(result: Any) -> Any:
    if isinstance(result, KVBatchMeta):
        return {"keys": result.keys, "partition_id": result.partition_id, "fields": result.fields, "tags": result.tags}
    if isinstance(result, TensorDict):
        return {"batch_size": tuple(result.batch_size), **{name: _column(result.get(name)) for name in result.keys()}}
    return result


def observe(action: Callable[[], Any]) -> Outcome:
    """What one operation gave: ("returned", its normalised result) or ("raised", type, details)."""
    try:
        result = action()
    except FieldNotFoundError as err:
        return "raised", ("FieldNotFoundError", err.partition_id, err.fields, err.keys, str(err))
    except Exception as err:  # noqa: BLE001  (the type and message are the outcome)
        return "raised", (type(err).__name__, str(err))
    return "returned", _normalise(result)


def difference(got: Any, want: Any, where: str) -> str | None:
    """Where `got` and `want` first differ (tensors by dtype, shape and every value), or None."""
    if isinstance(want, torch.Tensor) or isinstance(got, torch.Tensor):
        if not (isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor)):
            return f"{where}: {got!r} != {want!r}"
        if got.is_nested != want.is_nested or got.dtype != want.dtype or got.shape != want.shape:
            return f"{where}: tensor {got.dtype} {tuple(got.shape)} != {want.dtype} {tuple(want.shape)}"
        return None if torch.equal(got, want) else f"{where}: values {got} != {want}"
    if isinstance(want, dict) and isinstance(got, dict):
        if list(got) != list(want):
            return f"{where}: keys {list(got)} != {list(want)}"
        return next((d for k in want if (d := difference(got[k], want[k], f"{where}.{k}"))), None)
    if isinstance(want, (list, tuple)) and isinstance(got, (list, tuple)) and type(got) is type(want):
        if len(got) != len(want):
            return f"{where}: length {len(got)} != {len(want)} ({got!r} != {want!r})"
        return next((d for i, (g, w) in enumerate(zip(got, want)) if (d := difference(g, w, f"{where}[{i}]"))), None)
    return None if type(got) is type(want) and got == want else f"{where}: {got!r} != {want!r}"


# --------------------------------------------------------------------------- the sequence
def _nested(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def scenario(plane: DataPlane, pid: str, other: str) -> list[tuple[str, Outcome]]:
    """Run the sequence on `plane` (partitions `pid` and `other`, unused before); each step's label and outcome."""
    steps: list[tuple[str, Outcome]] = []

    def step(label: str, action: Callable[[], Any]) -> None:
        steps.append((label, observe(action)))

    put, get = plane.kv_batch_put, plane.kv_batch_get
    gen = torch.Generator().manual_seed(0)
    keys = ["k0", "k1", "k2", "k3"]
    every = ["x", "ids", "flags", "half", "ragged", "ragged_2d", "names", "extras", "tensors"]
    fields = {
        "x": torch.randn(4, 3, generator=gen),
        "ids": torch.arange(4, dtype=torch.int64) * 7,
        "flags": torch.tensor([[True, False], [False, False], [True, True], [False, True]]),
        "half": (torch.randn(4, 2, 2, generator=gen) * 10).to(torch.bfloat16),
        "ragged": _nested([torch.arange(n, dtype=torch.int64) for n in (2, 1, 3, 1)]),
        "ragged_2d": _nested([torch.randn(n, 2, generator=gen).to(torch.float16) for n in (1, 3, 2, 2)]),
        "names": ["a", "héllo", "", "d"],
        "extras": [{"gt": "4", "n": [1, 2]}, None, (1, 2), 2.5],
        "tensors": [
            torch.zeros(2, 3),
            torch.arange(4, dtype=torch.int8),
            torch.ones(1, 1, dtype=torch.bfloat16),
            torch.tensor(5),
        ],
    }
    step("put every kind of column", lambda: put(keys, pid, fields, tags=[{"seq_len": i} for i in range(4)]))
    step("get in another order, with a repeat", lambda: get(["k2", "k0", "k3", "k0", "k1"], pid, every))
    step(
        "overwrite two keys, no tags",
        lambda: put(
            ["k2", "k1"],
            pid,
            {
                "x": torch.randn(2, 3, generator=gen),
                "names": ["C", "B"],
                "ragged": _nested([torch.arange(5, dtype=torch.int64), torch.arange(2, dtype=torch.int64)]),
            },
        ),
    )
    step("get after the overwrite", lambda: get(keys, pid, ["x", "names", "ragged", "ids"]))
    step("overwrite with tags", lambda: put(["k3"], pid, {"ids": torch.tensor([99])}, tags=[{"done": True}]))
    step("put of new keys with one field", lambda: put(["k4", "k5"], pid, {"x": torch.randn(2, 3, generator=gen)}))
    step(
        "a new field for some keys",
        lambda: put(["k0", "k4"], pid, {"score": torch.tensor([0.5, -1.0], dtype=torch.float64)}),
    )
    step("get a field only some keys have", lambda: get(["k0", "k1", "k4"], pid, ["score"]))
    step("get it for the keys that have it", lambda: get(["k4", "k0"], pid, ["score", "x"]))
    step("a field of one key only", lambda: put(["k5"], pid, {"late": torch.ones(1, 2)}))
    step("get of a missing field", lambda: get(["k0"], pid, ["x", "nope"]))
    step("get of missing keys", lambda: get(["k0", "zz", "k1", "yy"], pid, ["x"]))
    step("get from an unknown partition", lambda: get(["k0"], pid + "-none", ["x"]))

    # Puts that change what a field holds: refused, whole.
    step("dtype change", lambda: put(["k0"], pid, {"x": torch.zeros(1, 3, dtype=torch.float64)}))
    step("row shape change", lambda: put(["k0"], pid, {"x": torch.zeros(1, 4)}))
    step(
        "dtype change overwriting every row",
        lambda: put(["k0", "k1", "k2", "k3", "k4", "k5"], pid, {"x": torch.zeros(6, 3, dtype=torch.int64)}),
    )
    step("ragged dtype change", lambda: put(["k0"], pid, {"ragged": _nested([torch.ones(2)])}))
    step(
        "ragged row shape change",
        lambda: put(["k0"], pid, {"ragged_2d": _nested([torch.ones(2, 3, dtype=torch.float16)])}),
    )
    step("dense to list", lambda: put(["k0"], pid, {"x": [1]}))
    step("list to dense", lambda: put(["k0"], pid, {"names": torch.ones(1)}))
    step("dense to ragged", lambda: put(["k0"], pid, {"ids": _nested([torch.arange(3)])}))
    # The field's record is the partition's, not the keys': a key that lacks the field cannot change it either
    # (on the ray backend, with three storage actors, no key of k1's actor has the field).
    step("dtype change on a key without the field", lambda: put(["k1"], pid, {"score": torch.ones(1)}))
    step("dtype change on a new key", lambda: put(["k9"], pid, {"late": torch.ones(1, 2, dtype=torch.int64)}))
    step(
        "refused put with a new key, a new field and tags",
        lambda: put(["k9", "k0"], pid, {"fresh": torch.ones(2), "x": torch.zeros(2, 4)}, tags=[{"t": 1}, {"t": 2}]),
    )
    step("the refused put wrote no key", lambda: plane.kv_list(pid))
    step("the refused put wrote no field", lambda: get(["k0"], pid, ["fresh"]))
    step("the refused put wrote no rows or tags", lambda: put(["k0"], pid, {"ids": torch.tensor([-1])}))
    step("get after the refusals", lambda: get(keys, pid, ["x", "ids", "ragged", "ragged_2d", "names"]))
    step("a list column takes any values", lambda: put(["k0", "k1"], pid, {"names": [torch.ones(2), {"a": 1}]}))
    step("get the new list values", lambda: get(["k1", "k0"], pid, ["names"]))

    # Zero keys: a get keeps each kind; a put writes (and checks) nothing.
    step("get of no keys", lambda: get([], pid, every))
    step("get of no keys, missing field", lambda: get([], pid, ["x", "nope"]))
    step("put of no keys", lambda: put([], pid, {"x": torch.zeros(0, 0, dtype=torch.int64), "ghost": []}))
    step("the put of no keys created no field", lambda: get([], pid, ["ghost"]))
    step("nor changed one", lambda: put(["k0"], pid, {"x": torch.ones(1, 3)}))
    step("put of no keys to a new partition", lambda: put([], pid + "-empty", {"x": torch.zeros(0, 2)}))
    step("which stays unknown", lambda: get([], pid + "-empty", ["x"]))

    step("list keys", lambda: plane.kv_list(pid))
    step("list an unknown partition", lambda: plane.kv_list(pid + "-none"))
    step(
        "the same field name in another partition, another dtype and shape",
        lambda: put(["k0"], other, {"x": torch.arange(5).reshape(1, 5)}),
    )
    step("get from the other partition", lambda: get(["k0"], other, ["x"]))

    step("clear some keys", lambda: plane.kv_clear(pid, ["k1", "k4", "absent"]))
    step("list after clearing keys", lambda: plane.kv_list(pid))
    step("get of a cleared key", lambda: get(["k1"], pid, ["x"]))
    step("get of the keys left", lambda: get(["k5", "k0", "k2", "k3"], pid, ["x", "names", "late"]))
    step("dtype change while the partition holds data", lambda: put(["k1"], pid, {"x": torch.zeros(1, 3).double()}))
    step("clear the only key with a field", lambda: plane.kv_clear(pid, ["k5"]))
    step("the field keeps its record", lambda: put(["k3"], pid, {"late": torch.ones(1, 3)}))
    step("nor is it back", lambda: get(["k3"], pid, ["late"]))
    step("a get of no keys still knows it", lambda: get([], pid, ["late", "x"]))
    step("clear the partition", lambda: plane.kv_clear(pid))
    step("list the cleared partition", lambda: plane.kv_list(pid))
    step("get from the cleared partition", lambda: get(["k0"], pid, ["x"]))
    step(
        "after clearing the partition a field may change",
        lambda: put(["k0", "k1"], pid, {"x": torch.arange(10).reshape(2, 5), "names": torch.ones(2)}),
    )
    step("get the changed fields", lambda: get(["k1", "k0"], pid, ["x", "names"]))
    step("clear the last key of a partition", lambda: plane.kv_clear(other, ["k0"]))
    step("list it", lambda: plane.kv_list(other))
    step("its fields may change too", lambda: put(["k0"], other, {"x": torch.ones(1, 2, dtype=torch.float16)}))
    step("get it", lambda: get(["k0"], other, ["x"]))
    step("clear an unknown partition", lambda: plane.kv_clear(pid + "-none"))
    for p in (pid, other):
        plane.kv_clear(p)
    return steps


# --------------------------------------------------------------------------- the backends
@pytest.fixture(scope="module")
def ray_session():
    """One local Ray for the module if a backend needs it; logical CPUs, so the 0.05-CPU actors fit on 2 cores."""
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        # address="local": a Ray of its own, even when another process on this machine runs one.
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


def _make(backend: str) -> DataPlane:
    if backend == "ray":
        # Three storage actors, so a put spans several of them.
        return make_data_plane("ray", num_storage_actors=3, actor_cpus=0.05)
    if backend == "transferqueue":
        pytest.importorskip("transfer_queue")
        return make_data_plane(
            "transferqueue", actor_cpus=0.05, tq_config={"backend": {"SimpleStorage": {"num_data_storage_units": 2}}}
        )
    return make_data_plane(backend)


def _run(backend: str) -> list[tuple[str, Outcome]]:
    with _make(backend) as plane:  # a fresh plane, so the same partition names on every backend
        return scenario(plane, "agree", "other")


@pytest.fixture(scope="module")
def reference() -> list[tuple[str, Outcome]]:
    """The sequence's outcomes on the memory backend."""
    return _run("memory")


@pytest.mark.parametrize("backend", ["ray", "transferqueue"])
def test_backend_agrees_with_memory(backend: str, reference: list, request: pytest.FixtureRequest) -> None:
    request.getfixturevalue("ray_session")
    got = _run(backend)
    assert [label for label, _ in got] == [label for label, _ in reference]
    differences = [d for (label, g), (_, w) in zip(got, reference) if (d := difference(g, w, label))]
    assert not differences, f"{backend} disagrees with memory:\n" + "\n".join(differences)


def test_the_memory_plane_served_over_its_socket_agrees_with_itself(reference: list) -> None:
    """What a worker in another process sees (`ServedDataPlane`): the same handles, batches and errors."""
    from conveyor.data_plane.served import DataPlaneServer

    with make_data_plane("memory") as plane:
        server = DataPlaneServer(plane)
        try:
            client = server.client()
            got = scenario(client, "agree", "other")
            client.close()
        finally:
            server.close()
    assert [label for label, _ in got] == [label for label, _ in reference]
    differences = [d for (label, g), (_, w) in zip(got, reference) if (d := difference(g, w, label))]
    assert not differences, "served disagrees with memory:\n" + "\n".join(differences)


def test_reference_outcomes(reference: list) -> None:
    """The rule the backends agree on: changing a field's dtype, row shape or kind is refused, whole."""
    out = dict(reference)
    for label in (
        "dtype change",
        "row shape change",
        "dtype change overwriting every row",
        "ragged dtype change",
        "ragged row shape change",
        "dense to list",
        "list to dense",
        "dense to ragged",
        "refused put with a new key, a new field and tags",
        "dtype change while the partition holds data",
        "dtype change on a key without the field",
        "dtype change on a new key",
        "the field keeps its record",
    ):
        kind, (error, message) = out[label]
        assert (kind, error) == ("raised", "ValueError"), label
        assert "in partition 'agree'" in message and "clear the partition" in message, label
    assert (
        out["dtype change"][1][1].startswith("field 'x' in partition 'agree'")
        and "holds rows of shape (3,) and dtype float32; this put gives (3,) float64" in out["dtype change"][1][1]
    )
    assert (
        "holds ragged rows of shape (*, 2) and dtype float16; this put gives (*, 3) float16"
        in out["ragged row shape change"][1][1]
    )
    assert "was stored as dense; this put gives list" in out["dense to list"][1][1]
    assert out["the refused put wrote no key"] == ("returned", ["k0", "k1", "k2", "k3", "k4", "k5"])
    assert out["the refused put wrote no field"][1][0] == "FieldNotFoundError"
    assert out["the refused put wrote no rows or tags"][1]["tags"] == [{"seq_len": 0}]
    for label in (
        "a list column takes any values",
        "nor changed one",
        "the same field name in another partition, another dtype and shape",
        "after clearing the partition a field may change",
        "its fields may change too",
    ):
        assert out[label][0] == "returned", label
    assert out["put of no keys"] == (
        "returned",
        {"keys": [], "partition_id": out["put of no keys"][1]["partition_id"], "fields": ["x", "ghost"], "tags": []},
    )
    assert out["the put of no keys created no field"][1][0] == "FieldNotFoundError"
    assert out["which stays unknown"][1][0] == "FieldNotFoundError"
    assert out["get a field only some keys have"][1][2:4] == (["score"], ["k1"])
