"""The run directory: created with clear errors, held by one run at a time, and kept consistent with its checkpoints.

- `open_run_dir(cfg)` creates the directory (a read-only or impossible path is
  a `ValueError` naming it and the key to change) and takes an exclusive lock
  on `run_dir/.conveyor.lock` for the run's life. The lock is an `flock`, so
  the kernel drops it when the process ends, however it ends: a crashed run
  leaves nothing stuck. A second run on the same directory is refused with the
  other run's pid, host and start time.
- `check_resume(cfg, checkpoint)` compares the config a checkpoint was written
  with against this run's. A difference in a setting that changes what the run
  computes is refused, naming the checkpoint and each key (saved -> now),
  unless `trainer.resume_accept_config_changes=true`; settings that only
  change where or how often things happen (steps to run, logging, saving,
  ranks and their strategy, devices, the data plane) may differ freely: each
  is declared `resume_neutral` on its field in `conveyor.config`.
- `check_no_newer_checkpoints(cfg, run_dir, resumed, step)` refuses a run that
  would start behind checkpoints already in its run directory (an explicit
  `resume_path` to an older step, or `resume_mode=disable` over a run's
  checkpoints): theirs would outrank the new steps, a plain re-run would
  continue the abandoned run, and pruning or a save of the same step would
  delete them. Nothing is moved or deleted; the message says how to branch
  into a new run directory.
- `write_config(cfg, run_dir, accepted)` writes `config.yaml`; the previous one
  is kept beside it when the change was accepted, so no record is lost.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import functools
import logging
import os
import socket
from pathlib import Path
from typing import Any

from conveyor.config import Config, config_to_dict, config_to_yaml, resume_neutral_keys
from conveyor.files import write_text_atomic
from conveyor.metrics.trackers import flatten_config
from conveyor.trainer.checkpoint import list_checkpoints

logger = logging.getLogger(__name__)

__all__ = [
    "RunDirLock",
    "open_run_dir",
    "check_resume",
    "check_no_newer_checkpoints",
    "write_config",
    "config_differences",
    "NEUTRAL_KEYS",
]

# Settings a resumed run may change without changing what it computes: how long, where and how often it
# logs, saves and validates, and how its ranks are placed and hold the model (sharded checkpoints reshard).
# Each is declared where the setting is, `F(..., resume_neutral=True)`; a whole section ends with '.'.
NEUTRAL_KEYS: tuple[str, ...] = resume_neutral_keys(Config)


def _neutral(key: str) -> bool:
    return any(key == n or (n.endswith(".") and key.startswith(n)) for n in NEUTRAL_KEYS)


class RunDirLock:
    """An exclusive lock on a run directory for one run's life (released by the kernel if the process dies)."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / ".conveyor.lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock, or fail naming the run that holds it."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            holder = self.path.read_text().strip() or "another process"
            raise ValueError(
                f"run directory {self.path.parent} is in use by another run ({holder}); wait for it to finish, stop "
                "it, or give this run its own directory (trainer.experiment_name or trainer.default_local_dir)"
            ) from None
        started = datetime.datetime.now().isoformat(timespec="seconds")
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}, started {started}\n".encode())
        self._fd = fd

    def release(self) -> None:
        """Give the lock back (safe to call twice)."""
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def open_run_dir(cfg: Config) -> RunDirLock:
    """Create the run directory and lock it for this run; an unusable directory is a ValueError naming the key."""
    run_dir = cfg.run_dir
    key = "trainer.default_local_dir" if cfg.trainer.default_local_dir else "trainer.experiment_name"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        lock = RunDirLock(run_dir)
        lock.acquire()
    except ValueError:
        raise
    except OSError as err:
        raise ValueError(
            f"cannot use run directory {run_dir} ({err.strerror or err}); choose a writable directory with {key}"
        ) from err
    return lock


@functools.cache
def _defaults() -> dict[str, Any]:
    """Every key's default value, flattened."""
    return flatten_config(config_to_dict(Config()))


def config_differences(saved: dict[str, Any], now: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, saved value, current value) for each setting that changes the run and differs.

    A key the checkpoint does not have, set to its default now, is no difference: it was added after the checkpoint
    was written, and a new key's default is the behaviour before it existed."""
    a, b = flatten_config(saved), flatten_config(now)
    missing = object()
    out = []
    for key in sorted(set(a) | set(b)):
        if _neutral(key):
            continue
        old, new = a.get(key, missing), b.get(key, missing)
        if old is missing and key in _defaults() and new == _defaults()[key]:
            continue
        if old != new:
            out.append((key, "(absent)" if old is missing else old, "(absent)" if new is missing else new))
    return out


def check_resume(cfg: Config, checkpoint: Path, saved_config: dict[str, Any] | None) -> bool:
    """Refuse (ValueError) a resume whose run-changing settings differ from `checkpoint`'s; True if changes were
    accepted."""
    if saved_config is None:
        raise ValueError(
            f"checkpoint {checkpoint} records no config, so it cannot be checked against this run; "
            "start a new run directory or set trainer.resume_mode=disable"
        )
    diffs = config_differences(saved_config, config_to_dict(cfg))
    if not diffs:
        return False
    listed = "; ".join(f"{k}: {old!r} -> {new!r}" for k, old, new in diffs[:12])
    more = f" and {len(diffs) - 12} more" if len(diffs) > 12 else ""
    if not cfg.trainer.resume_accept_config_changes:
        raise ValueError(
            f"checkpoint {checkpoint} was written with other settings that change the run: {listed}{more}. "
            "Resume with the checkpoint's settings, start a new run directory, or accept the change "
            "with trainer.resume_accept_config_changes=true"
        )
    logger.warning(
        "resuming %s with changed settings (trainer.resume_accept_config_changes=true): %s%s", checkpoint, listed, more
    )
    return True


def check_no_newer_checkpoints(cfg: Config, run_dir: Path, resumed: Path | None, step: int) -> None:
    """Refuse (ValueError) a run starting at `step` (from `resumed`, or fresh) behind checkpoints already in
    `run_dir`."""
    newer = [p for s, p in list_checkpoints(run_dir / "checkpoints") if s > step]
    if not newer:
        return
    names = ", ".join(p.name for p in newer[:4]) + (f" and {len(newer) - 4} more" if len(newer) > 4 else "")
    key = "trainer.default_local_dir" if cfg.trainer.default_local_dir else "trainer.experiment_name"
    if resumed is None:
        raise ValueError(
            f"trainer.resume_mode={cfg.trainer.resume_mode} starts a new run at step 0, but run directory {run_dir} "
            f"holds checkpoints of an earlier run ({names}), which would outrank the new run's steps and be "
            f"overwritten or pruned by its saves; give the new run its own directory ({key}), or continue the "
            "earlier run with trainer.resume_mode=auto"
        )
    raise ValueError(
        f"trainer.resume_from_path={resumed} is step {step}, but run directory {run_dir} holds newer checkpoints "
        f"({names}): they would outrank this run's steps, so a plain re-run would continue the abandoned run. To "
        f"branch from step {step}, give this run a new directory with {key} (keeping trainer.resume_from_path); to "
        "continue the newest checkpoint instead, use trainer.resume_mode=auto"
    )


def write_config(cfg: Config, run_dir: Path, keep_previous: bool = False) -> None:
    """Write the run's config.yaml (the previous one is kept as config.<time>.yaml when `keep_previous`)."""
    path = run_dir / "config.yaml"
    if keep_previous and path.is_file():
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        path.rename(run_dir / f"config.{stamp}.yaml")
    write_text_atomic(path, config_to_yaml(cfg))
