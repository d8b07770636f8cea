"""Runs `python -m conveyor.cli ARGS` in forked children of one interpreter that has imported the stack once.

`conveyor config` imports torch and transformers (through the config's choice
registries): a fresh interpreter spends ~10 s of CPU on that before it parses
its arguments. This server imports them once; each request is then a real child
process (forked) that runs the `conveyor.cli` module as `__main__`, the way
`python -m` does, with its own stdin (closed), stdout and stderr files, working
directory and exit status.

Protocol, one JSON object a line: the request `{"args": [...], "cwd": DIR,
"timeout": SECONDS}` (with `"script": PATH`, the child runs `python PATH ARGS`
instead) on stdin; the answer `{"returncode": N, "stdout": TEXT,
"stderr": TEXT}` on stdout (a child killed for running past its timeout has
returncode -9). Nothing else is written to stdout. `CliServer` is the tests'
side of it.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path


class CliServer:
    """A running server; `run(*ARGS)` is `python -m conveyor.cli ARGS` in a fresh child, to completion."""

    def __init__(self, cwd: Path, env: dict[str, str], log: Path):
        self.cwd, self.log = cwd, log
        with open(log, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, __file__],
                cwd=cwd,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )

    def run(
        self, *args: str, cwd: Path | None = None, timeout: float = 120, script: Path | None = None
    ) -> subprocess.CompletedProcess:
        """The child's exit status, stdout and stderr; the child is killed (-9) after `timeout` seconds.

        With `script`, the child runs `python SCRIPT ARGS` instead of `python -m conveyor.cli ARGS`.
        """
        request = {"args": list(args), "cwd": str(cwd or self.cwd), "timeout": timeout}
        if script is not None:
            request["script"] = str(script)
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if not answer:
            raise RuntimeError(f"the cli server exited with {self.proc.poll()}: {self.log.read_text()[-3000:]}")
        done = json.loads(answer)
        command = [sys.executable, *([str(script)] if script is not None else ["-m", "conveyor.cli"]), *args]
        return subprocess.CompletedProcess(command, done["returncode"], done["stdout"], done["stderr"])

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _child(args: list[str], script: str | None, cwd: str, out_path: str, err_path: str) -> None:
    code = 1
    try:
        os.chdir(cwd)
        for fd, path, flags in (
            (0, os.devnull, os.O_RDONLY),
            (1, out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
            (2, err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
        ):
            opened = os.open(path, flags, 0o600)
            os.dup2(opened, fd)
            os.close(opened)
        sys.stdin = sys.__stdin__ = os.fdopen(0, "r", closefd=False)  # nothing read ahead from the server's stdin
        if script is None:
            sys.path[0] = cwd  # as `python -m` puts the working directory first
            sys.argv = ["-m", *args]  # run_module sets argv[0] to the module's file, as `python -m` does
            runpy.run_module("conveyor.cli", run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` does
            sys.argv = [script, *args]
            runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exc:  # what the interpreter does with an uncaught SystemExit
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        try:  # what the interpreter does on its way out: join threads, run the exit handlers, flush
            threading._shutdown()
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _run(request: dict, tmp: str) -> dict:
    out_path, err_path = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        _child(request["args"], request.get("script"), request["cwd"], out_path, err_path)
    deadline = time.monotonic() + request.get("timeout", 120)
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            break
        time.sleep(0.01)
    with open(out_path) as out, open(err_path) as err:
        return {"returncode": os.waitstatus_to_exitcode(status), "stdout": out.read(), "stderr": err.read()}


def main() -> None:
    from conveyor.config import load_config

    load_config(None, [])  # imports every module the config's choices come from
    import conveyor.trainer.run  # noqa: F401  - what `conveyor train` imports

    # Not a TemporaryDirectory: its finalizer is an exit handler, which each child runs on its way out.
    tmp = tempfile.mkdtemp(prefix="cli-server-")
    try:
        for line in sys.stdin:
            sys.stdout.write(json.dumps(_run(json.loads(line), tmp)) + "\n")
            sys.stdout.flush()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
