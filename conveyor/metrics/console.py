"""The console view of a run: a compact table of the numbers people watch, a row every few steps.

`ConsoleTracker` prints one row every `every` steps (each column the mean over
the steps since the previous row, `CONSOLE_COLUMNS`), one at every validation,
and optionally every metric grouped by section; `console_interval` picks a
round row interval for a run's length. It is registered as the `console`
tracker in `conveyor.metrics.trackers`, which sends it each step's metrics.

What it deliberately does not do: keep anything (metrics.jsonl has every
metric of every step) or stop the run: a console whose reader is gone is
switched off with one warning (DESIGN 19).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
from collections.abc import Mapping, Sequence
from typing import TextIO

logger = logging.getLogger(__name__)

__all__ = ["CONSOLE_COLUMNS", "BarAwareStreamHandler", "ConsoleTracker", "console_interval"]

# The handful of numbers people watch, in the order of the console's columns:
# (label, candidate keys with the first present winning, format). The trainer's names come
# first, then verl's for runs that log those; every metric is in metrics.jsonl.
CONSOLE_COLUMNS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("reward", ("reward/mean", "critic/score/mean", "critic/rewards/mean"), "{:.3f}"),
    ("acc", ("reward/accuracy",), "{:.3f}"),
    ("val_acc", ("val/accuracy",), "{:.3f}"),
    ("len", ("response_length/mean",), "{:.1f}"),
    ("entropy", ("actor/entropy",), "{:.3f}"),
    # A distilling run's KL is the student's to its teachers (distill/kl_*), which its loss drives: it comes
    # before the KL to the reference, and actor/ppo_kl (the update's own drift, float noise on-policy) is last.
    (
        "kl",
        (
            "distill/kl_exact",
            "distill/kl_k3",
            "distill/kl_k1",
            "actor/kl_loss",
            "actor/reward_kl_penalty",
            "actor/ppo_kl",
        ),
        "{:.2g}",
    ),
    ("grad", ("actor/grad_norm",), "{:.3g}"),
    ("s/step", ("timing_s/step",), "{:.3f}"),
    ("tok/s", ("perf/throughput",), "{:.0f}"),
)

# Metrics that describe the moment they were taken rather than the steps since the last
# row: the console shows their latest value instead of a mean over the window.
_CONSOLE_LATEST = ("val/",)

# About this many rows for a whole run when trainer.console_every is 0, at a round interval.
_CONSOLE_ROWS_PER_RUN = 30
_ROUND_INTERVALS = (1, 2, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1000, 2000, 2500, 5000, 10000)


def _fmt_number(value: float) -> str:
    """A short human-readable number: 4 decimals for ordinary values, scientific for tiny/huge ones."""
    if math.isnan(value) or math.isinf(value):
        return str(value)
    a = abs(value)
    if a == 0:
        return "0"
    if a >= 1e5 or a < 1e-3:
        return f"{value:.3e}"
    if a >= 100:
        return f"{value:.1f}"
    return f"{value:.4f}"


def console_interval(total_steps: int | None, every: int = 0) -> int:
    """Steps per console row: `every` when > 0, else a round number giving about 30 rows over `total_steps`."""
    if every > 0:
        return every
    if not total_steps or total_steps <= 0:
        return 1
    target = total_steps / _CONSOLE_ROWS_PER_RUN
    return max(i for i in _ROUND_INTERVALS if i <= max(1.0, target))


def _discard_stdout() -> None:
    """Point the process's stdout at /dev/null, so that nothing written later, nor the flush at exit, fails again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no file descriptor behind sys.stdout (a test's stream): nothing to point
        pass


def _bars_cleared(stream: TextIO) -> contextlib.AbstractContextManager:
    """A context in which the progress bars drawn on the same terminal as `stream` are cleared (redrawn after it).

    A bar ends its line with no newline, so a row written beside it would be glued to the bar's text; tqdm
    clears the bars that share stdout/stderr with `stream` and draws them again below the row.
    """
    tqdm_module = sys.modules.get("tqdm")
    if tqdm_module is None:  # no bar can be on screen: tqdm was never imported
        return contextlib.nullcontext()
    return tqdm_module.tqdm.external_write_mode(file=stream)


class BarAwareStreamHandler(logging.StreamHandler):
    """A log handler on stderr that writes each line below the progress bars, not glued to the end of one."""

    def emit(self, record: logging.LogRecord) -> None:
        """Write `record` with the bars on its terminal cleared, and draw them again after it."""
        try:
            with _bars_cleared(self.stream):
                super().emit(record)
        except (OSError, ValueError):  # clearing a bar on a terminal that is gone: logging's own report, not a raise
            self.handleError(record)


