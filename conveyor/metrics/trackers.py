"""Experiment tracking: one `Tracking` sends each step's metrics to the chosen backends.

Backends (the `TRACKERS` registry; `register_tracker` adds one): `console` (a compact table of the numbers
people watch: one row every few steps, averaged over them, and one at every validation), `jsonl`
(`run_dir/metrics.jsonl`, every metric of every step,
the file `conveyor plot` reads), `tensorboard`, `wandb` and `mlflow`. The
optional libraries are imported only when their backend is chosen, so a run
that logs to the console and a file needs none of them.

Metrics arrive already reduced over ranks as flat `section/name -> float`
(the trainer's job); this module neither reduces nor decides when to log. It
never opens a network connection itself: wandb and mlflow talk to a server
only when the user's environment points them at one.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import math
import os
import re
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TextIO

from conveyor.files import read_jsonl_objects
from conveyor.registry import lookup, registrar

logger = logging.getLogger(__name__)

__all__ = [
    "VALID_LOGGERS",
    "TRACKERS",
    "TrackerContext",
    "register_tracker",
    "CONSOLE_COLUMNS",
    "Tracking",
    "ConsoleTracker",
    "console_interval",
    "JsonlTracker",
    "TensorBoardTracker",
    "WandbTracker",
    "MlflowTracker",
    "read_metrics_jsonl",
    "to_json_value",
    "flatten_config",
    "mlflow_safe_name",
]

# The module each optional backend needs, and the pyproject extra that brings it.
_OPTIONAL_MODULES = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
}

# The handful of numbers people watch, in the order of the console's columns:
# (label, candidate keys with the first present winning, format). The trainer's names come
# first, then verl's for runs that log those; every metric is in metrics.jsonl.
CONSOLE_COLUMNS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("reward", ("reward/mean", "critic/score/mean", "critic/rewards/mean"), "{:.3f}"),
    ("acc", ("reward/accuracy",), "{:.3f}"),
    ("val_acc", ("val/accuracy",), "{:.3f}"),
    ("len", ("response_length/mean",), "{:.1f}"),
    ("entropy", ("actor/entropy",), "{:.3f}"),
    ("kl", ("actor/kl_loss", "actor/reward_kl_penalty", "actor/ppo_kl"), "{:.2g}"),
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

# Where the ids of the wandb / mlflow runs are kept, so a resumed run continues them.
_TRACKER_RUNS_FILE = "tracker_runs.json"

# Conservative MLflow limits (older servers allow 500 characters per param value).
_MLFLOW_PARAM_VALUE_MAX = 500
_MLFLOW_KEY_MAX = 250
_MLFLOW_PARAMS_PER_BATCH = 100
_MLFLOW_METRICS_PER_BATCH = 1000


# --------------------------------------------------------------------------- helpers


def to_json_value(value: Any) -> Any:
    """A JSON-valid form of `value`: non-finite floats become "nan"/"inf"/"-inf", arrays become lists."""
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # numpy / torch scalars
        value = value.item()
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, Mapping):
        return {str(k): to_json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json_value(v) for v in value]
    if hasattr(value, "tolist"):  # numpy arrays and torch tensors
        return to_json_value(value.tolist())
    return str(value)


def _from_json_number(value: Any) -> Any:
    """Inverse of `to_json_value` for the non-finite float strings."""
    if isinstance(value, str) and value in ("nan", "inf", "-inf"):
        return float(value)
    return value


def read_metrics_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Records of a `metrics.jsonl`, sorted by step; a step logged twice (resume) keeps its last record."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"metrics file {path} does not exist; add 'jsonl' to trainer.logger to write it")
    by_step: dict[int, dict[str, Any]] = {}
    for lineno, record in read_jsonl_objects(path, "metrics file"):
        step = record.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 2**53:
            logger.warning("%s:%d has no 'step' that is a whole number from 0 to 2**53; skipped", path, lineno)
            continue
        by_step[step] = {k: v for k, v in ((k, _from_json_number(v)) for k, v in record.items()) if _plottable(v)}
    return [by_step[s] for s in sorted(by_step)]


def _plottable(value: Any) -> bool:
    """Whether a metric value can be kept: anything but an integer too large for a float (it would fail a plot)."""
    return not (isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 2**1023)


def flatten_config(config: Any, prefix: str = "") -> dict[str, Any]:
    """Nested mappings/dataclasses as one level of dotted keys: {"a": {"b": 1}} -> {"a.b": 1}."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        config = dataclasses.asdict(config)
    out: dict[str, Any] = {}
    if isinstance(config, Mapping):
        for k, v in config.items():
            key = f"{prefix}.{k}" if prefix else str(k)
            if isinstance(v, Mapping) or (dataclasses.is_dataclass(v) and not isinstance(v, type)):
                out.update(flatten_config(v, key))
            else:
                out[key] = v
    elif prefix:
        out[prefix] = config
    return out


