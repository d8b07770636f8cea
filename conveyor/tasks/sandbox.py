"""Running untrusted programs (a model's code) for a reward: one confined process per program, a pool of them.

`Sandbox.run(files)` writes the files into a fresh directory and runs
``python main.py`` there through the launcher (`sandbox_launch.py`, read its
docstring for the mechanics) with a cleared environment, no network, rlimits on
CPU seconds, memory, processes, open files and file size, a wall-clock timeout,
and everything it started killed afterwards. It returns a `SandboxResult`
whose `outcome` says how the program ended; a program that hits a limit is an
outcome, never an exception, so a run scoring hostile programs goes on. Only a
sandbox that cannot be built at all (`SandboxError`) stops the run: scoring
every sample 0 then would hide a broken machine.

Isolation (`ISOLATION_MODES`): ``namespaces`` adds new user/mount/network/PID/
IPC/UTS namespaces and a chroot holding only read-only system folders and the
program's own tmpfs; ``rlimits`` is the rlimits, the session and the cleanup
alone (for a kernel without user namespaces); ``auto`` takes namespaces when
this machine has them. docs/RELIABILITY.md says what each mode guarantees.

`SandboxPool` runs up to `max_concurrent` programs at once (threads that each
wait on one process) and counts outcomes for the step's metrics. A reward
function that runs code is marked with `runs_code`; the reward worker then
calls it with ``sandbox=`` the pool's sandbox, on the pool's threads.

What it deliberately does not do: judge a program (the reward function parses
what the program printed), or defend the score against a program that forges its
own test report (it shares the interpreter with the test harness).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import marshal
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

__all__ = [
    "ISOLATION_MODES",
    "OUTCOMES",
    "Sandbox",
    "SandboxError",
    "SandboxLimits",
    "SandboxPool",
    "SandboxResult",
    "namespaces_available",
    "runs_code",
    "sandbox_metrics",
    "sandbox_pool",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

ISOLATION_MODES = ("auto", "namespaces", "rlimits")
"""reward.sandbox.isolation's choices: namespaces when available, namespaces (required), rlimits alone."""

OUTCOMES = ("ok", "error", "timeout", "cpu_limit", "memory_limit", "output_limit", "signal")
"""How a program can end: exit 0, a non-zero exit, past the wall clock, past its CPU seconds, out of memory,
past the output size, killed by another signal (its own doing, e.g. killing its supervisor)."""

_LAUNCHER = Path(__file__).with_name("sandbox_launch.py")
# The system folders a program's interpreter may need, read-only; the interpreter's own prefix is added.
_SYSTEM_DIRS = ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin")
# Time the launcher has, past the program's wall clock, to kill and report before it is killed itself.
_GRACE_S = 5.0
# A marshal format every Python 3 interpreter that may run the launcher (reward.sandbox.python) reads.
_MARSHAL = 4


def _check_python3(python: str) -> None:
    """Refuse an interpreter that is not Python 3: every program would fail to start and score 0, not stop the run."""
    import subprocess

    try:
        out = subprocess.run(
            [python, "-I", "-c", "import sys; print(sys.version_info[0])"],
            capture_output=True,
            timeout=30,
            stdin=subprocess.DEVNULL,
        )
        ok = out.returncode == 0 and out.stdout.strip() == b"3"
    except (OSError, subprocess.SubprocessError):
        ok = False
    if not ok:
        raise ValueError(
            f"reward.sandbox.python: {python!r} is not a Python 3 interpreter (it did not run `import sys`); give "
            "one, or null for the trainer's own"
        )


