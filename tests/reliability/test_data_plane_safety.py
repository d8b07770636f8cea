"""The memory data plane under concurrency and clears: nothing lost, nothing mixed up, nothing half-read.

tests/data_plane/test_memory.py covers single-partition round trips and
concurrent writers on one partition; here several partitions are written,
read and cleared at the same time (as overlapping steps and validation do),
and a model-based property test checks every sequence of puts and clears
against a plain-Python model of what the store must hold.
"""

from __future__ import annotations

import concurrent.futures
import random
import sys
import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from conveyor.data_plane import FieldNotFoundError, make_data_plane
from conveyor.data_plane.memory import MemoryDataPlane


@pytest.fixture(autouse=True)
def _switch_threads_often():
    """Make the interpreter switch threads every few microseconds, so the races below really interleave."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(old)


DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
]


def _row_x(pid: str, key: str) -> torch.Tensor:
    """The dense (3,) row of `key` in partition `pid`, recomputable by any reader."""
    h = sum(ord(c) * 131**i for i, c in enumerate(f"{pid}/{key}")) % 1_000_003
    return torch.tensor([h, h % 97, -h], dtype=torch.int64)


def _row_r(pid: str, key: str) -> torch.Tensor:
    """A ragged row: its length depends on the key."""
    n = 1 + int(_row_x(pid, key)[1]) % 5
    return torch.arange(n, dtype=torch.float32) + float(_row_x(pid, key)[0])


def _check_rows(got, pid: str, keys: list[str], fields: list[str]) -> None:
    if "x" in fields:
        assert torch.equal(got["x"], torch.stack([_row_x(pid, k) for k in keys]))
    if "r" in fields:
        r = got["r"]
        rows = list(r.unbind(0)) if isinstance(r, torch.Tensor) and r.is_nested else list(r)
        assert len(rows) == len(keys)
        for row, k in zip(rows, keys):
            assert torch.equal(row, _row_r(pid, k))
    if "name" in fields:
        assert list(got["name"]) == [f"{pid}/{k}" for k in keys]


def test_partitions_written_read_and_cleared_concurrently_lose_nothing() -> None:
    """Writers fill several partitions stage by stage while readers verify and clearers drop finished ones."""
    plane = make_data_plane("memory")
    partitions = [f"step-{i}" for i in range(8)]
    puts, rows = 6, 5
    ready: dict[str, list[list[str]]] = {p: [] for p in partitions}  # batches whose every field is written
    lock = threading.Lock()
    verified: dict[str, set[str]] = {p: set() for p in partitions}
    cleared: list[str] = []  # marked before the clear starts, so a reader that races it knows
    writers_done = threading.Event()

    def write(pid: str) -> None:
        for i in range(puts):
            keys = [f"s{i}-{j}" for j in range(rows)]
            # Two puts per batch, like two stages: a reader only sees a batch once both landed.
            plane.kv_batch_put(keys, pid, {"x": torch.stack([_row_x(pid, k) for k in keys])})
            plane.kv_batch_put(keys, pid, {"r": [_row_r(pid, k) for k in keys], "name": [f"{pid}/{k}" for k in keys]})
            with lock:
                ready[pid].append(keys)

    def read(seed: int) -> int:
        rng = random.Random(seed)
        checked = 0
        while True:
            finished = writers_done.is_set()
            with lock:
                live = [(p, [k for b in ready[p] for k in b]) for p in partitions if ready[p] and p not in cleared]
            if not live:
                if finished:  # every partition was verified and cleared
                    return checked
                time.sleep(0.0005)
                continue
            pid, keys = rng.choice(live)
            ask = rng.sample(keys, min(len(keys), rng.randint(1, 12)))  # spans several puts, any order
            fields = rng.sample(["x", "r", "name"], rng.randint(1, 3))
            try:
                got = plane.kv_batch_get(ask, pid, fields)
            except FieldNotFoundError as err:
                with lock:
                    assert pid in cleared, f"{pid} lost data without being cleared: {err}"
                continue
            _check_rows(got, pid, ask, fields)
            with lock:
                verified[pid].update(ask)
            checked += len(ask)

    def clear() -> None:
        # Clear each partition once every key of it has been read back correctly at least once.
        pending = list(partitions)
        while pending:
            for pid in list(pending):
                with lock:
                    complete = len(ready[pid]) == puts and len(verified[pid]) == puts * rows
                    if complete:
                        cleared.append(pid)
                if complete:
                    if pid.endswith(("0", "2", "4", "6")):
                        plane.kv_clear(pid)
                    else:  # key by key, the way a partial clear happens
                        plane.kv_clear(pid, keys=[k for b in ready[pid] for k in b])
                    pending.remove(pid)
            time.sleep(0.0005)

    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        readers = [pool.submit(read, s) for s in range(3)]
        clearer = pool.submit(clear)
        writes = [pool.submit(write, p) for p in partitions]
        for f in writes:
            f.result(timeout=60)
        writers_done.set()
        counts = [f.result(timeout=60) for f in readers]
        clearer.result(timeout=60)
    assert all(c > 0 for c in counts)
    assert sorted(cleared) == partitions
    assert all(len(verified[p]) == puts * rows for p in partitions)  # every sample was read back exactly
    assert isinstance(plane, MemoryDataPlane) and plane.list_partitions() == []
    for pid in partitions:
        with pytest.raises(FieldNotFoundError) as info:
            plane.kv_batch_get(["s0-0"], pid, ["x"])
        assert repr(pid) in str(info.value)
    plane.close()


def test_a_read_racing_a_clear_gets_all_or_nothing() -> None:
    """A get of a partition being cleared returns the exact rows or raises FieldNotFoundError, never partial rows."""
    plane = make_data_plane("memory")
    keys = [f"k{j}" for j in range(16)]
    stop = threading.Event()
    outcomes = {"rows": 0, "missing": 0}

    def churn() -> int:
        cycles = 0
        while not stop.is_set():
            plane.kv_batch_put(keys, "hot", {"x": torch.stack([_row_x("hot", k) for k in keys])})
            plane.kv_batch_put(keys, "hot", {"r": [_row_r("hot", k) for k in keys]})
            time.sleep(0.0001)  # a window in which the partition is complete
            plane.kv_clear("hot", keys=keys[:8])
            plane.kv_clear("hot")
            time.sleep(0.0001)  # and one in which it is gone
            cycles += 1
        return cycles

    def read(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(400):
            ask = rng.sample(keys, 6)
            try:
                got = plane.kv_batch_get(ask, "hot", ["x", "r"])
            except FieldNotFoundError as err:
                assert err.partition_id == "hot"
                outcomes["missing"] += 1
                time.sleep(0)
                continue
            _check_rows(got, "hot", ask, ["x", "r"])
            outcomes["rows"] += 1
            time.sleep(0)
        # The partition next door is never touched by the churn.
        _check_rows(plane.kv_batch_get(["a", "b"], "calm", ["x"]), "calm", ["a", "b"], ["x"])

    plane.kv_batch_put(["a", "b"], "calm", {"x": torch.stack([_row_x("calm", k) for k in "ab"])})
    with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
        churner = pool.submit(churn)
        readers = [pool.submit(read, s) for s in range(2)]
        for f in readers:
            f.result(timeout=60)
        stop.set()
        assert churner.result(timeout=60) > 0
    assert outcomes["rows"] + outcomes["missing"] == 800
    assert outcomes["rows"] > 0 and outcomes["missing"] > 0, outcomes  # both sides of the race happened
    assert plane.list_partitions() == ["calm"]
    plane.close()


def test_get_of_a_cleared_partition_raises_and_names_it() -> None:
    plane = make_data_plane("memory")
    plane.kv_batch_put(["a", "b"], "train-3", {"x": torch.zeros(2, 2)})
    plane.kv_batch_put(["a"], "val-3", {"x": torch.ones(1, 2)})
    plane.kv_clear("train-3")
    with pytest.raises(FieldNotFoundError) as info:
        plane.kv_batch_get(["a"], "train-3", ["x"])
    assert info.value.partition_id == "train-3" and "'train-3'" in str(info.value) and "'x'" in str(info.value)
    assert isinstance(info.value, KeyError)
    assert torch.equal(plane.kv_batch_get(["a"], "val-3", ["x"])["x"], torch.ones(1, 2))
    # Clearing key by key until none is left drops the partition too.
    plane.kv_clear("val-3", keys=["a"])
    with pytest.raises(FieldNotFoundError, match="'val-3'"):
        plane.kv_batch_get(["a"], "val-3", ["x"])
    assert plane.list_partitions() == []
    plane.close()


# --------------------------------------------------------------------------- model-based property test
_PARTS = ["p0", "p1", "p2"]
_KEYS = [f"k{i}" for i in range(6)]
_FIELDS = ["x", "y"]


def _random_rows(n: int, spec: tuple[torch.dtype, tuple[int, ...]], seed: int) -> torch.Tensor:
    dtype, trailing = spec
    gen = torch.Generator().manual_seed(seed)
    shape = (n, *trailing)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen) * 50).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -(2**31)), min(info.max, 2**31 - 1), shape, generator=gen).to(dtype)


class MultiPartitionModel(RuleBasedStateMachine):
    """Random puts and clears over several partitions, checked against a dict model after every step."""

    @initialize()
    def start(self) -> None:
        self.plane = make_data_plane("memory")
        # pid -> key order, field -> key -> row, field -> (dtype, trailing) fixed while the partition lives
        self.keys: dict[str, dict[str, None]] = {}
        self.rows: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
        self.specs: dict[str, dict[str, tuple[torch.dtype, tuple[int, ...]]]] = {}

    def teardown(self) -> None:
        if hasattr(self, "plane"):
            self.plane.close()

    @rule(
        pid=st.sampled_from(_PARTS),
        keys=st.lists(st.sampled_from(_KEYS), min_size=1, max_size=4, unique=True),
        field=st.sampled_from(_FIELDS),
        seed=st.integers(0, 2**16),
        data=st.data(),
    )
    def put(self, pid: str, keys: list[str], field: str, seed: int, data: st.DataObject) -> None:
        spec = self.specs.get(pid, {}).get(field)
        if spec is None:
            spec = (data.draw(st.sampled_from(DTYPES)), tuple(data.draw(st.lists(st.integers(0, 3), max_size=2))))
        rows = _random_rows(len(keys), spec, seed)
        meta = self.plane.kv_batch_put(keys, pid, {field: rows})
        order = self.keys.setdefault(pid, {})
        order.update(dict.fromkeys(keys))
        self.specs.setdefault(pid, {})[field] = spec
        col = self.rows.setdefault(pid, {}).setdefault(field, {})
        for k, row in zip(keys, rows):
            col[k] = row
        assert meta.keys == keys and field in meta.fields

    @rule(pid=st.sampled_from(_PARTS), keys=st.lists(st.sampled_from(_KEYS), max_size=4, unique=True))
    def clear_keys(self, pid: str, keys: list[str]) -> None:
        self.plane.kv_clear(pid, keys=keys)
        if pid not in self.keys:
            return
        for k in keys:
            self.keys[pid].pop(k, None)
            for col in self.rows[pid].values():
                col.pop(k, None)
        if not self.keys[pid]:
            self._drop(pid)

    @rule(pid=st.sampled_from(_PARTS))
    def clear_partition(self, pid: str) -> None:
        self.plane.kv_clear(pid)
        self._drop(pid)

    def _drop(self, pid: str) -> None:
        for d in (self.keys, self.rows, self.specs):
            d.pop(pid, None)

    @rule(
        pid=st.sampled_from(_PARTS),
        keys=st.lists(st.sampled_from(_KEYS), min_size=1, max_size=6, unique=True),
        fields=st.lists(st.sampled_from(_FIELDS), min_size=1, max_size=2, unique=True),
    )
    def get(self, pid: str, keys: list[str], fields: list[str]) -> None:
        cols = self.rows.get(pid, {})
        present = pid in self.keys and all(f in cols and all(k in cols[f] for k in keys) for f in fields)
        if not present:
            with pytest.raises(FieldNotFoundError) as info:
                self.plane.kv_batch_get(keys, pid, fields)
            assert info.value.partition_id == pid
            return
        got = self.plane.kv_batch_get(keys, pid, fields)
        for f in fields:
            want = torch.stack([cols[f][k] for k in keys])
            assert got[f].dtype == want.dtype and got[f].shape == want.shape
            assert torch.equal(got[f], want)

    @invariant()
    def listing_matches(self) -> None:
        if not hasattr(self, "plane"):
            return
        for pid in _PARTS:
            assert self.plane.kv_list(pid) == list(self.keys.get(pid, {}))
        assert sorted(self.plane.list_partitions()) == sorted(self.keys)


MultiPartitionModel.TestCase.settings = settings(
    max_examples=40, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_multi_partition_puts_and_clears_match_the_model = MultiPartitionModel.TestCase
