"""Tracking against the real backends: files written by console, jsonl, TensorBoard, MLflow and W&B (offline) read
back."""

from __future__ import annotations

import glob
import io
import json
import math
import struct
import sys
import time
from pathlib import Path

import pytest

from conveyor.metrics.trackers import (
    VALID_LOGGERS,
    ConsoleTracker,
    Tracking,
    console_interval,
    flatten_config,
    mlflow_safe_name,
    read_metrics_jsonl,
)

# mlflow's SQL store trips a SQLAlchemy deprecation warning of its own; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated")

CONFIG = {"actor": {"lr": 1e-6, "clip_ratio": 0.2}, "data": {"files": ["a.parquet", "b.parquet"]}, "seed": 7}

STEPS = {
    1: {"critic/score/mean": 0.25, "actor/pg_loss": -0.5, "actor/entropy": 1.5, "perf/throughput": 1200.0},
    2: {
        "critic/score/mean": 0.5,
        "actor/pg_loss": -0.25,
        "actor/entropy": 1.25,
        "perf/throughput": 1300.0,
        "val/accuracy": 0.4,
    },
    3: {"critic/score/mean": 0.75, "actor/pg_loss": float("nan"), "actor/entropy": 1.0, "perf/throughput": 1400.0},
}


@pytest.fixture(scope="module")
def mlflow_installed() -> None:
    """Skip without mlflow; import it once for the module (the import takes seconds)."""
    pytest.importorskip("mlflow.tracking")


