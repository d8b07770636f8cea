"""The boundary with the file system: reading a user's files and writing into folders, with errors that say where.

Every reader of a file that comes from outside (a config YAML, a tool YAML, a
metrics or dump JSONL, a checkpoint's side files) reads its text through
`read_text`, so bytes that are not UTF-8 end in one `ValueError` naming the
file and the byte, not a codec message naming neither. Every writer that
creates a folder does so through `make_dir`, so a path under a regular file or
on a read-only filesystem names the folder and the key that chose it.
`environment_error` finds, behind any exception, an `OSError` the environment
caused (a full disk, a read-only or missing folder, a path under a file): the
command line turns those into one `error:` line and leaves every other
exception a traceback, since anything else is a bug.

It deliberately does not retry, wait for space, or pick another folder.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

__all__ = [
    "read_text",
    "read_jsonl_objects",
    "write_text_atomic",
    "make_dir",
    "environment_error",
    "full_disk_error",
    "describe_os_error",
]

# The errors a user's disk, mounts and paths cause. Any other OSError (EBADF, EINVAL; EEXIST or ENOTEMPTY from a
# rename, EMFILE from a leak) is more likely a bug, and stays a traceback.
_ENVIRONMENT_ERRNOS = frozenset(
    getattr(errno, name)
    for name in (
        "ENOSPC",
        "EDQUOT",
        "EROFS",
        "ENOTDIR",
        "EISDIR",
        "EACCES",
        "EPERM",
        "ENOENT",
        "ENAMETOOLONG",
        "EFBIG",
        "ELOOP",
    )
    if hasattr(errno, name)
)

_RUST_IO_ERROR = re.compile(r"\(os error (\d+)\)")

# What to change, per kind of failure.
_FIX = {
    errno.ENOSPC: "free space on that filesystem or choose a folder on another one",
    errno.EROFS: "that filesystem is mounted read-only: choose a writable folder",
    errno.ENOTDIR: "a part of that path is a regular file, not a folder: choose another path",
    errno.EISDIR: "that path is a folder where a file was expected: choose another path",
    errno.EACCES: "fix the folder's permissions or choose a writable folder",
    errno.EPERM: "fix the folder's permissions or choose a writable folder",
}


def read_text(path: str | Path, what: str, fix: str = "") -> str:
    """The UTF-8 text of the file at `path` (`what` it is, e.g. "metrics file"); ValueError naming it otherwise."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as err:
        raise ValueError(f"{what} {p} cannot be read: {err.strerror or err}" + (f"; {fix}" if fix else "")) from err
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise ValueError(
            f"{what} {p} is not UTF-8 text (byte 0x{data[err.start]:02x} on line {line}); save it as "
            "UTF-8" + (f", or {fix}" if fix else "")
        ) from err


def read_jsonl_objects(path: Path, what: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) of each line of the JSONL file `path` that is a JSON object; the others are skipped.

    A crash can leave the last line half written, and a file from elsewhere may hold anything: a line that
    is not UTF-8, not JSON, nested too deeply or not an object is skipped with a warning naming `what` and
    the line, and the rest is still read.
    """
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ValueError(f"{what} {path} cannot be read: {err.strerror or err}") from err
    for lineno, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw.decode("utf-8"))
        except (ValueError, RecursionError) as err:  # UnicodeDecodeError and int digit limits are ValueErrors
            logger.warning(
                "%s %s:%d is not valid UTF-8 JSON (%s); skipped",
                what,
                path,
                lineno,
                str(err).splitlines()[0][:200] if str(err) else type(err).__name__,
            )
            continue
        if not isinstance(record, dict):
            logger.warning("%s %s:%d is not a JSON object; skipped", what, path, lineno)
            continue
        yield lineno, record


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write `text` to `path` through a temporary file renamed over it: a reader sees the old file or the new one.

    A run killed mid-write would otherwise leave a half file (a config.yaml, a plan.json) that the next run or
    `conveyor plot` reads.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def make_dir(path: str | Path, key: str) -> Path:
    """Create the folder `path` (and its parents) for writing; a ValueError naming it and `key` if impossible."""
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
    except FileExistsError as err:
        raise ValueError(f"{key}: {p} is a file, not a folder; choose a folder") from err
    except OSError as err:
        raise ValueError(f"{key}: cannot create the folder {p}: {describe_os_error(err)}") from err
    if not os.access(p, os.W_OK):
        raise ValueError(f"{key}: the folder {p} is not writable; fix its permissions or choose another folder")
    return p


_FULL_BYTES = 1 << 20
"""Free space below which a filesystem counts as full: a write that ran out of room leaves only part of a block."""


def full_disk_error(path: str | Path) -> OSError | None:
    """An ENOSPC OSError when the filesystem holding `path` is full now, else None.

    For writers whose failure on a full disk is no OSError (torch's zip writer says "unexpected pos"):
    asked right after the failure, before anything is cleaned up, the disk itself tells.
    """
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    if st.f_bavail * st.f_frsize >= _FULL_BYTES:
        return None
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def describe_os_error(err: OSError) -> str:
    """`err` as 'what failed, on which file: what to change'."""
    where = f" ({err.filename})" if err.filename else ""
    fix = _FIX.get(err.errno or -1, "check that path")
    return f"{err.strerror or err}{where}; {fix}"


def environment_error(err: BaseException, any_errno: bool = False, through_context: bool = False) -> OSError | None:
    """The OSError the environment caused behind `err` (itself, a cause, a worker's or DCP's failure), or None.

    `through_context` also follows exceptions raised while handling another (a save's cleanup); `any_errno`
    accepts every OSError, not only the environment's (a save that failed on its disk, whatever the reason).
    """
    seen: set[int] = set()
    todo: list[Any] = [err]
    while todo:
        e = todo.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and (any_errno or e.errno in _ENVIRONMENT_ERRNOS):
            return e
        rust = _RUST_IO_ERROR.search(str(e)) if not isinstance(e, OSError) else None
        if rust and int(rust.group(1)) in _ENVIRONMENT_ERRNOS:
            # A Rust library's I/O failure (safetensors' SafetensorError) is no OSError, but says its errno.
            return OSError(int(rust.group(1)), os.strerror(int(rust.group(1))))
        todo += [e.__cause__, getattr(e, "cause", None)] + ([e.__context__] if through_context else [])
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint's CheckpointException
        if isinstance(failures, dict):
            todo += [v for v in failures.values() if isinstance(v, BaseException)]
    return None