def _plain_config(config: Any) -> dict[str, Any]:
    """The config as plain JSON-able dicts and lists (dataclasses and Paths converted)."""
    if config is None:
        return {}
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        config = dataclasses.asdict(config)
    if not isinstance(config, Mapping):
        raise ValueError(f"config must be a dict (or dataclass), got {type(config).__name__}")
    return to_json_value(config)


_MLFLOW_BAD_CHARS = re.compile(r"[^/\w.\- ]")


def mlflow_safe_name(name: str) -> str:
    """`name` with characters MLflow rejects replaced by "_" and path-like oddities removed."""
    cleaned = _MLFLOW_BAD_CHARS.sub("_", name)
    # MLflow also rejects names that normalise to another path ("a//b", "/a", "a/./b", "..").
    parts = [p if p != ".." else "__" for p in cleaned.split("/") if p not in ("", ".")]
    return ("/".join(parts) or "_")[:_MLFLOW_KEY_MAX]


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


def _coerce_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Metrics as plain floats (accepts ints, numpy and 0-d torch scalars); bad entries raise."""
    if not isinstance(metrics, Mapping):
        raise ValueError(f"metrics must be a dict of name -> float, got {type(metrics).__name__}")
    out: dict[str, float] = {}
    for name, value in metrics.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"metric names must be non-empty strings, got {name!r}")
        if name == "step":
            raise ValueError("a metric may not be called 'step': that key holds the step number in metrics.jsonl")
        try:
            out[name] = float(value)
        except (TypeError, ValueError):
            raise ValueError(
                f"metric {name!r} has value {value!r} ({type(value).__name__}), which is not a number"
            ) from None
    return out


def _load_tracker_runs(run_dir: Path) -> dict[str, Any]:
    path = run_dir / _TRACKER_RUNS_FILE
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):  # ValueError: not JSON, or not UTF-8
        logger.warning("%s is unreadable; starting new tracker runs", path)
        return {}
    return data if isinstance(data, dict) else {}


def _save_tracker_run(run_dir: Path, backend: str, info: dict[str, Any]) -> None:
    data = _load_tracker_runs(run_dir)
    data[backend] = info
    tmp = run_dir / (_TRACKER_RUNS_FILE + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, run_dir / _TRACKER_RUNS_FILE)


# --------------------------------------------------------------------------- backends


class _Backend(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self, failed: bool = False) -> None: ...


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


class JsonlTracker:
    """Appends one JSON object per step to a file, flushed and synced each step so a crash loses nothing."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # A crash mid-write can leave a last line without its newline; start ours on a fresh line.
        needs_newline = False
        if self.path.is_file() and self.path.stat().st_size > 0:
            with self.path.open("rb") as f:
                f.seek(-1, os.SEEK_END)
                needs_newline = f.read(1) != b"\n"
        self._file: TextIO | None = self.path.open("a", encoding="utf-8")
        if needs_newline:
            self._file.write("\n")

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Write `{"step": step, **metrics}`; non-finite values as the strings "nan", "inf", "-inf"."""
        assert self._file is not None, "JsonlTracker used after close"
        record = {"step": step, **{k: to_json_value(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self, failed: bool = False) -> None:
        """Close the file."""
        if self._file is not None:
            self._file.close()
            self._file = None


class TensorBoardTracker:
    """One scalar per metric in a TensorBoard event file under `log_dir`."""

    def __init__(self, log_dir: str | Path):
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(log_dir)
        self._writer = SummaryWriter(log_dir=str(self.log_dir))

    def log(self, metrics: dict[str, float], step: int) -> None:
        """add_scalar for every metric, then flush."""
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, global_step=step)
        self._writer.flush()

    def close(self, failed: bool = False) -> None:
        """Flush and close the event file."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class WandbTracker:
    """A Weights & Biases run in `run_dir/wandb`; WANDB_MODE=offline keeps it local. A resumed run dir continues its
    run."""

    def __init__(self, project: str, experiment: str, run_dir: Path, config: dict[str, Any]):
        import wandb

        previous = _load_tracker_runs(run_dir).get("wandb", {})
        run_id = previous.get("run_id") if isinstance(previous, dict) else None
        self._run = wandb.init(
            project=project,
            name=experiment,
            dir=str(run_dir),
            config=config,
            id=run_id,
            resume="allow" if run_id else None,
        )
        _save_tracker_run(run_dir, "wandb", {"run_id": self._run.id})

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Log all metrics at `step`."""
        self._run.log(dict(metrics), step=step)

    def close(self, failed: bool = False) -> None:
        """Finish the run (exit code 1 when the training failed)."""
        if self._run is not None:
            self._run.finish(exit_code=1 if failed else 0)
            self._run = None


class MlflowTracker:
    """An MLflow run (experiment = project, run name = experiment) with the flattened config as params.

    The tracking URI is `MLFLOW_TRACKING_URI` when set, else a local SQLite
    store `run_dir/mlruns/mlflow.db` with artifacts in `run_dir/mlruns/artifacts`
    (MLflow 3 refuses plain `file://` stores by default). A resumed run dir
    continues the same MLflow run when the URI is unchanged.
    """

    def __init__(self, project: str, experiment: str, run_dir: Path, config: dict[str, Any]):
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        artifact_location = None
        if not uri:
            store = (run_dir / "mlruns").resolve()
            store.mkdir(parents=True, exist_ok=True)
            uri = f"sqlite:///{store / 'mlflow.db'}"
            artifact_location = (store / "artifacts").as_uri()
        self.tracking_uri = uri
        self._client = MlflowClient(tracking_uri=uri)
        self.run_id = self._resume_or_create(run_dir, project, experiment, artifact_location)
        self._log_params(config)
        self._warned_renames: set[str] = set()

    def _resume_or_create(self, run_dir: Path, project: str, experiment: str, artifact_location: str | None) -> str:
        from mlflow.exceptions import MlflowException

        previous = _load_tracker_runs(run_dir).get("mlflow", {})
        if isinstance(previous, dict) and previous.get("tracking_uri") == self.tracking_uri and previous.get("run_id"):
            try:
                self._client.get_run(previous["run_id"])
            except MlflowException:
                logger.warning(
                    "MLflow run %s not found at %s; starting a new one", previous["run_id"], self.tracking_uri
                )
            else:
                self._client.update_run(previous["run_id"], status="RUNNING")
                return previous["run_id"]
        exp = self._client.get_experiment_by_name(project)
        if exp is not None:
            experiment_id = exp.experiment_id
        else:
            try:
                experiment_id = self._client.create_experiment(project, artifact_location=artifact_location)
            except MlflowException:
                # Another process created it between our lookup and create.
                experiment_id = self._client.get_experiment_by_name(project).experiment_id
        run = self._client.create_run(experiment_id, run_name=experiment)
        _save_tracker_run(run_dir, "mlflow", {"tracking_uri": self.tracking_uri, "run_id": run.info.run_id})
        return run.info.run_id

    def _log_params(self, config: dict[str, Any]) -> None:
        from mlflow.entities import Param

        existing = self._client.get_run(self.run_id).data.params
        params = []
        for key, value in flatten_config(config).items():
            key = mlflow_safe_name(key)
            text = json.dumps(value) if isinstance(value, (list, dict)) else str(value)
            if len(text) > _MLFLOW_PARAM_VALUE_MAX:
                text = text[: _MLFLOW_PARAM_VALUE_MAX - 3] + "..."
            if key in existing:
                # MLflow forbids changing a param; a resumed run with an edited config keeps the first value.
                if existing[key] != text:
                    logger.warning(
                        "MLflow param %s changed on resume (%r -> %r); keeping the first value",
                        key,
                        existing[key],
                        text,
                    )
                continue
            params.append(Param(key, text))
        for i in range(0, len(params), _MLFLOW_PARAMS_PER_BATCH):
            self._client.log_batch(self.run_id, params=params[i : i + _MLFLOW_PARAMS_PER_BATCH])

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Log all metrics at `step` (names made MLflow-safe)."""
        from mlflow.entities import Metric

        timestamp = int(time.time() * 1000)
        batch = []
        for name, value in metrics.items():
            safe = mlflow_safe_name(name)
            if safe != name and name not in self._warned_renames:
                self._warned_renames.add(name)
                logger.info("MLflow metric %r logged as %r", name, safe)
            batch.append(Metric(safe, value, timestamp, step))
        for i in range(0, len(batch), _MLFLOW_METRICS_PER_BATCH):
            self._client.log_batch(self.run_id, metrics=batch[i : i + _MLFLOW_METRICS_PER_BATCH])

    def close(self, failed: bool = False) -> None:
        """Mark the run FINISHED (or FAILED)."""
        if self._client is not None:
            self._client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")
            self._client = None