@pytest.fixture
def no_mlflow_env(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


@pytest.fixture(scope="module")
def shared_mlflow_store(tmp_path_factory, mlflow_installed):
    """One SQLite store for the tests that point MLFLOW_TRACKING_URI elsewhere (creating a store takes seconds)."""
    store = tmp_path_factory.mktemp("mlflow_store")
    return store / "db.sqlite", f"sqlite:///{store / 'db.sqlite'}"


def _mlflow_run(run_dir: Path):
    from mlflow.tracking import MlflowClient

    info = json.loads((run_dir / "tracker_runs.json").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=info["tracking_uri"])
    return client, info["run_id"]


def test_console_jsonl_tensorboard_mlflow_write_real_files(tmp_path, no_mlflow_env, mlflow_installed):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = io.StringIO()
    with Tracking(
        ["console", "jsonl", "tensorboard", "mlflow"],
        run_dir=tmp_path,
        project="proj",
        experiment="exp-1",
        config=CONFIG,
        stream=out,
    ) as tracking:
        for step, metrics in STEPS.items():
            tracking.log(metrics, step)

    # jsonl: one valid JSON object per step, NaN as the string "nan" (strict parse refuses bare NaN).
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3
    strict = [json.loads(ln, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}")) for ln in lines]
    assert strict[0] == {"step": 1, **STEPS[1]}
    assert strict[1]["val/accuracy"] == 0.4 and "val/accuracy" not in strict[2]
    assert strict[2]["actor/pg_loss"] == "nan"
    records = read_metrics_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert math.isnan(records[2]["actor/pg_loss"]) and records[2]["critic/score/mean"] == 0.75

    # TensorBoard: the event file holds every scalar at its step.
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert "critic/score/mean" in acc.Tags()["scalars"]
    events = acc.Scalars("critic/score/mean")
    assert [(e.step, e.value) for e in events] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert [(e.step, e.value) for e in acc.Scalars("val/accuracy")] == [(2, pytest.approx(0.4))]

    # MLflow: local store under run_dir/mlruns, experiment = project, run name = experiment.
    assert (tmp_path / "mlruns" / "mlflow.db").is_file()
    client, run_id = _mlflow_run(tmp_path)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "exp-1"
    assert client.get_experiment(run.info.experiment_id).name == "proj"
    history = client.get_metric_history(run_id, "perf/throughput")
    assert sorted((m.step, m.value) for m in history) == [(1, 1200.0), (2, 1300.0), (3, 1400.0)]
    assert run.data.params["actor.lr"] == "1e-06"
    assert run.data.params["data.files"] == '["a.parquet", "b.parquet"]'
    assert run.data.params["seed"] == "7"

    # Console: a header, then a row per step here (no total step count: one step per row); no full dump.
    text = out.getvalue()
    lines = text.splitlines()
    assert lines[0].split() == ["step", "reward", "acc", "val_acc", "len", "entropy", "kl", "grad", "s/step", "tok/s"]
    rows = [ln.split() for ln in lines[1:]]
    assert [r[0] for r in rows] == ["1", "2", "3"]
    assert rows[0][1] == "0.250" and rows[0][-1] == "1200"
    assert rows[1][3] == "0.400" and rows[2][3] == "-"
    assert "--- step" not in text and "[actor]" not in text


def test_console_rows_average_their_window_and_validation_gets_a_row():
    out = io.StringIO()
    console = ConsoleTracker(stream=out, every=4, total_steps=10)
    console.log({"val/accuracy": 0.125}, 0)
    for step in range(1, 11):
        metrics = {"reward/mean": float(step), "timing_s/step": 0.5, "perf/throughput": 100.0 * step}
        if step == 6:
            metrics["val/accuracy"] = 0.5
        console.log(metrics, step)
    lines = out.getvalue().splitlines()
    assert (
        lines[0] == "   step    reward       acc   val_acc       len   entropy        kl      grad    s/step     tok/s"
    )
    # Rows: the step-0 validation, step 1, every 4 steps, the validation at 6, and the last step.
    rows = [ln.split() for ln in lines[1:]]
    assert [r[0] for r in rows] == ["0/10", "1/10", "4/10", "6/10", "8/10", "10/10"]
    assert rows[0][1:] == ["-", "-", "0.125"] + ["-"] * 6
    # A row holds the mean over the steps since the previous row: (2 + 3 + 4) / 3, then (5 + 6) / 2.
    assert rows[2][1] == "3.000" and rows[3][1] == "5.500" and rows[3][3] == "0.500"
    assert rows[2][3] == "-" and rows[5][1] == "9.500" and rows[5][-1] == "950"
    assert (
        lines[1] == "   0/10         -         -     0.125         -         -         -         -         -         -"
    )
    # A negative value in scientific notation fits its column: the columns stay aligned.
    assert len(console.format_line({"actor/ppo_kl": -3.3e-08}, 1)) == len(lines[0])


def test_console_header_repeats_and_full_table_on_request():
    out = io.StringIO()
    console = ConsoleTracker(stream=out, header_every=2, table_every=3)
    for step in range(1, 5):
        console.log({"reward/mean": 0.5, "actor/pg_loss": -0.0123, "lr": 1e-6}, step)
    lines = out.getvalue().splitlines()
    firsts = [ln.split()[0] for ln in lines]
    assert [f for f in firsts if f == "step" or f.isdigit()] == ["step", "1", "2", "step", "3", "4"]
    # The full dump only when asked for: every metric grouped by section, keys and values aligned.
    assert [ln for ln in lines if ln.startswith("--- step")] == ["--- step 3: 3 metrics " + "-" * 20]
    table = lines[lines.index("--- step 3: 3 metrics " + "-" * 20) :]
    assert table[1] == "[actor]" and table[2] == "  pg_loss    -0.0123"
    assert table[3] == "[other]" and table[4] == "  lr       1.000e-06"


def test_console_interval_rounds_to_about_30_rows():
    assert [console_interval(n) for n in (None, 1, 2, 39, 80, 600, 1000, 3000)] == [1, 1, 1, 1, 2, 20, 25, 100]
    assert console_interval(1000, every=7) == 7
    with pytest.raises(ValueError, match="console_every"):
        ConsoleTracker(every=0)


def test_jsonl_appends_on_resume_and_survives_a_torn_line(tmp_path):
    with Tracking(["jsonl"], run_dir=tmp_path, project="p", experiment="e", config={}) as t:
        t.log({"a": 1.0}, 1)
        # On disk before close: a crash right after log() loses nothing.
        assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "a": 1.0}\n'
        t.log({"a": 2.0}, 2)
    # A crash in the middle of writing step 3 leaves half a line without a newline.
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "a": 3.')
    with Tracking(["jsonl"], run_dir=tmp_path, project="p", experiment="e", config={}) as t:
        t.log({"a": 20.0, "b": float("-inf")}, 2)  # resumed from the step-1 checkpoint
        t.log({"a": 30.0}, 3)
    raw = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(raw) == 5 and raw[2] == '{"step": 3, "a": 3.'
    records = read_metrics_jsonl(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["a"]) for r in records] == [(1, 1.0), (2, 20.0), (3, 30.0)]
    assert records[1]["b"] == float("-inf")