class ConsoleTracker:
    """A compact table on the console: a row every `every` steps (means over them) and at every validation.

    Each row averages the watched numbers (`CONSOLE_COLUMNS`) over the steps since
    the previous row, so a row every 25 steps hides nothing and scrolls 25 times
    slower; `val_acc` is the value of the validation at that step. The column
    header is repeated every `header_every` rows. `table_every` > 0 also prints
    every metric, grouped by section, every that many steps (the old full dump;
    everything is in metrics.jsonl anyway).
    """

    _VALUE_WIDTH = 8

    def __init__(
        self,
        stream: TextIO | None = None,
        table_every: int = 0,
        every: int = 1,
        total_steps: int | None = None,
        header_every: int = 20,
    ):
        if table_every < 0:
            raise ValueError(f"console_table_every must be >= 0 (0 turns the table off), got {table_every}")
        if every < 1:
            raise ValueError(
                f"trainer.console_every must be >= 1 step per row (0 in the config = automatic), got {every}"
            )
        self._stream = stream
        self._table_every = table_every
        self._every = every
        self._total = total_steps
        self._header_every = header_every
        self._window: list[Mapping[str, float]] = []
        self._rows = 0
        self._first = True
        self._step_width = max(4, len(str(total_steps)) if total_steps else 6)
        self._gone = False  # the output stream failed once: nothing more is written to it

    def _write(self, text: str) -> None:
        if self._gone:
            return
        # Resolve sys.stdout at write time so redirection after construction is honoured.
        stream = self._stream if self._stream is not None else sys.stdout
        try:
            with _bars_cleared(stream):
                stream.write(text + "\n")
                stream.flush()
        except (OSError, ValueError) as err:  # a reader that ended (EPIPE), a hung-up terminal, a closed file
            # The console is a view of the run (DESIGN 19): losing it must not lose the run.
            self._gone = True
            logger.warning(
                "console: its output is gone (%s: %s); the run goes on without it (metrics.jsonl and the "
                "other trackers still have every step)",
                type(err).__name__,
                err,
            )
            if stream is sys.stdout:
                _discard_stdout()

    def _step_label(self, step: int) -> str:
        if self._total:
            return f"{step:>{self._step_width}}/{self._total}"
        return f"{step:>{self._step_width}}"

    def format_header(self) -> str:
        """The column names, aligned with `format_line`."""
        width = len(self._step_label(0))
        fields = [f"{'step':>{width}}"] + [f"{label:>{self._VALUE_WIDTH}}" for label, _, _ in CONSOLE_COLUMNS]
        return "  ".join(fields)

    def format_line(self, metrics: Mapping[str, float] | Sequence[Mapping[str, float]], step: int) -> str:
        """The row for `step`: each column's mean over `metrics` (one step's dict, or a window of them), "-" if
        absent."""
        window = [metrics] if isinstance(metrics, Mapping) else list(metrics)
        fields = [self._step_label(step)]
        for _label, candidates, spec in CONSOLE_COLUMNS:
            key = next((k for k in candidates if any(k in m for m in window)), None)
            text = "-"
            if key is not None:
                values = [m[key] for m in window if key in m]
                value = values[-1] if key.startswith(_CONSOLE_LATEST) else sum(values) / len(values)
                text = spec.format(value)
            fields.append(f"{text:>{self._VALUE_WIDTH}}")
        return "  ".join(fields)

    @staticmethod
    def format_table(metrics: Mapping[str, float], step: int) -> str:
        """All metrics grouped by section (the part before the first "/"), keys aligned."""
        sections: dict[str, list[tuple[str, float]]] = {}
        for name in sorted(metrics):
            section, _, rest = name.partition("/")
            if not rest:
                section, rest = "other", name
            sections.setdefault(section, []).append((rest, metrics[name]))
        key_width = max(len(k) for rows in sections.values() for k, _ in rows) if sections else 0
        value_width = max((len(_fmt_number(v)) for v in metrics.values()), default=0)
        lines = [f"--- step {step}: {len(metrics)} metrics " + "-" * 20]
        for section in sorted(sections):
            lines.append(f"[{section}]")
            for key, value in sections[section]:
                lines.append(f"  {key:<{key_width}}  {_fmt_number(value):>{value_width}}")
        return "\n".join(lines)

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Add the step to the window; print a row at the first call, at step 1, every `every` steps and at
        validations."""
        self._window.append(metrics)
        validated = any(k.startswith(_CONSOLE_LATEST) for k in metrics)
        last = self._total is not None and step >= self._total
        # Step 1 too: the first training row says at once how fast the run goes.
        if self._first or step == 1 or step % self._every == 0 or validated or last:
            if self._rows % self._header_every == 0:
                self._write(self.format_header())
            self._write(self.format_line(self._window, step))
            self._rows += 1
            self._window = []
        if self._table_every and step % self._table_every == 0:
            self._write(self.format_table(metrics, step))
        self._first = False

    def close(self, failed: bool = False) -> None:
        """Nothing to release."""
