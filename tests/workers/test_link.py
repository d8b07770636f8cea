"""conveyor.workers.placement.link: calls over a Unix socket, answered in order, errors raised as themselves."""

from __future__ import annotations

import multiprocessing
import os
import threading

import pytest

from conveyor.workers.placement.link import Link, LinkClosed, RemoteTraceback, serve


class _Unpicklable(Exception):
    def __init__(self, message: str):
        super().__init__(message)
        self.lock = threading.Lock()  # a lock does not pickle


def _handler(op: str, *args):
    if op == "add":
        return sum(args)
    if op == "fail":
        err = ValueError(f"bad input {args[0]!r}")
        err.conveyor_step = ("reward", "compute_reward")
        raise err
    if op == "exit":  # the process ends in the middle of a call, as a crashed worker's does
        os._exit(1)
    if op == "odd":
        err = _Unpicklable("cannot travel")
        err.conveyor_step = ("rollout", "generate_sequences")
        raise err
    raise KeyError(op)


def test_requests_are_answered_in_order_and_errors_raised_with_the_other_ends_traceback() -> None:
    link = Link(*serve(_handler))
    try:
        link.request("add", 1, 2)
        link.request("add", 10, 20, 30)
        assert (link.answer(), link.answer()) == (3, 60)
        link.request("fail", "x")
        with pytest.raises(ValueError, match="bad input 'x'") as info:
            link.answer()
        assert info.value.conveyor_step == ("reward", "compute_reward")  # which step of a chain failed travels too
        assert isinstance(info.value.__cause__, RemoteTraceback) and "_handler" in str(info.value.__cause__)
        link.request("odd")  # an error that does not pickle arrives as text, still naming its step
        with pytest.raises(RuntimeError, match="_Unpicklable: cannot travel") as info:
            link.answer()
        assert info.value.conveyor_step == ("rollout", "generate_sequences")
        link.request("add", 4)  # the link goes on after errors
        assert link.answer() == 4
    finally:
        link.close()
    link.close()
    with pytest.raises(LinkClosed):
        link.request("add", 1)


def _serve_until_told(conn) -> None:
    conn.send(serve(_handler))
    conn.recv()


def test_a_process_that_ends_in_a_call_is_link_closed_not_a_hang() -> None:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve_until_told, args=(child,))
    proc.start()
    try:
        link = Link(*parent.recv())
        link.request("add", 1)
        assert link.answer() == 1
        link.request("exit")
        with pytest.raises(LinkClosed):
            link.answer()
        proc.join(timeout=60)
        assert proc.exitcode == 1
    finally:
        proc.kill()
        proc.join()


def test_a_caller_with_the_wrong_key_is_refused() -> None:
    address, key = serve(_handler)
    with pytest.raises(multiprocessing.AuthenticationError):
        Link(address, bytes(len(key)))


def _slow_handler(op: str, seconds: float = 0.0):
    import time

    time.sleep(seconds)
    return op


def test_an_answer_later_than_its_deadline_is_a_timeout_and_the_check_runs_while_waiting() -> None:
    from conveyor.workers.placement.link import LinkTimeout

    link = Link(*serve(_slow_handler))
    looks = []
    try:
        link.request("quick", 0.0)
        assert link.answer(timeout=5.0, check=lambda: looks.append(1), interval=0.05) == "quick"
        link.request("hung", 2.0)  # a stopped or deadlocked replica: nothing comes within the deadline
        with pytest.raises(LinkTimeout, match="no answer within 0.3 s"):
            link.answer(timeout=0.3, check=lambda: looks.append(1), interval=0.05)
        assert len(looks) >= 4  # looked at every interval while waiting

        def gone() -> None:
            raise LinkClosed("its process is gone")

        link.request("dead", 2.0)
        with pytest.raises(LinkClosed, match="process is gone"):  # a look that finds the process gone ends the wait
            link.answer(timeout=10.0, check=gone, interval=0.05)
    finally:
        link.close()