def test_mlflow_resume_continues_the_run_and_failure_is_recorded(tmp_path, monkeypatch, shared_mlflow_store):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", shared_mlflow_store[1])
    with Tracking(["mlflow"], run_dir=tmp_path, project="p", experiment="e", config={"x": 1}) as t:
        t.log({"loss/total": 1.0, "val-core/gsm8k/acc/mean@4": 0.5}, 1)
    client, first_id = _mlflow_run(tmp_path)
    with pytest.raises(RuntimeError, match="boom"):
        with Tracking(["mlflow"], run_dir=tmp_path, project="p", experiment="e", config={"x": 2}) as t:
            t.log({"loss/total": 0.5}, 2)
            raise RuntimeError("boom")
    client, run_id = _mlflow_run(tmp_path)
    assert run_id == first_id
    run = client.get_run(run_id)
    assert run.info.status == "FAILED"
    assert run.data.params["x"] == "1"  # MLflow params cannot change; the first value stays
    assert sorted((m.step, m.value) for m in client.get_metric_history(run_id, "loss/total")) == [(1, 1.0), (2, 0.5)]
    # '@' is not allowed in MLflow names.
    assert [m.value for m in client.get_metric_history(run_id, "val-core/gsm8k/acc/mean_4")] == [0.5]


def test_mlflow_honours_tracking_uri(tmp_path, monkeypatch, shared_mlflow_store):
    db, uri = shared_mlflow_store
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    run_dir = tmp_path / "run"
    with Tracking(["mlflow"], run_dir=run_dir, project="elsewhere", experiment="e", config={}) as t:
        t.log({"m": 3.0}, 5)
    assert db.is_file() and not (run_dir / "mlruns").exists()
    client, run_id = _mlflow_run(run_dir)
    assert client.tracking_uri == uri
    assert client.get_experiment(client.get_run(run_id).info.experiment_id).name == "elsewhere"
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "m")] == [(5, 3.0)]


