"""How a run stops on Ctrl-C or SIGTERM: finish the running step, then stop (and let the loop save it).

A step stopped half-way has advanced the prompt order and maybe the model, so
no checkpoint can describe it: with `trainer.save_on_interrupt` the first
Ctrl-C or SIGTERM only records the request, the loop finishes the running step,
saves it and raises `StopRequested`; a second one stops at once. Without
`save_on_interrupt` the first one stops at once.

`Reaper` is for the processes a run does not start itself (a local Ray's
raylet, agents and actors): a small watcher process that kills them if the
trainer ends without saying it is done, SIGKILL included.

What it deliberately does not do: save anything, or decide the exit status
(the command maps `StopRequested.signum` to 128 + signum).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["StopRequested", "StopSignals", "STOP_SIGNALS", "Reaper"]

# What a scheduler (Slurm, Kubernetes, `timeout`) or a person sends to stop a run.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequested(KeyboardInterrupt):
    """Training stopped on a signal (Ctrl-C or SIGTERM); the command exits with 128 + `signum`."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopSignals:
    """The stop handlers of one training loop: `install()` them, read `requested`, `restore()` the previous ones.

    `step` tells the warning which step is being finished; `save_on_interrupt`
    False makes the first signal stop at once.
    """

    def __init__(self, *, save_on_interrupt: bool, step: Callable[[], int]):
        self.save_on_interrupt = save_on_interrupt
        self._step = step
        self.requested = 0  # the signal that asked the loop to stop after this step (0: none)
        self.last = 0  # the last stop signal received (0: none)
        self._previous: dict[int, Any] = {}

    def install(self) -> StopSignals:
        """Take over SIGINT and SIGTERM (not off the main thread, where signals never arrive anyway)."""
        self.requested = 0
        for signum in STOP_SIGNALS:
            try:
                old = signal.getsignal(signum)
                signal.signal(signum, self._on_signal)
            except (ValueError, TypeError):  # not the main thread
                continue
            self._previous[signum] = old if old is not None else signal.SIG_DFL
        return self

    def restore(self) -> None:
        """Put back the handlers `install` replaced."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def check(self) -> None:
        """Raise `StopRequested` if a stop was asked for (called between two steps)."""
        if self.requested:
            raise StopRequested(self.requested)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.last = signum
        if self.requested or not self.save_on_interrupt:
            raise StopRequested(signum)
        self.requested = signum
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        logger.warning(
            "%s: finishing step %d, then saving a checkpoint and stopping (send it again to stop at "
            "once, without saving)",
            name,
            self._step(),
        )


# The watcher `Reaper` runs (python -c): every half second it notes the trainer's descendants started after it
# (another process's children are never its business); when the trainer's pipe ends without "done", or the
# trainer is gone, it kills every one it ever noted that is still the same process (same start time). The notes
# add up rather than being replaced: a look taken as the trainer dies sees its children already reparented (Ray's
# raylet dies with the driver at once and leaves its agents orphaned), and would find nothing to kill.
_REAPER = r"""
import os, select, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
trainer, me = int(sys.argv[1]), os.getpid()
def stat(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[1]), int(fields[19])
born = stat(me)[1]
def descendants(roots):
    children = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                ppid, start = stat(int(name))
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append((int(name), start))
    found, todo = [], list(roots)
    while todo:
        for pid, start in children.get(todo.pop(), []):
            if pid != me and start >= born:
                found.append((pid, start))
                todo.append(pid)
    return found
noted, said = set(), b""
while os.getppid() == trainer:
    ready, _, _ = select.select([0], [], [], 0.5)
    if ready:
        got = os.read(0, 64)
        said += got
        if not got:
            break
    noted.update(descendants([trainer]))
if b"done" not in said:
    if os.getppid() == trainer:  # swept by a trainer that failed: what it started since the last look
        noted.update(descendants([trainer]))
    # Children started since the last look, of processes already noted (the trainer is gone: its own are orphans).
    alive = []
    for pid, start in noted:
        try:
            if stat(pid)[1] == start:
                alive.append(pid)
        except (OSError, ValueError, IndexError):
            pass
    noted.update(descendants(alive))
    for pid, start in noted:
        try:
            if stat(pid)[1] == start:
                os.kill(pid, signal.SIGKILL)
        except (OSError, ValueError, IndexError):
            pass
"""


class Reaper:
    """Kills the processes this one starts from now on if it ends without `release()` (Linux; elsewhere a no-op)."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        if sys.platform.startswith("linux"):
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _REAPER, str(os.getpid())],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                close_fds=True,
            )

    def release(self, sweep: bool = False) -> None:
        """The processes were stopped in order: the watcher leaves them alone and exits (`sweep`: after a failure or a
        stop, it kills any still running first, e.g. a Ray a signal stopped half-way through its start)."""
        if self._proc is None:
            return
        try:
            if not sweep:
                self._proc.stdin.write(b"done")
            self._proc.stdin.close()
        except OSError:
            pass
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
        self._proc = None
