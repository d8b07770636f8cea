"""Running one agent per session: a command in a process of its own, or a Python callable on a thread.

A command (`actor_rollout_ref.rollout.agent.command`) is split as a shell
would and run without a shell, in the directory the run started in, in a new
process group, with `OPENAI_BASE_URL`, `OPENAI_API_KEY` and
`CONVEYOR_SESSION_ID` in its environment and the task as one JSON object on
its standard input. Past `timeout_s` its group gets SIGTERM, and SIGKILL
`term_grace_s` later if anything of it is still alive; when it ends, however
it ends, whatever is left of its group is killed, so no process of a session
outlives it (a program that leaves its process group on purpose, with
`setsid`, escapes this: run such agents in a container). Its standard output
is read as it comes, keeping only the last line (a flood costs no memory);
that line, when it is a JSON object with a numeric `"reward"`, is the
session's reward.

A callable (`.agent.callable`, `module:function` or `file.py:function`) is
called as `function(base_url, api_key, task)` on a thread; a number it
returns is the session's reward. Python cannot stop a thread: one that
outlasts `timeout_s` is abandoned (its later requests find the session
closed, 404).

What it deliberately does not do: serve the agent's requests or score it.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["AgentResult", "run_command", "run_callable", "reward_line", "split_command"]

# How an agent ended: the counter each outcome goes under in rollout/agent/*.
OK, EXIT_NONZERO, TIMEOUT, KILLED, ERROR = "ok", "exit_nonzero", "timeout", "killed", "error"


@dataclass
class AgentResult:
    """How one agent ended, what it reported as its reward (None: nothing), and the end of its error output."""

    outcome: str
    reward: float | None
    seconds: float
    exit_code: int | None = None
    stderr_tail: str = ""


def split_command(command: str) -> list[str]:
    """The agent command's argv, split as a shell would; a ValueError naming the key when it cannot be."""
    try:
        argv = shlex.split(command)
    except ValueError as err:
        raise ValueError(f"actor_rollout_ref.rollout.agent.command: cannot split {command!r} ({err})") from None
    if not argv:
        raise ValueError("actor_rollout_ref.rollout.agent.command is empty; give the agent's command line")
    return argv


def reward_line(line: str | None) -> float | None:
    """The reward an agent printed last: a JSON object with a finite numeric "reward", else None."""
    if not line:
        return None
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    value = obj.get("reward")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _drain(stream: Any, keep: Callable[[bytes], None]) -> None:
    """Read `stream` to its end in chunks, handing each line to `keep`; closes it."""
    try:
        for line in iter(stream.readline, b""):
            keep(line)
    except (OSError, ValueError):
        pass
    finally:
        try:
            stream.close()
        except OSError:
            pass


def _kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def run_command(
    argv: list[str],
    *,
    env: dict[str, str],
    task: dict,
    timeout_s: float,
    term_grace_s: float,
    cwd: str,
    stop: threading.Event | None = None,
) -> AgentResult:
    """Run one agent process to its end (or its timeout); its reward line and how it ended."""
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # its own process group: what it starts is stopped with it
        )
    except OSError as err:
        return AgentResult(ERROR, None, time.monotonic() - start, stderr_tail=f"cannot start {argv[0]!r}: {err}")
    last: list[bytes] = [b""]
    tail: deque[bytes] = deque(maxlen=40)

    def keep_last(line: bytes) -> None:
        if line.strip():
            last[0] = line[:65536]

    readers = [
        threading.Thread(target=_drain, args=(proc.stdout, keep_last), daemon=True),
        threading.Thread(target=_drain, args=(proc.stderr, lambda b: tail.append(b[:1024])), daemon=True),
    ]
    for r in readers:
        r.start()
    try:
        assert proc.stdin is not None
        proc.stdin.write(json.dumps(task).encode() + b"\n")
        proc.stdin.close()
    except OSError:
        pass  # an agent that does not read its task is its own business
    outcome = OK
    deadline = start + timeout_s
    while proc.poll() is None:
        if time.monotonic() >= deadline or (stop is not None and stop.is_set()):
            outcome = TIMEOUT
            _kill_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=term_grace_s)
            except subprocess.TimeoutExpired:
                outcome = KILLED  # it ignored SIGTERM
                _kill_group(proc.pid, signal.SIGKILL)
                proc.wait()
            break
        time.sleep(0.005)
    # Whatever it left running in its group ends with it.
    _kill_group(proc.pid, signal.SIGKILL)
    for r in readers:
        r.join(timeout=2)
    code = proc.returncode
    if outcome == OK and code != 0:
        outcome = EXIT_NONZERO
    stderr = b"".join(tail).decode(errors="replace")[-2000:]
    line = last[0].decode(errors="replace").strip()
    return AgentResult(outcome, reward_line(line), time.monotonic() - start, code, stderr)


def run_callable(fn: Callable[..., Any], *, base_url: str, api_key: str, task: dict, timeout_s: float) -> AgentResult:
    """Call an in-process agent on a thread of its own; what it returned, or how it failed."""
    start = time.monotonic()
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn(base_url, api_key, task)
        except BaseException as err:  # SystemExit included: an agent's failure, not the run's
            box["error"] = f"{type(err).__name__}: {err}"

    thread = threading.Thread(target=target, name="agent-callable", daemon=True)
    thread.start()
    thread.join(timeout_s)
    elapsed = time.monotonic() - start
    if thread.is_alive():
        return AgentResult(TIMEOUT, None, elapsed)
    if "error" in box:
        return AgentResult(ERROR, None, elapsed, stderr_tail=box["error"])
    value = box.get("value")
    reward = None
    if not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value):
        reward = float(value)
    return AgentResult(OK, reward, elapsed)
