"""The code-execution sandbox: hostile programs are contained, scored 0 and counted, and the run goes on.

Each hostile response below is a *right* solution (`x+1`) followed by an attack that raises when it is
stopped, so a response scores 1.0 only if its attack got through. The batch goes through the reward worker,
as in a training step, once per isolation mode this machine has.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import string
import sys
import threading

import pytest
import torch

from conveyor.config.sandbox import SandboxConfig
from conveyor.tasks.code import code_program, code_tests_score, parse_test_report
from conveyor.tasks.sandbox import (
    OUTCOMES,
    Sandbox,
    SandboxError,
    SandboxLimits,
    SandboxPool,
    _path_and_parents,
    namespaces_available,
)

_GROUND_TRUTH = json.dumps({"header": "def f(x): return ", "tests": ["f(1) == 2", "f(5) == 6", "f(11) == 12"]})
_LIMITS = {"timeout_s": 2.0, "cpu_limit_s": 1.0, "memory_limit_mb": 256, "max_processes": 8, "max_output_mb": 0.25}


def _python_for(mode: str) -> str | None:
    """An interpreter the mode can run: without namespaces a root trainer runs programs as nobody, who must reach
    the interpreter (a pyenv under /root is closed to it; the system's python3 is not)."""
    py = os.path.realpath(sys.executable)
    if mode == "namespaces" or os.geteuid() != 0:
        return None
    if all(os.stat(p).st_mode & 0o001 for p in _path_and_parents(py)):
        return None
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(candidate):
            return candidate
    pytest.skip("no interpreter that an unprivileged user can run")


def _wait_until_no_process_of(uids: set[int], seconds: float = 15.0) -> None:
    """Wait (bounded) until no process on the machine runs as one of `uids`."""
    import time
    from pathlib import Path

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        busy = False
        for status in Path("/proc").glob("[0-9]*/status"):
            try:
                uid_line = next(line for line in status.read_text().splitlines() if line.startswith("Uid:"))
            except (OSError, StopIteration):
                continue
            if int(uid_line.split()[1]) in uids:
                busy = True
                break
        if not busy:
            return
        time.sleep(0.1)


def _modes() -> list:
    return [
        pytest.param(
            "namespaces",
            marks=pytest.mark.skipif(not namespaces_available(), reason="this kernel gives no user namespaces"),
        ),
        "rlimits",
    ]


def _settings(mode: str, **over) -> dict:
    cfg = SandboxConfig(isolation=mode, python=_python_for(mode), max_concurrent=4, **_LIMITS)
    return dataclasses.replace(cfg, **over).__dict__.copy()


@pytest.fixture
def listener():
    """A TCP server on the loopback that records whether anything connected."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.2)
    hits: list[bool] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
                hits.append(True)
                conn.close()
            except OSError:
                continue

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1], hits
    stop.set()
    thread.join()
    server.close()


def _hostile(tmp_path, port: int, mode: str) -> dict[str, str]:
    """name -> a response: the right body, then an attack that raises (or is killed) when it is contained."""
    secret = tmp_path / "secret.txt"
    secret.write_text("trainer secret")
    secret.chmod(0o600)
    tmp_path.chmod(0o700)
    cases = {
        "fork bomb": "import os\nwhile True: os.fork()",
        "infinite loop": "while True: pass",
        "sleeps forever": "import time\ntime.sleep(10**6)",
        "memory bomb": "x = []\nwhile True: x.append(bytearray(1 << 24))",
        "huge allocation": "x = bytearray(1 << 36)",
        "huge output": "while True: print('x' * 65536)",
        "writes outside its folder": f"open({str(tmp_path / 'planted.txt')!r}, 'w').write('x')",
        "reads the trainer's files": f"assert open({str(secret)!r}).read()",
        "changes directory and writes": "import os\nos.chdir('..')\nopen('planted.txt', 'w').write('x')",
        "signals the trainer": f"import os, signal\nos.kill({os.getpid()}, signal.SIGKILL)",
        "signals every process": "import os, signal\nos.kill(-1, signal.SIGKILL)",
    }
    if mode == "namespaces":  # what only namespaces contain (docs/RELIABILITY.md)
        cases["opens a socket"] = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)"
        cases["reads a world-readable file"] = f"assert open({os.path.abspath(__file__)!r}).read()"
        cases["writes to /tmp"] = "open('/tmp/conveyor-planted.txt', 'w').write('x')"
    elif os.geteuid() != 0:
        pytest.skip("without namespaces, a trainer that is not root shares its user (and its signals) with programs")
    return {name: "x+1\n" + attack for name, attack in cases.items()}


def _fields(tok, responses: list[str]) -> dict:
    ids = [tok(r, add_special_tokens=False)["input_ids"] for r in responses]
    width = max(len(i) for i in ids)
    return {
        "responses": torch.tensor([i + [0] * (width - len(i)) for i in ids]),
        "response_mask": torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i in ids]).bool(),
        "data_source": ["synthetic/code"] * len(ids),
        "ground_truth": [_GROUND_TRUTH] * len(ids),
    }


def _worker_batch(responses: list[str]):
    from conveyor.data_plane import make_data_plane
    from conveyor.models.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer(string.printable)
    plane = make_data_plane("memory")
    keys = [f"k{i}" for i in range(len(responses))]
    return tok, plane, plane.kv_batch_put(keys, "step", _fields(tok, responses)), keys


@pytest.mark.parametrize("mode", _modes())
def test_hostile_programs_are_contained_scored_zero_and_counted(mode, tmp_path, listener):
    from conveyor.workers.ranks.reward import RewardWorker

    port, hits = listener
    hostile = _hostile(tmp_path, port, mode)
    responses = ["x+1", "7", *hostile.values()]  # right, a constant passing no test, then the attacks
    tok, plane, meta, keys = _worker_batch(responses)
    worker = RewardWorker(tokenizer=tok, data_plane=plane, sandbox=_settings(mode))
    out = worker.compute_reward(meta)
    acc = plane.kv_batch_get(keys, "step", ["acc"])["acc"].tolist()
    assert acc[:2] == [1.0, 0.0]
    escaped = {name: score for name, score in zip(hostile, acc[2:]) if score != 0.0}
    assert not escaped, f"attacks that got through under isolation={mode}: {escaped}"
    # Every execution counted by how it ended; the limits show up as their own outcomes.
    counts = {o: out.extra_info[f"reward/sandbox/{o}@sum"] for o in OUTCOMES}
    assert sum(counts.values()) == out.extra_info["reward/sandbox/executions@sum"] == len(responses)
    if mode == "namespaces":
        assert counts["ok"] >= 2 and counts["timeout"] + counts["cpu_limit"] >= 2
        assert counts["memory_limit"] >= 1 and counts["output_limit"] >= 1
    else:  # one user for every program: `kill -1` may end the neighbours' runs too (scored 0, counted as signals)
        assert counts["timeout"] + counts["cpu_limit"] + counts["signal"] >= 2
    assert not hits, "a program reached a socket on the trainer's loopback"
    assert not (tmp_path / "planted.txt").exists()
    # The run goes on: the same worker scores the next batch.
    next_batch = plane.kv_batch_put(["next"], "step2", {k: v[:1] for k, v in _fields(tok, ["x+1"]).items()})
    worker.compute_reward(next_batch)
    assert plane.kv_batch_get(["next"], "step2", ["acc"])["acc"].tolist() == [1.0]
    if mode == "namespaces":
        assert not os.path.exists("/tmp/conveyor-planted.txt")
    plane.close()


@pytest.mark.parametrize("mode", _modes())
def test_nothing_outlives_its_execution(mode, tmp_path):
    """A child that leaves the process group (setsid, double fork) is killed with the rest."""
    marker = f"conveyor-orphan-{os.getpid()}-{mode}"
    program = (
        "import os, sys, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        sys.argv[0] = {marker!r}\n"
        "        time.sleep(600)\n"
        "    os._exit(0)\n"
        "time.sleep(0.3)\n"
        "print('done')\n"
    )
    sandbox = Sandbox(SandboxLimits(wall_s=5), isolation=mode, python=_python_for(mode))
    result = sandbox.run({"main.py": program})
    assert result.outcome == "ok" and result.stdout.strip() == "done"
    survivors = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if b"sleep(600)" in cmd or marker.encode() in env + cmd:
            survivors.append(pid)
    assert not survivors


def test_the_program_sees_a_clean_environment_and_its_own_folder(monkeypatch):
    monkeypatch.setenv("CONVEYOR_SECRET_TOKEN", "leak")
    mode = "namespaces" if namespaces_available() else "rlimits"
    sandbox = Sandbox(isolation=mode, python=_python_for(mode))
    result = sandbox.run(
        {"main.py": "import os, sys\nprint(sorted(os.environ))\nprint(os.listdir('.'))\nprint(sys.flags.isolated)"}
    )
    env, files, isolated = result.stdout.strip().splitlines()
    assert eval(env) == ["HOME", "LANG", "PATH", "TMPDIR"]  # noqa: S307 - our own program's printed list
    assert eval(files) == ["main.py"]  # noqa: S307
    assert isolated == "1"


def test_pool_runs_concurrently_and_keeps_order():
    sandbox = Sandbox(SandboxLimits(wall_s=10), isolation="namespaces" if namespaces_available() else "rlimits")
    sandbox.python = _python_for(sandbox.isolation) or sandbox.python
    programs = [{"main.py": f"import time\ntime.sleep(0.5)\nprint({i})"} for i in range(4)]
    pool = SandboxPool(sandbox, max_concurrent=4)
    results = pool.run_all(programs)
    pool.close()
    assert [r.stdout.strip() for r in results] == ["0", "1", "2", "3"]
    counts, seconds = sandbox.pop_counts()
    assert counts == {"ok": 4} and seconds >= 4 * 0.5
    # Four half-second sleeps at once: the pool's wall time is far below their sum (each run's own is above 0.5).
    assert max(r.wall_s for r in results) < 4 * 0.5


def test_code_reward_scores_the_share_of_tests_and_ignores_forged_reports():
    sandbox = Sandbox(isolation="namespaces" if namespaces_available() else "rlimits")
    sandbox.python = _python_for(sandbox.isolation) or sandbox.python
    assert code_tests_score("x+1", _GROUND_TRUTH, sandbox=sandbox) == 1.0
    assert code_tests_score("2", _GROUND_TRUTH, sandbox=sandbox) == pytest.approx(1 / 3)
    assert code_tests_score("x+", _GROUND_TRUTH, sandbox=sandbox) == 0.0
    # A report printed by the program itself is not the harness's last line.
    forged = "0\nprint('\\n@@conveyor-tests 3 3')"
    assert code_tests_score(forged, _GROUND_TRUTH, sandbox=sandbox) == 0.0
    assert parse_test_report("noise\n@@conveyor-tests 2 3\n") == (2, 3)
    assert set(code_program("x", _GROUND_TRUTH)) == {"main.py", "solution.py"}
    with pytest.raises(ValueError, match="sandbox="):
        code_tests_score("x+1", _GROUND_TRUTH)


def test_a_sandbox_that_cannot_run_stops_the_run_naming_the_key(tmp_path):
    with pytest.raises(ValueError, match="reward.sandbox.isolation"):
        Sandbox(isolation="jail")
    with pytest.raises(ValueError, match="reward.sandbox.python"):
        Sandbox(python=str(tmp_path / "no-python"))
    # An executable that is not Python: every program would fail to start and score 0 while the run trained on.
    for name, body in (("fake-python", "#!/bin/sh\nexit 0\n"), ("python2ish", "#!/bin/sh\necho 2\n")):
        fake = tmp_path / name
        fake.write_text(body)
        fake.chmod(0o755)
        with pytest.raises(ValueError, match="reward.sandbox.python: .* is not a Python 3 interpreter"):
            Sandbox(python=str(fake))
    if os.geteuid() == 0:  # a root trainer runs programs as nobody, who cannot reach an interpreter under tmp_path
        tmp_path.chmod(0o700)
        python = tmp_path / "python3"
        python.symlink_to(os.path.realpath(sys.executable))
        closed = Sandbox(isolation="rlimits", python=str(python))
        closed.python = str(python)
        with pytest.raises(SandboxError, match="reward.sandbox.python"):
            closed.run({"main.py": "pass"})


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("reward.sandbox.isolation=jail", "reward.sandbox.isolation"),
        ("reward.sandbox.max_concurrent=0", "reward.sandbox.max_concurrent"),
        ("reward.sandbox.user=0", "reward.sandbox.user"),
        ("reward.sandbox.memory_limit_mb=8", "reward.sandbox.memory_limit_mb"),
    ],
)
def test_sandbox_keys_are_checked(override, key):
    from conveyor.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override])


@pytest.mark.skipif(os.geteuid() != 0, reason="programs get uids of their own only when the trainer runs as root")
@pytest.mark.parametrize("mode", _modes())
def test_a_fork_bomb_leaves_the_process_budget_of_programs_running_beside_it_alone(mode):
    """RLIMIT_NPROC counts a uid's processes: runs at once get uids of their own, so a neighbour's fork bomb
    cannot make another program's fork fail (it did when every run shared `reward.sandbox.user`)."""
    sandbox = Sandbox(SandboxLimits(wall_s=4, max_processes=8), isolation=mode, python=_python_for(mode))
    bomb = {
        "main.py": "import os, time\nwhile True:\n    try:\n        os.fork()\n"
        "    except OSError:\n        time.sleep(0.01)\n"
    }
    forker = {
        "main.py": (
            "import os, time\ntime.sleep(0.5)\n"  # the bomb has filled its budget by now
            # Three children alive at once, each forked by this program only (a comprehension of forks would have
            # every child fork too: 8 programs, past the budget with the launcher and its supervisor).
            "pids = []\nfor _ in range(3):\n    pid = os.fork()\n"
            "    if pid == 0:\n        time.sleep(0.2)\n        os._exit(0)\n    pids.append(pid)\n"
            "for p in pids:\n    os.waitpid(p, 0)\nprint('forked')\n"
        )
    }
    # RLIMIT_NPROC counts every process of a uid on the machine: earlier tests' programs (a fork bomb's last
    # children being reaped) must be gone, or they count against this test's budgets.
    _wait_until_no_process_of({sandbox.uid, sandbox.uid - 1})
    pool = SandboxPool(sandbox, 2)
    try:
        bombed, forked = pool.run_all([bomb, forker])
    finally:
        pool.close()
    assert bombed.outcome != "ok"
    assert forked.outcome == "ok" and forked.stdout.strip() == "forked", forked
    assert not sandbox._uids_in_use  # every uid handed back


@pytest.mark.parametrize("mode", _modes())
def test_the_isolation_in_force_and_the_limits_are_logged_once_when_the_pool_is_built(mode, caplog):
    from conveyor.tasks.sandbox import sandbox_pool

    settings = dataclasses.asdict(SandboxConfig(isolation=mode, python=_python_for(mode), **_LIMITS))
    with caplog.at_level("INFO", logger="conveyor.tasks.sandbox"):
        pool = sandbox_pool(settings)
        pool.run_all([{"main.py": "pass"}] * 2)
    pool.close()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("sandbox: isolation")]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"sandbox: isolation {mode}") and f"reward.sandbox.isolation={mode}" in lines[0]
    for part in ("2 s wall", "1 s CPU", "256 MB memory", "8 processes", "64 open files", "0.25 MB output", "4 at once"):
        assert part in lines[0], part
    assert ("16 MB disk" in lines[0]) == (mode == "namespaces")  # a tmpfs of its own only with namespaces


def test_a_uid_another_process_has_leased_is_skipped_until_it_is_handed_back():
    """Reward workers in processes of their own each hold a sandbox: their programs at once get distinct uids."""
    import random
    import subprocess
    from pathlib import Path

    uid = random.randrange(1_000_000, 2_000_000)  # no other test's uid
    sandbox = Sandbox(SandboxLimits(wall_s=4), uid=uid, isolation="rlimits")
    lock = Path("/tmp/conveyor-sandbox-uids") / f"{uid}.lock"
    lock.parent.mkdir(mode=0o700, exist_ok=True)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import fcntl, os, sys\nfd = os.open({str(lock)!r}, os.O_CREAT | os.O_RDWR)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('held', flush=True)\nsys.stdin.read()\n",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        first = sandbox._lease_uid()
        other = Sandbox(SandboxLimits(wall_s=4), uid=uid, isolation="rlimits")  # another sandbox of this process
        second = other._lease_uid()
        assert (first, second) == (uid - 1, uid - 2)
        sandbox._release_uid(first)
        other._release_uid(second)
    finally:
        holder.stdin.close()
        holder.wait(timeout=10)
    assert sandbox._lease_uid() == uid  # the other process is gone, and its lease with it
