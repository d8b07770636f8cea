"""Calls to a Ray rank actor on this machine over a Unix socket, instead of a Ray task per call.

A worker group whose every batch is one call, the asynchronous rollout's
replicas in processes of their own (`rollout_process=own`), pays Ray's task
machinery on every batch: 0.84 ms of CPU in the caller's process and 1.50 ms
of wall time for a handle of 256 samples, against 0.15 ms and 0.28 ms for the
same handle over a socket (`benchmarks/rollout_call.py`, docs/BENCHMARKS.md).
The rank actor still lives, is placed and dies under
Ray; only the hot calls (`call`, `call_chain`) take this way:

- `serve(handler)` (in the actor): a listener on an abstract Unix socket
  (a file in a temporary folder off Linux) and a thread that accepts one
  connection and answers its requests in order with `handler(*request)`;
  returns (address, key) for the caller;
- `Link(address, key)` (in the caller): `request(...)` sends one request,
  `answer()` waits for its answer and raises what the handler raised, with
  the actor's traceback as its cause.

Connections are authenticated with the key (another user's process cannot
call in). A dead actor shows as a closed connection (`LinkClosed`): the
caller asks Ray why (`RayRanks`), so the error is the one a Ray task would
have raised.

What it deliberately does not do: cross machines, run calls of one link
side by side (one at a time, in order), or replace Ray's other calls.
"""

from __future__ import annotations

import logging
import pickle
import secrets
import shutil
import threading
import traceback
from collections.abc import Callable
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

from conveyor.data_plane.served import local_socket_address

__all__ = ["serve", "Link", "LinkClosed", "LinkTimeout", "RemoteTraceback", "THREAD_NAME"]

logger = logging.getLogger(__name__)

# The serving thread's name in the actor's process.
THREAD_NAME = "conveyor-link"


class LinkClosed(ConnectionError):
    """The other end of a link is gone (its process ended)."""


class LinkTimeout(RuntimeError):
    """No answer came within the deadline (the other end is stopped, deadlocked or far slower than allowed)."""


class RemoteTraceback(Exception):
    """The traceback of an error raised on the other end of a link (the cause of the error raised here)."""

    def __str__(self) -> str:
        return self.args[0] if self.args else ""


def serve(handler: Callable[..., Any]) -> tuple[str, bytes]:
    """Answer one caller's requests with `handler(*request)` on a thread of this process; (address, key) to reach it."""
    address, folder = local_socket_address("conveyor-link")
    key = secrets.token_bytes(32)
    listener = Listener(address, family="AF_UNIX", authkey=key)
    threading.Thread(target=_serve, args=(listener, folder, handler), name=THREAD_NAME, daemon=True).start()
    return address, key


def _serve(listener: Listener, folder: str | None, handler: Callable[..., Any]) -> None:
    try:
        conn = listener.accept()
    except Exception:  # a caller that failed authentication: nobody else may call in
        logger.warning("link: a connection was refused", exc_info=True)
        return
    finally:
        listener.close()
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
    with conn:
        while True:
            try:
                request = conn.recv_bytes()
            except (EOFError, OSError):  # the caller closed the link, or its process ended
                return
            try:
                answer: tuple = ("ok", handler(*pickle.loads(request)))
            except BaseException as err:  # the caller's to raise
                answer = ("err", err, traceback.format_exc())
            try:
                conn.send_bytes(_dumps(answer))
            except (EOFError, OSError):
                return


def _dumps(answer: tuple) -> bytes:
    try:
        return pickle.dumps(answer, protocol=5)
    except Exception as err:  # an error (or a result) that does not pickle still reaches the caller, as text
        if answer[0] == "ok":
            answer = ("err", TypeError(f"the result does not pickle: {err}"), "")
        cause = RuntimeError(f"{type(answer[1]).__name__}: {answer[1]}")
        cause.__dict__.update({k: v for k, v in vars(answer[1]).items() if k.startswith("conveyor_")})
        return pickle.dumps(("err", cause, answer[2]), protocol=5)


class Link:
    """The calling end: one request at a time, answered in order."""

    def __init__(self, address: str, key: bytes):
        self._conn: Connection | None = Client(address, family="AF_UNIX", authkey=key)

    def request(self, *args: Any) -> None:
        """Send `args` (the handler's arguments)."""
        try:
            self._live().send_bytes(pickle.dumps(args, protocol=5))
        except (EOFError, OSError) as err:
            raise LinkClosed(f"the link's other end is gone: {err}") from err

    def answer(
        self, timeout: float | None = None, check: Callable[[], None] | None = None, interval: float = 1.0
    ) -> Any:
        """The answer to the oldest request not yet answered; what the handler raised is raised here (its cause: the
        other end's traceback, a `RemoteTraceback`).

        `timeout`: `LinkTimeout` when no answer has come within that many seconds (the link is then out of step:
        close it). `check()` runs every `interval` seconds of waiting, to raise on what it finds (a process gone).
        """
        try:
            conn = self._live()
            if timeout is not None or check is not None:
                waited = 0.0
                while not conn.poll(interval if timeout is None else max(0.0, min(interval, timeout - waited))):
                    waited += interval
                    if check is not None:
                        check()
                    if timeout is not None and waited >= timeout:
                        raise LinkTimeout(f"no answer within {timeout:g} s")
            reply = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError) as err:
            raise LinkClosed(f"the link's other end is gone: {err}") from err
        if reply[0] == "ok":
            return reply[1]
        _, err, text = reply
        err.__cause__ = RemoteTraceback(text) if text else None
        raise err

    def close(self) -> None:
        """Close the link (the other end's thread then returns); safe to call twice."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _live(self) -> Connection:
        if self._conn is None:
            raise LinkClosed("the link is closed")
        return self._conn
