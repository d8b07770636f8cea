"""The Reaper: a trainer killed with SIGKILL leaves none of the processes it started, however they were parented."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the Reaper watches /proc (Linux)")

# The trainer stand-in: a Reaper, then a child that dies with it at once (as Ray's raylet dies with its driver)
# and leaves a grandchild orphaned (as the raylet leaves its agents). It prints the grandchild's pid.
_TRAINER = r"""
import subprocess, sys, time
from conveyor.trainer.signals import Reaper
reaper = Reaper()
child = subprocess.Popen([sys.executable, "-c", '''
import ctypes, signal, subprocess, sys, time
ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(grandchild.pid, flush=True)
time.sleep(600)
'''], stdout=subprocess.PIPE, text=True)
print(child.stdout.readline().strip(), flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_killed_trainer_leaves_no_orphan_of_a_child_that_died_with_it() -> None:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    trainer = subprocess.Popen([sys.executable, "-c", _TRAINER], stdout=subprocess.PIPE, text=True, env=env)
    grandchild = int(trainer.stdout.readline())
    try:
        time.sleep(1.5)  # the Reaper has looked at the family a few times
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(timeout=30)
        deadline = time.monotonic() + 10
        while _alive(grandchild) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(grandchild)
    finally:
        if _alive(grandchild):
            os.kill(grandchild, signal.SIGKILL)
