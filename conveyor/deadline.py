"""Calling user code with a deadline: a reward function or a tool that may hang.

The call runs in a daemon thread while the caller waits for at most
`timeout_s`. Python cannot stop a thread, so a call past its deadline is
abandoned, not stopped: it keeps running in its daemon thread (which does not
hold the process open at exit) and the caller gets a `DeadlineExceeded`
naming the call and the config key that sets the limit. What the call raises
(anything, `SystemExit` included) is raised again in the caller's thread; what
it returns is returned.

It deliberately does not retry, kill or count abandoned calls: what a timeout
means (an error that stops the run, or an error text for the model) is the
caller's decision.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

__all__ = ["DeadlineExceeded", "call_with_deadline", "map_with_deadline"]

T = TypeVar("T")
R = TypeVar("R")


class DeadlineExceeded(TimeoutError):
    """A call did not return within its deadline; `index` is its item's position (0 for a single call)."""

    def __init__(self, message: str, index: int = 0) -> None:
        super().__init__(message)
        self.index = index


def map_with_deadline(
    fn: Callable[[T], R],
    items: Iterable[T],
    *,
    timeout_s: float,
    what: Callable[[int], str],
    key: str,
    thread_name: str = "deadline",
    cpu: list[float] | None = None,
) -> list[R]:
    """`[fn(item) for item in items]`, in one daemon thread, each call given `timeout_s` seconds from its own start.

    `timeout_s` 0 means no limit (the calls then run in this thread).
    `what(i)` names the call on item `i` in the DeadlineExceeded raised when it
    overruns, and `key` the setting of the limit; the first exception a call
    raises stops the rest and is raised here. `cpu`, if given, gets the CPU
    seconds of the daemon thread appended (nothing when the calls ran in the
    caller's thread, which counts its own).
    """
    items = list(items)
    if not timeout_s:
        return [fn(item) for item in items]
    results: list[R] = []
    failure: list[BaseException] = []
    current = [(0, time.monotonic())]  # (item index, its start), replaced whole so it reads consistently
    done = threading.Event()

    def work() -> None:
        start = time.thread_time()
        try:
            for i, item in enumerate(items):
                current[0] = (i, time.monotonic())
                results.append(fn(item))
        except BaseException as err:  # handed to the caller's thread, which raises it
            failure.append(err)
        finally:
            if cpu is not None:
                cpu.append(time.thread_time() - start)
            done.set()

    threading.Thread(target=work, name=thread_name, daemon=True).start()
    while not done.is_set():
        i, started = current[0]
        left = started + timeout_s - time.monotonic()
        if left <= 0 and not done.is_set() and current[0][0] == i:
            raise DeadlineExceeded(
                f"{what(i)} did not return within {key}={timeout_s:g}s (the call is abandoned, not stopped)", index=i
            )
        done.wait(max(left, 0.001))
    if failure:
        raise failure[0]
    return results


def call_with_deadline(
    fn: Callable[..., R], *args: Any, timeout_s: float, what: str, key: str, thread_name: str = "deadline"
) -> R:
    """`fn(*args)` in a daemon thread, given `timeout_s` seconds (0: no limit, called in this thread).

    Raises DeadlineExceeded (a TimeoutError naming `what` and `key`) when the
    call overruns, without waiting for it; what the call raises is raised here.
    """
    return map_with_deadline(
        lambda _: fn(*args), [None], timeout_s=timeout_s, what=lambda _: what, key=key, thread_name=thread_name
    )[0]
