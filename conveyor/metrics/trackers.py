"""Experiment tracking: one `Tracking` sends each step's metrics to the chosen backends.

Backends (the `TRACKERS` registry; `register_tracker` adds one): `console` (a compact table of the numbers
people watch: one row every few steps, averaged over them, and one at every validation;
`conveyor.metrics.console`), `jsonl`
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
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol, TextIO

from conveyor.files import read_jsonl_objects
from conveyor.metrics.console import CONSOLE_COLUMNS, ConsoleTracker, console_interval
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