def _read_wandb_records(path: Path):
    """Protobuf records of a .wandb file (LevelDB-style log: 7-byte file header, 32 KiB blocks, 7-byte record
    headers)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, pending, out = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pos += 7
        chunk = data[pos : pos + length]
        pos += length
        if kind == 1:
            out.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            out.append(pending + chunk)
    records = []
    for raw in out:
        rec = pb.Record()
        rec.ParseFromString(raw)
        records.append(rec)
    return records


def test_wandb_offline_writes_its_run_directory(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for var, value in {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_DIR": str(tmp_path / "wandb_default"),
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb_config"),
        "WANDB_CACHE_DIR": str(tmp_path / "wandb_cache"),
        "WANDB_DATA_DIR": str(tmp_path / "wandb_data"),
    }.items():
        monkeypatch.setenv(var, value)
    run_dir = tmp_path / "run"
    with Tracking(["wandb"], run_dir=run_dir, project="proj", experiment="exp-w", config=CONFIG) as t:
        t.log({"critic/score/mean": 0.25}, 1)
        t.log({"critic/score/mean": 0.75, "actor/entropy": 1.5}, 2)
    files = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(files) == 1
    # The wandb service process writes the file; finish() can return before it has written the last record.
    deadline = time.monotonic() + 20
    while True:
        records = _read_wandb_records(Path(files[0]))
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    runs = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert runs and runs[0].project == "proj" and runs[0].display_name == "exp-w"
    history = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
            history[r.history.step.num] = items
    assert history[1]["critic/score/mean"] == 0.25
    assert history[2]["critic/score/mean"] == 0.75 and history[2]["actor/entropy"] == 1.5
    run_id = json.loads((run_dir / "tracker_runs.json").read_text())["wandb"]["run_id"]
    assert files[0].endswith(f"run-{run_id}.wandb")


def test_unknown_logger_names_the_valid_ones_and_the_nearest(tmp_path):
    with pytest.raises(ValueError) as err:
        Tracking(["console", "tensorbord"], run_dir=tmp_path, project="p", experiment="e", config={})
    message = str(err.value)
    assert "'tensorbord'" in message and "did you mean 'tensorboard'" in message
    assert all(name in message for name in VALID_LOGGERS)


def test_missing_optional_library_gives_install_hint(tmp_path, monkeypatch):
    # An interpreter without site-packages on its path cannot find wandb, as on a bare install.
    monkeypatch.setattr(sys, "path", [p for p in sys.path if "site-packages" not in p])
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    hint = r"trainer.logger includes 'wandb' but wandb is not installed: pip install 'conveyor\[wandb\]'"
    with pytest.raises(ValueError, match=hint):
        Tracking(["console", "wandb"], run_dir=tmp_path / "r", project="p", experiment="e", config={})
    assert not (tmp_path / "r").exists()  # checked before anything was created


def test_log_validates_and_close_is_idempotent(tmp_path):
    t = Tracking("jsonl", run_dir=tmp_path, project="p", experiment="e", config={})
    with pytest.raises(ValueError, match="'actor/pg_loss'"):
        t.log({"actor/pg_loss": "high"}, 1)
    with pytest.raises(ValueError, match="'step'"):
        t.log({"step": 1.0}, 1)
    with pytest.raises(ValueError, match="step must be"):
        t.log({"a": 1.0}, -1)
    t.log({"a": 1}, 1)  # ints are accepted and written as numbers
    t.close()
    t.close()
    with pytest.raises(RuntimeError, match="after close"):
        t.log({"a": 1.0}, 2)
    assert read_metrics_jsonl(tmp_path / "metrics.jsonl") == [{"step": 1, "a": 1.0}]


def test_helpers():
    assert flatten_config({"a": {"b": 1, "c": {"d": "x"}}, "e": [1, 2]}) == {"a.b": 1, "a.c.d": "x", "e": [1, 2]}
    assert mlflow_safe_name("val-core/gsm8k/acc/mean@4") == "val-core/gsm8k/acc/mean_4"
    assert mlflow_safe_name("a//b/./c/../d") == "a/b/c/__/d"
    assert mlflow_safe_name("perf/max_memory (GB)") == "perf/max_memory _GB_"
    with pytest.raises(ValueError, match="metrics file .* does not exist"):
        read_metrics_jsonl("/nonexistent/metrics.jsonl")


class _ReaderGone(io.StringIO):
    """A console stream whose reader went away after the first line (a pipe into `head`, a closed terminal)."""

    def write(self, text: str) -> int:
        if self.getvalue():
            raise BrokenPipeError(32, "Broken pipe")
        return super().write(text)


def test_a_console_whose_reader_is_gone_stops_writing_and_the_run_goes_on(caplog):
    stream = _ReaderGone()
    console = ConsoleTracker(stream=stream, every=1, total_steps=5)
    with caplog.at_level("WARNING", logger="conveyor.metrics.trackers"):
        for step in range(1, 6):
            console.log({"reward/mean": float(step)}, step)  # raises nothing
    gone = [r for r in caplog.records if "its output is gone" in r.getMessage()]
    assert len(gone) == 1 and "BrokenPipeError" in gone[0].getMessage()  # said once, not at every step
    assert stream.getvalue().count("\n") == 1  # the header, written before the reader left; nothing after