def _lock_uid(uid: int) -> tuple[bool, int | None]:
    """Try to lease `uid` machine-wide: (whether it is ours, the descriptor holding the lease).

    flock locks belong to an open file, so two sandboxes of one process exclude each other as two processes do;
    where no lock folder can be made, the lease is this process's alone."""
    import fcntl

    # One folder for the machine whatever a process's TMPDIR says (Ray's workers may be given their own).
    folder = Path("/tmp" if os.path.isdir("/tmp") else tempfile.gettempdir()) / "conveyor-sandbox-uids"
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(folder / f"{uid}.lock", os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except OSError:
        return True, None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False, None
    return True, fd


class SandboxError(RuntimeError):
    """The sandbox itself could not be built (not a program's failure): the run stops, naming the cause."""


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """What one execution may use (the kernel enforces each one)."""

    wall_s: float = 10.0
    cpu_s: float = 5.0
    memory_mb: int = 1024
    max_processes: int = 16
    max_open_files: int = 64
    max_output_mb: float = 1.0
    disk_mb: int = 16

    def __post_init__(self) -> None:
        for name in ("wall_s", "cpu_s", "memory_mb", "max_processes", "max_open_files", "max_output_mb", "disk_mb"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {getattr(self, name)!r}")


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """How one program ended (`outcome`, one of OUTCOMES) and what it printed (cut at the output limit)."""

    outcome: str
    exit_code: int | None
    signal: int | None
    wall_s: float
    cpu_s: float
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        """Whether the program exited with status 0."""
        return self.outcome == "ok"


@functools.cache
def namespaces_available() -> bool:
    """Whether this machine lets the sandbox use namespaces (probed once per process by running an empty program)."""
    if not sys.platform.startswith("linux"):
        return False
    probe = Sandbox(SandboxLimits(wall_s=20.0), isolation="namespaces")
    try:
        return probe.run({"main.py": "pass\n"}).ok
    except SandboxError:
        return False


def runs_code(fn: Callable[..., float]) -> Callable[..., float]:
    """Mark a reward function as one that runs code: the reward worker calls it with `sandbox=` a `Sandbox`."""
    fn.runs_code = True  # type: ignore[attr-defined]
    return fn


class Sandbox:
    """Runs one program at a time per call (calls may run concurrently) under `limits` and an isolation mode."""

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        *,
        isolation: str = "auto",
        uid: int = 65534,
        gid: int = 65534,
        python: str | None = None,
    ):
        if isolation not in ISOLATION_MODES:
            raise ValueError(f"reward.sandbox.isolation must be one of {ISOLATION_MODES}, got {isolation!r}")
        if uid == 0 or gid == 0:
            raise ValueError("reward.sandbox.user must not be 0: programs never run as root")
        self.limits = limits or SandboxLimits()
        self.requested = isolation
        self.uid, self.gid = uid, gid
        # The base interpreter (a virtual environment's python is a link to it), run isolated from site-packages.
        self.python = os.path.realpath(python or sys.executable)
        if not os.access(self.python, os.X_OK):
            raise ValueError(f"reward.sandbox.python: {self.python!r} is not an executable file")
        _check_python3(self.python)
        prefix = os.path.dirname(os.path.dirname(self.python))  # <prefix>/bin/python: its stdlib is under <prefix>
        self.read_only = [*_SYSTEM_DIRS, *([prefix] if not prefix.startswith(_SYSTEM_DIRS) else [])]
        self._isolation: str | None = None if isolation == "auto" else isolation
        self._lock = threading.Lock()
        # RLIMIT_NPROC counts every process of a uid on the machine, so programs running at once as one uid would
        # share one budget (a fork bomb in one would make the others' forks fail): each run at once gets a uid of its
        # own, leased machine-wide (other reward workers' sandboxes, other runs) through a lock file per uid.
        self._uids_in_use: dict[int, int | None] = {}  # uid -> the descriptor holding its lease (None: no lock dir)
        self.counts: Counter[str] = Counter()
        self.exec_s = 0.0

    @property
    def isolation(self) -> str:
        """The mode in force: `namespaces` or `rlimits` (`auto` resolved on first use)."""
        if self._isolation is None:
            self._isolation = "namespaces" if namespaces_available() else "rlimits"
            if self._isolation == "rlimits":
                logger.warning(
                    "reward.sandbox.isolation=auto: this machine allows no namespaces, so programs run under "
                    "rlimits alone, with no network, file or process isolation (docs/RELIABILITY.md)"
                )
        return self._isolation

    def describe(self) -> str:
        """The isolation mode in force and the limits of every program, in one line (resolves `auto`)."""
        lim = self.limits
        namespaced = self.isolation == "namespaces"
        if namespaced:
            how = "namespaces (user, mount, network, PID, IPC and UTS of its own, a chroot of read-only system folders)"
        else:
            how = "rlimits alone (no network, file or process isolation)"
            if os.geteuid() == 0:
                how += f", as uid {self.uid}"
        return (
            f"sandbox: isolation {how} (reward.sandbox.isolation={self.requested}); per program at most "
            f"{lim.wall_s:g} s wall, {lim.cpu_s:g} s CPU, {lim.memory_mb} MB memory, {lim.max_processes} processes, "
            f"{lim.max_open_files} open files, {lim.max_output_mb:g} MB output"
            # The folder's size is a tmpfs's, which only the namespaces give.
            + (f", {lim.disk_mb} MB disk" if namespaced else "")
        )

    def pop_counts(self) -> tuple[Counter[str], float]:
        """Executions by outcome and their total wall seconds since the last call; both restart from zero."""
        with self._lock:
            counts, seconds = self.counts, self.exec_s
            self.counts, self.exec_s = Counter(), 0.0
        return counts, seconds

    def run(self, files: dict[str, str], entry: str = "main.py") -> SandboxResult:
        """Run `python entry` in a fresh directory holding `files` (name -> text); how it ended, never an exception
        for anything the program does."""
        if entry not in files:
            raise ValueError(f"the entry {entry!r} is not among the files {sorted(files)}")
        bad = [n for n in files if not n or "/" in n or n.startswith(".")]
        if bad:
            raise ValueError(f"sandbox file names must be plain names, got {bad}")
        isolation = self.isolation
        if isolation == "rlimits" and os.geteuid() == 0:
            self._check_reachable()
        work = Path(tempfile.mkdtemp(prefix="conveyor-sandbox-"))
        uid = self._lease_uid()
        try:
            result = self._run_in(work, files, entry, isolation, uid)
        finally:
            shutil.rmtree(work, ignore_errors=True)
            self._release_uid(uid)
        with self._lock:
            self.counts[result.outcome] += 1
            self.exec_s += result.wall_s
        return result

    def _lease_uid(self) -> int:
        """The uid this run's program gets as root: `uid`, or the next one down that no run in flight on this
        machine holds."""
        with self._lock:
            uid = self.uid
            while uid > 0:
                if uid not in self._uids_in_use:
                    held, fd = _lock_uid(uid)
                    if held:
                        self._uids_in_use[uid] = fd
                        return uid
                uid -= 1
        raise SandboxError(f"no free uid at or below reward.sandbox.user={self.uid} for a sandboxed program")

    def _release_uid(self, uid: int) -> None:
        """Hand a leased uid back (its lock file stays, for the next lease)."""
        with self._lock:
            fd = self._uids_in_use.pop(uid, None)
        if fd is not None:
            os.close(fd)  # closing the only descriptor of the open file drops its flock

    def _check_reachable(self) -> None:
        """Without namespaces, a root trainer runs programs as `uid`, which must be able to run the interpreter."""
        blocked = [p for p in _path_and_parents(self.python) if not os.stat(p).st_mode & 0o001]
        if blocked:
            raise SandboxError(
                f"reward.sandbox.isolation=rlimits runs programs as uid {self.uid}, which cannot enter {blocked[0]} "
                f"to run {self.python}; set reward.sandbox.python to an interpreter every user can run (such as "
                "/usr/bin/python3), or use reward.sandbox.isolation=namespaces"
            )

    def _run_in(self, work: Path, files: dict[str, str], entry: str, isolation: str, uid: int) -> SandboxResult:
        lim = self.limits
        output_bytes = max(1, int(lim.max_output_mb * 2**20))
        root = work / "root"
        root.mkdir()
        box = work / "box"
        as_root = os.geteuid() == 0
        if isolation == "rlimits":
            box.mkdir()
            for name, text in files.items():
                (box / name).write_text(text)
            if as_root:  # the program runs as `uid`: it must reach and write its folder, nothing more
                os.chmod(work, 0o711)
                for path in [box, *(box / n for n in files)]:
                    os.chown(path, uid, self.gid)
        home = "/sandbox" if isolation == "namespaces" else str(box)
        settings = {
            "isolation": isolation,
            "uid": uid,
            "gid": self.gid,
            "python": self.python,
            "entry": entry if isolation == "namespaces" else str(box / entry),
            "root": str(root),
            "read_only": self.read_only,
            "files": files if isolation == "namespaces" else {},
            "disk_bytes": int(lim.disk_mb * 2**20),
            "env": {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": home, "TMPDIR": home},
            "limits": {
                "wall_s": lim.wall_s,
                "cpu_s": lim.cpu_s,
                "memory_bytes": int(lim.memory_mb * 2**20),
                "processes": lim.max_processes,
                "open_files": lim.max_open_files,
                "output_bytes": output_bytes,
            },
        }
        read_fd, write_fd = os.pipe()
        settings["status_fd"] = write_fd
        out_path, err_path = work / "stdout", work / "stderr"
        try:
            with open(out_path, "wb") as out, open(err_path, "wb") as err:
                proc = subprocess.Popen(
                    [self.python, "-I", "-S", "-B", str(_LAUNCHER), marshal.dumps(settings, _MARSHAL).hex()],
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=err,
                    env={},
                    cwd=str(box if isolation == "rlimits" else work),
                    pass_fds=(write_fd,),
                    start_new_session=True,
                )
            os.close(write_fd)
            write_fd = -1
            try:
                raw = _read_until_closed(read_fd, time.monotonic() + lim.wall_s + _GRACE_S)
            finally:
                _kill_group(proc)
        finally:
            for fd in (read_fd, write_fd):
                if fd >= 0:
                    os.close(fd)
        stdout, stderr = _read_capped(out_path, output_bytes), _read_capped(err_path, output_bytes)
        # marshal: the launcher imports no json (its import would cost as much as a short program's run).
        report = marshal.loads(raw) if raw else {"outcome": "lost", "wall_s": lim.wall_s + _GRACE_S}
        if report["outcome"] == "sandbox_error":
            raise SandboxError(
                f"the sandbox could not be built ({report.get('detail')}) with reward.sandbox.isolation={isolation}; "
                + (
                    "this machine may not allow user namespaces: set reward.sandbox.isolation=rlimits "
                    "(see docs/RELIABILITY.md for what that mode does not guarantee)"
                    if isolation == "namespaces"
                    else "see docs/RELIABILITY.md"
                )
            )
        return SandboxResult(
            outcome=_outcome(report, stderr, lim),
            exit_code=report.get("exit_code"),
            signal=report.get("signal"),
            wall_s=float(report.get("wall_s", 0.0)),
            cpu_s=float(report.get("cpu_s", 0.0)),
            stdout=stdout,
            stderr=stderr,
        )


def _path_and_parents(path: str) -> list[str]:
    """`path` and every folder above it, from the root down."""
    parts = Path(path).parts
    return [str(Path(*parts[: i + 1])) for i in range(len(parts))]


def _read_until_closed(fd: int, deadline: float) -> bytes:
    """Everything written to the pipe `fd` until its writer closes it (the launcher's exit) or `deadline` passes.

    Waiting on the pipe wakes at once when the launcher is done (`Popen.wait` with a timeout polls, and would add
    up to 50 ms to every run)."""
    chunks = []
    while (left := deadline - time.monotonic()) > 0:
        if not select.select([fd], [], [], left)[0]:
            break
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the launcher's whole process group (whatever is left in it) and reap the launcher."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _read_capped(path: Path, limit: int) -> str:
    with open(path, "rb") as f:
        return f.read(limit).decode(errors="replace")


def _outcome(report: dict[str, Any], stderr: str, lim: SandboxLimits) -> str:
    """One of OUTCOMES from the launcher's report (and, for a Python error, the last line of stderr)."""
    kind = report["outcome"]
    if kind == "timeout":
        return "timeout"
    if kind == "lost":  # the launcher died without a word: the program killed it (possible only without namespaces)
        return "signal"
    if kind == "signal":
        sig = report.get("signal")
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and report.get("cpu_s", 0.0) >= lim.cpu_s):
            return "cpu_limit"
        if sig == signal.SIGXFSZ:
            return "output_limit"
        return "signal"
    if report.get("exit_code") == 0:
        return "ok"
    last = stderr.rstrip().rsplit("\n", 1)[-1]
    if last.startswith("MemoryError"):
        return "memory_limit"
    if "File too large" in last or "No space left on device" in last:
        return "output_limit"
    return "error"


def sandbox_pool(settings: dict[str, Any]) -> SandboxPool:
    """The pool the `reward.sandbox` keys describe (`settings`: that section as a dict)."""
    limits = SandboxLimits(
        wall_s=settings["timeout_s"],
        cpu_s=settings["cpu_limit_s"],
        memory_mb=settings["memory_limit_mb"],
        max_processes=settings["max_processes"],
        max_open_files=settings["max_open_files"],
        max_output_mb=settings["max_output_mb"],
        disk_mb=settings["disk_limit_mb"],
    )
    sandbox = Sandbox(
        limits,
        isolation=settings["isolation"],
        uid=settings["user"],
        gid=settings["user"],
        python=settings["python"],
    )
    pool = SandboxPool(sandbox, settings["max_concurrent"])
    # Once, as the run starts running code: what a hostile program meets here (auto resolves on this machine).
    logger.info("%s; %d at once (reward.sandbox.max_concurrent)", sandbox.describe(), pool.max_concurrent)
    return pool


class SandboxPool:
    """A `Sandbox` with up to `max_concurrent` executions at once (reward.sandbox.max_concurrent)."""

    def __init__(self, sandbox: Sandbox, max_concurrent: int):
        if not max_concurrent >= 1:
            raise ValueError(f"reward.sandbox.max_concurrent must be >= 1, got {max_concurrent}")
        self.sandbox = sandbox
        self.max_concurrent = int(max_concurrent)
        self._executor: ThreadPoolExecutor | None = None

    def map(self, fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
        """`[fn(item) for item in items]`, up to `max_concurrent` at once, in order; the first exception is raised."""
        items = list(items)
        if self.max_concurrent == 1 or len(items) <= 1:
            return [fn(item) for item in items]
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.max_concurrent, thread_name_prefix="sandbox")
        return list(self._executor.map(fn, items))

    def run_all(self, programs: Iterable[dict[str, str]]) -> list[SandboxResult]:
        """Run every program (a files dict with a main.py), up to `max_concurrent` at once; results in order."""
        return self.map(self.sandbox.run, programs)

    def close(self) -> None:
        """Stop the pool's threads (after the executions in flight)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


def sandbox_metrics(counts: Counter[str], seconds: float) -> dict[str, float]:
    """A step's executions as metrics, summed over ranks: one count per outcome, and the mean seconds per run."""
    total = float(sum(counts.values()))
    metrics = {f"reward/sandbox/{outcome}@sum": float(counts.get(outcome, 0)) for outcome in OUTCOMES}
    metrics["reward/sandbox/executions@sum"] = total
    if total:
        metrics["reward/sandbox/exec_s@sum"] = seconds
        metrics["reward/sandbox/exec_s@count"] = total
    return metrics
