"""call_with_deadline and map_with_deadline: results, exceptions raised through, and timeouts that do not wait."""

from __future__ import annotations

import threading
import time

import pytest

from conveyor.deadline import DeadlineExceeded, call_with_deadline, map_with_deadline


def test_returns_the_result_and_runs_in_a_daemon_thread() -> None:
    seen = []

    def fn(a, b):
        seen.append(threading.current_thread())
        return a + b

    assert call_with_deadline(fn, 2, 3, timeout_s=5, what="adding", key="x.timeout_s", thread_name="t1") == 5
    assert seen[0] is not threading.current_thread() and seen[0].daemon and seen[0].name == "t1"


def test_no_limit_calls_in_this_thread() -> None:
    assert call_with_deadline(threading.current_thread, timeout_s=0, what="w", key="k") is threading.current_thread()


@pytest.mark.parametrize("err", [RuntimeError("boom"), SystemExit(0), KeyboardInterrupt()])
@pytest.mark.parametrize("timeout_s", [5, 0])
def test_what_the_call_raises_is_raised_here(err: BaseException, timeout_s: float) -> None:
    def fn():
        raise err

    with pytest.raises(type(err)) as info:
        call_with_deadline(fn, timeout_s=timeout_s, what="w", key="k")
    assert info.value is err


def test_times_out_without_waiting_for_the_stuck_call() -> None:
    release = threading.Event()
    start = time.monotonic()
    with pytest.raises(
        DeadlineExceeded,
        match=r"^tool 'slow' did not return within a\.b\.timeout_s=0\.2s "
        r"\(the call is abandoned, not stopped\)$",
    ) as info:
        call_with_deadline(release.wait, 30, timeout_s=0.2, what="tool 'slow'", key="a.b.timeout_s")
    assert 0.2 <= time.monotonic() - start < 5
    assert isinstance(info.value, TimeoutError) and info.value.index == 0
    release.set()


def test_map_gives_each_item_its_own_deadline_and_names_the_one_that_overran() -> None:
    # Three calls of 0.15s each: 0.45s in all, but each within its own 0.5s.
    assert map_with_deadline(
        lambda x: (time.sleep(0.15), x * 2)[1], [1, 2, 3], timeout_s=0.5, what=lambda i: f"item {i}", key="k"
    ) == [2, 4, 6]
    release = threading.Event()
    with pytest.raises(DeadlineExceeded, match=r"^item 1 did not return within k=0\.2s") as info:
        map_with_deadline(
            lambda x: release.wait(30) if x == "hang" else x,
            ["ok", "hang", "never"],
            timeout_s=0.2,
            what=lambda i: f"item {i}",
            key="k",
        )
    assert info.value.index == 1
    release.set()


def test_map_stops_at_the_first_exception() -> None:
    calls = []

    def fn(x):
        calls.append(x)
        if x == 2:
            raise ValueError("two")
        return x

    with pytest.raises(ValueError, match="two"):
        map_with_deadline(fn, [1, 2, 3], timeout_s=5, what=str, key="k")
    assert calls == [1, 2]