# --------------------------------------------------------------------------- registry
@dataclasses.dataclass(frozen=True)
class TrackerContext:
    """What a tracker factory may use: where the run writes, its names and config, the console stream."""

    run_dir: Path
    project: str
    experiment: str
    config: dict[str, Any]
    stream: TextIO | None
    table_every: int


TrackerFactory = Callable[[TrackerContext], Any]


def _console_tracker(c: TrackerContext) -> ConsoleTracker:
    """The console table, paced by the run's trainer.console_every and trainer.total_training_steps when given."""
    trainer = c.config.get("trainer") if isinstance(c.config, Mapping) else None
    trainer = trainer if isinstance(trainer, Mapping) else {}
    total = trainer.get("total_training_steps")
    total = total if isinstance(total, int) and not isinstance(total, bool) and total > 0 else None
    every = trainer.get("console_every")
    every = every if isinstance(every, int) and not isinstance(every, bool) else 0
    return ConsoleTracker(
        stream=c.stream, table_every=c.table_every, every=console_interval(total, every), total_steps=total
    )


# `trainer.logger` is checked against this registry: a tracker registered here is selectable by name.
TRACKERS: dict[str, TrackerFactory] = {}


def register_tracker(name: str, *, overwrite: bool = False) -> Callable[[TrackerFactory], TrackerFactory]:
    """Decorator registering `factory(TrackerContext) -> tracker` (with `log(metrics, step)`, `close(failed)`) as
    `name`."""

    return registrar(TRACKERS, name, "tracker", overwrite=overwrite)


