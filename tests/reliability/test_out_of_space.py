"""Full disks and unusable folders, on real small filesystems: every writer ends in one `error:` line.

A tmpfs of a few megabytes (`mount -t tmpfs -o size=...`) fills up for real,
so what is tested is the kernel's ENOSPC at whatever write hits it, not an
injected fault; a tmpfs mounted read-only and a path under a regular file are
the unusable folders (the suite runs as root, which ignores permission bits).
The tests skip, saying why, where mounting is not permitted.
"""

from __future__ import annotations

import errno
import os
import subprocess
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest


def _mount(where: Path, size: str, read_only: bool = False) -> None:
    where.mkdir(parents=True, exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {proc.stderr.strip()}")


@pytest.fixture
def tmpfs(tmp_path: Path) -> Callable[..., Path]:
    """`tmpfs(size, read_only=False)`: a fresh small filesystem under tmp_path, unmounted when the test ends."""
    mounted: list[Path] = []

    def make(size: str = "2M", read_only: bool = False) -> Path:
        where = tmp_path / f"fs-{uuid.uuid4().hex[:8]}"
        _mount(where, size, read_only)
        mounted.append(where)
        return where

    yield make
    for where in reversed(mounted):
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def fill(fs: Path, leave: int = 0) -> Path:
    """Fill the filesystem `fs` up, leaving about `leave` bytes free; the filler file (delete it to free the space)."""
    filler = fs / "filler"
    # A filler left by an earlier fill is removed first: truncating it in place can itself fail on a full filesystem.
    filler.unlink(missing_ok=True)
    # Unbuffered: a buffered writer would keep the bytes a full disk refused and fail again when closed.
    with open(filler, "wb", buffering=0) as f:
        chunk = b"\0" * (1 << 16)
        try:
            while True:
                f.write(chunk)  # a partial write returns short; the next one raises ENOSPC
        except OSError as err:
            assert err.errno == errno.ENOSPC, err
    size = filler.stat().st_size
    os.truncate(filler, max(0, size - leave))
    return filler


def _one_error_line(rel, status: int, err: str, *needles: str) -> str:
    """The `error:` line of a usage error holding every needle (the suite's assert_usage_error), returned."""
    rel.assert_usage_error(status, err, needles)
    return err.strip().splitlines()[-1]


def _no_temporaries(root: Path) -> None:
    left = [p for p in root.rglob("*") if ".tmp" in p.name]
    assert not left, left


# --------------------------------------------------------------------------- a real full disk during a run


def test_a_full_disk_during_a_save_is_one_line_and_the_newest_checkpoint_stays_whole(
    rel, base_model: str, tmpfs, capsys
) -> None:
    from conveyor.trainer.checkpoint import list_checkpoints, load_checkpoint

    fs = tmpfs("48M")
    run_dir = fs / "run"
    first = rel.run_cli(*rel.train_args(run_dir, "trainer.total_training_steps=1"))
    assert first.returncode == 0, first.stderr[-3000:]
    assert rel.checkpoint_steps(run_dir) == [1]

    # Room for a step's logs, not for a checkpoint.
    filler = fill(fs, leave=256 << 10)
    second = rel.run_cli(*rel.train_args(run_dir, "trainer.total_training_steps=2"))
    last = _one_error_line(rel, second.returncode, second.stderr, "No space left on device", "global_step_1")
    assert "saving checkpoint" in last or "writing the run" in last, last
    assert rel.checkpoint_steps(run_dir) == [1]
    _no_temporaries(run_dir / "checkpoints")  # the half-written copy was removed, not left to fill the disk
    newest = load_checkpoint(list_checkpoints(run_dir / "checkpoints")[-1][1])
    assert newest["trainer_state"]["global_step"] == 1 and (newest["actor"] / "param_groups.json").is_file()

    # Writers outside a run, onto the same full filesystem: one line each, nothing half-written left.
    out = fs / "export"
    _one_error_line(
        rel, *rel.main_in_process(["export", str(run_dir), "--out", str(out)], capsys), "No space left on device"
    )
    assert not out.exists()
    pytest.importorskip("matplotlib")
    fill(fs)
    _one_error_line(
        rel, *rel.main_in_process(["plot", str(run_dir), "--out", str(fs / "plots")], capsys), "No space left on device"
    )

    # Space freed, the same command resumes from the intact checkpoint and finishes.
    filler.unlink()
    third = rel.run_cli(*rel.train_args(run_dir, "trainer.total_training_steps=2"))
    assert third.returncode == 0, third.stderr[-3000:]
    assert "(step 1)" in third.stderr and rel.checkpoint_steps(run_dir) == [1, 2]

    # A checkpoint from elsewhere whose model config is broken: transformers' OSError without an errno is named.
    (run_dir / "checkpoints" / "global_step_2" / "hf" / "config.json").write_bytes(b"{\xff")
    _one_error_line(
        rel, *rel.main_in_process(["export", str(run_dir), "--out", str(fs / "model")], capsys), "hf/config.json"
    )


def test_a_full_disk_for_the_model_cache_is_one_line_naming_conveyor_cache(rel, tmpfs, capsys, monkeypatch) -> None:
    fs = tmpfs("2M")
    (fs / "cache").mkdir()
    fill(fs, leave=64 << 10)  # room for the folder, not for the model's weights
    monkeypatch.setenv("CONVEYOR_CACHE", str(fs / "cache"))
    status, err = rel.main_in_process(["warmstart", "actor_rollout_ref.model.tiny.warmstart_steps=0"], capsys)
    _one_error_line(rel, status, err, "CONVEYOR_CACHE", "No space left on device")
    _no_temporaries(fs)


def test_a_full_disk_for_dumps_and_metrics_is_an_environment_error_and_leaves_no_half_dump(tmpfs) -> None:
    from conveyor.files import environment_error
    from conveyor.metrics.dumps import write_generations
    from conveyor.metrics.trackers import JsonlTracker

    fs = tmpfs("1M")
    tracker = JsonlTracker(fs / "metrics.jsonl")
    fill(fs)
    row = {
        "prompt": "1+1",
        "response": "2" * 100_000,
        "ground_truth": "2",
        "data_source": "d",
        "reward": 1.0,
        "advantage": 0.0,
    }
    with pytest.raises(OSError) as dump_err:
        write_generations(fs, 1, [row])
    assert environment_error(dump_err.value) is not None  # what the command reports as one line
    _no_temporaries(fs)
    with pytest.raises(OSError) as log_err:
        tracker.log({"x": 1.0, **{f"k{i}": float(i) for i in range(5000)}}, step=1)
    assert environment_error(log_err.value) is not None
    try:
        tracker.close()
    except OSError:
        pass


def test_a_cut_short_cached_model_says_to_delete_that_cache_entry(rel, tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("CONVEYOR_CACHE", str(tmp_path / "cache"))
    args = ["warmstart", "actor_rollout_ref.model.tiny.warmstart_steps=0"]
    status, err = rel.main_in_process(args, capsys)
    assert status == 0, err
    (entry,) = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    weights = entry / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    last = _one_error_line(rel, *rel.main_in_process(args, capsys), str(entry), "delete that folder", "rebuild")
    assert "copy" not in last


# --------------------------------------------------------------------------- unusable folders


def _metrics_run(tmp_path: Path) -> Path:
    run = tmp_path / "metrics-run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n')
    return run


@pytest.fixture(params=["under_a_file", "read_only"])
def unusable(request, tmp_path: Path, tmpfs) -> tuple[Path, str]:
    """A folder nothing can be written into, and the words its error line holds."""
    if request.param == "under_a_file":
        (tmp_path / "a_file").write_text("x")
        return tmp_path / "a_file" / "sub" / "dir", "a_file"
    return tmpfs("1M", read_only=True) / "sub", "sub"


def test_plot_into_an_unusable_folder_is_one_line(rel, unusable, tmp_path: Path, capsys) -> None:
    pytest.importorskip("matplotlib")
    folder, needle = unusable
    _one_error_line(
        rel, *rel.main_in_process(["plot", str(_metrics_run(tmp_path)), "--out", str(folder)], capsys), "--out", needle
    )


def test_export_into_an_unusable_folder_is_one_line_before_anything_is_built(
    rel, unusable, tmp_path: Path, capsys
) -> None:
    folder, needle = unusable
    _one_error_line(
        rel,
        *rel.main_in_process(["export", str(_metrics_run(tmp_path)), "--out", str(folder / "model")], capsys),
        "--out",
        needle,
    )


def test_export_out_naming_a_file_is_one_line(rel, tmp_path: Path, capsys) -> None:
    (tmp_path / "taken").write_text("x")
    _one_error_line(
        rel,
        *rel.main_in_process(["export", str(_metrics_run(tmp_path)), "--out", str(tmp_path / "taken")], capsys),
        "--out",
        "is a file",
    )


def test_a_model_cache_in_an_unusable_folder_is_one_line_naming_conveyor_cache(
    rel, unusable, capsys, monkeypatch
) -> None:
    folder, needle = unusable
    monkeypatch.setenv("CONVEYOR_CACHE", str(folder))
    _one_error_line(
        rel,
        *rel.main_in_process(["warmstart", "actor_rollout_ref.model.tiny.warmstart_steps=0"], capsys),
        "CONVEYOR_CACHE",
        needle,
    )
