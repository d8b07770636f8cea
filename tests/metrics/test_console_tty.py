"""On a terminal the progress bars and the console's rows share the screen without writing over each other, and
the warm start shows how far it is (a bar on a terminal, log lines elsewhere)."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from conveyor.trainer.warmstart import WarmstartProgress

EXAMPLE = Path(__file__).parents[2] / "examples" / "tiny_cpu.yaml"
STEPS = 4
ROW = re.compile(rf"^\s*\d+/{STEPS}\s")  # a console row starts with its step label


def _screen(raw: str) -> list[str]:
    """The lines a terminal shows for `raw`: a carriage return goes back to the line's start, escapes are dropped."""
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", raw)
    lines: list[str] = []
    line: list[str] = []
    col = 0
    for ch in text:
        if ch == "\n":
            lines.append("".join(line).rstrip())
            line, col = [], 0
        elif ch == "\r":
            col = 0
        else:
            if col < len(line):
                line[col] = ch
            else:
                line.append(ch)
            col += 1
    lines.append("".join(line).rstrip())
    return lines


def _run_on_a_terminal(argv: list[str], env: dict[str, str], timeout_s: float = 240.0) -> str:
    """Everything `argv` writes to its terminal (stdout and stderr both a pty of 120 columns)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True)
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                continue
            try:
                data = os.read(master, 65536)
            except OSError as err:  # EIO: the child closed the terminal
                if err.errno != errno.EIO:
                    raise
                break
            if not data:
                break
            chunks.append(data)
        else:
            pytest.fail(f"{argv} did not end within {timeout_s:.0f} s")
    finally:
        os.close(master)
        proc.wait(timeout=30)
    output = b"".join(chunks).decode("utf-8", "replace")
    assert proc.returncode == 0, output[-3000:]
    return output


@pytest.mark.process
def test_rows_start_on_a_line_of_their_own_and_the_warm_start_shows_progress(tmp_path) -> None:
    overrides = [
        "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "data.synthetic.num_train=64",
        "data.synthetic.num_val=8",
        "actor_rollout_ref.model.tiny.warmstart_steps=40",
        "actor_rollout_ref.model.tiny.warmstart_until_accuracy=0",
        f"trainer.total_training_steps={STEPS}",
        "trainer.test_freq=0",
        "trainer.console_every=1",
        "trainer.dump_freq=0",
        f"trainer.default_local_dir={tmp_path / 'run'}",
    ]
    # A cache of its own: the tiny model is built, so its warm start runs here.
    env = {**os.environ, "CONVEYOR_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1", "TERM": "xterm"}
    argv = [sys.executable, "-m", "conveyor.cli", "train", "--config", str(EXAMPLE), *overrides]
    raw = _run_on_a_terminal(argv, env)
    screen = _screen(raw)
    assert "train:" in raw, "the training bar was drawn"  # or nothing here would test the sharing
    rows = [line for line in screen if ROW.match(line)]
    assert len(rows) >= STEPS, "\n".join(screen)  # and the validation's at step 0
    # Nothing after a bar on its line: neither a row nor a log line is glued to the bar's end.
    glued = [line for line in screen if re.search(r"step/s[^\]]*\](?=.)", line)]
    assert not glued, f"written after a bar on its line: {glued}"
    assert any(re.match(r"^\s*step\s+reward", line) for line in screen), "the header has a line of its own"
    # The warm start drew its bar (cleared once done) and then said where it ended.
    assert re.search(r"warm start:\s+\d+%\|", raw), raw[:3000]
    assert any("warm start: 40 steps, loss" in line for line in screen)


def test_without_a_terminal_the_warm_start_logs_a_line_every_few_steps(caplog) -> None:
    progress = WarmstartProgress(7, bar=False, log_every=3)
    with caplog.at_level(logging.INFO, logger="conveyor.trainer.warmstart"):
        for step in range(1, 8):
            progress.update(step, loss=1.0 / step, accuracy=0.1 * step if step > 2 else None)
        progress.close()
    assert [r.getMessage() for r in caplog.records] == [
        "warm start: step 3/7, loss 0.333, exact match 0.30",
        "warm start: step 6/7, loss 0.167, exact match 0.60",
    ]