register_tracker("console")(lambda c: _console_tracker(c))
register_tracker("jsonl")(lambda c: JsonlTracker(c.run_dir / "metrics.jsonl"))
register_tracker("tensorboard")(lambda c: TensorBoardTracker(c.run_dir / "tensorboard"))
register_tracker("wandb")(lambda c: WandbTracker(c.project, c.experiment, c.run_dir, c.config))
register_tracker("mlflow")(lambda c: MlflowTracker(c.project, c.experiment, c.run_dir, c.config))

# The built-in names, for messages and docs (the registry above is what is checked).
VALID_LOGGERS = tuple(TRACKERS)


# --------------------------------------------------------------------------- fan-out


def _normalise_loggers(loggers: Iterable[str] | str) -> list[str]:
    if isinstance(loggers, str):
        loggers = [loggers]
    names: list[str] = []
    for name in loggers:
        if not isinstance(name, str):
            raise ValueError(f"trainer.logger entries must be strings, got {name!r}")
        key = name.strip().lower()
        lookup(TRACKERS, key, "trainer.logger")  # an unknown name fails here, before any backend is opened
        if key not in names:
            names.append(key)
    return names


class Tracking:
    """Sends each step's metrics to every chosen backend; `close()` is idempotent, and it is a context manager."""

    def __init__(
        self,
        loggers: list[str],
        *,
        run_dir: str | Path,
        project: str,
        experiment: str,
        config: dict[str, Any] | None = None,
        console_table_every: int = 0,
        stream: TextIO | None = None,
    ):
        self.loggers = _normalise_loggers(loggers)
        for name in self.loggers:
            if name in _OPTIONAL_MODULES:
                module, extra = _OPTIONAL_MODULES[name]
                if importlib.util.find_spec(module) is None:
                    raise ValueError(
                        f"trainer.logger includes {name!r} but {module} is not installed: "
                        f"pip install 'conveyor[{extra}]'"
                    )
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        plain = _plain_config(config)
        self._backends: dict[str, _Backend] = {}
        self._closed = False
        context = TrackerContext(self.run_dir, project, experiment, plain, stream, console_table_every)
        try:
            for name in self.loggers:
                self._backends[name] = lookup(TRACKERS, name, "trainer.logger")(context)
        except BaseException:
            self._close(failed=True)
            raise

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Log `metrics` (name -> number) at `step` to every backend."""
        if self._closed:
            raise RuntimeError("Tracking.log called after close()")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        values = _coerce_metrics(metrics)
        for backend in self._backends.values():
            backend.log(values, step)

    def _close(self, failed: bool) -> None:
        if self._closed:
            return
        self._closed = True
        errors = []
        for name, backend in self._backends.items():
            try:
                backend.close(failed=failed)
            except Exception as err:  # close the others even if one fails
                logger.error("closing the %s tracker failed: %s", name, err)
                errors.append(err)
        if errors and not failed:
            raise errors[0]

    def close(self, failed: bool = False) -> None:
        """Flush and close every backend (idempotent); `failed=True` marks wandb/mlflow runs as failed."""
        self._close(failed=failed)

    def __enter__(self) -> Tracking:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._close(failed=exc_type is not None)
